"""Adapters (peft) on a frozen base: what starts at zero, what trains, what travels and how many bytes, how
FedAvg combines LoRA factors, and that every protocol, sharing, codecs and split learning keep their meaning."""

from __future__ import annotations

import copy
import json
import logging
import re

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from fedlm.config import AdapterConfig, dump_config, validate
from fedlm.errors import UserError
from fedlm.federation.params import nbytes, snapshot
from fedlm.federation.strategies import ClientUpdate, FedAvg
from fedlm.models.adapters import apply_adapter, linear_block_modules
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Cut, SplitModel
from fedlm.run.recorder import RunRecorder, read_metrics
from fedlm.run.single import run_single
from fedlm.tasks import get_task
from fedlm.tasks.generation import left_pad
from tests.conftest import make_sentences, tiny_config
from tests.test_flower import no_telemetry, run_in_simulator_and_flower  # noqa: F401 (a fixture)
from tests.tiny_models import tiny_model
from tests.training_helpers import assert_same_weights, final_weights, one_client_split_equals_fedavg

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [t for t, _ in make_sentences(40)]
CASES = [("bert", "classification"), ("bert", "mlm"), ("gpt2", "clm"), ("llama", "classification")]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {family: build_tokenizer(None, family, TEXTS, 200) for family in ("bert", "gpt2", "llama")}


def _model(family: str, task: str, tokenizers: dict, layers: int = 2):
    return tiny_model(family, task, tokenizers[family], layers, num_labels=2)


def _batch(family: str, task: str, tokenizers: dict):
    bound = get_task(task, tokenizers[family])
    rows = [{"input_ids": tokenizers[family](t)["input_ids"], "labels": i % 2} for i, t in enumerate(TEXTS[:6])]
    if task != "classification":
        rows = [{"input_ids": row["input_ids"]} for row in rows]
    return bound, bound.collate(rows, torch.Generator().manual_seed(0))


def _adapted(family: str, task: str, tokenizers: dict, layers: int = 2, **spec):
    model = _model(family, task, tokenizers, layers)
    base = copy.deepcopy(model)
    return apply_adapter(AdapterConfig(**spec), model, task, seed=0), base


# ------------------------------------------------------------------------------------- start and freeze


