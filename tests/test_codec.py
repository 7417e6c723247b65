"""Reference codec: round-trip bounds, clipping, packing, degenerate input, determinism."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_export.errors import QuantizationError
from kvq_export.reference.codec import (
    dequantize,
    dequantize_packed,
    int_levels,
    pack,
    quantize,
    quantize_packed,
    unpack,
)
from kvq_export.scheme import TensorQuant

INT_FORMATS = ["int", "int_sym"]


def _data(seed: int, shape, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * scale + offset


def _step(q, tq, like):
    """Per-element quantization step (the scale broadcast back to x's shape)."""
    ones = torch.ones(like.shape)
    if tq.has_zero_point:
        return dequantize(q._replace(codes=torch.ones_like(q.codes), zeros=torch.zeros_like(q.zeros)), tq)
    offset = int_levels(tq)[2]
    return dequantize(q._replace(codes=torch.full_like(q.codes, offset + 1)), tq) * ones


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(INT_FORMATS), bits=st.sampled_from([2, 3, 4, 6, 8]), axis=st.sampled_from(["token", "channel"]),
    group=st.sampled_from([4, 8, 16]), seed=st.integers(0, 2**31 - 1),
    scale=st.floats(1e-3, 1e3), offset=st.floats(-10, 10),
)
def test_round_trip_within_half_step_fp32_scales(fmt, bits, axis, group, seed, scale, offset):
    tq = TensorQuant(format=fmt, bits=bits, axis=axis, group_size=group, scale_dtype="fp32")
    x = _data(seed, (2, 3, 16, 16), scale, offset)
    q = quantize(x, tq)
    err = (dequantize(q, tq) - x).abs()
    step = _step(q, tq, x).abs()
    assert bool((err <= 0.5 * step + 1e-6 * x.abs().max()).all())


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(INT_FORMATS), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**31 - 1))
def test_round_trip_fp16_scales_within_half_step_plus_metadata_rounding(fmt, bits, seed):
    tq = TensorQuant(format=fmt, bits=bits, group_size=8, scale_dtype="fp16")
    x = _data(seed, (1, 2, 8, 32)).half().float()
    q = quantize(x, tq)
    err = (dequantize(q, tq) - x).abs()
    slack = 2.0**-10 * x.abs().reshape(1, 2, 8, 4, 8).amax(-1, keepdim=True).expand(1, 2, 8, 4, 8).reshape(x.shape)
    assert bool((err <= 0.5 * _step(q, tq, x).abs() + 2 * slack).all())


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_clip_clamps_outliers_to_clipped_range(fmt):
    tq = TensorQuant(format=fmt, bits=4, group_size=16, scale_dtype="fp32", clip=0.5)
    x = _data(3, (1, 1, 4, 16))
    q = quantize(x, tq)
    xh = dequantize(q, tq)
    g = x.reshape(1, 1, 4, 1, 16)
    if fmt == "int":
        mn, mx = g.amin(-1), g.amax(-1)
        lo = ((mn + mx) / 2 - (mx - mn) / 4).expand(1, 1, 4, 16)
        hi = ((mn + mx) / 2 + (mx - mn) / 4).expand(1, 1, 4, 16)
    else:
        hi = (g.abs().amax(-1) * 0.5).expand(1, 1, 4, 16)
        lo = -hi
    eps = 1e-5
    assert bool((xh >= lo - eps).all() and (xh <= hi + eps).all())
    inside = (x >= lo) & (x <= hi)
    assert bool(((xh - x).abs()[inside] <= 0.5 * _step(q, tq, x)[inside] + eps).all())
    assert bool(((xh - x).abs()[~inside] > 0).all())  # outliers really were clipped


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 5), width=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_pack_unpack_bijective(bits, rows, width, seed):
    per = 8 // bits
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, width * per), generator=gen, dtype=torch.int64).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (rows, width * per * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)
    raw = torch.randint(0, 256, (rows, width), generator=gen, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(pack(unpack(raw, bits), bits), raw)


def test_documented_packing_order_low_bits_first():
    assert pack(torch.tensor([[1, 2]], dtype=torch.uint8), 4).tolist() == [[0x21]]
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[0b00111001]]


