"""P-Tuning v2 through split learning and sharing (FL-GLM): each block's prefix goes with its block.

The client holds the prefixes of its bottom and top blocks, the server trains those of the trunk's; a split
step computes what the unsplit step computes; ``critical_layer`` and block selectors pick prefixes by block.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fedlm.config import AdapterConfig, SharingConfig, validate
from fedlm.config.protocol_kinds import PROTOCOL_KINDS
from fedlm.errors import UserError
from fedlm.federation.params import nbytes
from fedlm.federation.sharing import build_policy, select
from fedlm.models.adapters import apply_adapter
from fedlm.models.build import build_tokenizer
from fedlm.models.cut import Cut, SplitModel
from fedlm.models.introspect import parameter_groups
from fedlm.models.presets import get_preset
from fedlm.run.recorder import RunRecorder, read_metrics
from fedlm.run.single import run_single
from fedlm.split.parts import Average, client_copy, split_parts
from fedlm.tasks import get_task
from tests.conftest import make_sentences, tiny_config
from tests.split_helpers import assert_split_grads_equal_unsplit, assert_split_step_equals_unsplit
from tests.tiny_models import ENCODERS, FAMILY_CONFIG, hf_model, random_batch, random_loss, tiny_model
from tests.training_helpers import one_client_split_equals_fedavg

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [t for t, _ in make_sentences(40)]
PREFIXED = [f for f in FAMILY_CONFIG if f != "distilbert"]  # distilbert's attention keeps no cache: refused


def _prefix(block_names: list[str]) -> list[str]:
    return [n for n in block_names if ".prefix_kv." in n]


def _adapted_family(family: str, task: str, length: int = 3):
    model = hf_model(family, task)
    adapter = apply_adapter(AdapterConfig(kind="p_tuning_v2", prefix_length=length), model, task, seed=0)
    with torch.no_grad():  # away from peft's initialisation, so that nothing passes by accident
        for name, p in model.named_parameters():
            if ".prefix_kv." in name:
                p.normal_(0, 1.0)
    return adapter


@pytest.mark.parametrize("cut", [Cut(1, 1), Cut(0, 1)], ids=["k1m1", "k0m1"])
@pytest.mark.parametrize("task", ["lm", "classification"])
@pytest.mark.parametrize("family", PREFIXED)
def test_p_tuning_v2_split_step_equals_the_unsplit_step_in_every_family(family, task, cut):
    """Sliding windows (mistral, qwen2, gemma3) and GQA included: the prefix enters each block's attention
    the same way whether the base model's forward or a split part runs the block."""
    model = _adapted_family(family, task).model.eval()
    ids, mask = random_batch(left_padding=family not in ENCODERS and task == "lm")
    split, got = assert_split_grads_equal_unsplit(model, cut, ids, mask, random_loss)
    trunk = _prefix(split.trunk_parameter_names())
    client = _prefix(split.client_parameter_names())
    assert trunk and client and all(got[n].abs().sum() > 0 for n in trunk + client)  # both sides learn


def _adapted(family: str, task: str, tokenizer, layers: int = 4):
    model = tiny_model(family, task, tokenizer, layers, num_labels=2)
    return apply_adapter(AdapterConfig(kind="p_tuning_v2", prefix_length=4), model, task, seed=0)


