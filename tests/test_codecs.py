"""Codecs: how far a round trip may move a value, and that every byte sent is counted exactly."""

from __future__ import annotations

import math

import pytest
import torch

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.codecs import CastCodec, Codec, Encoded, Int8Codec, get_codec


def half_step(absmax: torch.Tensor) -> torch.Tensor:
    """int8's worst error, absmax / 254, plus a few fp32 ulps of absmax for the arithmetic itself."""
    return absmax * (1 / 254 + 2**-20)


def roundtrip(codec: Codec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return codec.decode(codec.encode(tensors))


def normal_range(n: int = 1000) -> torch.Tensor:
    """Values spread over many binades, all inside fp16's normal range."""
    gen = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return signs * torch.exp2(torch.empty(n).uniform_(-12, 14, generator=gen))


def test_fp32_round_trip_is_bit_exact():
    x = torch.randn(5, 7) * 1e3
    back = roundtrip(get_codec("fp32"), {"x": x})["x"]
    assert back.dtype == torch.float32 and torch.equal(back, x)


@pytest.mark.parametrize(("name", "bound"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_half_precision_round_trip_relative_error(name, bound):
    x = normal_range()
    back = roundtrip(get_codec(name), {"x": x})["x"]
    rel = ((back - x).abs() / x.abs()).max().item()
    assert back.dtype == torch.float32
    assert 0 < rel <= bound  # lossy, but within half an ulp of the format's mantissa


def test_int8_per_tensor_error_is_at_most_half_a_step():
    x = torch.randn(40, 13) * 7
    encoded = get_codec("int8").encode({"x": x})
    back = get_codec("int8").decode(encoded)["x"]
    assert encoded.tensors["x"].dtype == torch.int8 and encoded.tensors["x"].shape == x.shape
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert ((back - x).abs() <= half_step(x.abs().max())).all()
    assert back.abs().max() == pytest.approx(x.abs().max().item(), rel=1e-6)  # the absmax itself survives


def test_int8_blocks_bound_the_error_by_their_own_absmax():
    gen = torch.Generator().manual_seed(1)
    small, large, tail = (torch.randn(8, generator=gen) * s for s in (1e-3, 1e3, 1.0))
    x = torch.cat([small, large, tail[:5]]).reshape(3, 7)  # blocks of 8: small | large | 5 values
    blockwise = roundtrip(get_codec("int8", 8), {"x": x})["x"].reshape(-1)
    per_tensor = roundtrip(get_codec("int8"), {"x": x})["x"].reshape(-1)
    flat = x.reshape(-1)
    for block in (slice(0, 8), slice(8, 16), slice(16, 21)):
        err = (blockwise[block] - flat[block]).abs()
        assert (err <= half_step(flat[block].abs().max())).all()
    small_blockwise = (blockwise[:8] - small).abs().max()
    small_per_tensor = (per_tensor[:8] - small).abs().max()
    assert torch.equal(per_tensor[:8], torch.zeros(8))  # one scale for all: the small block is lost
    assert small_blockwise < small_per_tensor / 100


def test_int8_never_uses_minus_128_and_zeros_stay_zeros():
    x = torch.tensor([-5.0, 5.0, -4.99, 0.0, -1e-9])
    q = get_codec("int8").encode({"x": x}).tensors["x"]
    assert q.min() == -127 and q.max() == 127
    for codec in (get_codec("int8"), get_codec("int8", 3)):
        encoded = codec.encode({"z": torch.zeros(2, 4)})
        assert torch.equal(encoded.meta["z"], torch.zeros_like(encoded.meta["z"]))
        assert torch.equal(codec.decode(encoded)["z"], torch.zeros(2, 4))  # no 0 / 0


@pytest.mark.parametrize("codec", [get_codec("fp16"), get_codec("bf16"), get_codec("int8"), get_codec("int8", 4)])
def test_non_float_tensors_pass_through(codec):
    ids = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    encoded = codec.encode({"ids": ids, "w": torch.ones(3)})
    assert encoded.tensors["ids"] is ids and "ids" not in encoded.meta
    assert torch.equal(codec.decode(encoded)["ids"], ids)


SHAPES = {"emb": (30, 16), "bias": (7,), "scalar": ()}  # 480, 7 and 1 values


@pytest.mark.parametrize(("name", "block_size", "payload", "meta"), [
    ("fp32", None, 4 * 488 + 8, 0),  # + 8: the int64 step counter travels as it is
    ("fp16", None, 2 * 488 + 8, 0),
    ("bf16", None, 2 * 488 + 8, 0),
    ("int8", None, 488 + 8, 4 * 3),  # one scale per float tensor
    ("int8", 64, 488 + 8, 4 * (math.ceil(480 / 64) + 1 + 1)),  # 8 + 1 + 1 blocks
    ("int8", 5, 488 + 8, 4 * (96 + 2 + 1)),  # 480 / 5 = 96; 7 values -> 2 blocks, the last partial
])
def test_bytes_are_counted_exactly(name, block_size, payload, meta):
    tensors = {n: torch.randn(shape) for n, shape in SHAPES.items()}
    tensors["step"] = torch.tensor(3, dtype=torch.int64)
    encoded = get_codec(name, block_size).encode(tensors)
    assert (encoded.payload_bytes, encoded.meta_bytes) == (payload, meta)
    assert encoded.total_bytes == payload + meta
    assert encoded.payload_bytes == sum(t.numel() * t.element_size() for t in encoded.tensors.values())
    assert encoded.meta_bytes == sum(t.numel() * t.element_size() for t in encoded.meta.values())


def test_decode_refuses_scales_for_another_block_size():
    encoded = get_codec("int8", 4).encode({"w": torch.randn(10)})  # 3 scales
    with pytest.raises(ValueError, match="block size 5"):
        get_codec("int8", 5).decode(encoded)


def test_get_codec_builds_each_codec_and_names_the_culprit():
    assert isinstance(get_codec("bf16"), CastCodec) and get_codec("bf16").dtype == torch.bfloat16
    int8 = get_codec("int8", 32)
    assert isinstance(int8, Int8Codec) and (int8.name, int8.block_size) == ("int8", 32)
    assert get_codec("int8").block_size is None and get_codec("fp16").block_size is None
    with pytest.raises(ValueError, match="no codec 'int4'"):
        get_codec("int4")
    with pytest.raises(ValueError, match="only int8 has blocks"):
        get_codec("fp16", 16)


@pytest.mark.parametrize(("protocol", "message"), [
    ({"codec": "int4"}, r"protocol\.codec = 'int4'.*'fp32', 'fp16', 'bf16' or 'int8'"),
    ({"codec": "int8", "codec_block_size": 0}, r"protocol\.codec_block_size = 0"),
    ({"codec": "fp16", "codec_block_size": 16}, r"codec_block_size is for codec int8"),
])
def test_the_config_names_the_culprit_of_a_bad_codec(protocol, message):
    with pytest.raises(UserError, match=message):
        validate({"data": {"source": "x.csv"}, "protocol": protocol})


def test_encoded_keeps_positional_construction():
    encoded = Encoded({"w": torch.ones(2)}, "fp32", 8)
    assert (encoded.meta_bytes, encoded.meta, encoded.total_bytes) == (0, {}, 8)
