"""Global / local / frozen parameters: selectors across families, FedSplitBERT's critical layer, FFDAPT's
rotating window, partial aggregation, local state that persists (in memory or on disk), exact upload bytes."""

from __future__ import annotations

import json

import pytest
import torch

from fedlm.config import SharingConfig, validate
from fedlm.config.protocol_kinds import PROTOCOL_KINDS
from fedlm.errors import UserError
from fedlm.federation.client_round import fit_client
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientJob
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import nbytes
from fedlm.federation.sharing import FreezeWindow, build_policy, layer_of, num_blocks, select
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import DiskClientStore
from fedlm.federation.strategies import ClientUpdate, FedAvg, FedOpt
from fedlm.models.build import FAMILIES, build_model, build_tokenizer
from fedlm.run.placement import Simulation
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import make_sentences, tiny_config

TASKS = {"bert": "classification", "roberta": "mlm", "distilbert": "classification", "gpt2": "clm",
         "llama": "classification"}


def _sharing(**kw) -> SharingConfig:
    return SharingConfig(**kw)


@pytest.fixture(scope="module")
def family_models() -> dict:
    texts = [t for t, _ in make_sentences(60)]
    out = {}
    for family in FAMILIES:
        tok = build_tokenizer(None, family, texts, 200)
        out[family] = build_model(family, "tiny", TASKS[family], tok, num_labels=2, seed=0)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_is_embeddings_a_block_or_head_in_every_family(family_models, family):
    model = family_models[family]
    names = [n for n, _ in model.named_parameters()]
    groups = {n: layer_of(n) for n in names}
    layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
    assert num_blocks(names) == layers == 2
    embeddings = [n for n, g in groups.items() if g == "embeddings"]
    head = [n for n, g in groups.items() if g == "head"]
    assert embeddings and head
    assert any("word" in n or "wte" in n or "embed_tokens" in n for n in embeddings)
    # every block holds the same parameter names (attention, MLP, norms): one rule found them all
    per_block = [sorted(n.split(f".{b}.", 1)[1] for n, g in groups.items() if g == b) for b in range(layers)]
    assert per_block[0] and per_block[0] == per_block[1]


def test_critical_layer_splits_embeddings_and_lower_blocks_from_the_rest(family_models):
    names = [n for n, _ in family_models["bert"].named_parameters()]
    half = build_policy(_sharing(critical_layer=1), PROTOCOL_KINDS["fedavg"], names, {})
    assert {layer_of(n) for n in half.global_names} == {"embeddings", 0}
    assert {layer_of(n) for n in half.local_names} == {1, "head"}
    assert sorted(half.global_names + half.local_names) == sorted(names) and half.personalized
    assert build_policy(_sharing(critical_layer=0), PROTOCOL_KINDS["fedavg"], names, {}).global_names == []
    full = build_policy(_sharing(critical_layer=2), PROTOCOL_KINDS["fedavg"], names, {})
    assert full.global_names == names and not full.personalized  # c = L is FedAvg
    assert build_policy(_sharing(), PROTOCOL_KINDS["isolated"], names, {}).global_names == []
    with pytest.raises(UserError, match="critical_layer = 3: this model has 2 blocks"):
        build_policy(_sharing(critical_layer=3), PROTOCOL_KINDS["fedavg"], names, {})


def test_selectors_and_their_errors(family_models):
    names = [n for n, _ in family_models["gpt2"].named_parameters()]
    assert {layer_of(n) for n in select("blocks 1-2", names, "x")} == {0, 1}
    assert {layer_of(n) for n in select("block 2", names, "x")} == {1}
    assert select("re:ln_f", names, "x") == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    policy = build_policy(_sharing(frozen=["embeddings"], local=["head"]), PROTOCOL_KINDS["fedavg"], names, {})
    assert set(policy.frozen_names) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert not set(policy.frozen_names) & set(policy.global_names + policy.local_names)
    assert {layer_of(n) for n in policy.local_names} == {"head"}
    with pytest.raises(UserError, match=r"sharing\.local: selector 'block 9' matches no trainable parameter"):
        build_policy(_sharing(local=["block 9"]), PROTOCOL_KINDS["fedavg"], names, {})
    with pytest.raises(UserError, match="unknown selector 'top'"):
        select("top", names, "sharing.frozen")