@pytest.mark.parametrize(("family", "task"), [("bert", "classification"), ("gpt2", "clm"), ("llama", "clm")])
def test_a_training_step_through_the_cut_equals_the_unsplit_one_and_only_prefixes_move(family, task):
    tokenizer = build_tokenizer(None, family, TEXTS, 200)
    adapter = _adapted(family, task, tokenizer)
    model = adapter.model.eval()
    bound = get_task(task, tokenizer)
    rows = [{"input_ids": tokenizer(t)["input_ids"], "labels": i % 2} for i, t in enumerate(TEXTS[:6])]
    if task != "classification":
        rows = [{"input_ids": row["input_ids"]} for row in rows]
    batch = bound.collate(rows, torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    assert_split_step_equals_unsplit(bound, batch, model, Cut(1, 1))  # steps ``model`` unsplit as reference

    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    trained = set(adapter.trainable_names())
    assert moved == trained  # the base stays frozen; every prefix (and the head) trains
    assert {n for n in trained if ".prefix_kv." in n} == {n for n in before if ".prefix_kv." in n}
    assert len(_prefix(list(trained))) == 4


def test_each_side_holds_exactly_the_prefixes_of_its_own_blocks():
    tokenizer = build_tokenizer(None, "llama", TEXTS, 200)
    model = _adapted("llama", "classification", tokenizer).model
    parts = split_parts(SplitModel(model, Cut(1, 1)), Average())
    prefix = "model.layers.{}.self_attn.prefix_kv.weight"
    assert _prefix(parts.bottom) == [prefix.format(0)]
    assert _prefix(parts.top) == [prefix.format(3)]
    assert parts.trunk == [prefix.format(1), prefix.format(2)]  # the server trains its blocks' prefixes
    assert set(parts.shared) == set(parts.bottom + parts.top)  # 'average': the client's prefixes are averaged
    assert set(parts.bottom + parts.top) - set(_prefix(parts.bottom + parts.top)) == {
        n for n in parts.top if "modules_to_save" in n}  # the rest of the client's trainables: the head

    client = client_copy(SplitModel(model, Cut(1, 1)))  # what a client process holds: no trunk weights
    held = dict(client.model.named_parameters())
    assert all(held[n].is_meta for n in parts.trunk)
    assert not any(held[n].is_meta for n in parts.bottom + parts.top)
    ids = torch.tensor([tokenizer(TEXTS[0])["input_ids"]])
    sent = client.bottom(ids, torch.ones_like(ids))  # the client's blocks run with their own prefixes
    assert torch.isfinite(sent.hidden).all()


@pytest.mark.parametrize("critical", [1, 2])
def test_critical_layer_and_block_selectors_pick_each_block_prefix_with_its_block(critical):
    tokenizer = build_tokenizer(None, "bert", TEXTS, 200)
    model = _adapted("bert", "classification", tokenizer).model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = parameter_groups(model)
    policy = build_policy(SharingConfig(critical_layer=critical), PROTOCOL_KINDS["fedavg"], names, {0: 1}, groups)
    lower = {f"bert.encoder.layer.{b}.attention.self.prefix_kv.weight" for b in range(critical)}
    assert set(policy.global_names) == lower  # blocks 1..c; the frozen embeddings are not trainable names
    assert set(_prefix(policy.local_names)) == {
        f"bert.encoder.layer.{b}.attention.self.prefix_kv.weight" for b in range(critical, 4)}
    assert select("block 3", names, "test", groups) == ["bert.encoder.layer.2.attention.self.prefix_kv.weight"]


def test_one_client_p_tuning_v2_split_run_equals_fedavg_and_the_trunk_prefixes_never_travel(tmp_path, tiny_csv):
    """FL-GLM: the trunk's prefixes train on the server, the client's (blocks 1 and 3 + head) on the client."""
    got = one_client_split_equals_fedavg(tmp_path, tiny_csv, {"kind": "p_tuning_v2", "prefix_length": 4})
    assert set(_prefix(list(got))) == {f"bert.encoder.layer.{b}.attention.self.prefix_kv.weight" for b in range(3)}
    client_parts = {n: t for n, t in got.items() if ".layer.1." not in n}
    rec = read_metrics(tmp_path / "split")[-1]
    assert rec["bytes_down"] - rec["bytes_down_boundary"] == nbytes(client_parts)  # prefixes of blocks 1, 3 + head
    assert rec["bytes_up"] - rec["bytes_up_boundary"] == nbytes(client_parts)
    sharing = json.loads((tmp_path / "split" / "sharing.json").read_text())
    width = 2 * get_preset("tiny").hidden  # a key and a value of the model's width per virtual token
    prefix_bytes = sum(4 * got[n].numel() for n in _prefix(list(client_parts)))
    assert prefix_bytes == 2 * 4 * 4 * width  # 2 client blocks x fp32 x 4 virtual tokens x width
    assert sharing["global"]["fp32_bytes"] == nbytes(got)


def test_a_projected_prefix_is_refused_in_split_runs_but_p_tuning_v2_and_flat_prefixes_pass(tmp_path, tiny_csv):
    raw = {**tiny_config(tmp_path, tiny_csv), "split": {"bottom_blocks": 1, "top_blocks": 1}}
    for adapter in ({"kind": "p_tuning_v2"}, {"kind": "prefix", "projection": False}):
        validate({**raw, "adapter": adapter})
    with pytest.raises(UserError) as err:
        validate({**raw, "adapter": {"kind": "prefix"}})
    assert "adapter.projection: false" in str(err.value) and "\n" not in str(err.value)


def test_a_split_clients_copy_keeps_its_own_prefix_hooks():
    """Deep copies (client copies, worker copies) run their own prefixes, never the original's."""
    tokenizer = build_tokenizer(None, "gpt2", TEXTS, 200)
    model = _adapted("gpt2", "clm", tokenizer).model.eval()
    twin = copy.deepcopy(model)
    ids = torch.tensor([tokenizer(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        twin.transformer.h[2].attn.prefix_kv.weight.add_(1.0)
        assert not torch.allclose(twin(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4)


def test_fedbert_cut_with_p_tuning_v2_trains_every_prefix_on_the_server(tmp_path, tiny_csv):
    """Cut(0, 0): the client's bottom is the frozen embeddings, so it has no gradient to take; every
    block's prefix is the server's, and only the head crosses between client and server."""
    raw = tiny_config(tmp_path, tiny_csv, rounds=1)
    raw["partition"] = {"kind": "iid", "num_clients": 2}
    raw["adapter"] = {"kind": "p_tuning_v2", "prefix_length": 2}
    raw["split"] = {"bottom_blocks": 0, "top_blocks": 0, "client_parts": "average"}
    run_single(validate(raw), tiny_csv, tmp_path / "fedbert")
    got = RunRecorder(tmp_path / "fedbert").load_checkpoint()["global"]
    prefixes = _prefix(list(got))
    assert len(prefixes) == get_preset("tiny").layers
    head = {n: t for n, t in got.items() if n not in prefixes}
    assert head and all("modules_to_save" in n for n in head)
    rec = read_metrics(tmp_path / "fedbert")[-1]
    assert rec["bytes_up"] - rec["bytes_up_boundary"] == 2 * nbytes(head)  # two clients, the head only
