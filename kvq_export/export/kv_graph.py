"""The quantized KV cache inside the ONNX graph (reference flavour: standard ONNX ops only).

Per layer and per stream (keys, values) the graph

1. merges the past recent window with this call's new tokens (left padding dropped),
2. fills the sink region, quantizes whatever leaves the recent window (a token, or a whole
   channel-axis group of tokens) with exactly the arithmetic of :mod:`kvq_export.reference.codec`,
3. emits the present state (same layout as the past, see :mod:`kvq_export.naming`), and
4. dequantizes the whole stored state into one token-ordered tensor for attention.

A rotated stream (``rotation`` of the scheme) is stored exactly like any other: the decoder body hands
:meth:`QuantizedCacheGraph.attend` q/k/v already in the rotated basis (it asks :meth:`rotation` which
``R`` to use), so the cache, attention and the ``probe.*`` values all live in the stored basis and the
graph computes the same codes as the reference cache fed the same rotated tokens.

Layout rule: every region of a batch is sized to its longest row and each row's valid entries are
right-aligned; per-row counts come from ``seq_lengths`` through the same split the reference cache
uses. All moves are one primitive, :meth:`_Ops.take`: pick consecutive valid entries out of a list of
right-aligned segments into a new right-aligned tensor (a GatherElements with computed indices,
padding read from an appended zero slot). That keeps padded positions out of every stored code and
every channel-axis group range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kvq_export.cache_layout import REGIONS, CacheLayout, RegionSplit
from kvq_export.dtypes import DType
from kvq_export.errors import ExportError
from kvq_export.export.builder import GraphBuilder
from kvq_export.naming import PARTS, PROBES, CacheTensor, probe_name, tensor_name
from kvq_export.reference.codec import int_levels
from kvq_export.rotation import stream_rotation
from kvq_export.scheme import FP8_E4M3_MAX, KVQuantScheme, TensorQuant


@dataclass
class _Counts:
    """Per-row token counts of one stream's regions ([B] int64 graph values)."""

    sinks: ir.Value
    quantized: ir.Value
    recent: ir.Value


def name_probes(b: GraphBuilder, layer: int, q: ir.Value, k: ir.Value, v: ir.Value, *,
                projected: bool = False) -> None:
    """Stable names for attention's inputs, so a validator can expose them (:func:`naming.probe_name`).

    Unused Identity nodes cost nothing: ONNX Runtime removes them unless they are made outputs (it does
    *not* remove other dead nodes, so probes never get computation of their own).
    """
    for which, value in zip(PROBES, (q, k, v)):
        b.op("Identity", value).name = probe_name(layer, which, projected=projected)


def static_name(layer: int, part: str, role: str) -> str:
    """Initializer holding a static-scale stream's calibrated ``scales`` / ``zero_points`` (``static.0.key.scales``)."""
    return f"static.{layer}.{part}.{role}"


def static_scales(static: Mapping, layer: int, part: str) -> np.ndarray:
    """The calibrated ``[H, n]`` scales of one static stream; refuses a stream that was never calibrated."""
    scales = static.get(layer, {}).get(part, {}).get("scales")
    if scales is None:
        raise ExportError(f"layer {layer} {part} uses static scales but no calibration was given "
                          "(calibrate first; kvq never guesses a scale)")
    return scales


def facts_window(facts, layer: int) -> int | None:
    """Sliding window of ``layer`` (None: full causal attention)."""
    return facts.window(layer)


@dataclass
class StoredStream:
    """One stream's present state as graph values (roles of :mod:`kvq_export.naming`) and its counts."""

    tq: TensorQuant
    counts: _Counts
    sinks: ir.Value | None = None
    codes: ir.Value | None = None
    scales: ir.Value | None = None  # static: the [H, n] constant
    zeros: ir.Value | None = None
    recent: ir.Value | None = None

    def roles(self) -> dict[str, ir.Value]:
        """The state that crosses the graph boundary, by role."""
        out = {"sinks": self.sinks, "codes": self.codes, "recent": self.recent}
        if self.tq.quantized and self.tq.scales == "dynamic":
            out.update(scales=self.scales, zero_points=self.zeros)
        return {role: value for role, value in out.items() if value is not None}


