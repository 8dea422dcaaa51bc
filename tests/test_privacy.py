"""Differential privacy: client-level DP-FedAvg (clip, noise, composition with the strategies), sample-level DP-SGD
through Opacus (per-example clipping, one-line refusals), and epsilon as Opacus' accountants compute it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.codecs import get_codec
from fedlm.federation.dp_sgd import refuse_unsupported
from fedlm.federation.executor import ClientJob
from fedlm.federation.local_training import LocalSettings, train_locally
from fedlm.federation.opacus import epsilon
from fedlm.federation.params import snapshot
from fedlm.federation.privacy import (
    ClientLevelDP,
    PrivacySpec,
    SampleLevelDP,
    clip_update,
    noise_seed,
    private_mean,
)
from fedlm.federation.strategies import ClientUpdate, FedAvg, FedOpt, FedProx
from fedlm.flower.messages import job_content, job_from_content
from fedlm.run.prepare import prepare
from fedlm.run.single import run_single
from tests.conftest import tiny_config
from tests.training_helpers import run_until_interrupted

pytestmark = pytest.mark.usefixtures("one_thread")


def opacus_epsilon(accountant: type, z: float, q: float, steps: int, delta: float) -> float:
    """Opacus' own way: one accountant step per round / per DP-SGD step."""
    ledger = accountant()
    for _ in range(steps):
        ledger.step(noise_multiplier=z, sample_rate=q)
    return ledger.get_epsilon(delta)


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def updates_around(current: dict[str, torch.Tensor], scales: list[float], seed: int = 0) -> list[ClientUpdate]:
    gen = torch.Generator().manual_seed(seed)
    return [ClientUpdate(k, 10, {n: v + s * torch.randn(v.shape, generator=gen) for n, v in current.items()})
            for k, s in enumerate(scales)]


CURRENT = {"a": torch.zeros(30, 4), "b": torch.ones(7)}


# ---- accounting --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "accountant"), [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_equals_opacus_stepping_its_accountant(name, accountant):
    for z, q, steps in ((1.1, 0.01, 500), (0.8, 0.3, 20), (2.0, 1.0, 3)):
        assert epsilon(z, q, steps, 1e-5, name) == pytest.approx(opacus_epsilon(accountant, z, q, steps, 1e-5),
                                                                 rel=1e-6)
    assert epsilon(1.0, 0.1, 0, 1e-5) == 0.0
    assert epsilon(0.0, 0.1, 5, 1e-5) == math.inf


def test_client_level_run_reports_opacus_epsilon_every_round(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2, rounds=3)
    raw["privacy"] = {"kind": "client", "noise_multiplier": 0.9, "clip": 0.5, "delta": 1e-4}
    row = run_single(validate(raw), tiny_csv, tmp_path / "client")
    rounds = [r for r in records(tmp_path / "client") if r["round"] > 0]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:  # q = clients_per_round / num_clients = 2 / 4, one release per round
        assert r["dp_sample_rate"] == 0.5
        assert r["dp_epsilon"] == pytest.approx(opacus_epsilon(RDPAccountant, 0.9, 0.5, r["round"], 1e-4), rel=1e-6)
    assert row["epsilon (client, delta=0.0001)"] == pytest.approx(rounds[-1]["dp_epsilon"])


def test_dp_sgd_with_one_client_runs_and_reports_its_epsilon(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, rounds=2)
    raw["partition"] = {"kind": "iid", "num_clients": 1}
    raw["train"]["local_steps"] = 5
    raw["privacy"] = {"kind": "sample", "noise_multiplier": 1.3, "max_grad_norm": 0.7}
    row = run_single(validate(raw), tiny_csv, tmp_path / "sample")
    (examples,) = json.loads((tmp_path / "sample" / "data.json").read_text())["client_sizes"]["train"]
    rounds = [r for r in records(tmp_path / "sample") if r["round"] > 0]
    for r in rounds:  # q = batch / the client's examples per step, composed over every step the client took
        assert r["dp_steps"] == 5 * r["round"]
        assert r["dp_sample_rate"] == pytest.approx(8 / examples)
        assert r["dp_epsilon"] == pytest.approx(opacus_epsilon(RDPAccountant, 1.3, 8 / examples, 5 * r["round"],
                                                               1e-5), rel=1e-6)
        assert math.isfinite(r["train_loss"])
    assert row["epsilon (sample, delta=1e-05)"] == pytest.approx(rounds[-1]["dp_epsilon"])


