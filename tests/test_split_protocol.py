"""Split learning inside the round engine: equivalence with FedAvg, what each mode and policy reports, what
crosses the boundary, FedBERT's Table 2 cost model, and runs for MLM, CLM and classification."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import get_args

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from fedlm.config import SplitConfig, validate
from fedlm.errors import UserError
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings, batch_order, make_optimizer
from fedlm.federation.params import snapshot
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies.fedavg import FedAvg
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.run.prepare import prepare
from fedlm.run.recorder import RunRecorder, read_metrics
from fedlm.run.single import run_single
from fedlm.split.executor import SplitExecutor
from fedlm.split.modes import TRUNK_MODES
from fedlm.split.optimizer_state import OPTIMIZER_STATES
from fedlm.split.parts import PARTS_POLICIES, client_copy
from fedlm.split.transport import InProcessTransport
from fedlm.split.trunk import TO_CLIENT, TO_SERVER, WIRE_DTYPES
from fedlm.split.trunk_batching import BatchingTrunkBackend
from fedlm.split.turns import CONNECTIONS
from fedlm.tasks import get_task
from fedlm.tasks.base import base_hidden
from tests.conftest import make_sentences, tiny_config
from tests.split_helpers import MessageLog

pytestmark = pytest.mark.usefixtures("one_thread")


def split_config(tmp_path, source, clients: int = 4, **split) -> dict:
    raw = tiny_config(tmp_path, source)
    raw["partition"] = {"kind": "iid", "num_clients": clients}
    raw["split"] = split
    return raw


def final_global(run_dir) -> dict[str, torch.Tensor]:
    return RunRecorder(run_dir).load_checkpoint()["global"]


# ------------------------------------------------------------------------------------------ task hook


@pytest.mark.parametrize(("family", "task"), [
    ("bert", "mlm"), ("roberta", "mlm"), ("distilbert", "mlm"), ("gpt2", "clm"), ("llama", "clm"),
    ("bert", "classification"), ("roberta", "classification"), ("distilbert", "classification"),
    ("gpt2", "classification"), ("llama", "classification"), ("bert", "regression"),
])
def test_loss_from_hidden_equals_the_tasks_own_loss(family, task):
    texts = [t for t, _ in make_sentences(40)]
    tokenizer = build_tokenizer(None, family, texts, 200)
    model = build_model(family, "tiny", task, tokenizer, num_labels=1 if task == "regression" else 2, seed=0).eval()
    rows = [{"input_ids": tokenizer(t)["input_ids"], "labels": i % 2 if task != "regression" else 0.5 * i}
            for i, t in enumerate(texts[:6])]
    bound = get_task(task, tokenizer)
    batch = bound.collate(rows, torch.Generator().manual_seed(0))
    expected, count = bound.loss(model, batch)
    got, got_count = bound.loss_from_hidden(model, base_hidden(model, batch), batch)
    assert got_count == count
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- run-level equivalence


@pytest.mark.parametrize(("mode", "cut"), [("sequential", (0, 0)), ("parallel", (1, 0)), ("client_batch", (0, 1))])
def test_one_client_split_run_equals_one_client_fedavg(tmp_path, tiny_csv, mode, cut):
    """The same batches, masks and dropout draws, computed in three parts across the boundary."""
    raw = tiny_config(tmp_path, tiny_csv)
    raw["partition"] = {"kind": "iid", "num_clients": 1}
    raw["model"]["preset"] = "tiny"
    raw["model"]["overrides"] = {"hidden_dropout_prob": 0.1, "num_hidden_layers": 3}
    raw["train"]["max_grad_norm"] = None  # the split clips client and trunk separately, FedAvg jointly
    run_single(validate(raw), tiny_csv, tmp_path / "fedavg")
    raw["split"] = {"trunk_mode": mode, "client_parts": "average", "bottom_blocks": cut[0], "top_blocks": cut[1]}
    run_single(validate(raw), tiny_csv, tmp_path / "split")
    expected, got = final_global(tmp_path / "fedavg"), final_global(tmp_path / "split")
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=2e-5, msg=name)
    assert read_metrics(tmp_path / "split")[-1]["test_accuracy"] == read_metrics(tmp_path / "fedavg")[-1][
        "test_accuracy"]


# ------------------------------------------------------------------------------ executor-level semantics


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_csv):
    tmp = tmp_path_factory.mktemp("split")
    raw = tiny_config(tmp, tiny_csv)
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    raw["train"]["local_steps"] = 2
    return prepare(validate(raw), tiny_csv)


def make_executor(prep, mode: str, parts: str, hook=None, remote=None, **split) -> tuple[SplitExecutor, dict]:
    model = build_model("bert", "tiny", "classification", prep.tokenizer, num_labels=2, seed=3)
    settings = LocalSettings(lr=0.01, batch_size=8, local_steps=2, max_grad_norm=None)
    spec = SplitConfig(trunk_mode=mode, client_parts=parts, **split)
    store = ClientStore({})
    executor = SplitExecutor(model, spec, prep.task, prep.client_train, get_codec("fp32"), store, settings,
                             hook=hook, remote=remote)
    store.initial = snapshot(model, executor.parts.local)
    start = snapshot(model, executor.parts.trunk + executor.parts.shared)
    return executor, start


def round_jobs(executor: SplitExecutor, start: dict, clients: list[int]) -> list[ClientJob]:
    settings = LocalSettings(lr=0.01, batch_size=8, local_steps=2, max_grad_norm=None)
    sent = get_codec("fp32").encode(executor.downlink(start))
    return [ClientJob(cid, 1, sent, settings, seed=100 + cid) for cid in clients]


def run_round(executor: SplitExecutor, start: dict, clients: list[int], round_idx: int = 1) -> list[ClientReport]:
    executor.begin_round(round_idx, start)
    reports = executor.run(round_jobs(executor, start, clients))
    assert all(isinstance(r, ClientReport) for r in reports), reports
    return reports


def next_global(executor: SplitExecutor, start: dict, reports: list[ClientReport]) -> dict[str, torch.Tensor]:
    """The round's global model as the engine makes it: FedAvg over the reports, then what the server hands in."""
    return {**FedAvg().aggregate(start, [r.update for r in reports]), **executor.server_params()}