class _SplitOps:
    """:meth:`RegionSplit.lengths` as ONNX ops on int64 graph values (``Div`` floors non-negative ints)."""

    def __init__(self, b: GraphBuilder) -> None:
        self.b = b

    def minimum(self, x: ir.Value, bound: int) -> ir.Value:
        return self.b.op("Min", x, self.b.const(bound))

    def maximum(self, x: ir.Value, bound: int) -> ir.Value:
        return self.b.op("Max", x, self.b.const(bound))

    def sub(self, x: ir.Value, y: ir.Value | int) -> ir.Value:
        return self.b.op("Sub", x, y if isinstance(y, ir.Value) else self.b.const(y))

    def floor_to(self, x: ir.Value, unit: int) -> ir.Value:
        step = self.b.const(unit)
        return self.b.op("Mul", self.b.op("Div", x, step), step)

    def zero(self, x: ir.Value) -> ir.Value:
        return self.b.op("Mul", x, self.b.const(0))


class _Ops:
    """Small graph idioms shared by every stream."""

    def __init__(self, b: GraphBuilder) -> None:
        self.b = b

    def dim(self, x: ir.Value, axis: int) -> ir.Value:
        """Size of ``axis`` as a 1-element int64 tensor."""
        b = self.b
        return b.op("Gather", b.op("Shape", x), b.const([axis]), axis=0)

    def reshape_tokens(self, x: ir.Value, tokens: ir.Value, tail: Sequence[int]) -> ir.Value:
        """Reshape ``[B, H, ...]`` to ``[B, H, tokens, *tail]`` without -1 (which fails on empty tensors)."""
        b = self.b
        lead = b.op("Slice", b.op("Shape", x), b.const([0]), b.const([2]))
        return b.op("Reshape", x, b.op("Concat", lead, tokens, b.const(list(tail)), axis=0))

    def scalar_max(self, v: ir.Value) -> ir.Value:
        """Max over a [B] vector as a 1-element tensor."""
        return self.b.op("ReduceMax", v, self.b.const([0]), keepdims=1)

    def take(
        self,
        parts: Sequence[tuple[ir.Value, ir.Value]],
        start: ir.Value | None,
        count: ir.Value,
        out_len: ir.Value,
        dtype: ir.DataType,
    ) -> ir.Value:
        """Entries ``start .. start+count`` (per row) of the concatenated valid entries of ``parts``.

        ``parts`` are ``(tensor [B, H, L_i, W], valid_i [B])`` with each row's valid entries
        right-aligned; the result is ``[B, H, out_len, W]`` with the taken entries right-aligned and
        zeros to their left. ``count``/``start`` are [B] int64, ``out_len`` a 1-element int64.
        """
        b = self.b
        first = parts[0][0]
        shape = b.op("Shape", first)
        batch_heads = b.op("Slice", shape, b.const([0]), b.const([2]))
        width = b.op("Slice", shape, b.const([3]), b.const([4]))
        zero = b.op("Expand", b.const(np.zeros((1, 1, 1, 1), dtype=ir.DataType(dtype).numpy())),
                    b.op("Concat", batch_heads, b.const([1]), width, axis=0))  # the padding source
        src = b.op("Concat", *[p for p, _ in parts], zero, axis=2)

        j = b.op("Unsqueeze", b.op("Range", b.const(0), b.op("Squeeze", out_len, b.const([0])), b.const(1)),
                 b.const([0]))  # [1, out_len]
        count2 = b.op("Unsqueeze", count, b.const([1]))  # [B, 1]
        i = b.op("Sub", j, b.op("Sub", out_len, count2))  # position within the taken run
        valid = b.op("GreaterOrEqual", i, b.const(0))
        k = i if start is None else b.op("Add", i, b.op("Unsqueeze", start, b.const([1])))

        # walk the parts from the last: slot of entry k inside ``src``
        slot_base = b.const(0)  # sum of L_p before part p
        entry_base = b.const(0)  # sum of valid_p before part p
        spans = []
        for tensor, valid_count in parts:
            length = self.dim(tensor, 2)
            v = b.op("Unsqueeze", valid_count, b.const([1]))
            # slot = slot_base + (L - v) + (k - entry_base)
            slot = b.op("Add", b.op("Add", slot_base, b.op("Sub", length, v)), b.op("Sub", k, entry_base))
            spans.append((entry_base, slot))
            slot_base = b.op("Add", slot_base, length)
            entry_base = b.op("Add", entry_base, v)
        idx = spans[-1][1]
        for (next_base, _), (_, slot) in zip(reversed(spans[1:]), reversed(spans[:-1])):
            idx = b.op("Where", b.op("Less", k, next_base), slot, idx)
        idx = b.op("Where", valid, idx, b.op("Reshape", slot_base, b.const([1, 1])))  # -> zero slot
        index = b.op("Expand", b.op("Unsqueeze", idx, b.const([1, 3])),
                     b.op("Concat", batch_heads, out_len, width, axis=0))
        return b.op("GatherElements", src, index, axis=2)