def test_sample_level_ledger_is_per_client_and_survives_a_checkpoint():
    spec = PrivacySpec(kind="sample", noise_multiplier=1.0)
    ledger = SampleLevelDP(FedAvg(), spec, client_examples={0: 40, 1: 80, 2: 80}, batch_size=8)
    ledger.account(1, [ClientUpdate(1, 80, {}, {"steps": 10.0}), ClientUpdate(2, 80, {}, {"steps": 10.0})])
    out = ledger.account(2, [ClientUpdate(0, 40, {}, {"steps": 5.0}), ClientUpdate(1, 80, {}, {"steps": 10.0})])
    each = {0: (0.2, 5), 1: (0.1, 20), 2: (0.1, 10)}  # (q = batch / examples, steps so far)
    eps = {cid: opacus_epsilon(RDPAccountant, 1.0, q, steps, 1e-5) for cid, (q, steps) in each.items()}
    worst = max(eps, key=eps.get)  # the run reports its worst-off client's guarantee
    assert (out["dp_epsilon_client"], out["dp_sample_rate"], out["dp_steps"]) == (worst, *each[worst])
    assert out["dp_epsilon"] == pytest.approx(eps[worst], rel=1e-6)
    resumed = SampleLevelDP(FedAvg(), spec, client_examples={0: 40, 1: 80, 2: 80}, batch_size=8)
    resumed.load_state_dict(ledger.state_dict())
    assert resumed.steps == {1: 20, 2: 10, 0: 5} and resumed.rounds == 2


# ---- client-level DP-FedAvg --------------------------------------------------------------------------------------

def test_clipping_bounds_every_update_and_leaves_small_ones_unchanged():
    for k, update in enumerate(updates_around(CURRENT, [0.01, 0.5, 3.0, 40.0])):
        clipped, norm = clip_update(CURRENT, update.params, clip=1.5)
        after = math.sqrt(sum(float((clipped[n] - CURRENT[n]).double().pow(2).sum()) for n in CURRENT))
        assert after <= 1.5 * (1 + 1e-6)
        if norm <= 1.5:
            assert k == 0 and clipped is update.params  # untouched: the very same tensors
        else:
            assert after == pytest.approx(1.5, rel=1e-5)  # scaled onto the ball, direction kept
            direction = torch.cat([(update.params[n] - CURRENT[n]).flatten() for n in CURRENT])
            kept = torch.cat([(clipped[n] - CURRENT[n]).flatten() for n in CURRENT])
            assert torch.allclose(kept, direction * (1.5 / norm), atol=1e-6)


def test_private_mean_is_the_clipped_sum_plus_noise_over_the_sampled_count():
    updates = updates_around(CURRENT, [0.01, 5.0, 9.0])
    clean = private_mean(CURRENT, updates, clip=1.0, noise_multiplier=0.0, generator=torch.Generator())
    by_hand = {n: CURRENT[n] + sum(clip_update(CURRENT, u.params, 1.0)[0][n] - CURRENT[n] for u in updates) / 3
               for n in CURRENT}
    for n in CURRENT:
        assert torch.allclose(clean[n], by_hand[n], atol=1e-6)


def test_noise_has_the_configured_standard_deviation():
    """z = 1.5, C = 2, 3 clients: the server's mean carries N(0, (z C / 3)^2) = N(0, 1) per coordinate."""
    current = {"w": torch.zeros(400, 500)}
    updates = updates_around(current, [0.001, 0.002, 0.003])
    clean = private_mean(current, updates, clip=2.0, noise_multiplier=0.0, generator=torch.Generator())
    noised = private_mean(current, updates, clip=2.0, noise_multiplier=1.5, generator=torch.Generator().manual_seed(3))
    noise = (noised["w"] - clean["w"]).double().flatten()
    n = noise.numel()  # sd of the sample sd ~ 1 / sqrt(2n) = 0.0016; of the mean 1 / sqrt(n) = 0.0022
    assert float(noise.std()) == pytest.approx(1.0, abs=5 / math.sqrt(2 * n))
    assert abs(float(noise.mean())) < 5 / math.sqrt(n)
    half = private_mean(current, updates, clip=1.0, noise_multiplier=1.5, generator=torch.Generator().manual_seed(3))
    assert float((half["w"] - clean["w"]).std()) == pytest.approx(0.5, rel=0.01)  # std scales with C