def test_every_choice_of_the_split_section_has_its_object():
    fields = SplitConfig.model_fields
    for name, registry in (("trunk_mode", TRUNK_MODES), ("client_parts", PARTS_POLICIES),
                           ("optimizer_state", OPTIMIZER_STATES), ("transport", CONNECTIONS),
                           ("activation_dtype", WIRE_DTYPES)):
        assert set(registry) == set(get_args(fields[name].annotation)), name


def test_what_each_trunk_mode_and_client_policy_reports(setup):
    for mode in ("sequential", "parallel", "client_batch"):
        for parts in ("share", "average_bottom", "average", "local"):
            executor, start = make_executor(setup, mode, parts)
            names = executor.parts
            reports = run_round(executor, start, [0, 1, 2])
            carried = [set(r.update.params) for r in reports]
            from_server = set(executor.server_params())
            trunk, shared = set(names.trunk), set(names.shared)
            if mode == "parallel":  # each client's own trunk copy, averaged by FedAvg
                assert all(trunk <= c for c in carried) and not trunk & from_server
            else:  # one trunk, handed to the global model by the server
                assert trunk <= from_server and not any(trunk & c for c in carried)
            if parts == "share":  # handed client to client; the last client's handed in by the server
                assert shared <= from_server and not any(shared & c for c in carried)
            else:
                assert all(shared <= c for c in carried) and not shared & from_server
            assert all(not (set(names.local) & c) for c in carried), "local parts never leave the client"
            expected_shared = {"share": names.bottom + names.top, "average": names.bottom + names.top,
                               "average_bottom": names.bottom, "local": []}[parts]
            assert sorted(names.shared) == sorted(expected_shared)
            assert all(r.boundary_up > 0 and r.boundary_down > 0 for r in reports)
            assert all(r.upload_bytes == sum(4 * start[n].numel() for n in names.shared) for r in reports)
            executor.close()


def test_sequential_share_is_a_chain_of_single_client_turns(setup):
    """Head-Emd Share: client 1 starts from the parts (and the trunk) client 0 finished with."""
    executor, start = make_executor(setup, "sequential", "share")
    both = next_global(executor, start, run_round(executor, start, [0, 1]))
    executor, start = make_executor(setup, "sequential", "share")
    after_first = next_global(executor, start, run_round(executor, start, [0]))
    chained = next_global(executor, after_first, run_round(executor, after_first, [1]))
    for name in both:
        torch.testing.assert_close(both[name], chained[name], rtol=0, atol=0, msg=name)


