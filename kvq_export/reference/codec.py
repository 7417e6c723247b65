"""The reference codec: quantize / dequantize / pack / unpack in plain torch.

The arithmetic every backend (ONNX graph, ONNX Runtime fused path, Triton, TensorRT) must reproduce: fixed fp32
operations, each with an exact ONNX counterpart, whatever the input dtype; scales and minimums rounded to
``scale_dtype`` before they quantize (codes are computed against exactly the stored metadata); round half to even.

* :func:`quantize` ``[..., T, D]`` by a :class:`~kvq_export.scheme.TensorQuant` -> :class:`Quantized`: unpacked
  codes (uint8, float8_e4m3fn for fp8) and the stored scales (and zero points for ``int``); :func:`dequantize`
  is its inverse: ``x̂ = code * scale + zero`` (``int``), ``(code - offset) * scale`` (``int_sym``, offset
  ``2**(bits-1)``), ``float(code) * scale`` (fp8). The ``ggml`` quantizer chooses codes and scales as ggml's
  reference quantizers do, bit for bit; the stored meaning is the same.
* :func:`pack` / :func:`unpack`: codes of fewer than 8 bits packed along the last axis into uint8, lowest bits
  first (3, 5 and 6 bits as two planes); :func:`pack_stream` / :func:`unpack_stream`: a stream's stored bytes, a
  stream's 8-bit high channels first.
* :func:`metadata_from_range` / :func:`scale_from_amax`: the metadata arithmetic calibration shares.

Every format's codes, ggml's quantizers, the byte layouts and high channels, and why: docs/design/codec.md.
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


#: (stored scales, stored zeros or None, scale, zero or None): the metadata :func:`quantize` returns, and the same as
#: float32 broadcast against the grouped values it quantizes
_Metadata = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


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


def _static_group_view(x: torch.Tensor, tq: TensorQuant) -> tuple[torch.Tensor, int]:
    """(view, reduce dim) of ``[..., H, T, D]`` grouped as static metadata: token groups split off D, channels whole."""
    if tq.axis == Axis.TOKEN:
        return x.reshape(*x.shape[:-1], -1, tq.token_group(x.shape[-1])), -1
    return x, -2


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
    xf = x.to(torch.float32)
    static = tq.scales == ScaleMode.STATIC
    if static and (static_scales is None or (tq.has_zero_point and static_zeros is None)):
        raise QuantizationError("static scales need static_scales (and static_zeros for format int)")
    xg, reduce_dim = _static_group_view(xf, tq) if static else _group_view(xf, tq)
    if tq.quantizer == Quantizer.GGML:  # token axis, dynamic scales (the scheme refuses anything else)
        codes, scales, zeros = _quantize_ggml(xg, tq)
        _check_scales(scales, tq)
        return Quantized(codes.reshape(x.shape), scales, zeros)
    levels = _code_levels(tq, high, static, x.shape[-1])
    if static:
        scales, zeros, scale, zero = _static_metadata(xf, tq, static_scales, static_zeros)
    else:
        scales, zeros, scale, zero = _dynamic_metadata(xg, reduce_dim, tq, levels if high is not None else None)
    _check_scales(scales, tq)
    return Quantized(_codes(xg, tq, scale, zero, levels, high is not None).reshape(x.shape), scales, zeros)


def _code_levels(tq: TensorQuant, high: torch.Tensor | None, static: bool, dim: int) -> tuple:
    """(lowest code, highest code, offset) :func:`quantize` clamps and shifts by (zeros for fp8, which has none).

    Ints for one code width; with high channels ``[H, ..., D]`` float32 per channel, shaped to broadcast against
    the grouped values (``[..., H, T, D]`` for static scales, ``[..., H, T/G, G, D]`` for channel groups).
    """
    if high is None:
        return int_levels(tq) if tq.is_int else (0, 0, 0)
    return tuple(t.reshape(high.shape[0], *([1] * (1 if static else 2)), -1) for t in channel_levels(tq, high, dim))


def _static_metadata(xf: torch.Tensor, tq: TensorQuant, static_scales: torch.Tensor,
                     static_zeros: torch.Tensor | None) -> _Metadata:
    """(stored scales, stored zeros, scale, zero) of the given static ``[H, n]`` metadata.

    Stored: in ``scale_dtype``; scale and zero: those as float32, broadcast against the grouped values of ``xf``.
    Zeros are None without a zero point.
    """
    sdtype = DType.get(tq.scale_dtype).torch
    scales = static_scales.to(sdtype)
    scale = _static_view(scales.float(), xf, tq)
    zeros = static_zeros.to(sdtype) if tq.has_zero_point else None
    zero = _static_view(zeros.float(), xf, tq) if zeros is not None else None
    return scales, zeros, scale, zero


def _dynamic_metadata(xg: torch.Tensor, reduce_dim: int, tq: TensorQuant,
                      high_levels: tuple | None) -> _Metadata:
    """(stored scales, stored zeros, scale, zero) of each group of ``xg`` (reduced along ``reduce_dim``).

    Stored: in ``scale_dtype`` without the group dim; scale and zero: float32 keeping it, to broadcast. ``high_levels``:
    :func:`_code_levels` of a stream with high channels, whose code range differs per channel.
    """
    lo, top, _ = high_levels if high_levels is not None else (None, None, None)
    if tq.has_zero_point:
        scale_kd, zero_kd = metadata_from_range(
            tq, xg.amin(dim=reduce_dim, keepdim=True), xg.amax(dim=reduce_dim, keepdim=True),
            None if high_levels is None else top - lo)
        return scale_kd.squeeze(reduce_dim), zero_kd.squeeze(reduce_dim), scale_kd.float(), zero_kd.float()
    scale_kd = scale_from_amax(tq, xg.abs().amax(dim=reduce_dim, keepdim=True), top)
    return scale_kd.squeeze(reduce_dim), None, scale_kd.float(), None


def _codes(xg: torch.Tensor, tq: TensorQuant, scale: torch.Tensor, zero: torch.Tensor | None, levels: tuple,
           per_channel: bool) -> torch.Tensor:
    """Codes of the grouped values against their metadata: float8_e4m3fn, or uint8 clamped to ``levels`` and offset.

    A zero scale divides by 1 instead (codes stay finite). ``per_channel``: ``levels`` are tensors (high channels).
    """
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    if tq.format == Format.FP8_E4M3:
        return torch.clamp(xg / safe, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    lo, top, offset = levels
    shifted = xg - zero if zero is not None else xg
    rounded = torch.round(shifted / safe)
    clamped = torch.minimum(torch.maximum(rounded, lo), top) if per_channel else torch.clamp(rounded, lo, top)
    return (clamped + offset).to(torch.uint8)


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
    inv = torch.where((d == 0) | torch.isinf(inv), torch.zeros_like(d), inv)  # |d| < 2**-128: docs/design/codec.md
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
        xg, _ = _static_group_view(values, tq)
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