@pytest.mark.parametrize("inner", [FedAvg, lambda: FedProx(0.1), lambda: FedOpt("adam", 0.1)])
def test_z0_and_huge_clip_equal_the_strategy_bitwise(inner):
    """Equal example counts (DP-FedAvg weighs clients equally): no clipping and no noise is the plain strategy."""
    updates = updates_around(CURRENT, [0.3, 1.0, 2.0])
    plain, private = inner(), ClientLevelDP(inner(), PrivacySpec("client", noise_multiplier=0.0, clip=1e9),
                                              num_clients=3, clients_per_round=3)
    for _ in range(2):  # FedOpt's moments too
        expected, got = plain.aggregate(CURRENT, updates), private.aggregate(CURRENT, updates)
        assert all(torch.equal(expected[n], got[n]) for n in CURRENT)


def test_noise_enters_before_the_server_optimizer():
    updates = updates_around(CURRENT, [0.3, 4.0])
    spec = PrivacySpec("client", noise_multiplier=2.0, clip=1.0)
    private = ClientLevelDP(FedOpt("adam", 0.1), spec, num_clients=4, clients_per_round=2, seed=5)
    got = private.aggregate(CURRENT, updates)
    # the same noise (round 1's stream), averaged first, then one FedAdam step on the noised pseudo-gradient
    generator = torch.Generator().manual_seed(noise_seed(5, 1))
    noised = private_mean(CURRENT, updates, 1.0, 2.0, generator)
    expected = FedOpt("adam", 0.1).aggregate(CURRENT, [ClientUpdate(-1, 1, noised)])
    assert all(torch.equal(expected[n], got[n]) for n in CURRENT)


def test_dp_fedavg_run_with_z0_and_huge_clip_equals_fedavg_bitwise(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2)  # 120 training rows: 30 per client, equal weights
    plain = run_single(validate(raw), tiny_csv, tmp_path / "plain")
    raw["privacy"] = {"kind": "client", "noise_multiplier": 0.0, "clip": 1e9}
    private = run_single(validate(raw), tiny_csv, tmp_path / "dp")
    sizes = json.loads((tmp_path / "plain" / "data.json").read_text())["client_sizes"]
    assert len(set(sizes["train"])) == 1
    a = torch.load(tmp_path / "plain" / "checkpoint" / "state.pt", weights_only=False)["global"]
    b = torch.load(tmp_path / "dp" / "checkpoint" / "state.pt", weights_only=False)["global"]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert private["epsilon (client, delta=1e-05)"] == "inf" and plain["final accuracy"] == private["final accuracy"]


@pytest.mark.parametrize("privacy", [{"kind": "client", "noise_multiplier": 0.7, "clip": 0.3},
                                     {"kind": "sample", "noise_multiplier": 0.7}])
def test_a_resumed_private_run_draws_the_same_noise_and_keeps_its_ledger(tmp_path, tiny_csv, privacy):
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2, rounds=3)
    raw["privacy"] = privacy
    raw["train"]["local_steps"] = 2
    cfg = validate(raw)
    run_single(cfg, tiny_csv, tmp_path / "straight")

    run_until_interrupted(cfg, tiny_csv, tmp_path / "cut", round_idx=3)
    run_single(cfg, tiny_csv, tmp_path / "cut", resume=True)
    a = torch.load(tmp_path / "straight" / "checkpoint" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "cut" / "checkpoint" / "state.pt", weights_only=False)
    assert all(torch.equal(a["global"][n], b["global"][n]) for n in a["global"])
    assert a["strategy"]["steps"] == b["strategy"]["steps"] and b["strategy"]["rounds"] == 3
    eps = [[r.get("dp_epsilon") for r in records(tmp_path / d)] for d in ("straight", "cut")]
    assert eps[0] == eps[1] and eps[0][-1] > eps[0][1] > 0


# ---- sample-level DP-SGD -----------------------------------------------------------------------------------------