def steps_with_one_optimizer(prep, turns: list[int]) -> dict[str, torch.Tensor]:
    """The reference for carried optimizer state: the unsplit model stepped through the same client turns
    (same batches, masks and seeds as the executor's jobs) by a single AdamW that never restarts."""
    model = build_model("bert", "tiny", "classification", prep.tokenizer, num_labels=2, seed=3)
    settings = LocalSettings(lr=0.01, batch_size=8, local_steps=2, max_grad_norm=None)
    model.train()
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], settings)
    for cid in turns:
        rows, seed = prep.client_train[cid], 100 + cid
        generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        for batch_rows in batch_order(len(rows), settings, generator):
            loss, _ = prep.task.loss(model, prep.task.collate([rows[i] for i in batch_rows], generator))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return dict(model.named_parameters())


def largest_gap(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - expected[n].detach()).abs().max()) for n in got)


def test_carried_share_is_one_continuous_training_run(setup):
    """Head-Emd Share with ``optimizer_state: carry``: two rounds of two clients equal the unsplit model
    trained through the same four turns by one optimizer; with ``reset`` they do not."""
    expected = steps_with_one_optimizer(setup, [0, 1, 0, 1])
    finals = {}
    for state in ("carry", "reset"):
        executor, start = make_executor(setup, "sequential", "share", optimizer_state=state)
        params = next_global(executor, start, run_round(executor, start, [0, 1]))
        finals[state] = next_global(executor, params, run_round(executor, params, [0, 1], round_idx=2))
        executor.close()
    assert set(finals["carry"]) == {n for n, p in expected.items() if p.requires_grad}
    assert largest_gap(finals["carry"], expected) < 1e-5
    assert largest_gap(finals["reset"], expected) > 1e-3


def test_carried_optimizer_state_is_counted_and_restored_for_a_retried_round(setup):
    executor, start = make_executor(setup, "sequential", "share", optimizer_state="carry")
    parts = sum(4 * start[n].numel() for n in executor.parts.shared)
    state = 2 * parts + 4 * len(executor.parts.shared)  # AdamW: two moments and a float32 step per tensor
    first = run_round(executor, start, [0, 1])
    first_global = next_global(executor, start, first)
    assert [r.upload_bytes for r in first] == [parts + state] * 2
    assert [r.download_extra for r in first] == [0, state]  # the second client is handed the first's state
    again = next_global(executor, start, run_round(executor, start, [0, 1]))  # begin_round(1) again: a retry
    for name, value in first_global.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=name)
    with pytest.raises(UserError, match="optimizer_state = carry needs one trunk"):
        make_executor(setup, "parallel", "average", optimizer_state="carry")
    for mode, parts, state in (("client_batch", "average", "reset"), ("sequential", "share", "carry"),
                               ("sequential", "average_bottom", "reset")):
        with pytest.raises(UserError, match="split learning across machines runs"):
            make_executor(setup, mode, parts, optimizer_state=state, remote=lambda backend, codec: None)


def test_parallel_trunk_copies_each_start_from_the_rounds_trunk(setup):
    executor, start = make_executor(setup, "parallel", "average")
    together = run_round(executor, start, [0, 1, 2])
    alone = run_round(executor, start, [2])[0]
    trunk = executor.parts.trunk
    for name in trunk:
        torch.testing.assert_close(together[2].update.params[name], alone.update.params[name], rtol=0, atol=0)
    assert not torch.equal(together[0].update.params[trunk[0]], together[1].update.params[trunk[0]])


def test_local_parts_stay_with_each_client_and_differ(setup):
    executor, start = make_executor(setup, "sequential", "local")
    run_round(executor, start, [0, 1])
    name = executor.parts.local[0]
    store = executor.clients.store
    kept = [store.get(c)[name] for c in (0, 1)]
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], store.initial[name])


