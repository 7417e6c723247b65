"""The reference codec: quantize / dequantize / pack / unpack in plain torch.

This is the arithmetic every backend (ONNX graph, ONNX Runtime fused path, Triton, TensorRT) must
reproduce, so it is written as a fixed sequence of IEEE fp32 operations that each has an exact ONNX
counterpart:

* all math in fp32, whatever the input dtype;
* scales and minimums are rounded to ``scale_dtype`` *before* they are used to quantize, so the codes
  are computed against exactly the metadata that will be stored;
* ``round`` is round-half-to-even (torch.round == ONNX Round), division is a true division.

Code conventions:

* ``int`` (asymmetric): ``code = clamp(round((x - zero) / scale), 0, 2**b - 1)``, ``x̂ = code * scale + zero``
  where ``zero`` is the (clipped) group minimum.
* ``int_sym``: ``code = clamp(round(x / scale), -(2**(b-1) - 1), 2**(b-1) - 1) + 2**(b-1)`` stored
  unsigned (the ONNX Runtime int4 convention ``q + 8``), ``x̂ = (code - 2**(b-1)) * scale``.
* ``fp8_e4m3``: ``code = float8_e4m3fn(clamp(x / scale, ±448))``, ``x̂ = float(code) * scale``.
* A zero-range group has scale 0: quantization divides by 1 instead, so codes are finite and
  ``x̂`` equals the stored minimum (asymmetric: exact for values representable in ``scale_dtype``) or 0.

The ``ggml`` quantizer (``TensorQuant.quantizer``) replaces how scales and codes are *chosen* by the
reference quantizers of ggml (``quantize_row_q4_0_ref`` ...), blocks of 32 along head_dim, fp32 arithmetic
in C's order, the fp32 scale used to quantize and its fp16 rounding stored; the stored meaning is the one
above (``x̂ = (code - 2**(b-1)) * d`` for q4_0/q5_0/q8_0, ``x̂ = code * d + m`` for q4_1/q5_1):

* q4_0 / q5_0: ``v`` = first element of largest magnitude (0 for an all-zero block), ``d = v / -2**(b-1)``,
  ``id = 1 / d`` (0 when d is 0), ``code = min(2**b - 1, floor(x * id + (2**(b-1) + 0.5)))``. Where ``1 / d``
  overflows (|d| < 2**-128: a block of tiny subnormals) ggml's C converts NaN/inf to an integer, which is
  undefined; kvq takes ``id = 0`` there too (such a ``d`` is ±0 in fp16, so the block decodes to 0 either way);
* q4_1 / q5_1: ``m`` / ``M`` = first minimum / maximum, ``d = (M - m) / (2**b - 1)``,
  ``code = min(2**b - 1, floor((x - m) * id + 0.5))``;
* q8_0: ``d = max|x| / 127``, ``code = roundf(x * id) + 128`` (round half away from zero).

Packing (``pack``/``unpack``): codes of ``b < 8`` bits are packed along the last axis into uint8,
lowest bits first: element ``i`` of the last axis lands in byte ``i // (8 // b)`` at bit offset
``(i % (8 // b)) * b`` (for 4 bits: even element in the low nibble, odd element in the high nibble).
3-, 5- and 6-bit codes are two planes along the last axis (:func:`~kvq_export.scheme.code_planes`): ``D * l / 8``
bytes holding the low ``l`` bits as ``l``-bit codes, then ``D * (b - l) / 8`` bytes holding the higher bits as
``(b - l)``-bit codes, with ``l = 4`` for 5 and 6 bits and ``l = 2`` for 3 bits. 6 bits: element ``i``'s top two
bits in byte ``D/2 + i // 4`` at bit ``(i % 4) * 2``; 5 bits: ``D/8`` bytes of fifth bits (element ``i``'s high
bit in byte ``D/2 + i // 8`` at bit ``i % 8``); 3 bits: ``D/4`` bytes of 2-bit codes, then element ``i``'s third
bit in byte ``D/4 + i // 8`` at bit ``i % 8``.

High channels (``TensorQuant.high_channels``, per-channel ``int`` / ``int_sym`` streams): the ``n`` channels of
each kv head listed (ascending) in the calibrated ``high_channels`` ``[H, n]`` get 8-bit codes: ``int`` in
``[0, 255]`` (scale = range / 255) beside the others' ``[0, 2**bits - 1]``, dequantized by the same
``code * scale + min``; ``int_sym`` ``clamp(round(x / scale), -127, 127) + 128`` (scale = max|x| / 127) beside the
others' ``± (2**(bits-1) - 1)`` and offset ``2**(bits-1)``, each dequantized with its own offset. Per token the
stored bytes are the ``n`` high channels' 8-bit codes in ascending channel order, then the other channels'
codes in ascending channel order, packed as above (their planes span those ``D - n`` channels).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from kvq_export.dtypes import DType
from kvq_export.errors import QuantizationError
from kvq_export.scheme import TensorQuant
from kvq_export.scheme_rules import FP8_E4M3_MAX, PLANE_BITS, code_planes
from kvq_export.vocab import Axis, Format, Quantizer, ScaleMode


class Quantized(NamedTuple):
    """Unpacked codes (uint8, or float8_e4m3fn for fp8) and the stored metadata.

    ``scales``/``zeros`` have shape ``[..., T, D // G]`` for token-axis groups and ``[..., T // G, D]``
    for channel-axis groups; for static scales they are the given per-layer tensors. ``zeros`` is
    ``None`` unless the format is asymmetric ``int``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None


def int_levels(tq: TensorQuant) -> tuple[int, int, int]:
    """(lowest code, highest code, offset) for an int format, as signed values before the offset."""
    if tq.format == Format.INT:
        return 0, (1 << tq.bits) - 1, 0
    if tq.quantizer == Quantizer.GGML and tq.bits < 8:  # q4_0 / q5_0 use all 2**bits codes
        return -(1 << (tq.bits - 1)), (1 << (tq.bits - 1)) - 1, 1 << (tq.bits - 1)
    qmax = (1 << (tq.bits - 1)) - 1
    return -qmax, qmax, 1 << (tq.bits - 1)


def metadata_from_range(tq: TensorQuant, mn: torch.Tensor, mx: torch.Tensor,
                        steps: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric ``int``: (scale, zero point) in ``scale_dtype`` for a group range, clip applied about its midpoint.

    Shared with calibration so static and dynamic scales come from the same arithmetic. ``steps``: code
    steps over the range, per channel for a stream with high channels (default ``2**bits - 1``).
    """
    sdtype = DType.get(tq.scale_dtype).torch
    if tq.clip != 1.0:
        mid, half = (mx + mn) * 0.5, (mx - mn) * (0.5 * tq.clip)
        mn, mx = mid - half, mid + half
    if steps is None:
        lo, hi, _ = int_levels(tq)
        steps = float(hi - lo)
    return ((mx - mn) / steps).to(sdtype), mn.to(sdtype)


def check_high_channels(high: torch.Tensor | None, tq: TensorQuant, heads: int, dim: int) -> torch.Tensor | None:
    """The calibrated ``[H, n]`` high-channel indices as int64, or a clear error when they do not fit ``tq``."""
    if not tq.high_channels:
        if high is not None:
            raise QuantizationError("high_channels were given for a stream whose scheme has none")
        return None
    if high is None:
        raise QuantizationError(f"the stream keeps {tq.high_channels} high channels per head: give the calibrated "
                                "high_channels [kv_heads, n] (kvq never guesses which)")
    high = torch.as_tensor(high)
    if high.dtype.is_floating_point or high.dim() != 2 or list(high.shape) != [heads, tq.high_channels]:
        raise QuantizationError(f"high_channels must be integer indices of shape [kv_heads={heads}, "
                                f"{tq.high_channels}], got {high.dtype} {list(high.shape)}")
    high = high.to(torch.int64)
    if bool((high < 0).any() or (high >= dim).any()) or (high.shape[1] > 1 and not bool((high.diff(dim=1) > 0).all())):
        raise QuantizationError(f"high_channels must be strictly ascending channel indices in [0, {dim}) per head")
    return high


def channel_order(high: torch.Tensor, dim: int) -> torch.Tensor:
    """``[H, D]`` stored channel order: each head's high channels, then the rest, both ascending."""
    is_high = torch.zeros(high.shape[0], dim, dtype=torch.bool, device=high.device).scatter_(1, high, True)
    rest = torch.stack([torch.nonzero(~row).flatten() for row in is_high])
    return torch.cat([high, rest], dim=1)


def high_channel_levels(tq: TensorQuant) -> tuple[int, int, int]:
    """:func:`int_levels` of a stream's 8-bit high channels (its format at 8 bits)."""
    return int_levels(dataclasses.replace(tq, bits=8, high_channels=0))


def channel_levels(tq: TensorQuant, high: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[H, D]`` float32 (lowest code, highest code, offset) per channel of a stream with high channels.

    The high channels take the 8-bit levels of the stream's format, the others ``int_levels(tq)``.
    """
    wide = high_channel_levels(tq)
    is_high = torch.zeros(high.shape[0], dim, dtype=torch.bool, device=high.device).scatter_(1, high, True)
    return tuple(torch.where(is_high, float(w), float(n)) for w, n in zip(wide, int_levels(tq)))


def scale_from_amax(tq: TensorQuant, amax: torch.Tensor, top: torch.Tensor | float | None = None) -> torch.Tensor:
    """Symmetric ``int_sym`` / ``fp8_e4m3``: the scale in ``scale_dtype`` for a group's max |x|, clip applied.

    ``top``: the highest code, per channel for a stream with high channels (default ``int_levels(tq)``).
    """
    if tq.clip != 1.0:
        amax = amax * tq.clip
    if top is None:
        top = FP8_E4M3_MAX if tq.format == Format.FP8_E4M3 else float(int_levels(tq)[1])
    return (amax / top).to(DType.get(tq.scale_dtype).torch)


def _group_view(x: torch.Tensor, tq: TensorQuant) -> tuple[torch.Tensor, int]:
    """Reshape ``[..., T, D]`` so one group sits along a single dim; return (view, reduce dim)."""
    *lead, tokens, dim = x.shape
    if tq.axis == Axis.TOKEN:
        group = tq.token_group(dim)
        return x.reshape(*lead, tokens, dim // group, group), -1
    group = tq.group_size
    if tokens % group:
        raise QuantizationError(f"channel-axis quantization needs whole groups of {group} tokens, got {tokens}")
    return x.reshape(*lead, tokens // group, group, dim), -2


def _static_view(meta: torch.Tensor, x: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """Broadcast static per-(head, group/channel) metadata ``[H, n]`` against the grouped view of x."""
    heads = x.shape[-3]
    if meta.shape[0] != heads or meta.dim() != 2:
        raise QuantizationError(f"static scales must have shape [kv_heads={heads}, n], got {list(meta.shape)}")
    if tq.axis == Axis.TOKEN:  # grouped x: [..., H, T, D/G, G]
        return meta.reshape(heads, 1, meta.shape[1], 1)
    return meta.reshape(heads, 1, meta.shape[1])  # x: [..., H, T, D] (whole-axis channel groups)


def check_finite(x: torch.Tensor) -> None:
    """Raise a clear error for NaN/Inf input (they would poison a whole group's scale)."""
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise QuantizationError(f"cannot quantize non-finite values: {bad} NaN/Inf element(s) in the input")


def quantize(
    x: torch.Tensor,
    tq: TensorQuant,
    *,
    static_scales: torch.Tensor | None = None,
    static_zeros: torch.Tensor | None = None,
    high_channels: torch.Tensor | None = None,
) -> Quantized:
    """Quantize ``x`` of shape ``[..., T, D]`` (``[B, H, T, D]`` for static scales) by ``tq``.

    Codes are returned unpacked; call :func:`pack` for the stored form of 2/4-bit codes.
    ``high_channels``: the calibrated ``[H, n]`` indices of a stream with ``tq.high_channels``.
    """
    if not tq.quantized:
        raise QuantizationError("format fp16 is not quantized")
    check_finite(x)
    high = check_high_channels(high_channels, tq, x.shape[-3] if x.dim() >= 3 else 0, x.shape[-1])
    sdtype = DType.get(tq.scale_dtype).torch
    xf = x.to(torch.float32)
    static = tq.scales == ScaleMode.STATIC
    if static:
        if static_scales is None or (tq.has_zero_point and static_zeros is None):
            raise QuantizationError("static scales need static_scales (and static_zeros for format int)")
        xg, reduce_dim = (xf.reshape(*xf.shape[:-1], -1, tq.token_group(xf.shape[-1])), -1) \
            if tq.axis == Axis.TOKEN else (xf, -2)
    else:
        xg, reduce_dim = _group_view(xf, tq)
    if tq.quantizer == Quantizer.GGML:  # token axis, dynamic scales (the scheme refuses anything else)
        codes, scales, zeros = _quantize_ggml(xg, tq)
        _check_scales(scales, tq)
        return Quantized(codes.reshape(x.shape), scales, zeros)

    lo, top, offset = int_levels(tq) if tq.is_int else (0, 0, 0)
    if high is not None:  # per-channel levels, broadcast against [..., H, T, D] (static) or [..., H, T/G, G, D]
        lo, top, offset = (t.reshape(high.shape[0], *([1] * (1 if static else 2)), -1)
                           for t in channel_levels(tq, high, x.shape[-1]))
    if static:
        scales = static_scales.to(sdtype)
        scale = _static_view(scales.float(), xf, tq)
        zeros = static_zeros.to(sdtype) if tq.has_zero_point else None
        zero = _static_view(zeros.float(), xf, tq) if zeros is not None else None
    elif tq.has_zero_point:
        scale_kd, zero_kd = metadata_from_range(
            tq, xg.amin(dim=reduce_dim, keepdim=True), xg.amax(dim=reduce_dim, keepdim=True),
            None if high is None else top - lo)
        scales, zeros = scale_kd.squeeze(reduce_dim), zero_kd.squeeze(reduce_dim)
        scale, zero = scale_kd.float(), zero_kd.float()
    else:
        scale_kd = scale_from_amax(tq, xg.abs().amax(dim=reduce_dim, keepdim=True), None if high is None else top)
        scales, zeros = scale_kd.squeeze(reduce_dim), None
        scale, zero = scale_kd.float(), None

    _check_scales(scales, tq)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    if tq.format == Format.FP8_E4M3:
        codes = torch.clamp(xg / safe, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    else:
        shifted = xg - zero if zero is not None else xg
        rounded = torch.round(shifted / safe)
        clamped = torch.clamp(rounded, lo, top) if high is None else torch.minimum(torch.maximum(rounded, lo), top)
        codes = (clamped + offset).to(torch.uint8)
    return Quantized(codes.reshape(x.shape), scales, zeros)


def _check_scales(scales: torch.Tensor, tq: TensorQuant) -> None:
    if not bool(torch.isfinite(scales).all()):
        raise QuantizationError(
            f"a group's scale overflows scale_dtype={tq.scale_dtype} (values too large); use scale_dtype fp32"
        )


def _first_at(xg: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The element of each group at ``index`` (argmax/argmin give the first occurrence, as ggml's loops do)."""
    return xg.gather(-1, index)


def round_away(y: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (half away from zero) from exact fp32 steps: ``floor(|y|)`` plus 1 when the fraction >= 0.5.

    ``floor(|y| + 0.5)`` would be wrong for ``0.49999997`` (the sum rounds up to 1.0).
    """
    a = y.abs()
    whole = torch.floor(a)
    r = whole + (a - whole >= 0.5).to(torch.float32)
    return torch.where(y < 0, -r, r)


def _quantize_ggml(xg: torch.Tensor, tq: TensorQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Ggml's reference block quantizers on ``[..., n, 32]`` fp32 groups -> (uint8 codes, fp16 d, fp16 m or None)."""
    top = (1 << tq.bits) - 1
    half = 1 << (tq.bits - 1)
    mn = None
    if tq.format == Format.INT_SYM and tq.bits == 8:  # q8_0
        d = xg.abs().amax(dim=-1, keepdim=True) / 127.0
    elif tq.format == Format.INT_SYM:  # q4_0 / q5_0: the signed element of largest magnitude, first one on ties
        amax = xg.abs().amax(dim=-1, keepdim=True)
        v = _first_at(xg, xg.abs().argmax(dim=-1, keepdim=True))
        v = torch.where(amax == 0, torch.zeros_like(v), v)  # ggml starts from +0.0 and keeps it
        d = v / float(-half)
    else:  # q4_1 / q5_1
        mn = _first_at(xg, xg.argmin(dim=-1, keepdim=True))
        mx = _first_at(xg, xg.argmax(dim=-1, keepdim=True))
        d = (mx - mn) / float(top)
    inv = 1.0 / torch.where(d == 0, torch.ones_like(d), d)
    inv = torch.where((d == 0) | torch.isinf(inv), torch.zeros_like(d), inv)  # see the module doc: |d| < 2**-128
    if tq.format == Format.INT_SYM and tq.bits == 8:
        codes = round_away(xg * inv) + 128.0
    elif tq.format == Format.INT_SYM:
        codes = torch.clamp(torch.floor(xg * inv + (half + 0.5)), max=float(top))
    else:
        codes = torch.clamp(torch.floor((xg - mn) * inv + 0.5), max=float(top))
    zeros = mn.squeeze(-1).to(torch.float16) if mn is not None else None
    return codes.to(torch.uint8), d.squeeze(-1).to(torch.float16), zeros


def dequantize(q: Quantized, tq: TensorQuant, out_dtype: torch.dtype = torch.float32,
               high_channels: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize` on unpacked codes; returns ``[..., T, D]`` in ``out_dtype``.

    ``high_channels``: the calibrated ``[H, n]`` indices of a stream with ``tq.high_channels`` (``int_sym``
    needs them: its high channels have their own offset).
    """
    codes = q.codes
    static = tq.scales == ScaleMode.STATIC
    if tq.format == Format.FP8_E4M3:
        values = codes.to(torch.float32)
    elif tq.high_channels and tq.format == Format.INT_SYM:
        high = check_high_channels(high_channels, tq, codes.shape[-3], codes.shape[-1])
        values = codes.to(torch.float32) - channel_levels(tq, high, codes.shape[-1])[2][:, None, :]
    else:
        values = codes.to(torch.float32) - float(int_levels(tq)[2])
    if static:
        xg = values.reshape(*values.shape[:-1], -1, tq.token_group(values.shape[-1])) \
            if tq.axis == Axis.TOKEN else values
        scale = _static_view(q.scales.float(), values, tq)
        zero = _static_view(q.zeros.float(), values, tq) if q.zeros is not None else None
    else:
        xg, reduce_dim = _group_view(values, tq)
        scale = q.scales.float().unsqueeze(reduce_dim)
        zero = q.zeros.float().unsqueeze(reduce_dim) if q.zeros is not None else None
    out = xg * scale
    if zero is not None:
        out = out + zero
    return out.reshape(codes.shape).to(out_dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of ``bits`` (1-6 or 8) along the last axis, lowest bits first (3, 5, 6: two planes)."""
    if bits == 8:
        return codes
    if bits in PLANE_BITS:
        low, high = code_planes(bits)
        return torch.cat([pack(codes & ((1 << low) - 1), low), pack(codes >> low, high)], dim=-1)
    per = 8 // bits
    *lead, dim = codes.shape
    if dim % per:
        raise QuantizationError(f"cannot pack {dim} codes of {bits} bits into whole bytes")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    grouped = codes.reshape(*lead, dim // per, per).to(torch.int32) << shifts.to(torch.int32)
    return grouped.sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., D * bits / 8]`` uint8 -> ``[..., D]`` uint8 codes."""
    if bits == 8:
        return packed
    if bits in PLANE_BITS:
        low, high = code_planes(bits)
        split = packed.shape[-1] * low // bits  # D*low/8 of the D*bits/8 bytes
        return unpack(packed[..., :split], low) | (unpack(packed[..., split:], high) << low)
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def _per_head(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[H, n]`` channel indices broadcast to gather along the last axis of ``like`` ``[..., H, T, D]``."""
    heads, n = index.shape
    return index[:, None, :].expand(*like.shape[:-3], heads, like.shape[-2], n)


def pack_stream(codes: torch.Tensor, tq: TensorQuant, high_channels: torch.Tensor | None = None) -> torch.Tensor:
    """Stored bytes of a stream's unpacked codes ``[..., H, T, D]`` (high channels first when it has them)."""
    if not tq.is_int:
        return codes
    high = check_high_channels(high_channels, tq, codes.shape[-3], codes.shape[-1])
    if high is None:
        return pack(codes, tq.bits)
    ordered = codes.gather(-1, _per_head(channel_order(high, codes.shape[-1]), codes))
    n = tq.high_channels
    return torch.cat([ordered[..., :n], pack(ordered[..., n:], tq.bits)], dim=-1)


def unpack_stream(packed: torch.Tensor, tq: TensorQuant, high_channels: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_stream`: codes ``[..., H, T, D]`` in channel order."""
    if not tq.is_int:
        return packed
    if not tq.high_channels:
        return unpack(packed, tq.bits)
    n = tq.high_channels
    rest = unpack(packed[..., n:], tq.bits)
    dim = n + rest.shape[-1]
    high = check_high_channels(high_channels, tq, packed.shape[-3], dim)
    ordered = torch.cat([packed[..., :n], rest], dim=-1)
    return torch.empty_like(ordered).scatter_(-1, _per_head(channel_order(high, dim), ordered), ordered)


def quantize_packed(x: torch.Tensor, tq: TensorQuant, **static) -> Quantized:
    """:func:`quantize` then :func:`pack_stream` (the stored form)."""
    q = quantize(x, tq, **static)
    return q._replace(codes=pack_stream(q.codes, tq, static.get("high_channels")))


def dequantize_packed(q: Quantized, tq: TensorQuant, out_dtype: torch.dtype = torch.float32,
                      high_channels: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dequantize` of stored (packed) codes."""
    return dequantize(q._replace(codes=unpack_stream(q.codes, tq, high_channels)), tq, out_dtype, high_channels)