NO_DROPOUT = {"bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
              "distilbert": {"dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0},
              "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0},
              "llama": {"attention_dropout": 0.0}}


@pytest.mark.parametrize("family", ["bert", "distilbert", "gpt2", "llama"])
def test_dp_sgd_step_is_the_mean_of_clipped_per_example_gradients(tmp_path, tiny_csv, family):
    """z = 0, plain SGD: one DP-SGD step moves the weights by lr * sum_i clip(g_i) / batch, g_i each example's
    own gradient computed alone (position embeddings included: their ids are shared across the batch)."""
    raw = tiny_config(tmp_path, tiny_csv)
    raw["model"] = {"family": family, "preset": "tiny", "vocab_size": 200, "max_length": 32,
                    "overrides": NO_DROPOUT[family]}
    prep = prepare(validate(raw), tiny_csv)
    model, task, rows = prep.model, prep.task, list(prep.client_train[0])[:4]
    settings = LocalSettings(optimizer="sgd", lr=0.5, batch_size=4, local_steps=1, dp_noise_multiplier=0.0,
                             dp_max_grad_norm=0.05)
    before = snapshot(model)
    params = dict(model.named_parameters())
    clipped = {n: torch.zeros_like(v) for n, v in before.items()}
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(11)).tolist()
    for i in order:
        model.zero_grad(set_to_none=True)
        loss, _ = task.loss(model, task.collate([rows[i]], gen))
        loss.backward()
        grads = {n: params[n].grad.clone() if params[n].grad is not None else torch.zeros_like(before[n])
                 for n in before}
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        for n, g in grads.items():
            clipped[n] += g * min(1.0, 0.05 / norm)
    model.zero_grad(set_to_none=True)
    train_locally(model, task, rows, settings, seed=11)
    after = snapshot(model)
    moved = 0
    for n in before:
        expected = before[n] - 0.5 * clipped[n] / 4
        assert torch.allclose(after[n], expected, atol=1e-6, rtol=1e-4), n
        moved += not torch.equal(after[n], before[n])
    assert moved > len(before) // 2
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # Opacus leaves nothing behind
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_dp_sgd_noise_changes_the_step_and_plain_training_is_untouched(tmp_path, tiny_csv):
    prep = prepare(validate(tiny_config(tmp_path, tiny_csv)), tiny_csv)
    model, task, rows = prep.model, prep.task, list(prep.client_train[0])[:16]
    start = snapshot(model)
    plain = LocalSettings(batch_size=8, local_steps=2)
    runs = {}
    for name, settings in (("plain", plain), ("dp", replace(plain, dp_noise_multiplier=1.0)),
                           ("plain_again", plain)):
        model.load_state_dict({**model.state_dict(), **start}, strict=False)
        train_locally(model, task, rows, settings, seed=3)
        runs[name] = snapshot(model)
    assert all(torch.equal(runs["plain"][n], runs["plain_again"][n]) for n in start)  # DP left no trace
    assert any(not torch.allclose(runs["plain"][n], runs["dp"][n]) for n in start)


def test_dp_sgd_settings_reach_flower_clients():
    """A deployment's ClientApp rebuilds LocalSettings from the train message: DP-SGD's noise and clip travel."""
    settings = LocalSettings(batch_size=4, dp_noise_multiplier=1.25, dp_max_grad_norm=0.3)
    job = ClientJob(2, 1, get_codec("fp32").encode({"w": torch.ones(3)}), settings, seed=9)
    received, _ = job_from_content(job_content(job, "experiment: yaml"))
    assert received.settings == settings
    plain = job_from_content(job_content(replace(job, settings=LocalSettings()), "x"))[0].settings
    assert plain.dp_noise_multiplier is None


def test_sample_level_refusals_are_one_line(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    for privacy, extra, culprit in (
            ({"kind": "sample"}, {"model": {"family": "t5", "preset": "tiny"}}, "not t5"),
            ({"kind": "sample"}, {"task": "mlm"}, "task mlm"),
            ({"kind": "sample"}, {"protocol": {"kind": "fedprox"}}, "proximal term"),
            ({"kind": "sample"}, {"train": {"precision": "bf16"}}, "fp32"),
            ({"kind": "client"}, {"protocol": {"kind": "isolated"}}, "isolated has none"),
            ({"kind": "client"}, {"split": {}}, "split learning"),
            ({"kind": "client", "delta": 1.5}, {}, "privacy.delta = 1.5"),
            ({"kind": "laplace"}, {}, "privacy.kind = 'laplace'")):
        with pytest.raises(UserError) as err:
            validate({**raw, **extra, "privacy": privacy})
        assert culprit in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(UserError, match=r"^privacy.kind sample .* task mlm is not one of them"):
        refuse_unsupported("bert", "mlm")  # task auto that resolves to mlm: refused once the task is known