def test_client_batch_steps_the_trunk_once_on_the_mean_of_the_clients_gradients():
    """Two clients, different sequence lengths: one trunk SGD step with (g_a + g_b) / 2; each client gets the
    input gradient of its own loss, as if it had the trunk alone."""
    tokenizer = build_tokenizer(None, "bert", [t for t, _ in make_sentences(40)], 200)
    model = build_model("bert", "tiny", "classification", tokenizer, num_labels=2, seed=0).eval()
    split = SplitModel(model, Cut(0, 0))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trunk_names = split.trunk_parameter_names()
    inputs = {"a": torch.randn(2, 5, 64), "b": torch.randn(3, 7, 64)}
    masks = {"a": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), "b": torch.ones(3, 7, dtype=torch.long)}
    targets = {k: torch.randn(v.shape[0], v.shape[1], 64) for k, v in inputs.items()}

    def client_loss(out: torch.Tensor, cid: str) -> torch.Tensor:
        return F.mse_loss(out, targets[cid])

    expected_input_grads, trunk_grads = {}, []
    for cid in ("a", "b"):  # reference: each client alone on the unchanged trunk
        received = Activations(inputs[cid], masks[cid]).detached()
        model.zero_grad()
        client_loss(split.trunk(received).hidden, cid).backward()
        expected_input_grads[cid] = received.hidden.grad
        params = dict(model.named_parameters())
        trunk_grads.append({n: params[n].grad.clone() for n in trunk_names})
    model.zero_grad()
    steps = []

    def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.5)
        optimizer.register_step_post_hook(lambda *_: steps.append(1))  # counts the trunk's steps
        return optimizer

    backend = BatchingTrunkBackend(split.trunk, 64, sgd, timeout_s=30)
    backend.expect(["a", "b"])
    log = MessageLog()
    transports = {cid: InProcessTransport(backend, cid, hook=log) for cid in ("a", "b")}
    with ThreadPoolExecutor(2) as pool:
        forward = pool.map(lambda c: transports[c].forward(0, Activations(inputs[c], masks[c])), "ab")
        outs = dict(zip("ab", forward, strict=True))
        grads = {}
        for cid in ("a", "b"):
            client_loss(outs[cid].hidden, cid).backward()
            grads[cid] = outs[cid].hidden.grad
        back = dict(zip("ab", pool.map(lambda c: transports[c].backward(0, grads[c]), "ab"), strict=True))
    for cid in ("a", "b"):
        torch.testing.assert_close(back[cid], expected_input_grads[cid], rtol=1e-4, atol=1e-6)
    params = dict(model.named_parameters())
    for name in trunk_names:
        mean_grad = (trunk_grads[0][name] + trunk_grads[1][name]) / 2
        torch.testing.assert_close(params[name].detach(), start[name] - 0.5 * mean_grad, rtol=1e-4, atol=1e-6)
    assert len(steps) == 1
    assert {m.kind for m in log.messages} == {"forward", "backward"} and len(log.messages) == 8


# ---------------------------------------------------------------------------------------- the boundary


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
@pytest.mark.parametrize("mode", ["sequential", "client_batch"])
def test_boundary_carries_no_ids_or_labels_and_clients_hold_no_trunk(setup, transport, mode):
    log = MessageLog()
    executor, start = make_executor(setup, mode, "average", transport=transport, hook=log)
    try:
        run_round(executor, start, [0, 1])
    finally:
        executor.close()
    assert log.messages, "the hook saw no message"
    assert log.names(TO_SERVER) <= {"hidden", "attention_mask", "position_ids", "grad"}
    assert log.names(TO_CLIENT) <= {"hidden", "grad"}
    for message in log.messages:
        for name, (dtype, shape) in message.tensors.items():
            if name in ("hidden", "grad"):
                assert dtype == "float32" and shape[-1] == 64, (name, dtype, shape)
            else:  # the only integer tensors: the 0/1 padding mask and positions (checked by the trunk)
                assert name in ("attention_mask", "position_ids") and len(shape) == 2
    forwards = [m for m in log.messages if m.kind == "forward" and m.direction == TO_SERVER]
    backwards = [m for m in log.messages if m.kind == "backward" and m.direction == TO_SERVER]
    assert len(forwards) == len(backwards) == 2 * 2  # 2 clients x 2 local steps
    trunk_ids = {id(p) for p in executor.server.trunk_parameters()}
    for client in executor.clients.models:
        assert all(p.device.type == "meta" for p in client.trunk_parameters())
        assert not trunk_ids & {id(p) for p in client.client_parameters()}
        real = sum(p.numel() for p in client.model.parameters() if p.device.type != "meta")
        assert real == sum(p.numel() for p in client.client_parameters())


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
def test_activation_dtype_puts_the_boundary_in_16_bits(setup, transport):
    sizes, dtypes = {}, {}
    for precision in ("float32", "bfloat16"):
        log = MessageLog()
        executor, start = make_executor(setup, "sequential", "average", transport=transport, hook=log,
                                        activation_dtype=precision)
        try:
            reports = run_round(executor, start, [0, 1])
        finally:
            executor.close()
        dtypes[precision] = {d for m in log.messages for n, (d, _) in m.tensors.items() if n in ("hidden", "grad")}
        sizes[precision] = sum(r.boundary_up + r.boundary_down for r in reports)
    assert dtypes == {"float32": {"float32"}, "bfloat16": {"bfloat16"}}
    assert 0.5 * sizes["float32"] < sizes["bfloat16"] < 0.6 * sizes["float32"]  # + masks and headers


