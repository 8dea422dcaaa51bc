"""Named tensors <-> bytes for the split-learning boundary.

Layout of a payload::

    uint32 little-endian   n = length of the header
    n bytes                header: compact UTF-8 JSON, [[name, dtype, shape], ...] in payload order
    rest                   each tensor's raw little-endian buffer, back to back, C order, no padding

Why not ``torch.save``/pickle: unpickling what a peer sent runs the peer's code. This format can carry
nothing but tensors of five dtypes, and ``decode`` checks every size against the header before it builds
anything, so garbage is refused with a :class:`WireError` naming the problem instead of crashing or
allocating whatever a corrupt header asks for. ``len(payload)`` is the exact number of bytes that crosses.
A shape's sizes are checked one by one, not only through their product: ``[0, 10**20, 64]`` holds no data
but would overflow torch's size arithmetic, so sizes above zero must multiply to at most 2**31 - 1.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["DTYPES", "WireError", "cast_floats", "decode", "describe", "encode", "float_dtypes", "header_length"]

if sys.byteorder != "little":  # raw buffers are written in native order, which the format fixes as little-endian
    raise ImportError("fedlm.split.wire needs a little-endian host")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_PREFIX = struct.Struct("<I")
_MAX_RANK = 8
# Elements in one tensor, zero sizes aside: int32's range, far above any boundary message (gRPC's own cap is
# 2 GiB), and small enough that torch's int64 size and stride arithmetic cannot overflow.
_MAX_ELEMENTS = 2**31 - 1
_SHAPES = f"expected at most {_MAX_RANK} integer sizes >= 0, those above 0 multiplying to at most {_MAX_ELEMENTS}"


class WireError(ValueError):
    """A payload that cannot be (or must not be) encoded or decoded; the message says why."""


def encode(tensors: Mapping[str, Tensor]) -> bytes:
    """Header + buffers of ``tensors`` (moved to CPU, gradients dropped), in the mapping's order."""
    entries, buffers = [], []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name:
            raise WireError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, Tensor):
            raise WireError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.dtype not in _NAMES:
            raise WireError(f"{name!r} has dtype {tensor.dtype}; the wire carries {', '.join(DTYPES)}")
        if tensor.dim() > _MAX_RANK:
            raise WireError(f"{name!r} has rank {tensor.dim()}; the wire carries at most {_MAX_RANK}")
        if not _fits(list(tensor.shape)):
            raise WireError(f"{name!r} has shape {list(tensor.shape)}; {_SHAPES}")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        entries.append([name, _NAMES[tensor.dtype], list(tensor.shape)])
        buffers.append(flat.view(torch.uint8).numpy().tobytes())
    header = json.dumps(entries, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(len(header)), header, *buffers])


def decode(payload: bytes) -> dict[str, Tensor]:
    """The tensors of an :func:`encode` payload; :class:`WireError` for anything that does not add up."""
    entries = _entries(payload)
    offset = header_length(payload)
    sizes = [math.prod(shape) * DTYPES[dtype].itemsize for _, dtype, shape in entries]
    if offset + sum(sizes) != len(payload):
        raise WireError(f"payload has {len(payload) - offset} data bytes, its header describes {sum(sizes)}")
    view = memoryview(payload)
    tensors = {}
    for (name, dtype, shape), size in zip(entries, sizes, strict=True):
        tensors[name] = _tensor(name, view[offset : offset + size], DTYPES[dtype], shape)
        offset += size
    return tensors


def header_length(payload: bytes) -> int:
    """Bytes of a payload that are not tensor data: the 4-byte length prefix plus the JSON header."""
    if len(payload) < _PREFIX.size:
        raise WireError(f"payload of {len(payload)} bytes is shorter than its {_PREFIX.size}-byte length prefix")
    (n,) = _PREFIX.unpack_from(payload)
    if _PREFIX.size + n > len(payload):
        raise WireError(f"header length {n} runs past the end of a {len(payload)}-byte payload")
    return _PREFIX.size + n


def describe(tensors: Mapping[str, Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}``: what a message carried, for logs and message hooks."""
    return {name: (_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for name, t in tensors.items()}


def float_dtypes(tensors: Mapping[str, Tensor]) -> set[torch.dtype]:
    """The floating-point dtypes among a message's tensors (one, in a well-formed message; none if it has none)."""
    return {t.dtype for t in tensors.values() if t.is_floating_point()}


def cast_floats(tensors: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """``tensors`` with every floating-point tensor in ``dtype`` (integer and bool tensors as they are): how
    activations and gradients change precision on their way onto and off the wire."""
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}


def _entries(payload: bytes) -> list[tuple[str, str, list[int]]]:
    end = header_length(payload)
    try:
        entries = json.loads(bytes(payload[_PREFIX.size : end]).decode(), parse_int=_header_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"header is not JSON: {err}") from None
    if not isinstance(entries, list):
        raise WireError("header must be a list of [name, dtype, shape] entries")
    seen: set[str] = set()
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[0]):
            raise WireError(f"header entry {str(entry)[:80]!r} is not [name, dtype, shape]")
        name, dtype, shape = entry
        if name in seen:
            raise WireError(f"tensor {name!r} appears twice")
        seen.add(name)
        if dtype not in DTYPES:
            raise WireError(f"{name!r} has dtype {str(dtype)[:40]!r}; the wire carries {', '.join(DTYPES)}")
        if not (isinstance(shape, list) and _fits(shape)):
            raise WireError(f"{name!r} has shape {str(shape)[:80]}; {_SHAPES}")
    return [tuple(entry) for entry in entries]


def _header_int(text: str) -> int:
    """An integer of the header, refused past 100 digits (far beyond any size; shorter ones too large get the
    shape's refusal) before Python's own digit limit would raise a bare ValueError."""
    if len(text) > 100:
        raise WireError(f"header holds an integer of {len(text)} digits; no size has that many")
    return int(text)


def _fits(shape: list) -> bool:
    """Whether ``shape`` is one torch can build without overflow (see ``_MAX_ELEMENTS``): each size is
    checked on its own, so a zero elsewhere cannot hide a huge one."""
    if len(shape) > _MAX_RANK or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return False
    return all(d <= _MAX_ELEMENTS for d in shape) and math.prod(d for d in shape if d) <= _MAX_ELEMENTS


def _tensor(name: str, chunk: memoryview, dtype: torch.dtype, shape: list[int]) -> Tensor:
    if not len(chunk):
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)  # a private, writable copy
    if dtype == torch.bool and int(raw.max()) > 1:
        raise WireError(f"{name!r} is bool but holds bytes other than 0 and 1")
    return raw.view(dtype).reshape(shape)
