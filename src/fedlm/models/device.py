"""Where a model computes and in what precision: the config's ``train.device`` and ``train.precision``.

One place for the three decisions every training and evaluation loop makes: which device ``auto`` means here,
the autocast context a forward pass runs under, and whether backward needs a gradient scaler. Parameters stay
float32 in every precision (autocast casts per operation), so what a client sends, what the server averages
and what a checkpoint holds are float32 whatever the precision.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from fedlm.errors import UserError

__all__ = ["AUTOCAST_DTYPES", "autocast", "check_precision", "grad_scaler", "model_device", "resolve_device"]

# Autocast's compute dtype per precision; fp32 has none: it runs with no autocast at all, today's arithmetic.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device ``train.device`` names here: ``auto`` is CUDA if present, else Apple's MPS, else the CPU. A
    device this machine lacks is a one-line error now, not a CUDA traceback in the first batch."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device = {name!r}: torch sees no CUDA device on this machine; use auto or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"train.device = {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                        f"numbered from 0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"train.device = {name!r}: torch sees no MPS device on this machine; use auto or cpu")
    return device


def check_precision(device: torch.device, precision: str) -> None:
    """bf16 autocast on a CUDA card without bfloat16 units (before Ampere, compute capability 8.0) is refused
    up front rather than left to run emulated or fail in a kernel."""
    if precision == "bf16" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise UserError(f"train.precision = 'bf16': {torch.cuda.get_device_name(device)} has no bfloat16 support; "
                        "use fp16 (loss-scaled) or fp32")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model computes on: its first real parameter's (a split client's trunk is ``meta``)."""
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def autocast(device: torch.device, precision: str) -> AbstractContextManager[object]:
    """The context a forward pass (and its loss) runs under: none for fp32, so fp32 stays bit-for-bit what
    it was; torch.autocast on the device's type for bf16 and fp16 (matmuls in 16 bits, reductions in 32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 only: float16's narrow range flushes small gradients to zero, so the loss is scaled up before
    backward and the gradients unscaled before clipping and stepping (steps that overflow are skipped).
    bf16 keeps float32's range and needs no scaler."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
