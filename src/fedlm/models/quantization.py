"""Quantized bases (QLoRA): a pretrained checkpoint loaded in 4 or 8 bits through bitsandbytes, frozen, with a
peft adapter trained on it in full precision.

The base stays on the device that loads it (bitsandbytes places its packed weights itself: a quantized model
cannot be moved with ``.to``), its packed weights never train and never travel, and the task head is kept in
full precision (it is trained and sent with the adapter). bitsandbytes is an optional extra (``fedlm[qlora]``);
since 0.50 it runs NF4 / FP4 and 8-bit layers on the CPU too, so a quantized run is testable without a GPU.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from fedlm.errors import UserError

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig

    from fedlm.config import QuantizationConfig

# the heads fedlm's tasks train on top of a base (sequence classification, token tagging, QA spans, LM heads):
# kept in full precision so that they can train and travel
HEAD_MODULES = ["classifier", "score", "qa_outputs", "lm_head", "pre_classifier", "pooler", "cls",
                "vocab_projector", "vocab_transform", "vocab_layer_norm"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require_bitsandbytes() -> None:
    """Stop in one line, naming the extra, when bitsandbytes is missing."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("model.quantization loads the base through bitsandbytes, which is not installed: "
                        "pip install 'fedlm[qlora]' (or remove model.quantization)")


def bnb_config(quantization: QuantizationConfig) -> BitsAndBytesConfig:
    """``transformers``' quantization settings for the section (the task heads left in full precision)."""
    from transformers import BitsAndBytesConfig

    require_bitsandbytes()
    compute = _DTYPES[quantization.compute_dtype]
    if quantization.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=HEAD_MODULES)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization.type,
                              bnb_4bit_compute_dtype=compute, bnb_4bit_use_double_quant=quantization.double_quant,
                              llm_int8_skip_modules=HEAD_MODULES)


def keep_trainable_layout(model: torch.nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference. On a CPU with AVX512-BF16 (0.50), the
    first forward in eval mode without gradients (fedlm's round-0 evaluation) repacks each weight in place for a
    faster kernel whose matmul has no backward to its input, so from then on no gradient reaches the adapters
    below the last 4-bit layer: the run goes on, its adapters barely train, and a resumed run (which skips that
    evaluation) trains differently. Keeping the training layout costs the faster CPU inference only."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes layers (it cannot be moved with ``.to`` nor trained in full)."""
    return bool(getattr(model, "is_quantized", False) or getattr(model, "is_loaded_in_4bit", False)
                or getattr(model, "is_loaded_in_8bit", False))


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers hold as stored (packed 4-bit weights count as stored)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in the backward pass (``train.gradient_checkpointing``): the flag sits
    on the blocks, so a split part or the trunk calling them checkpoints too. Non-reentrant, so a frozen base
    (an adapter's, a quantized one) still passes gradients to what trains."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"train.gradient_checkpointing: the {model.config.model_type} family does not support it "
                        "in transformers; set it false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
