"""The codec inside the graph: :mod:`kvq_export.reference.codec`, op for op, in standard ONNX ops.

:class:`GraphCodec` quantizes a block of tokens of one stream to its stored codes and metadata (kvq's
min/max and absmax quantizers, ggml's block quantizers, fp8), packs sub-byte codes, and dequantizes stored
codes back to float32. Every step mirrors the reference codec so the graph's stored bytes equal the
reference cache's (the tests compare them bit for bit).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from kvq_export.calibration.artifact import static_name
from kvq_export.dtypes import DType
from kvq_export.errors import ExportError
from kvq_export.graph.builder import GraphBuilder
from kvq_export.model_facts import CacheGeometry
from kvq_export.reference.codec import channel_levels, channel_order, check_high_channels, int_levels
from kvq_export.scheme import TensorQuant
from kvq_export.scheme_rules import FP8_E4M3_MAX, PLANE_BITS, code_planes
from kvq_export.vocab import Axis, Format, Part, Quantizer, ScaleMode


def static_scales(static: Mapping, layer: int, part: Part) -> np.ndarray:
    """The calibrated ``[H, n]`` scales of one static stream; refuses a stream that was never calibrated."""
    scales = static.get(layer, {}).get(part, {}).get("scales")
    if scales is None:
        raise ExportError(f"layer {layer} {part} uses static scales but no calibration was given "
                          "(calibrate first; kvq never guesses a scale)")
    return scales


def high_channel_choice(static: Mapping, layer: int, part: Part, tq: TensorQuant) -> np.ndarray:
    """The calibrated ``[H, n]`` high channels of one stream; refuses a stream whose channels were never chosen."""
    chosen = static.get(layer, {}).get(part, {}).get("high_channels")
    if chosen is None:
        raise ExportError(f"layer {layer} {part} keeps {tq.high_channels} high channels per head but no "
                          "calibration chose them (calibrate first; kvq never guesses)")
    return np.asarray(chosen)


def dim(b: GraphBuilder, x: ir.Value, axis: int) -> ir.Value:
    """Size of ``axis`` as a 1-element int64 tensor."""
    return b.op("Gather", b.op("Shape", x), b.const([axis]), axis=0)


def reshape_tokens(b: GraphBuilder, x: ir.Value, tokens: ir.Value, tail: Sequence[int]) -> ir.Value:
    """Reshape ``[B, H, ...]`` to ``[B, H, tokens, *tail]`` without -1 (which fails on empty tensors)."""
    lead = b.op("Slice", b.op("Shape", x), b.const([0]), b.const([2]))
    return b.op("Reshape", x, b.op("Concat", lead, tokens, b.const(list(tail)), axis=0))


def unpack_fields(b: GraphBuilder, values: ir.Value, bits: int, width: int) -> ir.Value:
    """float32 byte values [B,H,T,W*bits/8] -> float32 fields [B,H,T,W] of ``bits`` each, lowest first.

    Exact float arithmetic (``x - 2^b * floor(x / 2^b)`` on integers < 256), not BitShift, which ONNX Runtime's CPU
    runs slowly enough to dominate a 4-bit decode step (measured: models/smollm2/bench.md).
    """
    base = b.const(float(1 << bits))
    fields, rest = [], values
    for _ in range(8 // bits - 1):
        upper = b.op("Floor", b.op("Div", rest, base))
        fields.append(b.op("Sub", rest, b.op("Mul", upper, base)))
        rest = upper
    fields.append(rest)  # the top field: nothing above it
    last = b.const([-1])
    stacked = b.op("Concat", *(b.op("Unsqueeze", f, last) for f in fields), axis=-1)
    return b.op("Reshape", stacked, b.const([0, 0, 0, width]))  # (no -1: a slice may hold no token)


class HighChannels:
    """A high-channel stream's calibrated choice as graph constants, each added on first use.

    ``to_stored`` ``[H, D, D]`` is the 0/1 matrix with ``codes @ to_stored`` = each head's codes in stored
    order (high channels first); ``to_channels`` is its transpose. Products with a 0/1 permutation matrix
    are exact on integer codes, and MatMul broadcasts a per-head matrix where Gather cannot.
    ``low`` / ``top`` / ``offset``: each channel's code range and stored offset (the 8-bit levels of the format for
    the high channels, :func:`~kvq_export.reference.codec.channel_levels`), shaped ``[H, 1, D]`` against a static
    stream's ``[B, H, T, D]`` and ``[H, 1, 1, D]`` against grouped ``[B, H, T/G, G, D]``. ``order`` ``[H, D]`` int32:
    the channel at each stored position (:func:`~kvq_export.reference.codec.channel_order`; the fused
    attention plugin reads it). Lazy because each flavour reads a different subset (the reference graph
    dequantizes with ``to_channels``, the plugin takes ``order``), and an unused initializer is dead weight
    that ONNX Runtime warns about.
    """

    def __init__(self, b: GraphBuilder, layer: int, part: Part, order: np.ndarray,
                 levels: tuple[np.ndarray, np.ndarray, np.ndarray], static: bool) -> None:
        self._b, self._layer, self._part, self._order = b, layer, part, order
        heads, d = order.shape
        self._levels = [a.reshape(heads, *([1] * (1 if static else 2)), d) for a in levels]

    @functools.cached_property
    def _permutation(self) -> np.ndarray:
        """``[H, D, D]`` 0/1 matrix taking each head's codes to stored order (both MatMul constants derive from it)."""
        heads, d = self._order.shape
        to_stored = np.zeros((heads, d, d), dtype=np.float32)
        for h in range(heads):
            to_stored[h, self._order[h], np.arange(d)] = 1.0
        return to_stored

    def _constant(self, role: str, array: np.ndarray) -> ir.Value:
        return self._b.initializer(static_name(self._layer, self._part, role), array)

    @functools.cached_property
    def to_stored(self) -> ir.Value:
        return self._constant("high_channels.to_stored", self._permutation)

    @functools.cached_property
    def to_channels(self) -> ir.Value:
        return self._constant("high_channels.to_channels",
                              np.ascontiguousarray(self._permutation.transpose(0, 2, 1)))

    @functools.cached_property
    def low(self) -> ir.Value:
        return self._constant("high_channels.low", self._levels[0])

    @functools.cached_property
    def top(self) -> ir.Value:
        return self._constant("high_channels.top", self._levels[1])

    @functools.cached_property
    def steps(self) -> ir.Value:
        return self._constant("high_channels.steps", self._levels[1] - self._levels[0])

    @functools.cached_property
    def offset(self) -> ir.Value:
        """``[H, 1, D]`` (values are ``[B, H, T, D]`` when dequantized, whatever the scales)."""
        heads, d = self._order.shape
        return self._constant("high_channels.offset", self._levels[2].reshape(heads, 1, d))

    @functools.cached_property
    def order(self) -> ir.Value:
        return self._constant("channel_order", self._order.astype(np.int32))


