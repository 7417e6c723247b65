"""The quantized KV cache inside the ONNX graph: cache bookkeeping (reference flavour: standard ONNX ops only).

Per layer and per stream (keys, values) the graph

1. merges the past recent window with this call's new tokens (left padding dropped),
2. fills the sink region, quantizes whatever leaves the recent window (a token, or a whole
   channel-axis group of tokens) with the in-graph codec (:mod:`kvq_export.graph.codec`, exactly
   the arithmetic of :mod:`kvq_export.reference.codec`),
3. emits the present state (the ``regions`` layout of :mod:`kvq_export.cache_layout`), and
4. dequantizes the whole stored state into one token-ordered tensor for attention
   (:mod:`kvq_export.graph.attention`).

A rotated stream (``rotation`` of the scheme) is stored exactly like any other: the decoder body hands
:meth:`QuantizedCacheGraph.attend` q/k/v already in the rotated basis (it asks :meth:`rotation` which
``R`` to use), so the cache, attention and the ``probe.*`` values all live in the stored basis and the
graph computes the same codes as the reference cache fed the same rotated tokens.

Layout rule: every region of a batch is sized to its longest row and each row's valid entries are
right-aligned; per-row counts come from ``seq_lengths`` through :class:`~kvq_export.region_split.RegionSplit`,
the split the reference cache uses. All moves are one primitive, :meth:`_Ops.take`: pick consecutive valid
entries out of a list of right-aligned segments into a new right-aligned tensor (a GatherElements with
computed indices, padding read from an appended zero slot). That keeps padded positions out of every stored code and
every channel-axis group range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import onnx_ir as ir

from kvq_export.cache_layout import REGIONS, CacheLayout
from kvq_export.dtypes import DType
from kvq_export.flavors.cache_graph import AttentionInputs, CacheGraph, CallValues
from kvq_export.graph.attention import attention_mask, grouped_query_attention
from kvq_export.graph.builder import GraphBuilder
from kvq_export.graph.codec import GraphCodec, HighChannels, dim, high_channel_choice, static_scales
from kvq_export.graph.decoder_spec import DecoderSpec
from kvq_export.model_facts import CacheGeometry
from kvq_export.naming import PARTS, PROBES, CacheTensor, packed_probe_name, probe_name, tensor_name
from kvq_export.region_split import RegionSplit
from kvq_export.rotation import stream_rotation
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Axis, Format, Part, Role, ScaleMode


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


def name_packed_probe(b: GraphBuilder, layer: int, qkv: ir.Value, *, projected: bool = False) -> None:
    """:func:`name_probes` for a packed q|k|v (:func:`naming.packed_probe_name`)."""
    b.op("Identity", qkv).name = packed_probe_name(layer, projected=projected)


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
    high: HighChannels | None = None  # a high-channel stream's calibrated channel order (constants)

    def roles(self) -> dict[str, ir.Value]:
        """The state that crosses the graph boundary, by role."""
        out = {"sinks": self.sinks, "codes": self.codes, "recent": self.recent}
        if self.tq.quantized and self.tq.scales == ScaleMode.DYNAMIC:
            out.update(scales=self.scales, zero_points=self.zeros)
        return {role: value for role, value in out.items() if value is not None}


class GraphSplitOps:
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
        return dim(self.b, x, axis)

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


@dataclass(frozen=True, kw_only=True)
class LaidOutCall(CallValues):
    """:class:`CallValues` of a laid-out cache: ``n1`` [B] int64, the tokens each row holds after this call."""

    n1: ir.Value


@dataclass(frozen=True, kw_only=True)
class RegionCall(LaidOutCall):
    """What the reference cache graph's :meth:`~QuantizedCacheGraph.begin` computes once per call.

    [B] int64 unless noted: tokens held before the call, new real tokens per row, the call's length ``t`` ([1]),
    the new tokens' validity ([B, t] bool), the attention's token axis ``N`` ([1]) and one additive mask per
    sliding window (made by the first layer that needs it).
    """

    n0: ir.Value
    new_count: ir.Value
    new_len: ir.Value
    new_valid: ir.Value
    total_len: ir.Value
    masks: dict[int | None, ir.Value] = field(default_factory=dict)


L = TypeVar("L", bound=LaidOutCall)


class LaidOutCache(CacheGraph[L], Generic[L]):
    """What every flavour's cache graph shares: its layout and the tensors that layout puts at the boundary.

    Args:
        scheme: the cache description.
        geometry: the model's cache geometry (its :class:`~kvq_export.model_facts.ModelFacts`, or any
            :class:`~kvq_export.model_facts.CacheGeometry`).
        static: calibrated static scales ``{layer: {"key"|"value": {"scales": [H, n], "zero_points": ...}}}``
            for streams with ``scales="static"`` (numpy arrays).
    """

    #: How the cache crosses the graph boundary (each flavour's graph class sets its own).
    layout: CacheLayout

    def __init__(self, scheme: KVQuantScheme, geometry: CacheGeometry, *,
                 static: Mapping[int, Mapping[str, Mapping[str, np.ndarray]]] | None = None) -> None:
        scheme.check_model(geometry)
        self.scheme = scheme
        self.geometry = geometry
        self.static = static or {}

    def cache_specs(self, direction: str) -> list[CacheTensor]:
        """The cache tensors crossing the graph boundary in ``direction``, as :attr:`layout` names them."""
        return self.layout.tensors(self.scheme, self.geometry, direction)

    def declare_past(self, b: GraphBuilder) -> dict[str, ir.Value]:
        """Declare the past inputs in manifest order: the graph values by name."""
        return {tensor.name: b.input(tensor.name, DType.get(tensor.dtype).ir, tensor.shape)
                for tensor in self.cache_specs("past")}

    def end(self, b: GraphBuilder, call: L) -> None:
        """Declare the present outputs in manifest order."""
        call.present[tensor_name("present", None, None, "seq_lengths")] = call.n1
        for tensor in self.cache_specs("present"):
            b.output(call.present[tensor.name], tensor.name, DType.get(tensor.dtype).ir, tensor.shape)


class QuantizedCacheGraph(LaidOutCache[RegionCall]):
    """:class:`~kvq_export.flavors.cache_graph.CacheGraph` for any :class:`KVQuantScheme` (reference flavour).

    Args:
        scheme: the cache description.
        geometry: the model's cache geometry.
        static: calibrated static scales ``{layer: {"key"|"value": {"scales": [H, n], "zero_points": ...}}}``
            for streams with ``scales="static"`` (numpy arrays).
    """

    #: How the cache crosses the graph boundary.
    layout = REGIONS
    #: its attention applies ``spec.attn_softcap`` (Gemma2's attention soft-capping).
    supports_attn_softcap = True

    def __init__(self, scheme: KVQuantScheme, geometry: CacheGeometry, **options) -> None:
        super().__init__(scheme, geometry, **options)
        for layer, streams in enumerate(scheme.streams(self.geometry.num_layers)):
            for part, tq in zip(PARTS, streams):
                if tq.quantized and tq.scales == ScaleMode.STATIC:
                    static_scales(self.static, layer, part)
                if tq.quantized and tq.high_channels:
                    high_channel_choice(self.static, layer, part, tq)
        self.hp_type = DType.get(scheme.hp_dtype).ir
        self.codec = GraphCodec(geometry, static=self.static)

    # -- CacheGraph protocol --------------------------------------------------------------------------
    def rotation(self, layer: int, part: Part) -> np.ndarray | None:
        """``R`` of ``layer``'s ``key``/``value`` stream (the body rotates q/k and folds v with it)."""
        return stream_rotation(self.scheme, layer, part, self.geometry.head_dim)

    def begin(self, b: GraphBuilder, *, attention_mask: ir.Value, spec: DecoderSpec) -> RegionCall:
        """Declare past inputs; compute per-row counts, positions and the attention mask."""
        ops, past = _Ops(b), self.declare_past(b)
        n0 = past[tensor_name("past", None, None, "seq_lengths")]
        mask = b.op("Cast", attention_mask, to=ir.DataType.INT64)
        new_count = b.op("ReduceSum", mask, b.const([1]), keepdims=0)  # m [B]
        n1 = b.op("Add", n0, new_count)
        new_len = ops.dim(attention_mask, 1)  # t
        # new token j of row b (right-aligned real tokens) sits at position n0 + j - (t - m)
        j = b.op("Unsqueeze", b.op("Range", b.const(0), b.op("Squeeze", new_len, b.const([0])), b.const(1)),
                 b.const([0]))
        offset = b.op("Sub", b.op("Unsqueeze", n0, b.const([1])),
                      b.op("Sub", new_len, b.op("Unsqueeze", new_count, b.const([1]))))
        positions = b.op("Max", b.op("Add", j, offset), b.const(0))  # pads clamp to 0: never stored
        new_valid = b.op("Cast", mask, to=ir.DataType.BOOL)
        total_len = ops.scalar_max(n1)  # N: canonical token axis for attention
        return RegionCall(spec=spec, positions=positions, past=past, n0=n0, n1=n1, new_count=new_count,
                          new_len=new_len, new_valid=new_valid, total_len=total_len)

    def attend(self, b: GraphBuilder, layer: int, inputs: AttentionInputs[RegionCall]) -> ir.Value:
        """Store k/v, dequantize the cache and run grouped attention for q (``heads`` form)."""
        call, (q, k, v) = inputs.call, inputs.qkv
        key_tq, value_tq = self.scheme.for_layer(layer)
        name_probes(b, layer, q, k, v)
        with b.scope(f"kv{layer}"):
            keys = self.read(b, call, self.store(b, call, layer, Part.KEY, key_tq, k))
            values = self.read(b, call, self.store(b, call, layer, Part.VALUE, value_tq, v))
            window = call.spec.facts.window(layer)
            if window not in call.masks:
                with b.scope(f"mask_w{window}"):
                    call.masks[window] = attention_mask(b, positions=call.positions, total_len=call.total_len,
                                                        stored=call.n1, window=window,
                                                        compute_type=call.compute_type)
            return grouped_query_attention(b, call.spec, q, keys, values, call.masks[window],
                                           total_len=call.total_len, compute_type=call.compute_type)

    # -- per-row counts -------------------------------------------------------------------------------
    def _split(self, b: GraphBuilder, tq: TensorQuant, n: ir.Value) -> _Counts:
        """:class:`RegionSplit` of ``tq`` evaluated in the graph on a [B] int64 vector."""
        return _Counts(*RegionSplit.of(tq, self.scheme).lengths(n, GraphSplitOps(b)))

    # -- one stream ---------------------------------------------------------------------------------------
    def store(self, b: GraphBuilder, call: RegionCall, layer: int, part: Part, tq: TensorQuant,
              x: ir.Value) -> StoredStream:
        """Append this call's tokens ``x`` [B,H,t,D] to one stream; emit and return its present state.

        Flavours that read the stored state themselves (a fused attention plugin) call this and skip
        :meth:`read`.
        """
        ops, hp = _Ops(b), self.hp_type
        past = {role: call.past.get(tensor_name("past", layer, part, role))
                for role in (Role.SINKS, Role.CODES, Role.SCALES, Role.ZERO_POINTS, Role.RECENT)}
        before, after = self._split(b, tq, call.n0), self._split(b, tq, call.n1)
        x_hp = b.op("Cast", x, to=hp)
        # the new tokens are right-aligned (left padding): count m per row
        pending_count = b.op("Add", before.recent, call.new_count)
        pending_parts = [(past["recent"], before.recent), (x_hp, call.new_count)]
        if not tq.quantized:
            recent = ops.take(pending_parts, None, after.recent, ops.scalar_max(after.recent), hp)
            return self._emit(call, layer, part, StoredStream(tq, after, recent=recent))

        pending = ops.take(pending_parts, None, pending_count, ops.scalar_max(pending_count), hp)
        pend = [(pending, pending_count)]
        to_sinks = b.op("Sub", after.sinks, before.sinks)
        to_quant = b.op("Sub", after.quantized, before.quantized)
        sinks = ops.take([(past["sinks"], before.sinks), (pending, pending_count)], None, after.sinks,
                         ops.scalar_max(after.sinks), hp)
        block = ops.take(pend, to_sinks, to_quant, ops.scalar_max(to_quant), hp)
        recent = ops.take(pend, b.op("Add", to_sinks, to_quant), after.recent, ops.scalar_max(after.recent), hp)

        codes_new, scales_new, zeros_new = self.codec.quantize(b, layer, part, tq, block)
        past_codes, code_type = past["codes"], ir.DataType.UINT8
        if tq.format == Format.FP8_E4M3:
            past_codes, code_type = b.op("Cast", past_codes, to=ir.DataType.FLOAT16), ir.DataType.FLOAT16
        quant_len = ops.scalar_max(after.quantized)
        codes = ops.take([(past_codes, before.quantized), (codes_new, to_quant)], None, after.quantized,
                         quant_len, code_type)
        if tq.format == Format.FP8_E4M3:
            codes = b.op("Cast", codes, to=ir.DataType.FLOAT8E4M3FN)
        if tq.scales == ScaleMode.DYNAMIC:
            unit = b.const(1 if tq.axis == Axis.TOKEN else tq.group_size)
            q0, dq, q1 = (b.op("Div", c, unit) for c in (before.quantized, to_quant, after.quantized))
            meta_len = b.op("Div", quant_len, unit)
            sdtype = DType.get(tq.scale_dtype).ir
            scales = ops.take([(past["scales"], q0), (scales_new, dq)], None, q1, meta_len, sdtype)
            zeros = None
            if tq.has_zero_point:
                zeros = ops.take([(past["zero_points"], q0), (zeros_new, dq)], None, q1, meta_len, sdtype)
        else:
            scales, zeros = self.codec.static_meta(b, layer, part, tq)
        return self._emit(call, layer, part, StoredStream(tq, after, sinks, codes, scales, zeros, recent,
                                                    self.codec.high_channels(b, layer, part, tq)))

    def _emit(self, call: RegionCall, layer: int, part: Part, state: StoredStream) -> StoredStream:
        """Record the present outputs of one stream (static metadata is a constant, not an output)."""
        for role, value in state.roles().items():
            call.present[tensor_name("present", layer, part, role)] = value
        return state

    def read(self, b: GraphBuilder, call: RegionCall, state: StoredStream) -> ir.Value:
        """Dequantize a stored stream into one token-ordered tensor [B,H,N,D] in the compute dtype."""
        ct, counts = call.compute_type, state.counts
        if not state.tq.quantized:
            return b.op("Cast", state.recent, to=ct)
        codes = state.codes
        if state.tq.format == Format.FP8_E4M3:  # see GraphCodec.quantize: float8 moves as fp16
            codes = b.op("Cast", codes, to=ir.DataType.FLOAT16)
        deq = self.codec.dequantize(b, state.tq, codes, state.scales, state.zeros, state.high)
        return _Ops(b).take(
            [(b.op("Cast", state.sinks, to=ct), counts.sinks), (b.op("Cast", deq, to=ct), counts.quantized),
             (b.op("Cast", state.recent, to=ct), counts.recent)],
            None, call.n1, call.total_len, ct,
        )