def test_ffdapt_window_sizes_and_rotation_by_hand():
    # n = 400, N = 4 blocks: client 0 holds 1/4 -> ceil(1) = 1 block; client 1 holds 3/4 -> min(eps=2, 3) = 2
    window = FreezeWindow(epsilon=2, gamma=1.0, blocks=4, sizes={0: 100, 1: 300})
    assert (window.count(0), window.count(1)) == (1, 2)
    assert window.frozen_blocks(1, [0, 1], 0) == [0]
    assert window.frozen_blocks(1, [0, 1], 1) == [1, 2]
    assert window.frozen_blocks(2, [0, 1], 0) == [3]  # the window goes on where round 1 stopped
    assert window.frozen_blocks(2, [0, 1], 1) == [0, 1]  # and wraps around
    assert FreezeWindow(epsilon=9, gamma=0.5, blocks=4, sizes={0: 1, 1: 1}).count(0) == 1  # ceil(2) * 0.5


def test_fedavg_and_fedopt_average_each_tensor_over_the_clients_that_sent_it():
    current = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.full((2,), 5.0)}
    updates = [ClientUpdate(0, 1, {"a": torch.ones(2), "b": torch.ones(2)}),
               ClientUpdate(1, 3, {"a": torch.full((2,), 5.0)})]  # client 1 froze b
    merged = FedAvg().aggregate(current, updates)
    assert torch.allclose(merged["a"], torch.full((2,), 4.0))  # (1*1 + 3*5) / 4
    assert torch.allclose(merged["b"], torch.ones(2))  # client 0 alone
    assert torch.equal(merged["c"], current["c"])  # nobody sent c: unchanged
    server = FedOpt("sgdm", lr=1.0, momentum=0.0)
    stepped = server.aggregate(current, updates)
    assert torch.allclose(stepped["b"], torch.ones(2)) and torch.equal(stepped["c"], current["c"])
    assert set(server.m) == {"a", "b"}  # no optimizer state for a tensor nobody trained


def _tiny_run(tmp_path, tiny_csv, name, sharing, **protocol):
    raw = tiny_config(tmp_path, tiny_csv, **protocol)
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    raw["sharing"] = sharing
    run_dir = tmp_path / name
    run_single(validate(raw), tiny_csv, run_dir)
    return run_dir, read_metrics(run_dir), json.loads((run_dir / "sharing.json").read_text())


def test_critical_layer_uploads_exactly_the_global_tensors_and_keeps_personal_heads(tmp_path, tiny_csv):
    run_dir, records, sharing = _tiny_run(tmp_path, tiny_csv, "split", {"critical_layer": 1}, codec="fp16")
    global_bytes = sharing["global"]["fp32_bytes"]
    assert sharing["local"]["tensors"] > 0 and global_bytes > 0
    for rec in records[1:]:
        assert rec["bytes_up"] == len(rec["clients"]) * global_bytes // 2  # fp16, no metadata
        assert rec["bytes_down"] == 3 * global_bytes // 2 and rec["bytes_up_meta"] == 0
        assert "test_accuracy_mean" in rec and "local_accuracy_mean" in rec  # personalized evaluation
    from transformers import AutoModelForSequenceClassification

    clients = [dict(AutoModelForSequenceClassification.from_pretrained(run_dir / "model" / f"client_{c}")
                    .named_parameters()) for c in range(3)]
    for name in sharing["global"]["names"]:
        assert torch.equal(clients[0][name], clients[1][name]), name
    assert any(not torch.equal(clients[0][n], clients[1][n]) for n in sharing["local"]["names"])


