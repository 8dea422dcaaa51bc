"""What crosses the client/server boundary is encoded here, and every byte of it is counted.

The server always aggregates in fp32; a codec only changes what travels. ``payload_bytes`` counts the
tensors that stand for the values, ``meta_bytes`` what is needed to read them back (int8's scales).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from fedlm.federation.params import NamedTensors, nbytes


@dataclass(frozen=True)
class Encoded:
    tensors: NamedTensors
    codec: str
    payload_bytes: int
    meta_bytes: int = 0
    meta: NamedTensors = field(default_factory=dict)  # per-tensor scales, for the tensors that have them

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.meta_bytes


class Codec(Protocol):
    """A codec is rebuilt anywhere from ``get_codec(name, block_size)``, so those two are what travels."""

    name: str
    block_size: int | None

    def encode(self, tensors: NamedTensors) -> Encoded: ...

    def decode(self, encoded: Encoded) -> NamedTensors: ...


class CastCodec:
    """Send each tensor in a floating dtype (fp32 is lossless; fp16/bf16 halve the bytes)."""

    block_size: int | None = None

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def encode(self, tensors: NamedTensors) -> Encoded:
        out = {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        return Encoded(out, self.name, nbytes(out))

    def decode(self, encoded: Encoded) -> NamedTensors:
        return {n: t.to(torch.float32) if t.is_floating_point() else t for n, t in encoded.tensors.items()}


class Int8Codec:
    """Absmax int8: a quarter of fp32's bytes plus one fp32 scale per tensor, or per block of ``block_size``
    consecutive values (blocks keep one outlier from flattening a whole tensor's small values to zero).

    Each value is off by at most half its block's scale, absmax / 254. Non-float tensors pass through.
    """

    name = "int8"

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as rows of one block each, the last padded with zeros (zeros leave absmax unchanged)."""
        if self.block_size is None:
            block, rows = max(flat.numel(), 1), 1
        else:
            block, rows = self.block_size, math.ceil(flat.numel() / self.block_size)
        return F.pad(flat, (0, rows * block - flat.numel())).reshape(rows, block)

    def encode(self, tensors: NamedTensors) -> Encoded:
        out: NamedTensors = {}
        meta: NamedTensors = {}
        for name, tensor in tensors.items():
            if not tensor.is_floating_point():
                out[name] = tensor
                continue
            blocks = self._blocks(tensor.detach().reshape(-1).to(torch.float32))
            scale = blocks.abs().amax(dim=1) / 127
            divisor = torch.where(scale > 0, scale, 1.0)  # an all-zero block: 0 / 1 = 0, not NaN
            q = torch.round(blocks / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
            out[name] = q.reshape(-1)[: tensor.numel()].reshape(tensor.shape)
            meta[name] = scale
        return Encoded(out, self.name, nbytes(out), nbytes(meta), meta)

    def decode(self, encoded: Encoded) -> NamedTensors:
        out: NamedTensors = {}
        for name, q in encoded.tensors.items():
            if name not in encoded.meta:
                out[name] = q
                continue
            blocks = self._blocks(q.reshape(-1).to(torch.float32))
            scale = encoded.meta[name]
            if scale.shape != (blocks.shape[0],):
                raise ValueError(f"{name}: scales of shape {tuple(scale.shape)}, expected ({blocks.shape[0]},) "
                                 f"for block size {self.block_size}")
            values = (blocks * scale[:, None]).reshape(-1)[: q.numel()]
            out[name] = values.reshape(q.shape)
        return out


CASTS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CODECS = (*CASTS, Int8Codec.name)


def get_codec(name: str, block_size: int | None = None) -> Codec:
    """The codec a protocol names (``protocol.codec`` and ``codec_block_size``, validated by the config);
    a name from elsewhere, e.g. a message, that is not one of :data:`CODECS` is a ``ValueError``."""
    if name == Int8Codec.name:
        return Int8Codec(block_size)
    if name not in CASTS or block_size is not None:
        raise ValueError(f"no codec {name!r} with block size {block_size} (codecs: {', '.join(CODECS)}; "
                         "only int8 has blocks)")
    return CastCodec(name, CASTS[name])