def lm_folder(tmp_path):
    folder = tmp_path / "lm"
    folder.mkdir(exist_ok=True)
    (folder / "train.txt").write_text("\n".join(t for t, _ in make_sentences(400)) + "\n")
    (folder / "test.txt").write_text("\n".join(t for t, _ in make_sentences(60, seed=5)) + "\n")
    return folder


def test_fedbert_table2_cost_model_matches_the_measured_bytes(tmp_path):
    """Per client and epoch, split learning sends 4pL (activations up and down at both cuts, p batches of
    activation size L); the server exchanges N * 4pL; FedAvg sends 2|W| per client. Measured = model +
    the padding mask and message headers, which the paper's model leaves out."""
    folder = lm_folder(tmp_path)
    raw = tiny_config(tmp_path, folder)
    raw["data"] = {"source": str(folder), "format": "txt"}
    raw["task"] = "mlm"
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    raw["model"]["max_length"] = 16
    raw["protocol"]["rounds"] = 1
    raw["split"] = {"trunk_mode": "sequential", "client_parts": "local"}
    run_single(validate(raw), folder, tmp_path / "split")
    record = read_metrics(tmp_path / "split")[-1]
    prep = prepare(validate(raw), folder)
    hidden, batch_size = 64, raw["train"]["batch_size"]
    per_client = record["bytes_by_client"]
    assert len(per_client) == 3
    for cid, measured in per_client.items():
        n = len(prep.client_train[int(cid)])
        sizes = [min(batch_size, n - i) for i in range(0, n, batch_size)]  # p batches, the last maybe smaller
        four_p_l = 4 * sum(b * 16 * hidden * 4 for b in sizes)
        total = measured["up"] + measured["down"]
        assert four_p_l <= total <= 1.10 * four_p_l, (cid, total, four_p_l)
        mask = sum(b * 16 * 8 for b in sizes)  # int64 padding mask, forward only
        assert total - four_p_l - mask < 400 * len(sizes)  # + message headers
    server = record["bytes_up_boundary"] + record["bytes_down_boundary"]
    assert server == sum(m["up"] + m["down"] for m in per_client.values())  # N * 4pL (+ the same overheads)
    raw.pop("split")
    run_single(validate(raw), folder, tmp_path / "fedavg")
    fedavg = read_metrics(tmp_path / "fedavg")[-1]
    w = sum(4 * t.numel() for t in final_global(tmp_path / "fedavg").values())
    assert fedavg["bytes_up"] + fedavg["bytes_down"] == 3 * 2 * w  # FedAvg: 2|W| per client


# ------------------------------------------------------------------------------------- runs and errors