@pytest.mark.parametrize(("family", "task"), CASES)
@pytest.mark.parametrize("kind", ["lora", "ia3"])
def test_lora_and_ia3_start_as_the_identity_so_round_0_is_the_base_model(tokenizers, family, task, kind):
    adapter, base = _adapted(family, task, tokenizers, kind=kind)
    names = adapter.trainable_names()
    if kind == "lora":
        factors_b = [p for n, p in adapter.model.named_parameters() if "lora_B" in n]
        assert factors_b and all(torch.equal(p, torch.zeros_like(p)) for p in factors_b)  # B = 0
        assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in adapter.model.named_parameters()
                   if "lora_A" in n)
    bound, batch = _batch(family, task, tokenizers)
    torch.manual_seed(0)
    expected, _ = bound.loss(base.eval(), batch)
    torch.manual_seed(0)
    got, _ = bound.loss(adapter.model.eval(), batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # only adapter (and head) tensors train; every base weight is frozen
    adapter_marks = ("lora_", "ia3_", "modules_to_save")
    assert names and all(any(mark in n for mark in adapter_marks) for n in names)
    heads = [n for n in names if "modules_to_save" in n]
    assert bool(heads) == (task == "classification")  # train_head defaults to classification/regression only


@pytest.mark.parametrize(("family", "targets"), [
    ("qwen2", "peft"), ("mistral", "peft"), ("gemma3_text", "peft"), ("opt", "peft"),  # peft's q_proj, v_proj
    ("phi3", "all-linear"), ("olmo2", "all-linear"), ("modernbert", "all-linear"), ("distilbert", "all-linear"),
])
def test_lora_default_targets_work_on_every_family(family, targets, caplog):
    """``target_modules: null`` keeps peft's default where peft has one for the family, and elsewhere (olmo2,
    modernbert, phi3, distilbert) adapts every linear layer in the blocks, never the head nor the embeddings, so
    each split side holds the adapters of its own blocks; the adapted model starts as the base and trains."""
    tok = build_tokenizer(None, family, TEXTS, 200)
    model = build_model(family, "tiny", "classification", tok, num_labels=2, seed=0)
    base = copy.deepcopy(model).eval()
    with caplog.at_level(logging.INFO, logger="fedlm"):
        adapter = apply_adapter(AdapterConfig(kind="lora", r=2), model, "classification", seed=0)
    logged = [r.getMessage() for r in caplog.records if r.name == "fedlm"]
    adapted = {n.split(".lora_A.")[0] for n in adapter.trainable_names() if ".lora_A." in n}
    if targets == "all-linear":
        assert adapted == set(linear_block_modules(base))
        assert logged == [f"adapter.kind lora on a {family} model: peft has no default target_modules for this "
                          "family; adapting every linear layer in the blocks (all-linear)"]
    else:
        assert adapted == {n for n, _ in base.named_modules() if n.rsplit(".", 1)[-1] in ("q_proj", "v_proj")}
        assert not logged
    assert adapted and all(re.search(r"\.\d+\.", f".{n}.") for n in adapted)  # inside the blocks
    assert {n for n in adapter.trainable_names() if "lora_" not in n} == {
        n for n in adapter.trainable_names() if "modules_to_save" in n}  # besides LoRA, only the head trains
    batch = tok(TEXTS[:3], padding=True, return_tensors="pt")
    labels = torch.tensor([0, 1, 0])
    with torch.no_grad():
        torch.testing.assert_close(adapter.model.eval()(**batch).logits, base(**batch).logits, rtol=0, atol=1e-6)
    adapter.model.train()(**batch, labels=labels).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in adapter.model.named_parameters()
               if "lora_B" in n)


def _peft_reference(adapter, base, tmp_path, ids, mask):
    """The saved adapter on an untouched copy of the base, run the way ``PeftModel.forward`` runs it (its
    prompt as a key/value cache, the mask widened) but with the tokens numbered from 0 as fedlm numbers them
    (``PeftModel.forward`` itself adds the prefix length to the positions, see fedlm.models.prefixes)."""
    adapter.save(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    length = reloaded.peft_config["default"].num_virtual_tokens
    wide = torch.cat([torch.ones(ids.shape[0], length, dtype=mask.dtype), mask], dim=1)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return reloaded.get_base_model()(input_ids=ids, attention_mask=wide, position_ids=positions,
                                         past_key_values=reloaded.get_prompt(ids.shape[0])).logits


@pytest.mark.parametrize("kind", ["prefix", "p_tuning_v2"])
@pytest.mark.parametrize(("family", "task", "overrides"), [
    ("gpt2", "classification", {}), ("bert", "mlm", {}), ("llama", "clm", {"num_key_value_heads": 1}),  # GQA
])
def test_block_prefixes_compute_what_peft_prefix_cache_computes(tokenizers, tmp_path, kind, family, task, overrides):
    """fedlm's tasks call the base model; each attention layer's hook must add its prefix as peft's cache does,
    and ``model/`` (peft's save_pretrained) must hold exactly the prefixes that ran."""
    model = build_model(family, "tiny", task, tokenizers[family], num_labels=2, overrides=overrides, seed=0)
    base = copy.deepcopy(model).eval()
    adapter = apply_adapter(AdapterConfig(kind=kind, prefix_length=3), model, task, seed=0)
    names = adapter.trainable_names()
    prefixes = [n for n in names if ".prefix_kv." in n]
    if kind == "p_tuning_v2":  # one prefix per block, inside the block; no projection MLP
        assert len(prefixes) == 2 and not any(n.startswith("prompt_encoder.") for n in names)
    else:  # the projection makes every block's prefix: one module outside the blocks
        assert not prefixes and any("prompt_encoder.default.transform" in n for n in names)
    assert all(".prefix_kv." in n or n.startswith("prompt_encoder.") or "modules_to_save" in n for n in names)
    with torch.no_grad():  # trained prefixes, not peft's initialisation
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn_like(p))
    _, batch = _batch(family, task, tokenizers)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    adapter.model.eval()
    with torch.no_grad():
        ours = adapter.model(input_ids=ids, attention_mask=mask).logits
        plain = base(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, _peft_reference(adapter, base, tmp_path, ids, mask), rtol=0, atol=1e-5)
    assert not torch.allclose(ours, plain, atol=1e-4), "the prefixes must change the output"
    hidden = adapter.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state  # the tasks' path
    assert hidden.shape[:2] == ids.shape  # prefixes are keys/values only, never outputs


