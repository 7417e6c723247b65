"""The decoder body, written straight from the weights: embedding, layers, final norm, lm_head.

:func:`build_decoder` takes a causal LM (or its state dict and config), its :class:`~kvq_export.arch.Arch` and a
:class:`~kvq_export.flavors.cache_graph.CacheGraph`, and returns the decoder as an ``onnx_ir.Model``::

    model_ir = build_decoder(model, get_arch(model.config), MyCache(...), dtype="fp32")
    save(model_ir, "out/model.onnx")

Graph inputs: ``input_ids`` and ``attention_mask`` (int64 [batch, seq]; the mask is 1 for real tokens and 0 for
left padding of this call's new tokens), then whatever the cache graph declares. Graph outputs: ``logits``
(float32 [batch, seq, vocab]), then the cache graph's outputs.

The KV cache is not part of the body: each layer's attention is one :meth:`CacheGraph.attend` call, in the
:class:`~kvq_export.flavors.cache_graph.AttentionForm` the cache graph declares, with keys and values in the
basis its ``rotation`` asks for. The logits follow transformers' eager code. A dtype, an opset or an attention
soft-cap the cache graph cannot take is refused with an :class:`~kvq_export.errors.ExportError` before anything
is built.

Why the body is built this way (numerics, the fused body, packed RoPE, rotated caches):
docs/design/decoder.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from kvq_export.arch import GELU_TANH_ACTIVATIONS, Arch, LinearNames, QkNorm, get_arch
from kvq_export.dtypes import COMPUTE_DTYPES, DType
from kvq_export.errors import ExportError
from kvq_export.flavors.cache_graph import AttentionForm, AttentionInputs, CacheGraph, CallValues
from kvq_export.graph.builder import CONTRIB_DOMAIN, GraphBuilder
from kvq_export.graph.decoder_spec import DecoderSpec
from kvq_export.graph.projections import Projections, ProjectionSpec, StateWeights, block_diag
from kvq_export.graph.rope import RotaryGraph
from kvq_export.model_facts import ModelFacts
from kvq_export.request import MIN_OPSET
from kvq_export.vocab import Part

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

#: ONNX Gelu (with ``approximate="tanh"``) needs opset 20.
GELU_OPSET = 20
#: ONNX RMSNormalization (the fused body's norm) needs opset 23.
RMS_NORM_OPSET = 23


def build_decoder(
    source: PreTrainedModel | tuple[Mapping[str, Any], PretrainedConfig],
    arch: Arch | None,
    cache: CacheGraph,
    *,
    dtype: str = "fp32",
    opset: int = 23,
    facts: ModelFacts | None = None,
) -> ir.Model:
    """Build the decoder graph of ``source`` (a HF causal LM, or ``(state_dict, config)``) around ``cache``.

    ``arch`` defaults to ``get_arch(config)`` and ``facts`` to the facts it reads (an export passes the ones its
    manifest records). The state dict may hold torch tensors or numpy arrays in any float dtype; they are cast to
    ``dtype`` (``"fp32"`` or ``"fp16"``).
    """
    state, config = _split_source(source)
    arch = arch if arch is not None else get_arch(config)
    facts = facts if facts is not None else ModelFacts.from_config(config, arch)
    _check_request(facts, arch, cache, dtype, opset)
    start = time.perf_counter()
    compute = DType.get(dtype).ir
    spec = DecoderSpec.of(facts, arch, compute)
    b = GraphBuilder(opset=opset, name=f"kvq_{facts.model_type}")
    body = _Body(b, arch, spec, StateWeights(state, compute, facts.model_type), fused=cache.fuses_body)

    input_ids = b.input("input_ids", ir.DataType.INT64, ["batch", "seq"])
    attention_mask = b.input("attention_mask", ir.DataType.INT64, ["batch", "seq"])
    with b.scope("cache"):
        call = cache.begin(b, attention_mask=attention_mask, spec=spec)
    body.form = attention_form(cache, body, facts.num_layers)
    if body.form is not AttentionForm.PROJECTED:
        with b.scope("rope"):
            for rope in dict.fromkeys(spec.rope_for(i) for i in range(facts.num_layers)):
                if body.form is AttentionForm.PACKED:
                    body.rope.add_packed_tables(call.positions, rope)
                else:
                    body.rope.add_tables(call.positions, rope)

    with b.scope("embed"):
        hidden, embed = body.embed(input_ids)
    pending = None  # each layer leaves its last residual add to the next norm (fused: one node for both)
    for layer in range(facts.num_layers):
        with b.scope(f"layers.{layer}"):
            hidden, pending = body.layer(layer, hidden, pending, cache, call)
    with b.scope("head"):
        logits = body.head(hidden, pending, embed)
    b.output(logits, "logits", ir.DataType.FLOAT, ["batch", "seq", facts.vocab_size])
    with b.scope("cache"):
        cache.end(b, call)

    model = b.build(metadata={"kvq.model_type": facts.model_type, "kvq.dtype": dtype})
    logger.info("built %s decoder body: %d layers, %s, %d nodes in %.2f s", facts.model_type, facts.num_layers,
                dtype, len(model.graph), time.perf_counter() - start)
    return model


def _check_request(facts: ModelFacts, arch: Arch, cache: CacheGraph, dtype: str, opset: int) -> None:
    """Refuse a dtype, an opset or an attention soft-cap the decoder cannot build (before anything is built)."""
    if dtype not in COMPUTE_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; expected one of {', '.join(COMPUTE_DTYPES)}")
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} is too old; the decoder needs opset >= {MIN_OPSET}")
    if arch.attn_logit_softcap and not cache.supports_attn_softcap:
        raise ExportError(
            f"{facts.model_type} soft-caps its attention scores (attn_logit_softcapping={arch.attn_logit_softcap}), "
            f"which the {type(cache).__name__} attention does not implement"
        )


def attention_form(cache: CacheGraph, body: _Body, num_layers: int) -> AttentionForm:
    """The form the body hands ``cache`` q/k/v in: the one it declares, or ``heads`` in place of ``packed``.

    ``heads`` where a layer rotates values in the graph: the packed form has no place for that rotation.
    """
    if cache.attention is AttentionForm.PACKED and any(
            body.value_rotation_in_graph(cache, layer) is not None for layer in range(num_layers)):
        return AttentionForm.HEADS
    return cache.attention


def _split_source(source: Any) -> tuple[Mapping[str, Any], Any]:
    if isinstance(source, tuple):
        if len(source) != 2:
            raise ExportError("a model source tuple must be (state_dict, config)")
        return source[0], source[1]
    if hasattr(source, "state_dict") and hasattr(source, "config"):
        return source.state_dict(), source.config
    raise ExportError(
        f"cannot build a decoder from {type(source).__name__}; pass a transformers causal LM "
        "or a (state_dict, config) pair"
    )


class _Body:
    """Emits the pieces of the decoder body into one :class:`GraphBuilder`.

    ``fused`` (a cache graph with ``fuses_body = True``, i.e. one that runs on ONNX Runtime anyway) asks for
    fewer, larger nodes with the same arithmetic up to float reassociation:

    * projections that read the same input are one MatMul over their concatenated ``[in, sum(out)]`` weights
      (folded value rotation and biases included), then a Split: q/k/v, and gate/up;
    * with an fp32 body, every RMSNorm is one ONNX ``RMSNormalization`` (opset 23; the scale is the float32
      ``norm_offset + w``, so Gemma's ``1 + w`` is exact), and a residual add followed by a norm is one
      ``com.microsoft.SkipSimplifiedLayerNormalization`` that returns both the norm and the sum. An fp16 body
      keeps the primitive ops: transformers rounds the normalized value to fp16 before the Llama-style weight
      multiply, which a fused kernel (one rounding) does not reproduce;
    * a tied lm_head is a MatMul on the embedding's Transpose, which ONNX Runtime folds into a constant at load.
    """

    def __init__(self, b: GraphBuilder, arch: Arch, spec: DecoderSpec, weights: StateWeights, *,
                 fused: bool = False) -> None:
        self.b = b
        self.arch = arch
        self.spec, self.facts = spec, spec.facts
        self.weights = weights
        self.dtype = spec.dtype
        self.fuse_norms = fused and self.dtype == ir.DataType.FLOAT
        if self.fuse_norms and b.opset < RMS_NORM_OPSET:
            raise ExportError(f"the fused body's RMSNormalization needs opset >= {RMS_NORM_OPSET} (got {b.opset})")
        self.proj = Projections(b, weights, fused=fused)
        self.rope = RotaryGraph(b, spec.facts, from_float=self.from_float)
        #: the form attention takes q/k/v in (:func:`attention_form`, set by :func:`build_decoder`)
        self.form = AttentionForm.HEADS
        self._rotations: dict[bytes, ir.Value] = {}  # one float32 initializer per distinct R

    # --------------------------------------------------------------------------------- building blocks
    def to_float(self, x: ir.Value) -> ir.Value:
        """Cast a compute-dtype value to float32; no node for an fp32 body."""
        return x if self.dtype == ir.DataType.FLOAT else self.b.op("Cast", x, to=ir.DataType.FLOAT)

    def from_float(self, x: ir.Value) -> ir.Value:
        """Cast a float32 value to the compute dtype; no node for an fp32 body."""
        return x if self.dtype == ir.DataType.FLOAT else self.b.op("Cast", x, to=self.dtype)

    def rms_norm(self, x: ir.Value, weight_name: str, width: int | None = None) -> ir.Value:
        """HF RMSNorm over the last axis (``width``, default hidden_size): in float32, x / sqrt(mean(x^2) + eps).

        Llama style: cast back, then times the weight. ``Arch.norm_weight_in_float``: times the float32
        weight (plus ``Arch.norm_offset``: Gemma's ``1 + w``), then cast back.
        """
        b, arch = self.b, self.arch
        width = self.facts.hidden_size if width is None else width
        if self.fuse_norms:
            return b.op("RMSNormalization", x, self.norm_scale(weight_name, width), axis=-1,
                        epsilon=float(arch.rms_norm_eps), stash_type=1)
        xf = self.to_float(x)
        variance = b.op("ReduceMean", b.op("Mul", xf, xf), b.const([-1]), keepdims=1)
        inv_rms = b.op("Reciprocal", b.op("Sqrt", b.op("Add", variance, b.const(arch.rms_norm_eps))))
        normed = b.op("Mul", xf, inv_rms)
        if not arch.norm_weight_in_float and not arch.norm_offset:
            weight = self.weights.initializer(b, weight_name, (width,))
            return b.op("Mul", weight, self.from_float(normed))
        weight = b.initializer(weight_name, self.weights.array(weight_name, (width,), dtype=np.float32))
        if arch.norm_offset:  # 1 + w in float32, exactly as transformers computes it
            weight = b.op("Add", weight, b.const(np.float32(arch.norm_offset)))
        if arch.norm_weight_in_float:
            return self.from_float(b.op("Mul", normed, weight))
        return b.op("Mul", self.from_float(weight), self.from_float(normed))

    def norm_scale(self, weight_name: str, width: int) -> ir.Value:
        """The float32 scale of a fused RMSNorm: ``w``, or ``norm_offset + w`` in float32 (as transformers)."""
        weight = self.weights.array(weight_name, (width,), dtype=np.float32)
        if not self.arch.norm_offset:
            return self.b.initializer(weight_name, weight)
        scale = np.float32(self.arch.norm_offset) + weight
        return self.b.initializer(f"{weight_name}+{self.arch.norm_offset:g}", scale)

    def add_norm(self, hidden: ir.Value, delta: ir.Value | None,
                 weight_name: str | None) -> tuple[ir.Value, ir.Value]:
        """``hidden += delta`` (when given), then the RMSNorm ``weight_name`` of it: returns ``(normed, hidden)``.

        A fused fp32 body does both in one SkipSimplifiedLayerNormalization; no norm returns the sum twice.
        """
        b = self.b
        if delta is None:
            return self.maybe_norm(hidden, weight_name), hidden
        if weight_name is None or not self.fuse_norms:
            hidden = b.op("Add", hidden, delta)
            return self.maybe_norm(hidden, weight_name), hidden
        normed, _, _, total = b.op_multi(
            "SkipSimplifiedLayerNormalization", hidden, delta, self.norm_scale(weight_name, self.facts.hidden_size),
            num_outputs=4, domain=CONTRIB_DOMAIN, epsilon=float(self.arch.rms_norm_eps))
        return normed, total

    def softcap(self, x: ir.Value, cap: float) -> ir.Value:
        """``cap * tanh(x / cap)`` in the dtype of ``x`` (Gemma2's soft-capping)."""
        b = self.b
        c = b.const(np.array(cap, dtype=self.weights.np_dtype))
        return b.op("Mul", b.op("Tanh", b.op("Div", x, c)), c)

    def rotate(self, x: ir.Value, matrix: np.ndarray, *, inverse: bool = False) -> ir.Value:
        """``x @ R`` (``x @ R.T`` with ``inverse``) over the last axis, as a float32 MatMul."""
        b = self.b
        r = np.ascontiguousarray(matrix.T if inverse else matrix, dtype=np.float32)
        key = r.tobytes()
        if key not in self._rotations:
            self._rotations[key] = b.initializer(f"rotation.{len(self._rotations)}", r)
        return self.from_float(b.op("MatMul", self.to_float(x), self._rotations[key]))

    def apply_packed_rope(self, qkv: ir.Value, layer: int, key_rotation: np.ndarray | None) -> ir.Value:
        """RoPE on the q and k heads of a packed ``[B, t, (Hq + 2 Hkv) * D]`` projection, then the key rotation.

        RoPE runs on the flat row (:meth:`~kvq_export.graph.rope.RotaryGraph.apply_packed`: the same products and
        sums as the per-head form, no reshapes). A key rotation ``R`` then multiplies each q and k head (a float32
        MatMul per head, the identity on the value heads).
        """
        b, f = self.b, self.facts
        x = self.rope.apply_packed(qkv, self.spec.rope_for(layer))
        if key_rotation is not None:
            heads, d = f.num_heads + 2 * f.num_kv_heads, f.head_dim
            per_head = np.stack([key_rotation] * (f.num_heads + f.num_kv_heads) + [np.eye(d)] * f.num_kv_heads)
            x = b.op("Reshape", self.rotate(b.op("Reshape", x, b.const([0, 0, heads, 1, d])), per_head),
                     b.const([0, 0, heads * d]))
        return x

    def projections(self, x: ir.Value, layer: int, parts: list[ProjectionSpec], *,
                    split: bool = True) -> tuple[list[ir.Value] | None, ir.Value | None]:
        """q, k, v of the normed input ``x`` (q/k normed where the family norms them), and the packed q|k|v.

        The packed value (fused body, nothing between projection and attention) is None otherwise. ``split=False``:
        a fused body without q/k norms returns the packed value alone (None for the parts: no Split node).
        """
        f, names = self.facts, self.arch.layer_names(layer)
        norms = self.arch.qk_norm is not None and (names.q_norm or names.k_norm)
        if self.proj.fused and not norms and not split:
            return None, self.proj.fused_projection(x, f.hidden_size, parts)
        (q, k, v), packed = self.proj.linears(x, f.hidden_size, parts)
        if norms:
            packed = None
            q = self.qk_norm(q, names.q_norm, f.num_heads)
            k = self.qk_norm(k, names.k_norm, f.num_kv_heads)
        return [q, k, v], packed

    def qk_norm(self, x: ir.Value, weight_name: str | None, num_heads: int) -> ir.Value:
        """``Arch.qk_norm`` on a projection [B, t, H*D]: per head (over D) or over the whole projection."""
        mode, d = self.arch.qk_norm, self.facts.head_dim
        if mode is None or weight_name is None:
            return x
        if mode == QkNorm.PROJECTION:
            return self.rms_norm(x, weight_name, num_heads * d)
        b = self.b
        per_head = b.op("Reshape", x, b.const([0, 0, num_heads, d]))
        return b.op("Reshape", self.rms_norm(per_head, weight_name, d), b.const([0, 0, num_heads * d]))

    def mlp_activation(self, gate: ir.Value, up: ir.Value) -> ir.Value:
        """act(gate) * up: SiLU, or GELU with the tanh approximation (Gemma)."""
        b = self.b
        if self.arch.activation in GELU_TANH_ACTIVATIONS:
            if b.opset < GELU_OPSET:
                raise ExportError(f"{self.facts.model_type}: GELU needs opset >= {GELU_OPSET} (got {b.opset})")
            return b.op("Mul", b.op("Gelu", gate, approximate="tanh"), up)
        return b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)  # SiLU(gate) * up

    def heads(self, x: ir.Value, num_heads: int) -> ir.Value:
        """[B, t, H*D] -> [B, H, t, D]."""
        b = self.b
        x = b.op("Reshape", x, b.const([0, 0, num_heads, self.facts.head_dim]))
        return b.op("Transpose", x, perm=[0, 2, 1, 3])

    # ------------------------------------------------------------------------------------ the layer
    def maybe_norm(self, x: ir.Value, weight_name: str | None) -> ir.Value:
        """RMSNorm with ``weight_name``, or ``x`` itself where the family has no norm there."""
        return x if weight_name is None else self.rms_norm(x, weight_name)

    def embed(self, input_ids: ir.Value) -> tuple[ir.Value, ir.Value]:
        """The embedded tokens (scaled where the family scales them) and the embedding (a tied head reuses it)."""
        b, arch, f = self.b, self.arch, self.facts
        embed = self.weights.initializer(b, arch.embed_name(), (f.vocab_size, f.hidden_size))
        hidden = b.op("Gather", embed, input_ids)
        if arch.embedding_scale is not None:  # in the weights' dtype, like GemmaTextScaledWordEmbedding
            hidden = b.op("Mul", hidden, b.const(np.array(arch.embedding_scale, dtype=self.weights.np_dtype)))
        return hidden, embed

    def head(self, hidden: ir.Value, pending: ir.Value | None, embed: ir.Value) -> ir.Value:
        """The last residual add, the final norm and the lm_head: float32 logits (soft-capped where the family caps)."""
        hidden, _ = self.add_norm(hidden, pending, self.arch.final_norm_name())
        logits = self.lm_head(hidden, embed)
        if self.arch.final_logit_softcap is not None:
            logits = self.softcap(logits, self.arch.final_logit_softcap)
        return self.to_float(logits)

    def layer(self, layer: int, hidden: ir.Value, pending: ir.Value | None, cache: CacheGraph,
              call: CallValues) -> tuple[ir.Value, ir.Value | None]:
        """One decoder layer: attention and gated MLP, each with a residual (norms as ``LayerNames`` says).

        ``hidden + pending`` is the residual stream; the layer returns it the same way, and :meth:`add_norm`
        adds each residual where the next norm reads it (a fused fp32 body: inside that norm's
        SkipSimplifiedLayerNormalization).
        """
        b, arch, f = self.b, self.arch, self.facts
        names = arch.layer_names(layer)
        q_size = f.num_heads * f.head_dim
        value_rot = cache.rotation(layer, Part.VALUE)
        fold = value_rot is not None and self.value_rotation_in_graph(cache, layer) is None

        with b.scope("attn"):
            x, hidden = self.add_norm(hidden, pending, names.input_norm)
            attn = self.attention(x, layer, cache, call, value_rot if fold else None)  # [B, t, Hq * D]
            out = self.proj.linear(attn, names.o, q_size, f.hidden_size, rotate_in=value_rot if fold else None)
            delta = self.maybe_norm(out, names.attention_out_norm)

        with b.scope("mlp"):
            x, hidden = self.add_norm(hidden, delta, names.post_attention_norm)
            inter = arch.intermediate_size
            (gate, up), _ = self.proj.linears(x, f.hidden_size, [(names.gate, inter, None), (names.up, inter, None)])
            out = self.proj.linear(self.mlp_activation(gate, up), names.down, inter, f.hidden_size)
            delta = self.maybe_norm(out, names.mlp_out_norm)
        return hidden, delta

    def value_rotation_in_graph(self, cache: CacheGraph, layer: int) -> np.ndarray | None:
        """``layer``'s value rotation when the weights cannot absorb it (``Arch.folds_value_rotation`` False)."""
        value_rot = cache.rotation(layer, Part.VALUE)
        return value_rot if value_rot is not None and not self.arch.folds_value_rotation else None

    def attention(self, x: ir.Value, layer: int, cache: CacheGraph, call: CallValues,
                  folded_value_rotation: np.ndarray | None) -> ir.Value:
        """q/k/v projections of the normed input ``x``, RoPE where the body applies it, and ``cache``'s attention.

        Returns ``[B, t, Hq * D]`` for ``o_proj``. ``folded_value_rotation``: the value rotation folded into
        ``v_proj`` (``o_proj`` folds its inverse). The q/k/v go to the cache graph in :attr:`form`.
        """
        names, f = self.arch.layer_names(layer), self.facts
        q_size, kv_size = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
        parts = [(names.q, q_size, None), (names.k, kv_size, None), (names.v, kv_size, folded_value_rotation)]
        if self.form is AttentionForm.PACKED:
            separate, qkv = self.projections(x, layer, parts, split=False)
            qkv = qkv if separate is None else self.b.op("Concat", *separate, axis=-1)
            qkv = self.apply_packed_rope(qkv, layer, cache.rotation(layer, Part.KEY))
            return cache.attend(self.b, layer, AttentionInputs(AttentionForm.PACKED, call, packed=qkv))
        if self.form is AttentionForm.PROJECTED:
            return self.projected_attention(x, layer, cache, call, parts)
        return self.heads_attention(x, layer, cache, call, parts)

    def projected_attention(self, x: ir.Value, layer: int, cache: CacheGraph, call: CallValues,
                            parts: list[ProjectionSpec]) -> ir.Value:
        """Attention in the ``projected`` form: [B, t, H*D] in and out, the cache graph's kernel applies RoPE."""
        f = self.facts
        if cache.rotation(layer, Part.KEY) is not None:
            raise ExportError(f"layer {layer}: rotated keys need RoPE before the rotation, but this "
                              "cache graph applies RoPE itself (export it with the body's RoPE)")
        in_graph = self.value_rotation_in_graph(cache, layer)
        # packed [B, t, (Hq + 2 Hkv) * D] (fused body): q, k, v side by side, for a kernel that takes them so;
        # then the parts are not even split out (None)
        separate, packed = self.projections(x, layer, parts, split=in_graph is not None)
        q, k, v = separate or (None, None, None)
        if in_graph is not None:
            v, packed = self.rotate(v, block_diag(in_graph, f.num_kv_heads)), None
        inputs = (AttentionInputs(AttentionForm.PROJECTED, call, packed=packed) if packed is not None
                  else AttentionInputs(AttentionForm.PROJECTED, call, q, k, v))
        attn = cache.attend(self.b, layer, inputs)
        if in_graph is not None:
            attn = self.rotate(attn, block_diag(in_graph, f.num_heads), inverse=True)
        return attn

    def heads_attention(self, x: ir.Value, layer: int, cache: CacheGraph, call: CallValues,
                        parts: list[ProjectionSpec]) -> ir.Value:
        """Attention in the ``heads`` form: RoPE (and the rotations) on [B, H, t, D] heads, then back to [B, t, H*D]."""
        b, f = self.b, self.facts
        key_rot, in_graph = cache.rotation(layer, Part.KEY), self.value_rotation_in_graph(cache, layer)
        separate, _ = self.projections(x, layer, parts)
        q, k, v = separate or (None, None, None)
        q = self.rope.apply(self.heads(q, f.num_heads), self.spec.rope_for(layer))
        k = self.rope.apply(self.heads(k, f.num_kv_heads), self.spec.rope_for(layer))
        if key_rot is not None:
            q, k = self.rotate(q, key_rot), self.rotate(k, key_rot)
        v = self.heads(v, f.num_kv_heads)
        if in_graph is not None:
            v = self.rotate(v, in_graph)
        attn = cache.attend(b, layer, AttentionInputs(AttentionForm.HEADS, call, q, k, v))  # [B, Hq, t, D]
        if in_graph is not None:
            attn = self.rotate(attn, in_graph, inverse=True)
        return b.op("Reshape", b.op("Transpose", attn, perm=[0, 2, 1, 3]), b.const([0, 0, f.num_heads * f.head_dim]))

    def lm_head(self, hidden: ir.Value, embed: ir.Value) -> ir.Value:
        """Logits [B, t, V] in the compute dtype; a tied head reuses the embedding instead of a copy."""
        b, f = self.b, self.facts
        name = self.arch.lm_head_name()
        if name is not None:
            return self.proj.linear(hidden, LinearNames(name), f.hidden_size, f.vocab_size)
        if self.proj.fused:
            # ONNX Runtime folds the Transpose of the initializer into a [H, V] constant when it loads the graph
            # (the file holds the embedding once), and its MatMul runs faster than Gemm(transB=1) on it with the
            # same logits (docs/design/decoder.md)
            return b.op("MatMul", hidden, b.op("Transpose", embed, perm=[1, 0]))
        # Gemm reads the [V, H] embedding transposed in place; MatMul would need a [H, V] copy.
        flat = b.op("Reshape", hidden, b.const([-1, f.hidden_size]))
        logits = b.op("Gemm", flat, embed, transB=1)
        out_shape = b.op("Concat", b.op("Shape", hidden, end=2), b.const([f.vocab_size]), axis=0)
        return b.op("Reshape", logits, out_shape)