@pytest.mark.parametrize(("family", "task", "auto_class", "split"), [
    ("roberta", "mlm", AutoModelForMaskedLM, {"trunk_mode": "sequential", "client_parts": "share"}),
    ("gpt2", "clm", AutoModelForCausalLM,
     {"trunk_mode": "client_batch", "client_parts": "average", "bottom_blocks": 1, "top_blocks": 1}),
    ("llama", "clm", AutoModelForCausalLM, {"trunk_mode": "parallel", "client_parts": "average_bottom"}),
])
def test_lm_pretraining_by_split_learning_improves_and_saves_a_plain_transformers_model(
        tmp_path, family, task, auto_class, split):
    folder = lm_folder(tmp_path)
    raw = tiny_config(tmp_path, folder)
    raw["data"] = {"source": str(folder), "format": "txt"}
    raw["task"] = task
    raw["model"] = {"family": family, "preset": "tiny", "vocab_size": 200, "max_length": 16,
                    "overrides": {"num_hidden_layers": 3} if family != "gpt2" else {"n_layer": 3}}
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    raw["protocol"]["rounds"] = 2
    raw["split"] = split
    run_single(validate(raw), folder, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    key = "test_perplexity" if "test_perplexity" in records[-1] else "test_perplexity_mean"
    assert records[-1][key] < 0.7 * records[0][key]
    assert records[-1]["bytes_up_boundary"] > 0 and "bytes_by_client" in records[-1]
    for name in ("config.yaml", "metrics.jsonl", "sharing.json"):
        assert (tmp_path / "run" / name).is_file()
    loaded = auto_class.from_pretrained(tmp_path / "run" / "model")
    assert loaded.config.model_type == family


def test_split_runs_resume_from_their_last_round(tmp_path, tiny_csv):
    raw = split_config(tmp_path, tiny_csv, trunk_mode="sequential", client_parts="average_bottom")
    raw["protocol"]["rounds"] = 2
    run_single(validate(raw), tiny_csv, tmp_path / "whole")
    raw["protocol"]["rounds"] = 1
    run_single(validate(raw), tiny_csv, tmp_path / "cut")
    config = validate(raw)
    config = config.model_copy(update={"protocol": config.protocol.model_copy(update={"rounds": 2})})
    run_single(config, tiny_csv, tmp_path / "cut", resume=True)
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [r["round"] for r in resumed] == [0, 1, 2]
    assert resumed[-1]["train_loss"] == pytest.approx(whole[-1]["train_loss"], rel=1e-6)


def test_split_config_errors_are_one_line(tmp_path, tiny_csv):
    raw = split_config(tmp_path, tiny_csv, trunk_mode="sequential")
    raw["protocol"]["kind"] = "fedprox"
    with pytest.raises(UserError, match="split learning averages with FedAvg"):
        validate(raw)
    raw = split_config(tmp_path, tiny_csv)
    raw["sharing"] = {"critical_layer": 1}
    with pytest.raises(UserError, match="remove the sharing section"):
        validate(raw)
    raw = split_config(tmp_path, tiny_csv, trunk_mode="diagonal")
    with pytest.raises(UserError, match=r"split\.trunk_mode"):
        validate(raw)
    raw = split_config(tmp_path, tiny_csv, trunk_mode="parallel", optimizer_state="carry")
    with pytest.raises(UserError, match="optimizer_state = carry needs one trunk"):
        run_single(validate(raw), tiny_csv, tmp_path / "carry")
    raw = split_config(tmp_path, tiny_csv, bottom_blocks=1, top_blocks=1)  # tiny has 2 blocks: no trunk left
    with pytest.raises(UserError, match="the server trunk needs at least one block"):
        run_single(validate(raw), tiny_csv, tmp_path / "bad")


def test_copy_for_a_client_has_real_client_parts_and_a_meta_trunk():
    tokenizer = build_tokenizer(None, "gpt2", [t for t, _ in make_sentences(40)], 200)
    model = build_model("gpt2", "tiny", "clm", tokenizer, seed=0)
    split = SplitModel(model, Cut(1, 0))
    client = client_copy(split)
    assert all(p.device.type == "meta" for p in client.trunk_parameters())
    for ours, theirs in zip(client.client_parameters(), split.client_parameters(), strict=True):
        assert torch.equal(ours, theirs) and ours is not theirs
    assert client.model.lm_head.weight is client.model.transformer.wte.weight  # ties survive the copy


def test_emdavg_keeps_only_pretraining_heads_local_so_its_encoder_can_be_fine_tuned(tmp_path, tiny_csv):
    """EmdAvg's clients keep their MLM heads; fine-tuning replaces heads, so the shared encoder is the model."""
    raw = split_config(tmp_path, tiny_csv, trunk_mode="sequential", client_parts="average_bottom")
    raw["task"] = "mlm"
    raw["protocol"]["rounds"] = 1
    raw["downstream"] = {"sentiment": {"data.source": str(tiny_csv), "task": "classification",
                                       "data.columns": {"text": "sentence", "label": "sentiment"},
                                       "protocol.kind": "centralized", "protocol.rounds": 1}}
    row = run_single(validate(raw), tiny_csv, tmp_path / "emdavg")
    assert 0 <= row["sentiment accuracy"] <= 1
    assert (tmp_path / "emdavg" / "model" / "config.json").is_file()
    assert (tmp_path / "emdavg" / "model" / "client_1" / "config.json").is_file()
    raw["split"]["client_parts"] = "local"  # embeddings stay on the clients: no single encoder
    with pytest.raises(UserError, match="needs one global encoder"):
        run_single(validate(raw), tiny_csv, tmp_path / "local")