def test_p_tuning_v2_on_gemma3_with_sliding_window_and_gqa_matches_peft(tmp_path):
    """FL-GLM's setting: p-tuning v2 on a Gemma 3 model (sliding-window layers, one key/value head); the
    window here is longer than the input, as peft's prefix leaves a shorter window (fedlm's stays visible)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=16,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    base = copy.deepcopy(model)
    adapter = apply_adapter(AdapterConfig(kind="p_tuning_v2", prefix_length=3), model, "clm")
    ids = torch.randint(1, 100, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    ours = adapter.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours.detach(), _peft_reference(adapter, base, tmp_path, ids, mask), rtol=0, atol=1e-6)
    ours.sum().backward()
    names = [f"model.layers.{b}.self_attn.prefix_kv.weight" for b in range(3)]
    assert adapter.trainable_names() == names
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in names)
    assert model.get_parameter(names[0]).shape == (3, 2 * 1 * 16)  # P x (key + value) x kv heads x head dim


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generation_with_a_cache_uses_the_prefixes_as_the_forward_does(tokenizers, family):
    """``generate`` keeps a key/value cache; the prefix must enter every step (never the cache itself), so
    greedy decoding equals re-running the whole forward for each new token."""
    adapter, _ = _adapted(family, "clm", tokenizers, kind="p_tuning_v2", prefix_length=3)
    model = adapter.model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 1.0)
    tok = tokenizers[family]
    ids, mask = left_pad([tok(t)["input_ids"][:n] for t, n in zip(TEXTS[:3], (6, 3, 5), strict=True)],
                         tok.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, min_length=0,
                         pad_token_id=tok.pad_token_id, eos_token_id=None, output_scores=True,
                         return_dict_in_generate=True)
    tokens, seen = ids, mask
    for step in range(4):
        positions = (seen.cumsum(-1) - 1).clamp(min=0)  # what generate numbers left-padded prompts with
        with torch.no_grad():
            logits = model(input_ids=tokens, attention_mask=seen, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(out.scores[step], logits[:, -1], rtol=0, atol=1e-5)
        chosen = logits[:, -1].argmax(-1, keepdim=True)
        tokens, seen = torch.cat([tokens, chosen], 1), torch.cat([seen, torch.ones_like(chosen)], 1)
    assert torch.equal(out.sequences, tokens)


def test_a_saved_p_tuning_v2_adapter_loads_back_into_its_blocks(tokenizers, tmp_path):
    adapter, base = _adapted("bert", "classification", tokenizers, kind="p_tuning_v2", prefix_length=2)
    with torch.no_grad():
        for p in adapter.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    adapter.save(tmp_path / "model")
    saved = load_file(tmp_path / "model" / "adapter_model.safetensors")
    prefixes = [adapter.model.get_parameter(f"bert.encoder.layer.{b}.attention.self.prefix_kv.weight")
                for b in range(2)]
    torch.testing.assert_close(saved["prompt_embeddings"], torch.cat(prefixes, dim=1), rtol=0, atol=0)
    fresh = apply_adapter(AdapterConfig(kind="p_tuning_v2", prefix_length=2), copy.deepcopy(base),
                          "classification", seed=1)
    fresh.load(tmp_path / "model")
    expected = snapshot(adapter.model, adapter.trainable_names())
    got = snapshot(fresh.model, fresh.trainable_names())
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_opacus_sees_each_example_own_prefix_gradient(tokenizers):
    """DP-SGD clips per example: a block's prefix is looked up once per example, so Opacus' per-example
    gradient of it is that example's gradient alone."""
    from opacus.grad_sample import GradSampleModule

    model = build_model("bert", "tiny", "classification", tokenizers["bert"], num_labels=2, seed=0,
                        overrides={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    model = apply_adapter(AdapterConfig(kind="p_tuning_v2", prefix_length=2), model, "classification").model
    model.train()  # Opacus records activations in training mode only; no dropout, so examples stay apart
    _, batch = _batch("bert", "classification", tokenizers)
    ids, mask = batch["input_ids"][:3], batch["attention_mask"][:3]
    name = "bert.encoder.layer.1.attention.self.prefix_kv.weight"
    alone = []
    for i in range(3):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).logits[0, 1].backward()
        alone.append(model.get_parameter(name).grad.clone())
    model.zero_grad(set_to_none=True)
    tracked = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    try:
        tracked(input_ids=ids, attention_mask=mask).logits[:, 1].sum().backward()
        per_example = model.get_parameter(name).grad_sample
        torch.testing.assert_close(per_example, torch.stack(alone), rtol=1e-4, atol=1e-6)
    finally:
        tracked.remove_hooks()


def test_prefixes_on_a_family_whose_attention_keeps_no_cache_are_one_line(tokenizers):
    tok = build_tokenizer(None, "distilbert", TEXTS, 200)
    model = build_model("distilbert", "tiny", "classification", tok, num_labels=2, seed=0)
    with pytest.raises(UserError, match="p_tuning_v2 on a distilbert model: its attention layers take no") as err:
        apply_adapter(AdapterConfig(kind="p_tuning_v2"), model, "classification")
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------- LoRA under FedAvg


def test_fedavg_of_lora_averages_a_and_b_not_their_product(tokenizers):
    """FedAvg on LoRA factors: mean(B) mean(A), which is not mean(B A). Checked by hand on a rank-1 case."""
    adapter, _ = _adapted("bert", "classification", tokenizers, kind="lora", r=1, alpha=2.0,
                          target_modules=["query"])
    layer = adapter.model.bert.encoder.layer[0].attention.self.query
    a_name = "bert.encoder.layer.0.attention.self.query.lora_A.default.weight"
    b_name = "bert.encoder.layer.0.attention.self.query.lora_B.default.weight"
    width = layer.base_layer.in_features
    a0, a1, b0, b1 = (torch.zeros(1, width), torch.zeros(1, width), torch.zeros(width, 1), torch.zeros(width, 1))
    a0[0, 0], a1[0, 1], b0[0, 0], b1[1, 0] = 1.0, 1.0, 2.0, 4.0
    updates = [ClientUpdate(0, 1, {a_name: a0, b_name: b0}), ClientUpdate(1, 3, {a_name: a1, b_name: b1})]
    merged = FedAvg().aggregate({a_name: torch.zeros(1, width), b_name: torch.zeros(width, 1)}, updates)
    # by hand: A = (1 a0 + 3 a1) / 4 = [0.25, 0.75, 0...]; B = [0.5, 3, 0...]^T; delta = (alpha / r) B A
    expected = torch.zeros(width, width)
    expected[:2, :2] = torch.tensor([[0.25, 0.75], [1.5, 4.5]])
    with torch.no_grad():
        for name, value in merged.items():
            adapter.model.get_parameter(name).copy_(value)
        x = torch.randn(3, width)
        delta = layer(x) - layer.base_layer(x)
    torch.testing.assert_close(delta, x @ expected.T, rtol=0, atol=1e-5)
    mean_of_products = torch.zeros(width, width)
    mean_of_products[0, 0], mean_of_products[1, 1] = 2 * 2 * 1 / 4, 2 * 4 * 3 / 4
    assert not torch.allclose(expected, mean_of_products)  # what FedAvg of factors is not


# ---------------------------------------------------------------------------------------------- runs


def _run(tmp_path, tiny_csv, name: str, adapter: dict, clients: int = 2, **protocol) -> tuple:
    raw = tiny_config(tmp_path, tiny_csv, **protocol)
    raw["partition"] = {"kind": "iid", "num_clients": clients}
    raw["adapter"] = adapter
    run_dir = tmp_path / name
    run_single(validate(raw), tiny_csv, run_dir)
    return run_dir, read_metrics(run_dir), json.loads((run_dir / "sharing.json").read_text())


@pytest.mark.parametrize(("kind", "codec"), [("lora", "fp32"), ("ia3", "fp16"), ("p_tuning_v2", "int8")])
def test_only_adapter_and_head_travel_and_bytes_are_their_sizes(tmp_path, tiny_csv, kind, codec):
    run_dir, records, sharing = _run(tmp_path, tiny_csv, kind, {"kind": kind}, codec=codec, rounds=1)
    names = sharing["global"]["names"] + sharing["local"]["names"]
    assert names and all(("lora_" in n or "ia3_" in n or ".prefix_kv." in n or "modules_to_save" in n)
                         for n in names)
    checkpoint = RunRecorder(run_dir).load_checkpoint()["global"]
    assert set(checkpoint) == set(sharing["global"]["names"])
    size = sum(t.numel() for t in checkpoint.values())  # adapter bytes == sum of adapter tensor sizes
    assert sharing["global"]["fp32_bytes"] == nbytes(checkpoint) == 4 * size
    per_value = {"fp32": 4, "fp16": 2, "int8": 1}[codec]
    for rec in records[1:]:
        meta = rec["bytes_up_meta"]
        assert rec["bytes_up"] - meta == len(rec["clients"]) * per_value * size
        assert rec["bytes_down"] - rec["bytes_down_meta"] == 2 * per_value * size
        assert (meta > 0) == (codec == "int8")


def test_base_stays_frozen_and_the_saved_adapter_and_merged_model_agree(tmp_path, tiny_csv):
    run_dir, _, _ = _run(tmp_path, tiny_csv, "saved", {"kind": "lora", "r": 4, "save_merged": True})
    model_dir = run_dir / "model"
    saved = load_file(model_dir / "adapter_model.safetensors")
    assert saved and all("lora_" in n or "modules_to_save" in n or "classifier" in n or "pooler" in n
                         for n in saved)
    assert any("lora_B" in n and t.abs().sum() > 0 for n, t in saved.items()), "training must move B"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = build_model("bert", "tiny", "classification", tokenizer, num_labels=2,
                       overrides={"hidden_dropout_prob": 0.1}, seed=7)  # the run's base, rebuilt
    untouched = copy.deepcopy(base)
    reloaded = PeftModel.from_pretrained(base, model_dir).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(model_dir / "merged").eval()
    ids = tokenizer(TEXTS[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        via_adapter = reloaded(**ids).logits
        via_merged = merged(**ids).logits
        via_base = untouched.eval()(**ids).logits
    torch.testing.assert_close(via_merged, via_adapter, rtol=0, atol=1e-5)
    assert not torch.allclose(via_base, via_adapter, atol=1e-4)


def test_one_client_fedavg_equals_centralized_with_lora(tmp_path, tiny_csv):
    lora = {"kind": "lora", "r": 4, "dropout": 0.1}
    fedavg, fed_records, _ = _run(tmp_path, tiny_csv, "fedavg", lora, clients=1)
    central, central_records, _ = _run(tmp_path, tiny_csv, "central", lora, clients=1, kind="centralized")
    assert_same_weights(final_weights(fedavg), final_weights(central))
    assert fed_records[-1]["test_loss"] == pytest.approx(central_records[-1]["test_loss"], abs=1e-6)


@pytest.mark.parametrize("kind", ["isolated", "fedprox", "fedopt"])
def test_every_protocol_trains_the_adapter_only(tmp_path, tiny_csv, kind):
    _, records, sharing = _run(tmp_path, tiny_csv, kind, {"kind": "lora", "r": 2}, rounds=1, kind=kind)
    names = sharing["global"]["names"] + sharing["local"]["names"]
    assert names and all("lora_" in n or "modules_to_save" in n for n in names)
    if kind == "isolated":
        assert not sharing["global"]["names"] and records[-1]["bytes_up"] == 0
    else:
        assert records[-1]["bytes_up"] == 2 * sharing["global"]["fp32_bytes"]


@pytest.mark.parametrize("frozen", [[], ["block 2"]])
def test_critical_layer_keeps_upper_block_lora_local_and_shares_the_lower(tmp_path, tiny_csv, frozen):
    raw = tiny_config(tmp_path, tiny_csv, rounds=1)
    raw["partition"] = {"kind": "iid", "num_clients": 2}
    raw["adapter"] = {"kind": "lora", "r": 2, "target_modules": "all-linear"}
    raw["sharing"] = {"critical_layer": 1, "frozen": frozen}
    run_single(validate(raw), tiny_csv, tmp_path / "critical")
    sharing = json.loads((tmp_path / "critical" / "sharing.json").read_text())
    shared, local = sharing["global"]["names"], sharing["local"]["names"]
    assert shared and all(".layer.0." in n and "lora_" in n for n in shared)
    assert len([n for n in shared if "lora_A" in n]) == 6  # all-linear: q, k, v, attention out, intermediate, out
    assert any("classifier" in n for n in local) and all(".layer.0." not in n for n in local)
    upper = [n for n in sharing["frozen"]["names"] + local if ".layer.1." in n]
    assert upper and all("lora_" in n for n in upper)  # block 2's LoRA: kept local, or frozen for everyone
    assert any(".layer.1." in n for n in local) == (not frozen)
    assert read_metrics(tmp_path / "critical")[-1]["bytes_up"] == 2 * sharing["global"]["fp32_bytes"]


@pytest.mark.usefixtures("no_telemetry")
def test_lora_rounds_through_flower_equal_the_simulator(tmp_path, tiny_csv, monkeypatch):
    """Flower nodes build the same adapter from the config they are sent, and exchange only its tensors."""
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2, codec="fp16")
    raw["partition"]["num_clients"] = 3
    raw["adapter"] = {"kind": "lora", "r": 2}
    sim, fl = run_in_simulator_and_flower(monkeypatch, validate(raw), tiny_csv, tmp_path)
    for a, b in zip(sim[1:], fl[1:], strict=True):
        assert a["clients"] == b["clients"] and a["bytes_down"] == b["bytes_down"]
        assert a["test_loss"] == pytest.approx(b["test_loss"], abs=1e-6)
    expected = load_file(tmp_path / "sim" / "model" / "adapter_model.safetensors")
    got = load_file(tmp_path / "flower" / "model" / "adapter_model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------ split


def test_lora_split_step_equals_the_unsplit_step(tokenizers):
    adapter, _ = _adapted("llama", "classification", tokenizers, layers=3, kind="lora", r=2,
                          target_modules="all-linear")
    model = adapter.model.train()
    with torch.no_grad():  # B != 0, so A gets a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    reference = copy.deepcopy(model)
    bound, batch = _batch("llama", "classification", tokenizers)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]

    loss, _ = bound.loss(reference, batch)
    loss.backward()
    torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=1.0).step()

    split = SplitModel(model, Cut(1, 1))
    client = torch.optim.SGD([p for p in split.client_parameters() if p.requires_grad], lr=1.0)
    server = torch.optim.SGD([p for p in split.trunk_parameters() if p.requires_grad], lr=1.0)
    sent = split.bottom(batch["input_ids"], batch["attention_mask"])
    received = sent.detached()
    out = split.trunk(received)
    top_in = out.detached()
    split_loss = torch.nn.functional.cross_entropy(split.top.logits(split.top(top_in), batch["input_ids"]),
                                                   batch["labels"])
    split_loss.backward()
    out.hidden.backward(top_in.hidden.grad)
    sent.hidden.backward(received.hidden.grad)
    client.step()
    server.step()

    torch.testing.assert_close(split_loss, loss.detach(), rtol=0, atol=1e-6)
    expected, got = snapshot(reference, trained), snapshot(model, trained)
    for name in trained:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-5, msg=name)
    trunk = set(split.trunk_parameter_names())
    assert any(n in trunk for n in trained) and any(n not in trunk for n in trained)  # adapters on both sides