class GraphCodec:
    """Quantize, pack, unpack and dequantize one stream's tokens in the graph.

    Args:
        geometry: the cache geometry (its ``num_kv_heads`` and ``head_dim``).
        static: calibrated static scales ``{layer: {"key"|"value": {"scales": [H, n], "zero_points": ...}}}``;
            each stream's become initializers once (:meth:`static_meta`).
    """

    def __init__(self, geometry: CacheGeometry, *, static: Mapping) -> None:
        self.geometry, self.static = geometry, static
        self._made: dict[tuple[int, str], tuple[ir.Value, ir.Value | None]] = {}
        self._orders: dict[tuple[int, str], HighChannels] = {}

    def _grouped(self, b: GraphBuilder, tq: TensorQuant, x: ir.Value) -> tuple[ir.Value, int]:
        """[B,H,T,D] -> one group per reduce axis: token [B,H,T,D/G,G] (-1), channel [B,H,T/G,G,D] (-2).

        Static channel-axis scales span all tokens: x stays [B,H,T,D] and broadcasts against [H,1,D].
        """
        d = self.geometry.head_dim
        tokens = dim(b, x, 2)
        if tq.axis == Axis.TOKEN:
            g = tq.token_group(d)
            return reshape_tokens(b, x, tokens, [d // g, g]), -1
        if tq.scales == ScaleMode.STATIC:
            return x, -2
        groups = b.op("Div", tokens, b.const(tq.group_size))
        return reshape_tokens(b, x, groups, [tq.group_size, d]), -2

    def static_meta(self, b: GraphBuilder, layer: int, part: Part, tq: TensorQuant):
        """The calibrated [H, n] scales (and zero points) as initializers, made once per stream."""
        made = self._made.get((layer, part))
        if made is not None:
            return made
        meta = self.static[layer][part]
        sdtype = DType.get(tq.scale_dtype).numpy
        scales = b.initializer(static_name(layer, part, "scales"), np.asarray(meta["scales"], dtype=sdtype))
        zeros = None
        if tq.has_zero_point:
            zeros = b.initializer(static_name(layer, part, "zero_points"),
                                  np.asarray(meta["zero_points"], dtype=sdtype))
        self._made[(layer, part)] = (scales, zeros)
        return scales, zeros

    def high_channels(self, b: GraphBuilder, layer: int, part: Part, tq: TensorQuant) -> HighChannels | None:
        """The stream's calibrated high channels as constants (made once per stream); None without them."""
        if not tq.high_channels:
            return None
        made = self._orders.get((layer, part))
        if made is not None:
            return made
        import torch

        d = self.geometry.head_dim
        chosen = torch.as_tensor(high_channel_choice(self.static, layer, part, tq))
        high = check_high_channels(chosen, tq, self.geometry.num_kv_heads, d)
        levels = tuple(t.numpy() for t in channel_levels(tq, high, d))
        made = HighChannels(b, layer, part, channel_order(high, d).numpy(), levels, tq.scales == ScaleMode.STATIC)
        self._orders[(layer, part)] = made
        return made

    def _static_view(self, b: GraphBuilder, tq: TensorQuant, meta: ir.Value) -> ir.Value:
        """[H, n] static metadata as fp32, broadcastable against the grouped view."""
        h = self.geometry.num_kv_heads
        shape = [h, 1, -1, 1] if tq.axis == Axis.TOKEN else [h, 1, -1]
        return b.op("Reshape", b.op("Cast", meta, to=ir.DataType.FLOAT), b.const(shape))

    def quantize(self, b: GraphBuilder, layer: int, part: Part, tq: TensorQuant, block: ir.Value):
        """Quantize a [B,H,F,D] block (F whole groups); return (stored codes, scales, zeros)."""
        f32, sdtype = ir.DataType.FLOAT, DType.get(tq.scale_dtype).ir
        xg, axis = self._grouped(b, tq, b.op("Cast", block, to=f32))
        high = self.high_channels(b, layer, part, tq)
        if tq.quantizer == Quantizer.GGML:
            return self._quantize_ggml(b, tq, xg, block)
        axes = None if tq.scales == ScaleMode.STATIC else b.const([axis])  # static: no reduction, no dangling constant
        scales = zeros = zero = None
        if tq.scales == ScaleMode.STATIC:
            s_meta, z_meta = self.static_meta(b, layer, part, tq)
            scale = self._static_view(b, tq, s_meta)
            zero = self._static_view(b, tq, z_meta) if z_meta is not None else None
        elif tq.has_zero_point:
            mn = b.op("ReduceMin", xg, axes, keepdims=1)
            mx = b.op("ReduceMax", xg, axes, keepdims=1)
            if tq.clip != 1.0:
                mid = b.op("Mul", b.op("Add", mx, mn), b.const(0.5))
                half = b.op("Mul", b.op("Sub", mx, mn), b.const(0.5 * tq.clip))
                mn, mx = b.op("Sub", mid, half), b.op("Add", mid, half)
            lo, hi, _ = int_levels(tq)
            steps = b.const(float(hi - lo)) if high is None else high.steps
            scale_s = b.op("Cast", b.op("Div", b.op("Sub", mx, mn), steps), to=sdtype)
            zero_s = b.op("Cast", mn, to=sdtype)
            scales, zeros = b.op("Squeeze", scale_s, axes), b.op("Squeeze", zero_s, axes)
            scale, zero = b.op("Cast", scale_s, to=f32), b.op("Cast", zero_s, to=f32)
        else:
            amax = b.op("ReduceMax", b.op("Abs", xg), axes, keepdims=1)
            if tq.clip != 1.0:
                amax = b.op("Mul", amax, b.const(float(tq.clip)))
            top = b.const(FP8_E4M3_MAX if tq.format == Format.FP8_E4M3 else float(int_levels(tq)[1])) \
                if high is None else high.top
            scale_s = b.op("Cast", b.op("Div", amax, top), to=sdtype)
            scales = b.op("Squeeze", scale_s, axes)
            scale = b.op("Cast", scale_s, to=f32)
        safe = b.op("Where", b.op("Equal", scale, b.const(0.0)), b.const(1.0), scale)
        d = self.geometry.head_dim
        if tq.format == Format.FP8_E4M3:
            clipped = b.op("Clip", b.op("Div", xg, safe), b.const(-FP8_E4M3_MAX), b.const(FP8_E4M3_MAX))
            # fp8 codes travel inside the graph as fp16 (exact for every e4m3 value): ONNX Runtime's
            # Concat/GatherElements have no float8 kernels; they become float8 only at the boundary.
            codes = b.op("Cast", b.op("Cast", clipped, to=ir.DataType.FLOAT8E4M3FN), to=ir.DataType.FLOAT16)
            return reshape_tokens(b, codes, dim(b, block, 2), [d]), scales, zeros
        lo, hi, offset = int_levels(tq)
        shifted = b.op("Sub", xg, zero) if zero is not None else xg
        rounded = b.op("Round", b.op("Div", shifted, safe))
        if high is None:
            rounded = b.op("Clip", rounded, b.const(float(lo)), b.const(float(hi)))
            shift = b.const(float(offset))
        elif tq.format == Format.INT:  # per-channel tops (the offset is 0)
            rounded = b.op("Min", b.op("Max", rounded, b.const(float(lo))), high.top)
            shift = b.const(float(offset))
        else:  # int_sym: per-channel ranges and offsets ([H, 1, D] -> [H, 1, 1, D] against a grouped view)
            rounded = b.op("Min", b.op("Max", rounded, high.low), high.top)
            shift = high.offset if tq.scales == ScaleMode.STATIC else b.op("Unsqueeze", high.offset, b.const([1]))
        codes = b.op("Cast", b.op("Add", rounded, shift), to=ir.DataType.UINT8)
        codes = reshape_tokens(b, codes, dim(b, block, 2), [d])
        return self.pack(b, tq, codes, high), scales, zeros

    def _quantize_ggml(self, b: GraphBuilder, tq: TensorQuant, xg: ir.Value, block: ir.Value):
        """Ggml's reference block quantizers on [B,H,F,D/32,32] fp32 groups, op for op the codec's ``_quantize_ggml``.

        C's ``(int)(y)`` is Floor here because every y is >= 0; ``roundf`` is built from exact steps
        (:func:`kvq_export.reference.codec.round_away`); ArgMax/ArgMin return the first index, like ggml's loops.
        """
        f32 = ir.DataType.FLOAT
        axes = b.const([-1])
        top, half = (1 << tq.bits) - 1, 1 << (tq.bits - 1)
        absx = b.op("Abs", xg)
        amax = b.op("ReduceMax", absx, axes, keepdims=1)
        mn = None
        if tq.format == Format.INT_SYM and tq.bits == 8:  # q8_0
            d = b.op("Div", amax, b.const(127.0))
        elif tq.format == Format.INT_SYM:  # q4_0 / q5_0
            v = b.op("GatherElements", xg, b.op("ArgMax", absx, axis=-1, keepdims=1), axis=-1)
            v = b.op("Where", b.op("Equal", amax, b.const(0.0)), b.const(0.0), v)
            d = b.op("Div", v, b.const(float(-half)))
        else:  # q4_1 / q5_1
            mn = b.op("GatherElements", xg, b.op("ArgMin", xg, axis=-1, keepdims=1), axis=-1)
            mx = b.op("GatherElements", xg, b.op("ArgMax", xg, axis=-1, keepdims=1), axis=-1)
            d = b.op("Div", b.op("Sub", mx, mn), b.const(float(top)))
        is_zero = b.op("Equal", d, b.const(0.0))
        inv = b.op("Where", is_zero, b.const(0.0), b.op("Div", b.const(1.0), b.op("Where", is_zero, b.const(1.0), d)))
        if tq.format == Format.INT_SYM and tq.bits == 8:
            y = b.op("Mul", xg, inv)
            a = b.op("Abs", y)
            whole = b.op("Floor", a)
            r = b.op("Add", whole, b.op("Cast", b.op("GreaterOrEqual", b.op("Sub", a, whole), b.const(0.5)), to=f32))
            r = b.op("Where", b.op("Less", y, b.const(0.0)), b.op("Neg", r), r)
            codes = b.op("Add", r, b.const(128.0))
        else:
            shifted = xg if mn is None else b.op("Sub", xg, mn)
            bias = b.const(half + 0.5 if mn is None else 0.5)
            codes = b.op("Min", b.op("Floor", b.op("Add", b.op("Mul", shifted, inv), bias)), b.const(float(top)))
        codes = reshape_tokens(b, b.op("Cast", codes, to=ir.DataType.UINT8), dim(b, block, 2),
                                        [self.geometry.head_dim])
        scales = b.op("Squeeze", b.op("Cast", d, to=ir.DataType.FLOAT16), axes)
        zeros = None if mn is None else b.op("Squeeze", b.op("Cast", mn, to=ir.DataType.FLOAT16), axes)
        return self.pack(b, tq, codes), scales, zeros

    def pack(self, b: GraphBuilder, tq: TensorQuant, codes: ir.Value, high: HighChannels | None = None) -> ir.Value:
        """uint8 codes [B,H,T,D] -> stored bytes (``high``: the stream's high channels, stored first)."""
        if high is not None:
            n = tq.high_channels
            ordered = b.op("MatMul", b.op("Cast", codes, to=ir.DataType.FLOAT), high.to_stored)
            first = b.op("Cast", b.op("Slice", ordered, b.const([0]), b.const([n]), b.const([-1])),
                         to=ir.DataType.UINT8)
            rest = b.op("Cast", b.op("Slice", ordered, b.const([n]), b.const([self.geometry.head_dim]), b.const([-1])),
                        to=ir.DataType.INT32)
            return b.op("Concat", first, self._pack_planes(b, rest, tq.bits, self.geometry.head_dim - n), axis=-1)
        if tq.bits == 8:
            return codes
        return self._pack_planes(b, b.op("Cast", codes, to=ir.DataType.INT32), tq.bits, self.geometry.head_dim)

    def _pack_planes(self, b: GraphBuilder, codes: ir.Value, bits: int, width: int) -> ir.Value:
        """int32 codes [B,H,T,W] -> their planes' bytes (3/5/6 bits: low bits, then the higher bits; see the codec)."""
        if bits not in PLANE_BITS:
            return self._pack_bits(b, codes, bits, width)
        low_bits, high_bits = code_planes(bits)
        base = b.const(np.array(1 << low_bits, dtype=np.int32))
        high = b.op("Div", codes, base)  # integer division: the bits above the low plane
        low = b.op("Sub", codes, b.op("Mul", high, base))
        return b.op("Concat", self._pack_bits(b, low, low_bits, width), self._pack_bits(b, high, high_bits, width),
                    axis=-1)

    def _pack_bits(self, b: GraphBuilder, codes: ir.Value, bits: int, width: int | None = None) -> ir.Value:
        """int32 codes [B,H,T,W] of ``bits`` each -> uint8 [B,H,T,W*bits/8], lowest bits first (W: head_dim)."""
        per = 8 // bits
        weights = np.array([1 << (bits * i) for i in range(per)], dtype=np.int32)
        grouped = b.op("Reshape", codes, b.const([0, 0, 0, (width or self.geometry.head_dim) // per, per]))
        packed = b.op("ReduceSum", b.op("Mul", grouped, b.const(weights)), b.const([-1]), keepdims=0)
        return b.op("Cast", packed, to=ir.DataType.UINT8)

    def unpack(self, b: GraphBuilder, tq: TensorQuant, packed: ir.Value, high: HighChannels | None = None) -> ir.Value:
        """Stored uint8 codes -> float32 code values ``[B,H,T,D]`` in ``[0, 2^bits)`` (channel order).

        Sub-byte fields are peeled off lowest first by :func:`unpack_fields` (exact float arithmetic).
        """
        values = b.op("Cast", packed, to=ir.DataType.FLOAT)
        if high is not None:
            n, d = tq.high_channels, self.geometry.head_dim
            first = b.op("Slice", values, b.const([0]), b.const([n]), b.const([-1]))
            rest = b.op("Slice", values, b.const([n]), b.const([n + (d - n) * tq.bits // 8]), b.const([-1]))
            ordered = b.op("Concat", first, self._unpack_planes(b, rest, tq.bits, d - n), axis=-1)
            return b.op("MatMul", ordered, high.to_channels)
        if tq.bits == 8:
            return values
        return self._unpack_planes(b, values, tq.bits, self.geometry.head_dim)

    def _unpack_planes(self, b: GraphBuilder, values: ir.Value, bits: int, width: int) -> ir.Value:
        """float32 bytes of ``width`` codes -> float32 codes [B,H,T,W] (two planes for 3/5/6 bits)."""
        if bits not in PLANE_BITS:
            return unpack_fields(b, values, bits, width)
        low_bits, high_bits = code_planes(bits)
        split = width * low_bits // 8
        low = b.op("Slice", values, b.const([0]), b.const([split]), b.const([-1]))
        high = b.op("Slice", values, b.const([split]), b.const([width * bits // 8]), b.const([-1]))
        return b.op("Add", unpack_fields(b, low, low_bits, width),
                    b.op("Mul", unpack_fields(b, high, high_bits, width), b.const(float(1 << low_bits))))

    def dequantize(self, b: GraphBuilder, tq: TensorQuant, codes: ir.Value, scales, zeros,
                   high: HighChannels | None = None) -> ir.Value:
        """Stored codes + metadata -> fp32 [B,H,Tq,D]."""
        f32 = ir.DataType.FLOAT
        values = b.op("Cast", codes, to=f32) if tq.format == Format.FP8_E4M3 else self.unpack(b, tq, codes, high)
        if high is not None and tq.format == Format.INT_SYM:  # each channel's own offset
            values = b.op("Sub", values, high.offset)
        elif tq.is_int and int_levels(tq)[2]:
            values = b.op("Sub", values, b.const(float(int_levels(tq)[2])))
        xg, axis = self._grouped(b, tq, values)
        if tq.scales == ScaleMode.STATIC:
            scale = self._static_view(b, tq, scales)
            zero = self._static_view(b, tq, zeros) if zeros is not None else None
        else:
            axes = b.const([axis])
            scale = b.op("Unsqueeze", b.op("Cast", scales, to=f32), axes)
            zero = b.op("Unsqueeze", b.op("Cast", zeros, to=f32), axes) if zeros is not None else None
        out = b.op("Mul", xg, scale)
        if zero is not None:
            out = b.op("Add", out, zero)
        return reshape_tokens(b, out, dim(b, codes, 2), [self.geometry.head_dim])