def test_6_bit_codes_are_a_nibble_plane_then_a_2_bit_plane():
    codes = torch.tensor([[0x3F, 0x01, 0x22, 0x10, 0x05, 0x31, 0x00, 0x2A]], dtype=torch.uint8)  # D = 8
    packed = pack(codes, 6)
    assert packed.shape == (1, 6)  # D/2 nibble bytes + D/4 bytes of top bits
    assert packed[0, :4].tolist() == [0x1F, 0x02, 0x15, 0xA0]
    assert packed[0, 4:].tolist() == [0b01_10_00_11, 0b10_00_11_00]
    assert torch.equal(unpack(packed, 6), codes)
    gen = torch.Generator().manual_seed(0)
    many = torch.randint(0, 64, (3, 64), generator=gen, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(unpack(pack(many, 6), 6), many)


def test_3_bit_codes_are_a_2_bit_plane_then_a_1_bit_plane():
    codes = torch.tensor([[7, 0, 5, 2, 3, 4, 6, 1]], dtype=torch.uint8)  # D = 8
    packed = pack(codes, 3)
    assert packed.shape == (1, 3)  # D/4 bytes of low bit pairs + D/8 bytes of third bits
    assert packed[0, :2].tolist() == [0b10_01_00_11, 0b01_10_00_11]
    assert packed[0, 2:].tolist() == [0b0110_0101]
    assert torch.equal(unpack(packed, 3), codes)
    gen = torch.Generator().manual_seed(0)
    many = torch.randint(0, 8, (3, 64), generator=gen, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(unpack(pack(many, 3), 3), many)


@pytest.mark.parametrize("fmt, bits", [("int", 2), ("int", 4), ("int", 8), ("int_sym", 4), ("fp8_e4m3", 8)])
@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
def test_constant_groups_are_finite_and_exact(fmt, bits, scale_dtype):
    tq = TensorQuant(format=fmt, bits=bits, group_size=8, scale_dtype=scale_dtype)
    x = torch.zeros(1, 1, 3, 16)
    x[0, 0, 1] = 1.5  # constant, representable in fp16
    x[0, 0, 2, :8] = -0.25
    xh = dequantize_packed(quantize_packed(x, tq), tq)
    assert bool(torch.isfinite(xh).all())
    if fmt == "int":  # the zero point is the constant itself
        assert torch.equal(xh, x)
    else:  # symmetric: all-zero groups are exact, constant groups land on the top code
        assert torch.equal(xh[0, 0, 0], x[0, 0, 0])
        assert torch.allclose(xh, x, rtol=2e-3, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.zeros(1, 1, 2, 8)
    x[0, 0, 1, 3] = bad
    with pytest.raises(QuantizationError, match="non-finite"):
        quantize(x, TensorQuant(group_size=8))


def test_fp16_scale_overflow_raises():
    x = torch.tensor([[[[-1e8, 1e8, 0.0, 0.0]]]])
    with pytest.raises(QuantizationError, match="scale_dtype fp32"):
        quantize(x, TensorQuant(format="fp8_e4m3", bits=8, scale_dtype="fp16"))
    quantize(x, TensorQuant(format="fp8_e4m3", bits=8, scale_dtype="fp32"))


@pytest.mark.parametrize("fmt, bits", [("int", 4), ("int_sym", 2), ("fp8_e4m3", 8)])
def test_deterministic_bit_identical_codes(fmt, bits):
    tq = TensorQuant(format=fmt, bits=bits, group_size=16)
    x = _data(7, (2, 2, 16, 32))
    a, b = quantize_packed(x, tq), quantize_packed(x.clone(), tq)
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
    assert torch.equal(a.scales, b.scales)


def test_fp8_relative_error():
    tq = TensorQuant(format="fp8_e4m3", bits=8, scale_dtype="fp32")
    x = _data(11, (1, 2, 32, 64))
    q = quantize(x, tq)
    assert q.codes.dtype == torch.float8_e4m3fn
    err = (dequantize(q, tq) - x).abs()
    subnormal_step = q.scales * 2.0**-9  # [..., T, 1]: one scale per head vector
    assert bool((err <= 2.0**-4 * x.abs() + subnormal_step).all())


def test_channel_axis_groups_tokens():
    tq = TensorQuant(format="int", bits=4, axis="channel", group_size=4, scale_dtype="fp32")
    x = _data(5, (1, 1, 8, 6))
    q = quantize(x, tq)
    assert q.scales.shape == (1, 1, 2, 6)
    assert torch.allclose(q.zeros, x.reshape(1, 1, 2, 4, 6).amin(-2))
    with pytest.raises(QuantizationError, match="whole groups of 4 tokens"):
        quantize(x[:, :, :6], tq)


def test_static_scales_per_channel_symmetric_matches_ort_convention():
    tq = TensorQuant(format="int_sym", bits=4, axis="channel", scales="static", scale_dtype="fp32")
    x = _data(9, (2, 3, 5, 8))
    scales = x.abs().amax(dim=(0, 2)) / 7  # [H, D]
    q = quantize(x, tq, static_scales=scales)
    assert torch.equal(q.scales, scales)
    signed = q.codes.to(torch.int16) - 8
    assert int(signed.min()) >= -7 and int(signed.max()) <= 7
    assert torch.allclose(dequantize(q, tq), x, atol=float(scales.max()) / 2 + 1e-6)
