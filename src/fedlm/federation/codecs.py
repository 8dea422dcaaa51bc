"""What crosses the client/server boundary is encoded here, and every byte of it is counted.

The server always aggregates in fp32; a codec only changes what travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlm.errors import UserError
from fedlm.federation.params import NamedTensors


@dataclass(frozen=True)
class Encoded:
    tensors: NamedTensors
    codec: str
    payload_bytes: int
    meta_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.meta_bytes


class CastCodec:
    """Send each tensor in a floating dtype (fp32 is lossless; fp16/bf16 halve the bytes)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def encode(self, tensors: NamedTensors) -> Encoded:
        out = {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        payload = sum(t.numel() * t.element_size() for t in out.values())
        return Encoded(out, self.name, payload)

    def decode(self, encoded: Encoded) -> NamedTensors:
        return {n: t.to(torch.float32) if t.is_floating_point() else t for n, t in encoded.tensors.items()}


_CODECS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def get_codec(name: str) -> CastCodec:
    if name not in _CODECS:
        raise UserError(f"protocol.codec = {name!r}: unknown codec (allowed: {', '.join(_CODECS)})")
    return CastCodec(name, _CODECS[name])
