"""A quantized base (QLoRA): a 4-bit checkpoint with a LoRA trains under FedAvg, sends only the adapter and the
head, resumes bitwise; gradient checkpointing changes no gradient; what cannot work is refused in one line."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.models.build import build_tokenizer
from fedlm.models.cut import Cut
from fedlm.run.prepare import prepare
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import make_sentences, tiny_config
from tests.split_helpers import assert_split_grads_equal_unsplit

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A tiny pretrained-looking llama (random weights) with its own tokenizer, as a checkpoint directory."""
    folder = tmp_path_factory.mktemp("llama")
    tokenizer = build_tokenizer(None, "llama", [t for t, _ in make_sentences(200)], 200)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _raw(tmp_path, tiny_csv, checkpoint, rounds=2, **model):
    raw = tiny_config(tmp_path, tiny_csv, rounds=rounds)
    raw["model"] = {"family": "llama", "checkpoint": str(checkpoint), "preset": None, "max_length": 32, **model}
    raw["adapter"] = {"kind": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}
    raw["train"]["lr"] = 0.01
    return raw


def test_a_4bit_base_trains_its_adapter_sends_only_that_and_resumes_bitwise(tmp_path, tiny_csv, llama_checkpoint,
                                                                             one_thread):
    quantized = _raw(tmp_path, tiny_csv, llama_checkpoint, quantization={"bits": 4, "type": "nf4"})
    prep = prepare(validate(quantized), tiny_csv)
    linear = prep.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(linear).__name__ == "Linear4bit" and linear.weight.dtype == torch.uint8
    assert not any(p.requires_grad for n, p in prep.model.named_parameters() if "lora_" not in n and "score" not in n)

    whole = tmp_path / "whole"
    run_single(validate(quantized), tiny_csv, whole)
    records = read_metrics(whole)
    assert [r["round"] for r in records] == [0, 1, 2] and not any(r["failed"] for r in records)
    full = tmp_path / "full"
    run_single(validate(_raw(tmp_path, tiny_csv, llama_checkpoint)), tiny_csv, full)
    assert [r["bytes_up"] for r in read_metrics(full)] == [r["bytes_up"] for r in records]  # adapter + head only
    assert records[1]["test_accuracy"] != read_metrics(full)[1]["test_accuracy"] or (
        records[1]["train_loss"] != read_metrics(full)[1]["train_loss"])  # the 4-bit base computes otherwise

    cut = tmp_path / "cut"
    run_single(validate({**quantized, "protocol": {**quantized["protocol"], "rounds": 1}}), tiny_csv, cut)
    run_single(validate(quantized), tiny_csv, cut, resume=True)
    assert [r["test_accuracy"] for r in read_metrics(cut)] == [r["test_accuracy"] for r in records]
    a, b = load_file(next((whole / "model").rglob("*.safetensors"))), load_file(next((cut / "model").rglob(
        "*.safetensors")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_evaluation_does_not_stop_the_4bit_base_passing_gradients(tmp_path, tiny_csv, llama_checkpoint, one_thread):
    """bitsandbytes repacks a 4-bit weight for a faster CPU kernel on the first eval-mode forward without gradients
    (AVX512-BF16 CPUs), and that kernel has no backward to its input: after round 0's evaluation the adapters
    below the last 4-bit layer would stop learning. The first block's LoRA must still get gradients."""
    prep = prepare(validate(_raw(tmp_path, tiny_csv, llama_checkpoint, quantization={"bits": 4})), tiny_csv)
    model, batch = prep.model, prep.task.collate(prep.client_train[0][:4], torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    model.train()
    model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss.backward()
    attention = model.model.layers[0].self_attn
    assert not getattr(attention.q_proj.base_layer.weight.quant_state, "packing_format_for_cpu", False)
    for lora in (attention.q_proj, attention.v_proj):  # lora_B starts at 0, so it is B that gets the first gradient
        assert lora.lora_B["default"].weight.grad.abs().sum() > 0


def test_a_4bit_trunk_trains_its_adapters_as_the_unsplit_model_does(tmp_path, tiny_csv, llama_checkpoint, one_thread):
    """FL-GLM's server holds the big model: a split cut of the 4-bit base gives the unsplit loss and gradients,
    and a split run trains with its trunk's blocks 4-bit."""
    raw = _raw(tmp_path, tiny_csv, llama_checkpoint, rounds=1, quantization={"bits": 4})
    prep = prepare(validate(raw), tiny_csv)
    batch = prep.task.collate(prep.client_train[0][:4], torch.Generator().manual_seed(0))
    split, grads = assert_split_grads_equal_unsplit(prep.model, Cut(1, 1), batch["input_ids"],
                                                    batch["attention_mask"], lambda logits, mask: logits.pow(2).sum())
    assert type(split.trunk.blocks[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    assert any("layers.1." in n and "lora_" in n for n in grads)  # the trunk's block trains its adapter

    raw["split"] = {"bottom_blocks": 1, "top_blocks": 1}
    run_single(validate(raw), tiny_csv, tmp_path / "split")
    records = read_metrics(tmp_path / "split")
    assert [r["round"] for r in records] == [0, 1] and not records[1]["failed"] and records[1]["bytes_up_boundary"]


def test_gradient_checkpointing_changes_no_gradient(tmp_path, tiny_csv, llama_checkpoint, one_thread):
    grads = []
    for checkpointing in (False, True):
        raw = _raw(tmp_path, tiny_csv, llama_checkpoint)
        raw["train"]["gradient_checkpointing"] = checkpointing
        prep = prepare(validate(raw), tiny_csv)
        prep.model.train()
        batch = prep.task.collate(prep.client_train[0][:4], torch.Generator().manual_seed(0))
        loss, _ = prep.task.loss(prep.model, batch)
        loss.backward()
        assert prep.model.model.gradient_checkpointing == checkpointing
        grads.append({n: p.grad.clone() for n, p in prep.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_what_a_quantized_base_cannot_do_is_refused_in_one_line(tmp_path, tiny_csv, llama_checkpoint, monkeypatch):
    four = {"quantization": {"bits": 4}}
    with pytest.raises(UserError, match=r"cannot be fine-tuned in full .* add an adapter section"):
        validate({**_raw(tmp_path, tiny_csv, llama_checkpoint, **four), "adapter": None})
    with pytest.raises(UserError, match="a preset builds a random model"):
        validate(_raw(tmp_path, tiny_csv, llama_checkpoint, preset="tiny", **four))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    with pytest.raises(UserError, match=r"pip install 'fedlm\[qlora\]'"):
        prepare(validate(_raw(tmp_path, tiny_csv, llama_checkpoint, **four)), tiny_csv)
