"""``--flavor ort-gqa``: ONNX Runtime's fused ``com.microsoft.GroupQueryAttention`` over a shared cache buffer.

Each layer's attention is one GroupQueryAttention node that reads the cache in place: int8/int4 codes with static
float32 scales (the static schemes :func:`~kvq_export.flavors.ort_gqa.capability.unsupported` accepts, symmetric or
with zero points, with or without high channels), or an unquantized fp16/fp32 buffer. The cache is the ``buffer``
layout of :mod:`kvq_export.cache_layout`: one ``[batch, kv_heads, capacity, packed head_dim]`` tensor per stream,
row ``b``'s tokens at ``[0, seq_lengths[b])``, which the runtime binds as both ``past.*`` input and ``present.*``
output, so a step appends in place. Rows may be left- or right-padded. A call of several new tokens (or into empty
caches) attends exactly over its own tokens and the held codes and writes its tokens' codes once; a decode step runs
the quantized node; either way the buffers hold the bytes the quantized node writes.

:class:`GQACacheGraph` fuses RoPE into the node; :class:`GQABodyRopeCacheGraph` (picked by
:meth:`GQACacheGraph.for_model`) leaves RoPE to the body, for keys transformed after it (rotation, zero points, high
channels). What the node does on ONNX Runtime's CPU and how the graph works around it (prefill, padding, offsets,
high channels, probes, rotation): docs/design/ort-gqa.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from kvq_export.cache_layout import BUFFER
from kvq_export.dtypes import DType
from kvq_export.errors import ExportError
from kvq_export.flavors.cache_graph import AttentionForm, AttentionInputs
from kvq_export.flavors.ort_gqa.call import GQACall, begin_call
from kvq_export.flavors.ort_gqa.capability import rope_in_body, unsupported
from kvq_export.flavors.ort_gqa.high_nodes import NodeShape, fold, high_nibbles, pack, quantize, widen
from kvq_export.flavors.ort_gqa.plan import plan_layer
from kvq_export.flavors.reference.graph import LaidOutCache, name_packed_probe, name_probes
from kvq_export.graph.builder import CONTRIB_DOMAIN, GraphBuilder
from kvq_export.graph.codec import static_name, unpack_fields
from kvq_export.graph.decoder_spec import DecoderSpec
from kvq_export.model_facts import CacheGeometry, ModelFacts
from kvq_export.naming import PARTS
from kvq_export.rotation import stream_rotation
from kvq_export.scheme import KVQuantScheme
from kvq_export.vocab import Part

logger = logging.getLogger(__name__)



class GQACacheGraph(LaidOutCache[GQACall]):
    """:class:`~kvq_export.flavors.cache_graph.CacheGraph` built on ``com.microsoft.GroupQueryAttention``.

    Args:
        scheme: the cache description (see :func:`unsupported` for what GQA can hold).
        geometry: the model's cache geometry.
        static: calibrated static scales ``{layer: {"key"|"value": {"scales": [H, n]}}}``.
        fuse_body: ask the decoder body for ONNX Runtime's fused nodes (default): one MatMul for q/k/v and
            one for gate/up, RMSNorm as ``RMSNormalization`` and residual + norm as
            ``com.microsoft.SkipSimplifiedLayerNormalization`` (see :class:`kvq_export.export.decoder._Body`).
            The graph needs ONNX Runtime anyway; False gives the portable body of the reference flavour.
        fast_prefill: a quantized layer attends exactly over a prompt's or chunk's own tokens and writes their
            codes once (default; docs/design/ort-gqa.md), unless a run feeds
            :data:`~kvq_export.naming.EXACT_PREFILL` false; False runs the quantized node on every call.
    """

    layout = BUFFER
    #: the node's ``softcap`` attribute is Gemma2's attention soft-capping
    supports_attn_softcap = True
    #: the node applies RoPE (``do_rotary``) to the raw projections; :class:`GQABodyRopeCacheGraph` leaves it to
    #: the body
    attention = AttentionForm.PROJECTED

    def __init__(self, scheme: KVQuantScheme, geometry: CacheGeometry, *, fuse_body: bool = True,
                 fast_prefill: bool = True, **options) -> None:
        super().__init__(scheme, geometry, **options)
        reasons = unsupported(scheme, self.geometry.num_layers, self.geometry.head_dim)
        if reasons:
            raise ExportError(f"flavor ort-gqa cannot hold scheme {scheme.name or 'custom'}: " + "; ".join(reasons))
        if self.attention is AttentionForm.PROJECTED and rope_in_body(scheme, self.geometry.num_layers):
            raise ExportError("ort-gqa: rotated keys, keys with zero points and high channels are transformed "
                              "after RoPE, so RoPE cannot be fused into GroupQueryAttention "
                              "(use GQABodyRopeCacheGraph)")
        self.fuses_body = fuse_body
        self.fast_prefill = fast_prefill
        self.kv_row = self.geometry.num_kv_heads * self.geometry.head_dim  # one stream's packed row
        self.plans = [plan_layer(layer, key, value, self.static, geometry)
                      for layer, (key, value) in enumerate(scheme.streams(self.geometry.num_layers))]

    @classmethod
    def unsupported(cls, scheme: KVQuantScheme, num_layers: int, head_dim: int | None = None) -> list[str]:
        """Why GroupQueryAttention cannot hold ``scheme`` (see the module-level :func:`unsupported`)."""
        return unsupported(scheme, num_layers, head_dim)

    @classmethod
    def for_model(cls, scheme: KVQuantScheme, facts: ModelFacts, *, static: Mapping | None = None,
                  **options) -> GQACacheGraph:
        """RoPE fused into the node unless the keys are transformed after it (:func:`rope_in_body`).

        ``options``: the constructor's (``fuse_body``, ``fast_prefill``).
        """
        graph_class = GQABodyRopeCacheGraph if rope_in_body(scheme, facts.num_layers) else GQACacheGraph
        return graph_class(scheme, facts, static=static, **options)

    # -- CacheGraph protocol --------------------------------------------------------------------------
    def rotation(self, layer: int, part: Part) -> np.ndarray | None:
        """``R`` of ``layer``'s ``key``/``value`` stream (the body rotates q/k and folds v with it)."""
        return stream_rotation(self.scheme, layer, part, self.geometry.head_dim)

    def begin(self, b: GraphBuilder, *, attention_mask: ir.Value, spec: DecoderSpec) -> GQACall:
        """Declare the past buffers; compute GQA's length inputs and the left/right realignment."""
        hp, compute = DType.get(self.scheme.hp_dtype).ir, ir.DataType(spec.dtype)
        if any(plan.bits is None for plan in self.plans) and hp != compute:
            logger.warning("ort-gqa: unquantized %s cache with %s compute; ONNX Runtime's CPU GroupQueryAttention "
                           "has no float16 kernel, so on CPU it casts the whole buffer to float32 and back every "
                           "step (use hp_dtype fp32 for a copy-free CPU baseline)", hp.name, compute.name)
        shape = NodeShape(spec.facts, self.geometry.head_dim, self.kv_row, spec.dtype)
        return begin_call(b, spec, self.declare_past(b), attention_mask, shape,
                          fused_rotary=self.attention is AttentionForm.PROJECTED,
                          exact_switch=self.fast_prefill and any(plan.bits is not None for plan in self.plans))

    def attend(self, b: GraphBuilder, layer: int, inputs: AttentionInputs[GQACall]) -> ir.Value:
        """One GroupQueryAttention over the shared buffers, in any :class:`AttentionForm`.

        ``projected`` (q/k/v before RoPE, or packed; the node applies RoPE) and ``packed`` (q|k|v with the body's
        RoPE) -> [B, t, Hq * D]: the node takes GQA's packed query, one realignment moves all three, and the packed
        value is the probe. ``heads`` (q [B,Hq,t,D], k/v [B,Hkv,t,D] with RoPE applied) -> [B,Hq,t,D]: the body
        hands it only where it rotates values in the graph (an architecture whose weights cannot absorb the
        rotation).
        """
        call, rotary = inputs.call, inputs.form is AttentionForm.PROJECTED
        if inputs.packed is not None:
            name_packed_probe(b, layer, inputs.packed, projected=rotary)
            with b.scope(f"gqa{layer}"):
                return self._gqa(b, call, layer, inputs.packed, None, None, rotary=rotary)
        q, k, v = inputs.qkv
        name_probes(b, layer, q, k, v, projected=rotary)
        if rotary:
            with b.scope(f"gqa{layer}"):
                return self._gqa(b, call, layer, q, k, v, rotary=True)
        f = call.spec.facts
        with b.scope(f"gqa{layer}"):
            flat = [b.op("Reshape", b.op("Transpose", x, perm=[0, 2, 1, 3]), b.const([0, 0, heads * f.head_dim]))
                    for x, heads in ((q, f.num_heads), (k, f.num_kv_heads), (v, f.num_kv_heads))]
            out = self._gqa(b, call, layer, b.op("Concat", *flat, axis=-1), None, None, rotary=False)
            out = b.op("Reshape", out, b.const([0, 0, f.num_heads, f.head_dim]))
            return b.op("Transpose", out, perm=[0, 2, 1, 3])

    # -- pieces --------------------------------------------------------------------------------------------
    def _gqa(self, b: GraphBuilder, call: GQACall, layer: int, q: ir.Value, k: ir.Value | None, v: ir.Value | None, *,
             rotary: bool) -> ir.Value:
        """Realign to right padding, run the node on the shared buffers, realign back (k = v = None: packed q).

        A quantized layer runs it under an ``If`` on :attr:`exact`: a prompt or a chunk attends exactly over its
        own tokens and the held codes and writes its codes once (:meth:`_exact`), a decode step runs the
        quantized node on the buffers. With high channels the node's widened row (:meth:`_widen`) is made in the
        step branch only: an exact call attends over the exact projections and computes the stored nibbles from
        them directly (:meth:`_high_nibbles`).
        """
        plan = self.plans[layer]
        scales: tuple[ir.Value | None, ir.Value | None] = (None, None)
        if plan.bits is not None:
            scales = tuple(b.initializer(static_name(layer, part, "scales"), array)
                           for part, array in zip(PARTS, (plan.k_scale, plan.v_scale)))
        offset = self._value_offset(b, call, layer)
        high = plan.k_high is not None  # (the body's RoPE: q is the packed q|k|v)
        if high:
            width = (call.spec.facts.num_heads + 2 * call.spec.facts.num_kv_heads) * self.geometry.head_dim
            codes = {role: b.initializer(static_name(layer, "kv", f"high_channels.{role}"), array) for role, array
                     in plan.high_code_constants((width - 2 * self.kv_row, width - self.kv_row), width).items()}
        else:  # the node's input, offsets subtracted: both branches read it
            node_in = self._right(b, call, *self._offset_inputs(b, call, layer, q, k, v))

        def step() -> list[ir.Value]:
            inputs = self._right(b, call, widen(b, call.shape, layer, plan, q, codes), None, None) if high else node_in
            past = [call.past[self.layout.buffer_name("past", layer, part)] for part in PARTS]
            out, present_k, present_v = self._node(b, call, layer, *inputs, past, scales, rotary=rotary)
            if plan.v_high is not None:
                out = fold(b, call.shape, layer, out, plan.v_high)
            return [out if offset is None else b.op("Add", out, offset), present_k, present_v]

        def exact() -> list[ir.Value]:
            if high:
                return self._exact(b, call, layer, self._right(b, call, q, None, None), scales, None, rotary, codes)
            return self._exact(b, call, layer, node_in, scales, offset, rotary)

        if plan.bits is None or not self.fast_prefill:
            out, present_k, present_v = step()
        else:
            branches = {"then_branch": b.subgraph(f"gqa{layer}_exact", exact),
                        "else_branch": b.subgraph(f"gqa{layer}_step", step)}
            out, present_k, present_v = b.op_multi("If", call.exact, num_outputs=3, **branches)
        for part, value in zip(PARTS, (present_k, present_v)):
            call.present[self.layout.buffer_name("present", layer, part)] = value
        return b.op("Where", call.valid, b.op("GatherND", out, call.to_left, batch_dims=1), call.zero)

    def _right(self, b: GraphBuilder, call: GQACall, *values: ir.Value | None) -> tuple[ir.Value | None, ...]:
        """Each row's new tokens moved to the front (GQA's right padding)."""
        return tuple(None if x is None else b.op("GatherND", x, call.to_right, batch_dims=1) for x in values)

    def _node(self, b: GraphBuilder, call: GQACall, layer: int, q: ir.Value, k: ir.Value | None, v: ir.Value | None,
              past: list[ir.Value | None], scales: tuple[ir.Value | None, ir.Value | None], *,
              rotary: bool, query_seqlens: ir.Value | None = None, total: ir.Value | None = None) -> list[ir.Value]:
        """One GroupQueryAttention node: (output, present key, present value); no ``scales``: unquantized."""
        f, plan = call.spec.facts, self.plans[layer]
        attrs = {}
        if scales[0] is not None:
            attrs = {"k_quant_type": plan.k_quant, "v_quant_type": plan.v_quant, "kv_cache_bit_width": plan.bits}
        window = f.window(layer)
        cos, sin = call.tables[id(call.spec.rope_for(layer))] if rotary else (None, None)
        if call.spec.attn_softcap:
            attrs["softcap"] = float(call.spec.attn_softcap)
        return b.op_multi(
            "GroupQueryAttention", q, k, v, past[0], past[1], call.seqlens_k, call.total if total is None else total,
            cos, sin,
            None, None, None,  # position_ids (implied by query_seqlens), attention_bias, head_sink
            scales[0], scales[1],
            None, None,  # q_norm_weight, k_norm_weight
            call.query_seqlens if query_seqlens is None else query_seqlens,
            num_outputs=3, domain=CONTRIB_DOMAIN,
            num_heads=f.num_heads, kv_num_heads=f.num_kv_heads, scale=float(f.scaling),
            do_rotary=int(rotary), rotary_interleaved=0, local_window_size=int(window) if window else -1,
            **attrs,
        )

    def _value_offset(self, b: GraphBuilder, call: GQACall, layer: int) -> ir.Value | None:
        """What the attention output gets back for value offsets (None: no offset).

        sum_j a_j (v_j - c) + c = sum_j a_j v_j: each query head's kv head's offset c.
        """
        plan, f = self.plans[layer], call.spec.facts
        if plan.out_offset is None:
            return None
        per_query_head = np.repeat(plan.out_offset.reshape(f.num_kv_heads, -1), f.kv_groups, 0)
        return self._offset(b, call, layer, "value.output", per_query_head.reshape(-1))

    def _exact(self, b: GraphBuilder, call: GQACall, layer: int, node_in: tuple[ir.Value | None, ...],
               scales: tuple[ir.Value | None, ir.Value | None], offset: ir.Value | None, rotary: bool,
               codes: dict[str, ir.Value] | None = None) -> list[ir.Value]:
        """An exact call's attention and buffers: the new tokens' exact K/V after the held codes, then their codes.

        An unquantized node attends over the held tokens' values (:meth:`_held`: the buffers up to the longest
        row, decoded once, where ONNX Runtime's quantized kernel dequantizes the cache for every query, several
        times slower at prompt length) and the new tokens' exact keys and values. The buffers get the codes the
        quantized node would have stored, at each row's new places (:meth:`_write`): :meth:`_quantize` of the
        keys and values it would have quantized (the unquantized node's present there: after its RoPE and the
        offsets), or with high channels (``codes``: their constants; ``node_in``: the exact packed projections)
        the nibbles of its widened rows (:meth:`_high_nibbles`).
        """
        plan = self.plans[layer]
        buffers = [call.past[self.layout.buffer_name("past", layer, part)] for part in PARTS]
        held = [self._held(b, call, layer, part, buffer) for part, buffer in zip(PARTS, buffers)]
        out, present_k, present_v = self._node(b, call, layer, *node_in, held, (None, None), rotary=rotary,
                                               query_seqlens=call.exact_seqlens, total=call.exact_total)
        if codes is not None:  # [B, t, 2, kv_heads, node head / 2] -> [2, B, kv_heads, t, ..]: key, value
            nibbles = high_nibbles(b, call.shape, layer, self.plans[layer], node_in[0], codes)
            both = b.op("Transpose", pack(b, nibbles), perm=[2, 0, 3, 1, 4])
            stored = [b.op("Squeeze", b.op("Gather", both, b.const([i]), axis=0), b.const([0])) for i in range(2)]
        else:
            out = out if offset is None else b.op("Add", out, offset)
            stored = [quantize(b, self._new_rows(b, call, x), scale, plan.bits, call.compute_type)
                      for x, scale in zip((present_k, present_v), scales)]
        return [out] + [self._write(b, call, buffer, x, plan.bits) for buffer, x in zip(buffers, stored)]

    def _held(self, b: GraphBuilder, call: GQACall, layer: int, part: Part, buffer: ir.Value) -> ir.Value:
        """The values one stream's buffer holds, up to the longest row: ``[B, kv_heads, held, head_dim]``.

        ``u * a + c`` of the stored numbers (:meth:`LayerPlan.stored_values`), with high channels plus each
        extra channel's lower nibble times its scale at its place (a ``[n, head_dim]`` MatMul per kv head).
        """
        plan, heads, head_dim = self.plans[layer], self.geometry.num_kv_heads, self.geometry.head_dim
        a, c, lower = plan.stored_values(part, heads, head_dim)
        codes = b.op("Slice", buffer, b.const([0]), call.held, b.const([2]))

        def const(role: str, array: np.ndarray) -> ir.Value:
            return b.initializer(static_name(layer, part, f"held_{role}"), array)

        u = b.op("Cast", codes, to=ir.DataType.FLOAT)
        if plan.bits == 4:  # two nibbles to a byte, low first -> [B, kv_heads, held, node head]
            u = unpack_fields(b, u, 4, head_dim + (0 if lower is None else lower.shape[1]))
        if lower is None:
            x = b.op("Mul", u, const("scale", a[:, None, :]))
        else:
            own = b.op("Slice", u, b.const([0]), b.const([head_dim]), b.const([3]))
            extra = b.op("Slice", u, b.const([head_dim]), b.const([2**62]), b.const([3]))
            x = b.op("Add", b.op("Mul", own, const("scale", a[:, None, :])),
                     b.op("MatMul", extra, const("lower", lower)))
        if np.any(c):
            x = b.op("Add", x, const("offset", c[:, None, :]))
        return x if call.compute_type == ir.DataType.FLOAT else b.op("Cast", x, to=call.compute_type)

    def _new_rows(self, b: GraphBuilder, call: GQACall, present: ir.Value) -> ir.Value:
        """The new tokens' rows of the exact node's ``present`` [B, kv_heads, held + t, D]: [B, kv_heads, t, D]."""
        return b.op("GatherND", present, call.new_rows, batch_dims=2)

    def _write(self, b: GraphBuilder, call: GQACall, buffer: ir.Value, codes: ir.Value, bits: int) -> ir.Value:
        """``buffer`` with ``codes`` [B, kv_heads, t, ..] written at each row's new places (zero bytes for padding).

        A padding token's place lies past its row's length (never read); zeros keep the buffer's bytes a function
        of the tokens alone.
        """
        zero = b.const(np.array(0, np.int8 if bits == 8 else np.uint8))
        return b.op("ScatterND", buffer, call.new_cells, b.op("Where", call.new_real, codes, zero))

    def _offset(self, b: GraphBuilder, call: GQACall, layer: int, what: str, array: np.ndarray) -> ir.Value:
        return b.initializer(static_name(layer, what, "offset"), array.astype(call.np_type))

    def _offset_inputs(self, b: GraphBuilder, call: GQACall, layer: int, q: ir.Value, k: ir.Value | None,
                       v: ir.Value | None) -> tuple[ir.Value, ir.Value | None, ir.Value | None]:
        """Subtract asymmetric streams' offsets from the new keys/values (k = v = None: from GQA's packed q)."""
        plan, f = self.plans[layer], call.spec.facts
        if plan.k_offset is None and plan.v_offset is None:
            return q, k, v
        if k is None:  # packed q | k | v: one offset over the whole row
            whole = np.concatenate([np.zeros(f.num_heads * f.head_dim, np.float32),
                                    *plan.stream_offsets(f.num_kv_heads * f.head_dim)])
            return b.op("Sub", q, self._offset(b, call, layer, "packed", whole)), None, None
        k, v = (x if o is None else b.op("Sub", x, self._offset(b, call, layer, part, o))
                for x, o, part in zip((k, v), (plan.k_offset, plan.v_offset), PARTS))
        return q, k, v


class GQABodyRopeCacheGraph(GQACacheGraph):
    """:class:`GQACacheGraph` with RoPE in the decoder body: the node gets q|k|v packed, RoPE applied (``do_rotary=0``).

    Rotated keys, keys with zero points and high channels are transformed after RoPE, so RoPE cannot run in the
    node for them (:func:`rope_in_body`; :meth:`GQACacheGraph.for_model` picks this class then).
    """

    attention = AttentionForm.PACKED