class LaidOutCache:
    """What every flavour's cache graph shares: its layout and the tensors that layout puts at the boundary."""

    layout: CacheLayout
    scheme: KVQuantScheme
    num_layers: int
    kv_heads: int
    head_dim: int

    def cache_specs(self, direction: str) -> list[CacheTensor]:
        """The cache tensors crossing the graph boundary in ``direction``, as :attr:`layout` names them."""
        return self.layout.tensors(self.scheme, num_layers=self.num_layers, kv_heads=self.kv_heads,
                                   head_dim=self.head_dim, direction=direction)


class QuantizedCacheGraph(LaidOutCache):
    """:class:`~kvq_export.export.decoder.CacheGraph` for any :class:`KVQuantScheme` (reference flavour).

    Args:
        scheme: the cache description.
        num_layers, kv_heads, head_dim: the model's cache geometry.
        static: calibrated static scales ``{layer: {"key"|"value": {"scales": [H, n], "zero_points": ...}}}``
            for streams with ``scales="static"`` (numpy arrays).
    """

    #: How the cache crosses the graph boundary.
    layout = REGIONS
    #: :meth:`_attention` applies ``facts.attn_softcap`` (Gemma2's attention soft-capping).
    supports_attn_softcap = True

    def __init__(
        self,
        scheme: KVQuantScheme,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        static: Mapping[int, Mapping[str, Mapping[str, np.ndarray]]] | None = None,
    ) -> None:
        scheme.check_model(num_layers, head_dim)
        self.scheme = scheme
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.static = static or {}
        for layer, streams in enumerate(scheme.streams(num_layers)):
            for part, tq in zip(PARTS, streams):
                if tq.quantized and tq.scales == "static":
                    static_scales(self.static, layer, part)
        self.hp_type = DType.get(scheme.hp_dtype).ir
        self.past: dict[str, ir.Value] = {}
        self.present: dict[str, ir.Value] = {}
        self._static_values: dict[tuple[int, str], tuple[ir.Value, ir.Value | None]] = {}

    # -- CacheGraph protocol --------------------------------------------------------------------------
    def rotation(self, layer: int, part: str) -> np.ndarray | None:
        """``R`` of ``layer``'s ``key``/``value`` stream (the body rotates q/k and folds v with it)."""
        return stream_rotation(self.scheme, layer, part, self.head_dim)

    def begin(self, b: GraphBuilder, *, attention_mask: ir.Value, facts) -> ir.Value:
        """Declare past inputs; compute per-row counts, positions and the attention mask."""
        self.ops, self.facts = _Ops(b), facts
        self.compute_type = DType.get(facts.dtype).ir if isinstance(facts.dtype, str) else facts.dtype
        for spec in self.cache_specs("past"):
            self.past[spec.name] = b.input(spec.name, DType.get(spec.dtype).ir, spec.shape)
        n0 = self.past[tensor_name("past", None, None, "seq_lengths")]
        mask = b.op("Cast", attention_mask, to=ir.DataType.INT64)
        self.new_count = b.op("ReduceSum", mask, b.const([1]), keepdims=0)  # m [B]
        self.n0, self.n1 = n0, b.op("Add", n0, self.new_count)
        self.new_len = self.ops.dim(attention_mask, 1)  # t
        # new token j of row b (right-aligned real tokens) sits at position n0 + j - (t - m)
        j = b.op("Unsqueeze", b.op("Range", b.const(0), b.op("Squeeze", self.new_len, b.const([0])), b.const(1)),
                 b.const([0]))
        offset = b.op("Sub", b.op("Unsqueeze", n0, b.const([1])),
                      b.op("Sub", self.new_len, b.op("Unsqueeze", self.new_count, b.const([1]))))
        positions = b.op("Max", b.op("Add", j, offset), b.const(0))  # pads clamp to 0: never stored
        self.new_valid = b.op("Cast", mask, to=ir.DataType.BOOL)
        self.total_len = self.ops.scalar_max(self.n1)  # N: canonical token axis for attention
        self.positions = positions
        self._masks: dict[int | None, ir.Value] = {}  # one additive mask per distinct sliding window
        return positions

    def attend(self, b: GraphBuilder, layer: int, q: ir.Value, k: ir.Value, v: ir.Value) -> ir.Value:
        """Store k/v, dequantize the cache and run grouped attention for ``q``."""
        key_tq, value_tq = self.scheme.for_layer(layer)
        name_probes(b, layer, q, k, v)
        with b.scope(f"kv{layer}"):
            keys = self.read(b, self.store(b, layer, "key", key_tq, k))
            values = self.read(b, self.store(b, layer, "value", value_tq, v))
            window = facts_window(self.facts, layer)
            if window not in self._masks:
                with b.scope(f"mask_w{window}"):
                    self._masks[window] = self._attention_mask(b, self.positions, window)
            return self._attention(b, q, keys, values, self._masks[window])

    def end(self, b: GraphBuilder) -> None:
        """Declare the present outputs in manifest order."""
        self.present[tensor_name("present", None, None, "seq_lengths")] = self.n1
        for spec in self.cache_specs("present"):
            b.output(self.present[spec.name], spec.name, DType.get(spec.dtype).ir, spec.shape)

    # -- per-row counts -------------------------------------------------------------------------------
    def _split(self, b: GraphBuilder, tq: TensorQuant, n: ir.Value) -> _Counts:
        """:class:`RegionSplit` of ``tq`` evaluated in the graph on a [B] int64 vector."""
        return _Counts(*RegionSplit.of(tq, self.scheme).lengths(n, _SplitOps(b)))

    # -- one stream ---------------------------------------------------------------------------------------
    def store(self, b: GraphBuilder, layer: int, part: str, tq: TensorQuant, x: ir.Value) -> StoredStream:
        """Append this call's tokens ``x`` [B,H,t,D] to one stream; emit and return its present state.

        Flavours that read the stored state themselves (a fused attention plugin) call this and skip
        :meth:`read`.
        """
        ops, hp = self.ops, self.hp_type
        past = {role: self.past.get(tensor_name("past", layer, part, role))
                for role in ("sinks", "codes", "scales", "zero_points", "recent")}
        before, after = self._split(b, tq, self.n0), self._split(b, tq, self.n1)
        x_hp = b.op("Cast", x, to=hp)
        # the new tokens are right-aligned (left padding): count m per row
        pending_count = b.op("Add", before.recent, self.new_count)
        pending_parts = [(past["recent"], before.recent), (x_hp, self.new_count)]
        if not tq.quantized:
            recent = ops.take(pending_parts, None, after.recent, ops.scalar_max(after.recent), hp)
            return self._emit(layer, part, StoredStream(tq, after, recent=recent))

        pending = ops.take(pending_parts, None, pending_count, ops.scalar_max(pending_count), hp)
        pend = [(pending, pending_count)]
        to_sinks = b.op("Sub", after.sinks, before.sinks)
        to_quant = b.op("Sub", after.quantized, before.quantized)
        sinks = ops.take([(past["sinks"], before.sinks), (pending, pending_count)], None, after.sinks,
                         ops.scalar_max(after.sinks), hp)
        block = ops.take(pend, to_sinks, to_quant, ops.scalar_max(to_quant), hp)
        recent = ops.take(pend, b.op("Add", to_sinks, to_quant), after.recent, ops.scalar_max(after.recent), hp)

        codes_new, scales_new, zeros_new = self._quantize(b, layer, part, tq, block)
        past_codes, code_type = past["codes"], ir.DataType.UINT8
        if tq.format == "fp8_e4m3":
            past_codes, code_type = b.op("Cast", past_codes, to=ir.DataType.FLOAT16), ir.DataType.FLOAT16
        quant_len = ops.scalar_max(after.quantized)
        codes = ops.take([(past_codes, before.quantized), (codes_new, to_quant)], None, after.quantized,
                         quant_len, code_type)
        if tq.format == "fp8_e4m3":
            codes = b.op("Cast", codes, to=ir.DataType.FLOAT8E4M3FN)
        if tq.scales == "dynamic":
            unit = b.const(1 if tq.axis == "token" else tq.group_size)
            q0, dq, q1 = (b.op("Div", c, unit) for c in (before.quantized, to_quant, after.quantized))
            meta_len = b.op("Div", quant_len, unit)
            sdtype = DType.get(tq.scale_dtype).ir
            scales = ops.take([(past["scales"], q0), (scales_new, dq)], None, q1, meta_len, sdtype)
            zeros = None
            if tq.has_zero_point:
                zeros = ops.take([(past["zero_points"], q0), (zeros_new, dq)], None, q1, meta_len, sdtype)
        else:
            scales, zeros = self._static_meta(b, layer, part, tq)
        return self._emit(layer, part, StoredStream(tq, after, sinks, codes, scales, zeros, recent))

    def _emit(self, layer: int, part: str, state: StoredStream) -> StoredStream:
        """Record the present outputs of one stream (static metadata is a constant, not an output)."""
        for role, value in state.roles().items():
            self.present[tensor_name("present", layer, part, role)] = value
        return state

    def read(self, b: GraphBuilder, state: StoredStream) -> ir.Value:
        """Dequantize a stored stream into one token-ordered tensor [B,H,N,D] in the compute dtype."""
        ct, counts = self.compute_type, state.counts
        if not state.tq.quantized:
            return b.op("Cast", state.recent, to=ct)
        codes = state.codes
        if state.tq.format == "fp8_e4m3":  # see _quantize: float8 moves as fp16
            codes = b.op("Cast", codes, to=ir.DataType.FLOAT16)
        deq = self._dequantize(b, state.tq, codes, state.scales, state.zeros)
        return self.ops.take(
            [(b.op("Cast", state.sinks, to=ct), counts.sinks), (b.op("Cast", deq, to=ct), counts.quantized),
             (b.op("Cast", state.recent, to=ct), counts.recent)],
            None, self.n1, self.total_len, ct,
        )

    # -- codec in the graph (mirrors kvq_export.reference.codec step by step) ------------------------------
    def _grouped(self, b: GraphBuilder, tq: TensorQuant, x: ir.Value) -> tuple[ir.Value, int]:
        """[B,H,T,D] -> one group per reduce axis: token [B,H,T,D/G,G] (-1), channel [B,H,T/G,G,D] (-2).

        Static channel-axis scales span all tokens: x stays [B,H,T,D] and broadcasts against [H,1,D].
        """
        d = self.head_dim
        tokens = self.ops.dim(x, 2)
        if tq.axis == "token":
            g = tq.token_group(d)
            return self.ops.reshape_tokens(x, tokens, [d // g, g]), -1
        if tq.scales == "static":
            return x, -2
        groups = b.op("Div", tokens, b.const(tq.group_size))
        return self.ops.reshape_tokens(x, groups, [tq.group_size, d]), -2

    def _static_meta(self, b: GraphBuilder, layer: int, part: str, tq: TensorQuant):
        """The calibrated [H, n] scales (and zero points) as initializers, made once per stream."""
        made = self._static_values.get((layer, part))
        if made is not None:
            return made
        meta = self.static[layer][part]
        sdtype = DType.get(tq.scale_dtype).numpy
        scales = b.initializer(static_name(layer, part, "scales"), np.asarray(meta["scales"], dtype=sdtype))
        zeros = None
        if tq.has_zero_point:
            zeros = b.initializer(static_name(layer, part, "zero_points"),
                                  np.asarray(meta["zero_points"], dtype=sdtype))
        self._static_values[(layer, part)] = (scales, zeros)
        return scales, zeros

    def _static_view(self, b: GraphBuilder, tq: TensorQuant, meta: ir.Value) -> ir.Value:
        """[H, n] static metadata as fp32, broadcastable against the grouped view."""
        h = self.kv_heads
        shape = [h, 1, -1, 1] if tq.axis == "token" else [h, 1, -1]
        return b.op("Reshape", b.op("Cast", meta, to=ir.DataType.FLOAT), b.const(shape))

    def _quantize(self, b: GraphBuilder, layer: int, part: str, tq: TensorQuant, block: ir.Value):
        """Quantize a [B,H,F,D] block (F whole groups); return (stored codes, scales, zeros)."""
        f32, sdtype = ir.DataType.FLOAT, DType.get(tq.scale_dtype).ir
        xg, axis = self._grouped(b, tq, b.op("Cast", block, to=f32))
        if tq.quantizer == "ggml":
            return self._quantize_ggml(b, tq, xg, block)
        axes = None if tq.scales == "static" else b.const([axis])  # static: no reduction, no dangling constant
        scales = zeros = zero = None
        if tq.scales == "static":
            s_meta, z_meta = self._static_meta(b, layer, part, tq)
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
            scale_s = b.op("Cast", b.op("Div", b.op("Sub", mx, mn), b.const(float(hi - lo))), to=sdtype)
            zero_s = b.op("Cast", mn, to=sdtype)
            scales, zeros = b.op("Squeeze", scale_s, axes), b.op("Squeeze", zero_s, axes)
            scale, zero = b.op("Cast", scale_s, to=f32), b.op("Cast", zero_s, to=f32)
        else:
            amax = b.op("ReduceMax", b.op("Abs", xg), axes, keepdims=1)
            if tq.clip != 1.0:
                amax = b.op("Mul", amax, b.const(float(tq.clip)))
            top = FP8_E4M3_MAX if tq.format == "fp8_e4m3" else float(int_levels(tq)[1])
            scale_s = b.op("Cast", b.op("Div", amax, b.const(top)), to=sdtype)
            scales = b.op("Squeeze", scale_s, axes)
            scale = b.op("Cast", scale_s, to=f32)
        safe = b.op("Where", b.op("Equal", scale, b.const(0.0)), b.const(1.0), scale)
        d = self.head_dim
        if tq.format == "fp8_e4m3":
            clipped = b.op("Clip", b.op("Div", xg, safe), b.const(-FP8_E4M3_MAX), b.const(FP8_E4M3_MAX))
            # fp8 codes travel inside the graph as fp16 (exact for every e4m3 value): ONNX Runtime's
            # Concat/GatherElements have no float8 kernels; they become float8 only at the boundary.
            codes = b.op("Cast", b.op("Cast", clipped, to=ir.DataType.FLOAT8E4M3FN), to=ir.DataType.FLOAT16)
            return self.ops.reshape_tokens(codes, self.ops.dim(block, 2), [d]), scales, zeros
        lo, hi, offset = int_levels(tq)
        shifted = b.op("Sub", xg, zero) if zero is not None else xg
        rounded = b.op("Clip", b.op("Round", b.op("Div", shifted, safe)), b.const(float(lo)), b.const(float(hi)))
        codes = b.op("Cast", b.op("Add", rounded, b.const(float(offset))), to=ir.DataType.UINT8)
        codes = self.ops.reshape_tokens(codes, self.ops.dim(block, 2), [d])
        return self._pack(b, tq, codes), scales, zeros

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
        if tq.format == "int_sym" and tq.bits == 8:  # q8_0
            d = b.op("Div", amax, b.const(127.0))
        elif tq.format == "int_sym":  # q4_0 / q5_0
            v = b.op("GatherElements", xg, b.op("ArgMax", absx, axis=-1, keepdims=1), axis=-1)
            v = b.op("Where", b.op("Equal", amax, b.const(0.0)), b.const(0.0), v)
            d = b.op("Div", v, b.const(float(-half)))
        else:  # q4_1 / q5_1
            mn = b.op("GatherElements", xg, b.op("ArgMin", xg, axis=-1, keepdims=1), axis=-1)
            mx = b.op("GatherElements", xg, b.op("ArgMax", xg, axis=-1, keepdims=1), axis=-1)
            d = b.op("Div", b.op("Sub", mx, mn), b.const(float(top)))
        is_zero = b.op("Equal", d, b.const(0.0))
        inv = b.op("Where", is_zero, b.const(0.0), b.op("Div", b.const(1.0), b.op("Where", is_zero, b.const(1.0), d)))
        if tq.format == "int_sym" and tq.bits == 8:
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
        codes = self.ops.reshape_tokens(b.op("Cast", codes, to=ir.DataType.UINT8), self.ops.dim(block, 2),
                                        [self.head_dim])
        scales = b.op("Squeeze", b.op("Cast", d, to=ir.DataType.FLOAT16), axes)
        zeros = None if mn is None else b.op("Squeeze", b.op("Cast", mn, to=ir.DataType.FLOAT16), axes)
        return self._pack(b, tq, codes), scales, zeros

    def _pack(self, b: GraphBuilder, tq: TensorQuant, codes: ir.Value) -> ir.Value:
        if tq.bits == 8:
            return codes
        codes = b.op("Cast", codes, to=ir.DataType.INT32)
        if tq.bits == 5:  # low nibbles, then the plane of fifth bits (see the codec)
            sixteen = b.const(np.array(16, dtype=np.int32))
            high = b.op("Div", codes, sixteen)  # integer division: the fifth bit
            low = b.op("Sub", codes, b.op("Mul", high, sixteen))
            return b.op("Concat", self._pack_bits(b, low, 4), self._pack_bits(b, high, 1), axis=-1)
        return self._pack_bits(b, codes, tq.bits)

    def _pack_bits(self, b: GraphBuilder, codes: ir.Value, bits: int) -> ir.Value:
        """int32 codes [B,H,T,D] of ``bits`` each -> uint8 [B,H,T,D*bits/8], lowest bits first."""
        per = 8 // bits
        weights = np.array([1 << (bits * i) for i in range(per)], dtype=np.int32)
        grouped = b.op("Reshape", codes, b.const([0, 0, 0, self.head_dim // per, per]))
        packed = b.op("ReduceSum", b.op("Mul", grouped, b.const(weights)), b.const([-1]), keepdims=0)
        return b.op("Cast", packed, to=ir.DataType.UINT8)

    def _unpack(self, b: GraphBuilder, tq: TensorQuant, packed: ir.Value) -> ir.Value:
        """Stored uint8 codes -> float32 code values ``[B,H,T,D]`` in ``[0, 2^bits)``.

        Sub-byte fields are peeled off lowest first with exact float arithmetic (``x - 2^b * floor(x / 2^b)``
        on integers < 256): ONNX Runtime's CPU BitShift made 4-bit unpacking 41% of a decode step at 8192
        tokens; this is about 4x faster and gives the same values.
        """
        values = b.op("Cast", packed, to=ir.DataType.FLOAT)
        if tq.bits == 8:
            return values
        if tq.bits == 5:  # D/2 nibble bytes, then D/8 bytes of fifth bits
            d = self.head_dim
            low = b.op("Slice", values, b.const([0]), b.const([d // 2]), b.const([-1]))
            high = b.op("Slice", values, b.const([d // 2]), b.const([d // 2 + d // 8]), b.const([-1]))
            return b.op("Add", self._unpack_bits(b, low, 4),
                        b.op("Mul", self._unpack_bits(b, high, 1), b.const(16.0)))
        return self._unpack_bits(b, values, tq.bits)

    def _unpack_bits(self, b: GraphBuilder, values: ir.Value, bits: int) -> ir.Value:
        """float32 byte values [B,H,T,D*bits/8] -> float32 fields [B,H,T,D] of ``bits`` each, lowest first."""
        base = b.const(float(1 << bits))
        fields, rest = [], values
        for _ in range(8 // bits - 1):
            upper = b.op("Floor", b.op("Div", rest, base))
            fields.append(b.op("Sub", rest, b.op("Mul", upper, base)))
            rest = upper
        fields.append(rest)  # the top field: nothing above it
        last = b.const([-1])
        stacked = b.op("Concat", *(b.op("Unsqueeze", f, last) for f in fields), axis=-1)
        return b.op("Reshape", stacked, b.const([0, 0, 0, self.head_dim]))

    def _dequantize(self, b: GraphBuilder, tq: TensorQuant, codes: ir.Value, scales, zeros) -> ir.Value:
        """Stored codes + metadata -> fp32 [B,H,Tq,D]."""
        f32 = ir.DataType.FLOAT
        values = b.op("Cast", codes, to=f32) if tq.format == "fp8_e4m3" else self._unpack(b, tq, codes)
        if tq.is_int and int_levels(tq)[2]:
            values = b.op("Sub", values, b.const(float(int_levels(tq)[2])))
        xg, axis = self._grouped(b, tq, values)
        if tq.scales == "static":
            scale = self._static_view(b, tq, scales)
            zero = self._static_view(b, tq, zeros) if zeros is not None else None
        else:
            axes = b.const([axis])
            scale = b.op("Unsqueeze", b.op("Cast", scales, to=f32), axes)
            zero = b.op("Unsqueeze", b.op("Cast", zeros, to=f32), axes) if zeros is not None else None
        out = b.op("Mul", xg, scale)
        if zero is not None:
            out = b.op("Add", out, zero)
        return self.ops.reshape_tokens(out, self.ops.dim(codes, 2), [self.head_dim])

    # -- attention ------------------------------------------------------------------------------------------
    def _attention_mask(self, b: GraphBuilder, positions: ir.Value, window: int | None) -> ir.Value:
        """Additive mask [B,1,1,t,N]: key j of row b is real (j >= N - n1) and causal/in-window."""
        n_total = b.op("Squeeze", self.total_len, b.const([0]))
        j = b.op("Unsqueeze", b.op("Range", b.const(0), n_total, b.const(1)), b.const([0]))  # [1,N]
        key_pos = b.op("Sub", j, b.op("Unsqueeze", b.op("Sub", self.total_len, self.n1), b.const([1])))  # [B,N]
        key_pos = b.op("Unsqueeze", key_pos, b.const([1]))  # [B,1,N]
        query_pos = b.op("Unsqueeze", positions, b.const([2]))  # [B,t,1]
        allowed = b.op("And", b.op("GreaterOrEqual", key_pos, b.const(0)),
                       b.op("LessOrEqual", key_pos, query_pos))
        if window:
            allowed = b.op("And", allowed, b.op("Greater", key_pos, b.op("Sub", query_pos, b.const(int(window)))))
        np_type = ir.DataType(self.compute_type).numpy()
        big = b.const(np.array(np.finfo(np_type).min, dtype=np_type))
        mask = b.op("Where", allowed, b.const(np.array(0, dtype=np_type)), big)
        return b.op("Unsqueeze", mask, b.const([1, 2]))

    def _attention(self, b: GraphBuilder, q: ir.Value, keys: ir.Value, values: ir.Value, mask: ir.Value) -> ir.Value:
        """Grouped-query attention without repeating K/V: q heads of one kv head share a MatMul."""
        facts = self.facts
        groups = facts.num_heads // facts.num_kv_heads
        d = facts.head_dim
        qg = b.op("Reshape", q, b.const([0, facts.num_kv_heads, -1, d]))  # [B,Hkv,g*t,D]
        scores = b.op("MatMul", qg, b.op("Transpose", keys, perm=[0, 1, 3, 2]))
        np_type = ir.DataType(self.compute_type).numpy()
        scores = b.op("Mul", scores, b.const(np.array(facts.scaling, dtype=np_type)))
        cap = getattr(facts, "attn_softcap", None)
        if cap:  # Gemma2: cap * tanh(scores / cap), before the mask (transformers' eager order)
            c = b.const(np.array(cap, dtype=np_type))
            scores = b.op("Mul", b.op("Tanh", b.op("Div", scores, c)), c)
        shape5 = b.op("Concat", b.const([0, facts.num_kv_heads, groups, -1]), self.total_len, axis=0)
        scores = b.op("Add", b.op("Reshape", scores, shape5), mask)
        if self.compute_type != ir.DataType.FLOAT:  # softmax in fp32, as Hugging Face does
            probs = b.op("Cast", b.op("Softmax", b.op("Cast", scores, to=ir.DataType.FLOAT), axis=-1),
                         to=self.compute_type)
        else:
            probs = b.op("Softmax", scores, axis=-1)
        probs = b.op("Reshape", probs, b.op("Concat", b.const([0, facts.num_kv_heads, -1]), self.total_len, axis=0))
        out = b.op("MatMul", probs, values)  # [B,Hkv,g*t,D]
        return b.op("Reshape", out, b.const([0, facts.num_heads, -1, d]))
