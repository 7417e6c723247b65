"""``--flavor ort-gqa``: ONNX Runtime's fused ``com.microsoft.GroupQueryAttention`` over a shared cache buffer.

Each layer's attention is one GroupQueryAttention (GQA) node that reads the cache in place: int8/int4
codes with static float32 scales (``ort-int8``/``ort-int4``/``ort-int4-asymk`` and any static int8/int4
scheme, symmetric or with zero points), or an
unquantized fp16/fp32 buffer (``fp16``: the like-for-like baseline). RoPE is fused into the node
(``do_rotary`` with cos/sin tables of ``max_position_embeddings`` rows), and the cache is the ``buffer``
layout of :mod:`kvq_export.cache_layout`: one ``[batch, kv_heads, capacity, packed head_dim]`` tensor per
stream, row ``b``'s tokens at ``[0, seq_lengths[b])``. The runtime binds the same buffer as ``past.*``
input and ``present.*`` output, so the kernel appends in place and no step copies the cache.

What GQA does on ONNX Runtime 1.32 CPU (measured, see ``tests/test_gqa_flavor.py``):

* **Quantized cache**: ``T_CACHE`` is ``int8`` for ``kv_cache_bit_width=8`` (signed ``q``; a uint8 cache is
  rejected) and ``uint8`` for 4 bits (two codes per byte, low nibble first, each ``q + 8``). Codes are
  ``clip(round_half_even(x / scale), -2^(b-1), 2^(b-1) - 1)``: the same rounding as kvq's codec, but the
  negative end is ``-128``/``-8`` where kvq clamps to ``-127``/``-7`` (only reached by values beyond the
  calibrated range). Scales: float32 ``[1]`` (``PER_TENSOR``) or ``[1, kv_heads, 1, head_dim]``
  (``PER_CHANNEL``); kvq's per-(head, channel) static scales map to ``PER_CHANNEL`` exactly, per-head or
  per-group token-axis static scales by repeating them along head_dim, and a stream whose scales are all
  equal maps to ``PER_TENSOR`` (the CPU kernel needs ``k_quant_type == v_quant_type``, so a layer with one
  ``PER_TENSOR`` and one ``PER_CHANNEL`` stream uses ``PER_CHANNEL`` for both). A decode step's new tokens
  are quantized *before* attention (like kvq's reference cache with no high-precision window), from the
  compute-dtype values: kvq's reference rounds them to ``hp_dtype`` (fp16) first, so with the fp16 presets
  about 0.02-3% of codes differ by one (with ``hp_dtype=fp32`` they are identical). fp8 caches are not
  implemented on CPU.
* **Prefill and chunks**: the quantized kernel dequantizes the cache for every query, so a prompt attending
  over codes runs 3-5x slower than over an unquantized buffer (one node, 9 query and 3 kv heads of 64, two
  threads: int8 3.1x / 3.7x, int4 3.6x / 4.7x at 512 / 2048 tokens; the quantization itself is cheap). So a
  quantized layer runs its node under an ``If`` on the *exact* condition: a call of more than one new token (a
  prompt, or a chunk of one after earlier chunks), or any call into empty caches (``t > 1 or
  max(past.seq_lengths) == 0``). Then the buffers are decoded once up to the longest row (the values the node
  would read back; with high channels kvq's values, offsets included) and an unquantized node attends over
  them followed by the new tokens' exact keys and values (after its RoPE and the offsets below; with high
  channels, over the body's exact projections). The graph writes the new tokens' codes once, at each row's
  new places (ScatterElements into the buffers): ``clip(round_half_even(x / scale), ..)`` of what the
  quantized node would have quantized (its present: the rotated keys, the offset values), packed to the node's
  bytes (:meth:`GQACacheGraph._quantize`). With high channels the node's widened rows are never made at prompt
  length: the nibbles it would store are computed from the exact keys and values directly
  (:meth:`GQACacheGraph._high_nibbles`), the same bytes. A decode step (one new token after a past) runs the
  quantized node on the shared buffers, in place. **The rule**: a call's new tokens see each other's exact
  K/V and the codes of every earlier call (as a high-precision window of the call's length would); a decode
  step sees codes only, its own token's included. The codes are the node's: the same K/V give the same bytes
  (bit for bit, checked per scheme), but the K/V of layer ``l > 0`` follow from the exact attention below
  (kvq's reference cache with ``exact_prefill`` follows the same rule). The branch is chosen per call, so a
  row given one new token after a past in a call where another row gets several attends over its own exact
  token, not its code, and gives other logits than alone (by its own token's rounding; onnxruntime-genai and
  kvq's loop never mix the two: a batch's rows prefill together, then step one token each).
  ``fast_prefill=False`` keeps the quantized node on every call.
* **Padding**: the kernel takes *right*-padded chunks through ``query_seqlens`` (ragged batched prefill and
  multi-token steps work, and an idle row has ``query_seqlens = 0``); positions follow from
  ``seqlens_k + 1 - query_seqlens``. kvq's inputs are *left*-padded, so the graph moves each row's tokens
  (contiguous, starting at the mask's first 1) to the front (GatherND) before the node and back after it;
  padding rows get zeros (the node leaves whatever was in memory at positions past ``query_seqlens``, so the
  zeroing is needed even for single-token steps, where an idle row of a batch is the only padding). The
  decoder body hands the node the fused q|k|v projection whole (GQA's packed query) unless something sits
  between projection and attention (q/k norms, an in-graph value rotation), so one GatherND realigns all
  three, and q, k and v are not split out at all. When RoPE runs in the body (below) it runs on the packed
  projection too (:meth:`~kvq_export.export.decoder._Body.apply_packed_rope`: no per-head transposes, no
  Split), and the node still gets one packed input. So left-padded batches are fully supported and a batched
  prompt gives what it gives alone; right-padded rows (onnxruntime-genai's prompts, see
  :mod:`kvq_export.flavors.ort_gqa.genai`) work too, and onnxruntime-genai's variant of the graph, whose rows are
  never left-padded, bypasses the realignment (its values are named for that).
* ``seqlens_k = max(seq_lengths + new - 1, 0)`` (int32), ``total_sequence_length = max(longest row, t)``,
  ``query_seqlens = new tokens per row``, all computed in-graph from ``past.seq_lengths`` and the mask.
* **Buffer sharing**: when ``past_key`` and ``present_key`` are the same memory (IO binding), the kernel
  writes the new tokens in place; otherwise it returns a copy of ``max(capacity, longest row)`` positions.
  A step needs ``max(seq_lengths) + t <= capacity`` (:class:`~kvq_export.runtime.session.KVQSession` grows
  the buffer by doubling when it would overflow, and never beyond the rotary table's rows).
* **fp16 buffers on CPU**: ONNX Runtime 1.32's CPU GroupQueryAttention has no float16 kernel; with an
  unquantized fp16 buffer it inserts Casts around the node (``InsertedPrecisionFreeCast_past.*``), so every
  step converts the whole buffer to float32 and back (measured on SmolLM2 at 8192 tokens: Cast is half of
  the step). The export warns; the copy-free CPU baseline is an fp32 buffer (``hp_dtype="fp32"``,
  ``tools/schemes/fp32-cache.json``). int8/int4 buffers are read natively.
* **Sliding windows**: ``local_window_size = sliding_window`` gives exactly Hugging Face Mistral's window
  (checked past the window in the tests; ``sliding_window - 1`` would drop one key).
* **Asymmetric codes** (static ``int`` with zero points, e.g. ``ort-int4-asymk``): the node only stores
  symmetric codes, so the graph subtracts a per-(head, channel) offset ``c = zero_point + 2^(b-1) * scale``
  from each new key/value before the node and the node quantizes ``x - c`` symmetrically: its codes are
  exactly kvq's unsigned ``int`` codes minus ``2^(b-1)``, the same bytes the ``buffer`` layout documents.
  Nothing is added back for keys: ``q·(k - c) = q·k - q·c`` moves every score of a query by the same amount,
  which softmax ignores, so the offset must be taken *after* RoPE (keys with a zero point run RoPE in the
  body, ``do_rotary=0``). Values get ``c`` added to the node's output (the attention weights sum to one).
  Static per-channel keys have channels whose range sits far from zero (SmolLM2: ``ort-int4`` +12.6% on
  protocol P, keys with zero points +5.4%), which a symmetric scale pays for with half its levels.
* **High channels** (``high_channels = n`` on static int4 streams, e.g. ``ort-int4-hc16``): the node has one
  bit width, so each of the n 8-bit channels per kv head travels as two nibbles of a node head of
  ``head_dim + n`` channels (:class:`HighSplit`): the graph computes kvq's 8-bit code ``c`` of the channel (the
  codec's arithmetic), and the node stores its upper nibble in the channel's own place (node scale 16x the
  channel's) and its lower nibble in an extra channel (the channel's scale). The queries' extra channels
  repeat the query at the kv head's high key channels, so each score reads ``q_c * (c - 136) * scale``: kvq's
  key up to a per-channel constant, which softmax ignores; each value's extra output channel is folded back
  onto its channel and the constant added back (as for zero points). The bytes are exactly kvq's (``n +
  (head_dim - n) / 2`` per token and head), the codes bit-exact with the reference cache. Keys and values of
  a layer need the same n (one head size per node), ``head_dim + n`` a multiple of 8 (ONNX Runtime), and
  RoPE runs in the body (the node would rotate the widened head). Speed: the wider head costs the node its
  width (one node, 8192 cached tokens, int4, one thread: head 80 1.2x head 64), but ONNX Runtime 1.32's CPU
  kernel takes a slow path for head sizes that are not a multiple of 16 (head 72: 2.0x, head 88: 2.1x), so
  with head_dim 64 prefer n = 16 or 32.
* **Not supported** (refused at export with the reason): dynamic scales, fp8, 2 bits,
  high-precision windows (``residual_length``/``sink_tokens``), a layer whose key and value differ in
  quantized/bit width (one cache type and ``kv_cache_bit_width`` per node).
* **Probes**: with fused RoPE the post-RoPE q/k never exist as graph values, so the graph names the raw
  projections (the packed ``probe.<layer>.qkv.projected``, or ``probe.<layer>.<q|key|value>.projected`` where
  q/k norms split them) and a validator applies the graph's own rotary tables to them
  (:mod:`kvq_export.validate.probe`); computing RoPE, or even a Split, in the graph just for probes would run
  on every step, since ONNX Runtime executes dead branches. With RoPE in the body
  (:class:`GQABodyRopeCacheGraph`) it runs on the packed q|k|v, the node gets ``do_rotary=0`` and the graph
  names that packed value (``probe.<layer>.qkv``), which the validator splits.
* **Rotation** (``rotation`` of a scheme stream): rotated keys must be rotated *after* RoPE, which the node
  cannot do when it applies RoPE itself, so a scheme with any rotated (or offset) key stream is exported with
  RoPE in the body (:class:`GQABodyRopeCacheGraph`: RoPE and the q/k rotation run in the body; the node gets
  ``do_rotary=0``). A value rotation is folded into ``v_proj``/``o_proj`` by the body and keeps the fused RoPE.
  Static scales are calibrated in the rotated basis, so the node's buffer holds rotated codes.
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
    """:class:`~kvq_export.export.decoder.CacheGraph` built on ``com.microsoft.GroupQueryAttention``.

    Args:
        scheme: the cache description (see :func:`unsupported` for what GQA can hold).
        geometry: the model's cache geometry.
        static: calibrated static scales ``{layer: {"key"|"value": {"scales": [H, n]}}}``.
        fuse_body: ask the decoder body for ONNX Runtime's fused nodes (default): one MatMul for q/k/v and
            one for gate/up, RMSNorm as ``RMSNormalization`` and residual + norm as
            ``com.microsoft.SkipSimplifiedLayerNormalization`` (see :class:`kvq_export.export.decoder._Body`).
            The graph needs ONNX Runtime anyway; False gives the portable body of the reference flavour.
        fast_prefill: a quantized layer attends exactly over a prompt's or chunk's own tokens and writes their
            codes once (default; see the module notes); False runs the quantized node on every call.
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
                          fused_rotary=self.attention is AttentionForm.PROJECTED)

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
        shape = b.op("Shape", present)
        t = b.op("Gather", b.op("Shape", call.new_places), b.const([2]), axis=0)
        wide = b.op("Concat", b.op("Slice", shape, b.const([0]), b.const([2])), t,
                    b.op("Slice", shape, b.const([3]), b.const([4])), axis=0)
        return b.op("GatherElements", present, b.op("Expand", call.new_places, wide), axis=2)

    def _write(self, b: GraphBuilder, call: GQACall, buffer: ir.Value, codes: ir.Value, bits: int) -> ir.Value:
        """``buffer`` with ``codes`` [B, kv_heads, t, ..] written at each row's new places (zero bytes for padding).

        A padding token's place lies past its row's length (never read); zeros keep the buffer's bytes a function
        of the tokens alone.
        """
        zero = b.const(np.array(0, np.int8 if bits == 8 else np.uint8))
        codes = b.op("Where", call.new_real, codes, zero)
        return b.op("ScatterElements", buffer, b.op("Expand", call.new_places, b.op("Shape", codes)), codes, axis=2)

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
