"""The round engine against independent computations: a plain training loop, FedAvg by hand, faults, resume."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.client_round import fit_client
from fedlm.federation.codecs import get_codec
from fedlm.federation.engine import EngineHooks, RoundEngine, RoundFailed, RoundPlan
from fedlm.federation.local_training import LocalSettings, batch_order, local_seed, round_lr
from fedlm.federation.params import snapshot, trainable_names
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import FedAvg, FedProx
from fedlm.run.prepare import prepare
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import make_sentences, tiny_config
from tests.training_helpers import assert_saved_classifiers_close, run_until_interrupted


def _engine(prep, strategy, clients_per_round, fit_fn=fit_client, rounds=1, min_clients=1, timeout=None,
            max_retries=0):
    names = trainable_names(prep.model)
    executor = InProcessExecutor(prep.model, prep.task, prep.client_train, get_codec("fp32"),
                                 ClientStore({}), [],
                                 fit_fn=fit_fn)
    plan = RoundPlan(rounds=rounds, clients_per_round=clients_per_round, min_clients=min_clients,
                     max_retries=max_retries, timeout_s=timeout, seed=prep.config.seed)
    engine = RoundEngine(strategy, executor, get_codec("fp32"), list(prep.client_train),
                         LocalSettings.from_config(prep.config.train), plan, EngineHooks())
    return engine, snapshot(prep.model, names)


def test_fedavg_one_client_one_epoch_equals_plain_centralized_epoch(tmp_path, tiny_csv):
    cfg = validate(tiny_config(tmp_path, tiny_csv) | {"partition": {"kind": "iid", "num_clients": 1}})
    prep = prepare(cfg, tiny_csv)
    engine, initial = _engine(prep, FedAvg(), clients_per_round=1)
    federated = engine.run(initial)

    # an independent plain loop over the pooled data: same seed, same batches, same optimizer
    prep2 = prepare(cfg, tiny_csv)
    model, task, rows = prep2.model, prep2.task, prep2.client_train[0]
    settings = LocalSettings.from_config(cfg.train)
    seed = local_seed(cfg.seed, 1, 0)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    for idx in batch_order(len(rows), settings, gen):
        loss, _ = task.loss(model, task.collate([rows[i] for i in idx], gen))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.train.max_grad_norm)
        opt.step()
    centralized = snapshot(model)
    assert len(rows) == 120
    for name, value in centralized.items():
        assert torch.allclose(federated[name], value, atol=1e-6), name
    assert any(not torch.equal(federated[n], initial[n]) for n in initial)


def test_fedprox_with_mu_zero_equals_fedavg(tmp_path, tiny_csv):
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    results = []
    for strategy in (FedAvg(), FedProx(0.0)):
        prep = prepare(cfg, tiny_csv)
        engine, initial = _engine(prep, strategy, clients_per_round=3, rounds=2)
        results.append(engine.run(initial))
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_fedprox_mu_pulls_clients_toward_global(tmp_path, tiny_csv):
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    drift = []
    for mu in (0.0, 50.0):
        prep = prepare(cfg, tiny_csv)
        engine, initial = _engine(prep, FedProx(mu), clients_per_round=1)
        out = engine.run(initial)
        drift.append(sum(float((out[n] - initial[n]).pow(2).sum()) for n in initial))
    assert drift[1] < drift[0]


def test_failed_clients_are_left_out_and_the_round_completes(tmp_path, tiny_csv, caplog):
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    prep = prepare(cfg, tiny_csv)

    def faulty(model, task, rows, job, codec, local_state, local_names):
        if job.client_id == 0:
            raise RuntimeError("disk on fire")
        if job.client_id == 1:  # a diverging client: an infinite step size turns its weights to Inf/NaN
            job = replace(job, settings=replace(job.settings, lr=float("inf")))
        if job.client_id == 2:  # a client that cannot finish in time
            job = replace(job, timeout_s=1e-9)
        return fit_client(model, task, rows, job, codec, local_state, local_names)

    records = []
    engine, initial = _engine(prep, FedAvg(), clients_per_round=4, fit_fn=faulty, min_clients=1)
    engine.hooks.record = lambda r: records.append(r.to_dict())
    out = engine.run(initial)
    reasons = {f["client"]: f["reason"] for f in records[0]["failed"]}
    assert set(reasons) == {0, 1, 2}
    assert "disk on fire" in reasons[0] and "non-finite" in reasons[1] and "timeout" in reasons[2]
    assert records[0]["clients"] == [3]
    assert all(torch.isfinite(v).all() for v in out.values())
    assert "client 0 left out" in caplog.text

    # the aggregate is client 3's update alone: recompute it directly
    prep_b = prepare(cfg, tiny_csv)
    engine_b, _ = _engine(prep_b, FedAvg(), clients_per_round=4,
                          fit_fn=lambda m, t, r, job, *a: fit_client(m, t, r, job, *a) if job.client_id == 3
                          else (_ for _ in ()).throw(RuntimeError("skip")))
    only3 = engine_b.run(snapshot(prep_b.model))
    for name in out:
        assert torch.equal(out[name], only3[name])


def test_round_is_retried_then_fails_when_too_few_clients_report(tmp_path, tiny_csv):
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    prep = prepare(cfg, tiny_csv)
    calls = []

    def always_fails(model, task, rows, job, *rest):
        calls.append(job.client_id)
        raise RuntimeError("down")

    engine, initial = _engine(prep, FedAvg(), clients_per_round=2, fit_fn=always_fails, min_clients=1,
                              max_retries=2)
    with pytest.raises(RoundFailed, match="fewer than 1 clients reported after 3 attempts"):
        engine.run(initial)
    assert len(calls) == 6


def test_run_directory_and_resume_gives_the_same_final_model(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, rounds=3, kind="fedopt", server_optimizer="adam", server_lr=0.01)
    raw["protocol"]["clients_per_round"] = 2
    cfg = validate(raw)
    full_dir = tmp_path / "full"
    run_single(cfg, tiny_csv, full_dir)
    for name in ("config.yaml", "metrics.jsonl", "data.json", "learning_curves.png", "summary.md",
                 "partition/partition.csv", "partition/label_distribution.png", "partition/js_divergence.png"):
        assert (full_dir / name).is_file(), name
    records = read_metrics(full_dir)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert "test_accuracy" in records[0] and records[0]["bytes_up"] == 0  # the starting point
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["wall_s"] > 0 for r in records[1:])
    assert "test_accuracy" in records[-1] and "local_accuracy_mean" in records[-1]

    cut_dir = tmp_path / "cut"
    run_until_interrupted(cfg, tiny_csv, cut_dir, round_idx=3)
    assert [r["round"] for r in read_metrics(cut_dir)] == [0, 1, 2]
    run_single(cfg, tiny_csv, cut_dir, resume=True)
    assert [r["round"] for r in read_metrics(cut_dir)] == [0, 1, 2, 3]

    assert_saved_classifiers_close(full_dir / "model", cut_dir / "model")
    assert json.loads((cut_dir / "data.json").read_text())["task"] == "classification"


def test_eval_start_off_skips_round_zero_and_nothing_else(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["eval"] |= {"start": False, "local": False}
    run_single(validate(raw), tiny_csv, tmp_path / "no-start")
    assert [r["round"] for r in read_metrics(tmp_path / "no-start")] == [1, 2]
    raw["eval"]["start"] = True
    run_single(validate(raw), tiny_csv, tmp_path / "start")
    with_start = read_metrics(tmp_path / "start")
    assert [r["round"] for r in with_start] == [0, 1, 2]
    assert read_metrics(tmp_path / "no-start")[-1]["test_accuracy"] == with_start[-1]["test_accuracy"]
    with pytest.raises(UserError, match=r"eval\.start: false with protocol\.rounds: 0"):
        validate(tiny_config(tmp_path, tiny_csv, rounds=0) | {"eval": {"start": False}})


def test_isolated_reports_mean_and_spread_over_clients(tmp_path, tiny_csv):
    cfg = validate(tiny_config(tmp_path, tiny_csv, kind="isolated", rounds=1))
    run_single(cfg, tiny_csv, tmp_path / "iso")
    rec = read_metrics(tmp_path / "iso")[-1]
    assert "test_accuracy_mean" in rec and "test_accuracy_std" in rec
    assert len(rec["test_by_client"]) == 4
    assert rec["bytes_up"] == 0


def test_holdout_gives_each_client_a_local_test_split_from_its_own_share(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["partition"] = {"kind": "iid", "num_clients": 4, "holdout": 0.25}
    prep = prepare(validate(raw), tiny_csv)
    n_train = sum(len(r) for r in prep.client_train.values())
    n_test = sum(len(r) for r in prep.client_test.values())
    assert n_train + n_test == 120 and 28 <= n_test <= 32  # 25% of each client's 30, rounded per client
    assert all(len(prep.client_test[c]) > 0 for c in range(4))


def test_downstream_fine_tunes_the_saved_model_and_rounds_zero_is_the_starting_model(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, rounds=0)
    raw["task"] = "mlm"
    raw["downstream"] = {"sentiment": {"data.source": str(tiny_csv), "task": "classification",
                                       "data.columns": {"text": "sentence", "label": "sentiment"},
                                       "protocol.kind": "centralized", "protocol.rounds": 1,
                                       "train.lr": 0.003, "eval.batch_size": 32}}
    row = run_single(validate(raw), tiny_csv, tmp_path / "pre")
    records = read_metrics(tmp_path / "pre")
    assert [r["round"] for r in records] == [0] and row["final perplexity"] == row["start perplexity"]
    fine = read_metrics(tmp_path / "pre" / "downstream" / "sentiment")
    assert [r["round"] for r in fine] == [0, 1]
    assert row["sentiment accuracy"] == fine[-1]["test_accuracy"]
    sub_config = (tmp_path / "pre" / "downstream" / "sentiment" / "config.yaml").read_text()
    assert f"checkpoint: {tmp_path / 'pre' / 'model'}" in sub_config


def test_mask_rate_reaches_the_mlm_task_and_is_refused_elsewhere(tmp_path, tiny_csv):
    folder = tmp_path / "lm"
    folder.mkdir()
    for split, seed in (("train", 0), ("test", 5)):
        (folder / f"{split}.txt").write_text("\n".join(t for t, _ in make_sentences(40, seed=seed)) + "\n")
    raw = tiny_config(tmp_path, folder) | {"task": "mlm"}
    raw["data"] = {"source": str(folder), "format": "txt"}
    raw["train"] = raw["train"] | {"mask_rate": 0.4}
    assert prepare(validate(raw), folder).task.mask_rate == 0.4
    classifier = tiny_config(tmp_path, tiny_csv)
    classifier["train"] = classifier["train"] | {"mask_rate": 0.4}
    with pytest.raises(UserError, match=r"train\.mask_rate is for masked LM"):
        prepare(validate(classifier), tiny_csv)


@pytest.mark.parametrize(("schedule", "expected"), [
    ("constant", [1.0, 1.0, 1.0, 1.0]),
    ("linear", [1.0, 0.75, 0.5, 0.25]),
    ("cosine", [1.0, 0.5 * (1 + 2**-0.5), 0.5, 0.5 * (1 - 2**-0.5)]),
])
def test_lr_schedule_gives_each_round_its_learning_rate(schedule, expected):
    assert [round_lr(2e-4, schedule, r, 4) / 2e-4 for r in (1, 2, 3, 4)] == pytest.approx(expected)


def test_the_engine_hands_each_round_the_scheduled_lr_and_a_resumed_run_continues_it(tmp_path, tiny_csv):
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    prep = prepare(cfg, tiny_csv)
    seen: dict[int, set[float]] = {}

    def recording(model, task, rows, job, *rest):
        seen.setdefault(job.round_idx, set()).add(job.settings.lr)
        return fit_client(model, task, rows, job, *rest)

    engine, initial = _engine(prep, FedAvg(), clients_per_round=2, rounds=3, fit_fn=recording)
    engine.plan.lr_schedule = "linear"
    after_1 = engine.run_round(1, initial)
    engine.run(after_1, start_round=2)  # as --resume does from round 1's checkpoint
    lr = cfg.train.lr
    assert {r: len(lrs) for r, lrs in seen.items()} == {1: 1, 2: 1, 3: 1}  # one lr for every client of a round
    assert [lrs.pop() for _, lrs in sorted(seen.items())] == pytest.approx([lr, lr * 2 / 3, lr / 3])


def test_lr_schedule_is_refused_for_split_runs(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["train"]["lr_schedule"] = "linear"
    raw["split"] = {"trunk_mode": "sequential"}
    with pytest.raises(Exception, match=r"train\.lr_schedule linear is for FedAvg-family and centralized runs"):
        validate(raw)