def test_int8_blockwise_bytes_count_payload_and_scales_separately(tmp_path, tiny_csv):
    _, records, sharing = _tiny_run(tmp_path, tiny_csv, "int8", {}, codec="int8", codec_block_size=64)
    params = sharing["global"]["fp32_bytes"] // 4
    rec = records[1]
    assert rec["bytes_down_meta"] > 0
    assert rec["bytes_down"] == 3 * (params + rec["bytes_down_meta"] // 3)
    assert rec["bytes_up"] - rec["bytes_up_meta"] == 3 * params


def test_local_parts_persist_for_clients_not_sampled_every_round(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, rounds=4, clients_per_round=1)
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    raw["sharing"] = {"critical_layer": 1, "local_store": "disk"}
    seen: dict[int, list] = {}
    last: dict[int, dict] = {}

    def recording_fit(model, task, rows, job, codec, local_state, local_names, **steps):
        report, local = fit_client(model, task, rows, job, codec, local_state, local_names, **steps)
        seen.setdefault(job.client_id, []).append((job.round_idx, local_state))
        if job.client_id in last:  # what it gets back is what it kept last time, not the initial state
            assert all(torch.equal(local_state[n], last[job.client_id][n]) for n in local_names)
        last[job.client_id] = local
        return report, local

    class Recording(InProcessExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "fit_fn": recording_fit})

    run_single(validate(raw), tiny_csv, tmp_path / "persist", placement=Simulation(Recording))
    assert any(len(v) >= 2 for v in seen.values())  # some client came back after sitting out
    assert len(list((tmp_path / "persist" / "client_states" / "committed").glob("*.pt"))) == len(seen)


def test_disk_store_commits_at_checkpoints_and_drops_uncommitted_writes(tmp_path):
    store = DiskClientStore({"w": torch.zeros(2)}, tmp_path / "states")
    store.put(1, {"w": torch.ones(2)})
    assert torch.equal(store.get(1)["w"], torch.ones(2))
    saved = store.checkpoint(1)
    store.checkpointed(1)
    store.put(1, {"w": torch.full((2,), 2.0)})  # a round that gets interrupted
    store = DiskClientStore({"w": torch.zeros(2)}, tmp_path / "states")  # the resumed process
    store.restore(saved, 1)
    assert torch.equal(store.get(1)["w"], torch.ones(2)) and torch.equal(store.get(2)["w"], torch.zeros(2))


def test_frozen_parameters_get_no_gradient_are_not_sent_and_stay_put(tmp_path, tiny_csv):
    from fedlm.run.prepare import prepare

    raw = tiny_config(tmp_path, tiny_csv)
    prep = prepare(validate(raw), tiny_csv)
    params = dict(prep.model.named_parameters())
    names = list(params)
    frozen = tuple(n for n in names if layer_of(n) == 0)
    codec = get_codec("fp32")
    before = {n: params[n].detach().clone() for n in names}
    grads_seen = {}

    class Spy:
        def __getattr__(self, item):
            return getattr(prep.task, item)

        def loss(self, model, batch):
            loss, count = prep.task.loss(model, batch)
            loss.register_hook(lambda g: grads_seen.update({n: p.grad for n, p in params.items() if n in frozen}))
            return loss, count

    job = ClientJob(0, 1, codec.encode(before), LocalSettings(batch_size=8, lr=0.01), seed=1, frozen=frozen)
    report, _ = fit_client(prep.model, Spy(), prep.client_train[0], job, codec, None, [])
    sent = report.update.params
    assert not set(frozen) & set(sent) and len(sent) == len(names) - len(frozen)
    assert report.upload_bytes == nbytes({n: before[n] for n in sent})
    assert all(torch.equal(params[n], before[n]) for n in frozen)
    assert all(params[n].grad is None for n in frozen)
    assert all(params[n].requires_grad for n in names)  # restored for the next client


def test_ffdapt_run_freezes_a_window_per_client_and_uploads_less(tmp_path, tiny_csv):
    window = {"freeze_window": {"epsilon": 1, "gamma": 1.0}}
    _, plain, _ = _tiny_run(tmp_path, tiny_csv, "fdapt", {})
    _, frozen, sharing = _tiny_run(tmp_path, tiny_csv, "ffdapt", window)
    assert sharing["freeze_window"]["blocks_frozen_per_client"] == {"0": 1, "1": 1, "2": 1}
    assert frozen[1]["bytes_down"] == plain[1]["bytes_down"]
    assert frozen[1]["bytes_up"] < plain[1]["bytes_up"]


def test_downstream_on_a_personalized_run_is_refused_before_any_training(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["sharing"] = {"critical_layer": 1}
    raw["downstream"] = {"again": {"data.source": str(tiny_csv)}}
    with pytest.raises(UserError, match="downstream fine-tuning needs one global encoder"):
        run_single(validate(raw), tiny_csv, tmp_path / "refused")
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