def test_one_client_lora_split_run_equals_lora_fedavg_and_never_sends_the_trunk(tmp_path, tiny_csv):
    got = one_client_split_equals_fedavg(tmp_path, tiny_csv, {"kind": "lora", "r": 2})
    sharing = json.loads((tmp_path / "split" / "sharing.json").read_text())
    client_parts = {n: got[n] for n in sharing["global"]["names"] if ".layer.1." not in n}
    assert any(".layer.1." in n for n in got) and all(".layer.1." not in n for n in client_parts)
    rec = read_metrics(tmp_path / "split")[-1]
    assert rec["bytes_down"] - rec["bytes_down_boundary"] == nbytes(client_parts)  # LoRA of blocks 1, 3 + head
    assert rec["bytes_up"] - rec["bytes_up_boundary"] == nbytes(client_parts)


# ----------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(("change", "words"), [
    ({"adapter": {"kind": "prefix", "r": 4}}, "r not used by adapter.kind prefix"),
    ({"adapter": {"kind": "prefix"}, "split": {}}, "prefix with a projection does not run through a split model"),
    ({"adapter": {"kind": "lora"}, "downstream": {"x": {"task": "mlm"}}}, "with an adapter the run saves"),
    ({"adapter": {"kind": "dora"}}, "adapter.kind"),
])
def test_adapter_config_mistakes_are_one_line(tmp_path, tiny_csv, change, words):
    raw = {**tiny_config(tmp_path, tiny_csv), **change}
    with pytest.raises(UserError) as err:
        validate(raw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_dumped_adapter_config_validates_again(tmp_path, tiny_csv):
    """Flower nodes and resumed runs read the config back as dumped, every key written out."""
    for adapter in ({"kind": "prefix", "prefix_length": 4}, {"kind": "lora", "r": 2, "target_modules": "all-linear"}):
        config = validate({**tiny_config(tmp_path, tiny_csv), "adapter": adapter})
        assert validate(yaml.safe_load(dump_config(config))) == config


def test_train_head_on_a_tied_lm_head_and_unknown_families_are_user_errors(tokenizers):
    with pytest.raises(UserError, match="tied to the input embeddings"):
        _adapted("gpt2", "clm", tokenizers, kind="lora", train_head=True)
    texts = TEXTS
    tok = build_tokenizer(None, "distilbert", texts, 200)
    model = build_model("distilbert", "tiny", "classification", tok, num_labels=2, seed=0)
    with pytest.raises(UserError, match=r"set adapter\.target_modules") as err:
        apply_adapter(AdapterConfig(kind="lora", target_modules=["nonexistent"]), model, "classification")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="ia3 on a distilbert model"):
        apply_adapter(AdapterConfig(kind="ia3", target_modules=["nonexistent"]), model, "classification")
