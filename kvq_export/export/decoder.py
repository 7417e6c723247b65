"""The decoder body, written straight from the weights: embedding, layers, final norm, lm_head.

The KV cache is not part of the body. A :class:`CacheGraph` declares the past/present cache tensors
and computes attention; the body hands it rope-applied q/k/v per layer (or, to a cache graph with
``fuses_rotary = True`` such as a fused attention kernel, the raw projections through
:meth:`CacheGraph.attend_projected`; it applies RoPE itself from ``facts.rope``)::

    arch = get_arch(model.config)
    model_ir = build_decoder(model, arch, MyCache(...), dtype="fp32")
    save(model_ir, "out/model.onnx")

Graph inputs: ``input_ids`` and ``attention_mask`` (int64 [batch, seq]; the mask is 1 for real
tokens and 0 for left padding of this call's new tokens), then whatever the cache declares.
Graph outputs: ``logits`` (float32 [batch, seq, vocab]), then the cache's outputs.

Numerics follow transformers' eager code: RMSNorm and the rotary cos/sin tables are computed in
float32 whatever the body dtype, then cast (like ``LlamaRMSNorm`` / ``LlamaRotaryEmbedding``).
Linear weights are stored transposed ([in, out], so a plain MatMul applies them) under their
Hugging Face state-dict names (a slice of a fused projection adds its row range to the name);
a tied lm_head reuses the embedding through ``Gemm(transB=1)`` (the fused body: a MatMul on its Transpose).

A cache graph that runs on ONNX Runtime anyway (``fuses_body = True``: the ort-gqa flavour) gets a fused body
with the same arithmetic up to float reassociation: one MatMul for q/k/v (handed to the cache graph whole as
well, for a kernel that takes a packed q|k|v) and one for gate/up, and in fp32 bodies ``RMSNormalization`` and
``com.microsoft.SkipSimplifiedLayerNormalization`` for the norms (see :class:`_Body`). Other cache graphs get
the portable body of standard ONNX primitives.

A cache graph whose kernel reads q|k|v packed but needs RoPE applied before it (``attend_packed``: the ort-gqa
flavour with keys transformed after RoPE) gets RoPE on the packed projection in ``[B, t, H*D]`` form, with the
same products and sums as the per-head form (:meth:`_Body.apply_packed_rope`), and no per-head transposes:
decode steps of small models are dominated by per-node overhead, so that layout saves about 20 nodes a layer.

Family differences are the :class:`~kvq_export.export.arch.Arch` declarations (norm placement and
style, q/k norms, embedding scale, logit soft-capping, activation, per-layer RoPE). Soft-capping of
attention scores is the cache graph's job (it computes the scores): a cache graph that implements
``facts.attn_softcap`` says so with ``supports_attn_softcap = True``; others are refused for such models.

Rotated caches (``rotation`` of a scheme stream, :mod:`kvq_export.rotation`): a cache graph that stores a
layer's keys or values in a rotated basis says so through ``rotation(layer, part) -> R | None``, and the
body feeds it that basis, so every flavour's cache, kernel and probes see rotated tensors only:

* keys: q and k are multiplied by ``R`` (a float32 MatMul per layer) after RoPE, before the cache graph
  gets them; scores are unchanged in exact arithmetic. A cache graph that applies RoPE itself
  (``fuses_rotary``) cannot take rotated keys and is refused: it must let the body apply RoPE.
* values: the rotation is folded into the weights at export, at zero run-time cost: each kv head's block of
  ``v_proj`` output rows (and of its bias) becomes ``R.T @ W_v[block]`` (``v R`` comes out of the
  projection) and each query head's block of ``o_proj`` input columns becomes ``W_o[:, block] @ R`` (the
  rotated attention output is rotated back inside ``o_proj``), computed in float64 and cast. This holds
  whenever attention's output goes straight into ``o_proj`` and v straight from ``v_proj`` into the cache
  -- true of every registered architecture. An :class:`~kvq_export.export.arch.Arch` that puts something
  between them (a norm or gate on v or on the attention output) sets ``folds_value_rotation = False``;
  the body then rotates v and un-rotates the output with float32 MatMuls in the graph instead.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from kvq_export.dtypes import COMPUTE_DTYPES, DType
from kvq_export.errors import ExportError, ModelError
from kvq_export.export.arch import GELU_TANH_ACTIVATIONS, Arch, LinearNames, RopeSpec, get_arch
from kvq_export.export.builder import GraphBuilder

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from kvq_export.model_facts import ModelFacts
    from kvq_export.scheme import KVQuantScheme

logger = logging.getLogger(__name__)

#: ``dtype=`` names accepted by :func:`build_decoder`.
#: ReduceMean with axes as an input needs opset 18.
MIN_OPSET = 18
#: ONNX Gelu (with ``approximate="tanh"``) needs opset 20.
GELU_OPSET = 20
#: ONNX RMSNormalization (the fused body's norm) needs opset 23.
RMS_NORM_OPSET = 23
#: Domain of ONNX Runtime's contrib ops (SkipSimplifiedLayerNormalization).
CONTRIB_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class DecoderFacts:
    """What a cache graph needs to know about the decoder it serves.

    ``sliding_window`` is the window of the layers that have one (None if none does);
    ``layer_windows`` says per layer (empty = every layer uses ``sliding_window``). Ask
    :meth:`window` rather than reading either field.
    """

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: ir.DataType  # compute dtype of q/k/v and of the attention output
    sliding_window: int | None
    scaling: float  # applied to q.k before the softmax
    layer_windows: tuple[int | None, ...] = ()
    max_positions: int | None = None
    rope: RopeSpec | None = field(default=None, compare=False)  # set by build_decoder
    attn_softcap: float | None = None  # cap * tanh(scores / cap) on the scaled scores, before the mask
    layer_ropes: tuple[RopeSpec, ...] = field(default=(), compare=False)  # per layer; empty: ``rope`` everywhere

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} kv heads"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ModelError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer``: a query at position q sees keys at p with q - window < p <= q."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def rope_for(self, layer: int) -> RopeSpec | None:
        """The RoPE of ``layer`` (Gemma3's local layers have their own base)."""
        return self.layer_ropes[layer] if self.layer_ropes else self.rope

    @classmethod
    def from_arch(cls, arch: Arch, dtype: ir.DataType) -> DecoderFacts:
        """Read the facts of ``arch``'s config for a body computed in ``dtype``."""
        windows = tuple(arch.layer_window(i) for i in range(arch.num_layers))
        distinct = {w for w in windows if w is not None}
        if len(distinct) > 1:
            raise ExportError(f"{arch.model_type}: layers use different sliding windows {sorted(distinct)}")
        return cls(
            model_type=arch.model_type,
            num_layers=arch.num_layers,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            hidden_size=arch.hidden_size,
            vocab_size=arch.vocab_size,
            dtype=dtype,
            sliding_window=distinct.pop() if distinct else None,
            scaling=arch.scaling,
            layer_windows=windows,
            max_positions=arch.max_positions,
            attn_softcap=arch.attn_logit_softcap,
        )


class CacheGraph(ABC):
    """The KV-cache part of the graph: declares cache inputs/outputs and computes attention.

    Every flavour's cache graph subclasses it. What a cache graph can do is declared by the class-level flags
    below (a subclass, or an instance whose choice depends on the scheme, sets its own); the body reads the
    flags and never probes for methods. The optional hooks have base defaults: no rotation, and the fused
    attention entry points refuse unless the flag that selects them is set.
    """

    #: its attention applies RoPE itself and takes the raw projections through :meth:`attend_projected`
    #: (its :meth:`begin` may then return None: the body builds no cos/sin tables; RoPE comes from ``facts.rope``)
    fuses_rotary: bool = False
    #: its kernel reads rope-applied q|k|v packed in one value, through :meth:`attend_packed` (ONNX Runtime's
    #: packed GQA input; the body then applies RoPE on the packed projection, see :meth:`_Body.apply_packed_rope`)
    attends_packed: bool = False
    #: it runs on ONNX Runtime anyway, so the body may use ONNX Runtime's fused nodes (see :class:`_Body`)
    fuses_body: bool = False
    #: its attention applies ``facts.attn_softcap`` (Gemma2's attention soft-capping)
    supports_attn_softcap: bool = False

    @classmethod
    def unsupported(cls, scheme: KVQuantScheme, num_layers: int, head_dim: int | None = None) -> list[str]:
        """Why this cache graph cannot hold ``scheme`` (one line per reason; empty when it can)."""
        return []

    @classmethod
    def for_model(cls, scheme: KVQuantScheme, facts: ModelFacts, *,
                  static: Mapping[int, Mapping[str, Mapping[str, Any]]] | None = None) -> CacheGraph:
        """Build the cache graph for ``scheme`` on the model of ``facts`` (with calibrated ``static`` metadata)."""
        return cls(scheme, num_layers=facts.num_layers, kv_heads=facts.num_kv_heads, head_dim=facts.head_dim,
                   static=static)

    @abstractmethod
    def begin(self, b: GraphBuilder, *, attention_mask: ir.Value, facts: DecoderFacts) -> ir.Value | None:
        """Declare the past-cache graph inputs; return `positions` int64 [B, t] of the new tokens."""

    @abstractmethod
    def attend(self, b: GraphBuilder, layer: int, q: ir.Value, k: ir.Value, v: ir.Value) -> ir.Value:
        """Attend: q [B, Hq, t, D], k/v [B, Hkv, t, D] (rope applied, compute dtype) -> [B, Hq, t, D]."""

    @abstractmethod
    def end(self, b: GraphBuilder) -> None:
        """Declare the present-cache graph outputs."""

    def rotation(self, layer: int, part: str) -> np.ndarray | None:
        """``R`` [D, D] (float64) ``layer``'s ``key``/``value`` stream is stored in, or None when it is not rotated."""
        return None

    def attend_projected(self, b: GraphBuilder, layer: int, q: ir.Value | None, k: ir.Value | None,
                         v: ir.Value | None, *, packed: ir.Value | None = None) -> ir.Value:
        """Attend: q [B, t, Hq*D], k/v [B, t, Hkv*D] straight from the projections (no RoPE) -> [B, t, Hq*D].

        ``packed``, when given, is ``concat(q, k, v)`` along the last axis as one value (a fused projection's
        output); q/k/v are then None (the graph does not split them out) and the kernel reads ``packed``.
        Only called when :attr:`fuses_rotary` is set.
        """
        raise NotImplementedError(f"{type(self).__name__} does not fuse RoPE (fuses_rotary is False)")

    def attend_packed(self, b: GraphBuilder, layer: int, qkv: ir.Value) -> ir.Value:
        """Attend: ``qkv`` [B, t, (Hq + 2 Hkv) * D] with RoPE applied (compute dtype) -> [B, t, Hq * D].

        Only called when :attr:`attends_packed` is set.
        """
        raise NotImplementedError(f"{type(self).__name__} does not read a packed q|k|v (attends_packed is False)")


def cache_rotation(cache: CacheGraph, layer: int, part: str) -> np.ndarray | None:
    """The rotation ``cache`` stores ``layer``'s ``part`` stream in (None for a cache without rotations)."""
    return cache.rotation(layer, part)


def fuses_rotary(cache: CacheGraph) -> bool:
    """Whether ``cache`` takes the raw projections through ``attend_projected`` and applies RoPE itself."""
    return cache.fuses_rotary


def attends_packed(cache: CacheGraph) -> bool:
    """Whether ``cache`` takes rope-applied packed q|k|v through ``attend_packed`` (and not raw projections)."""
    return cache.attends_packed and not cache.fuses_rotary


def fuses_body(cache: CacheGraph) -> bool:
    """Whether ``cache``'s runtime takes ONNX Runtime's fused body (``fuses_body = True``; see :class:`_Body`)."""
    return cache.fuses_body


def build_decoder(
    source: PreTrainedModel | tuple[Mapping[str, Any], PretrainedConfig],
    arch: Arch | None,
    cache: CacheGraph,
    *,
    dtype: str = "fp32",
    opset: int = 23,
) -> ir.Model:
    """Build the decoder graph of ``source`` (a HF causal LM, or ``(state_dict, config)``) around ``cache``.

    ``arch`` defaults to ``get_arch(config)``. The state dict may hold torch tensors or numpy arrays
    in any float dtype; they are cast to ``dtype`` (``"fp32"`` or ``"fp16"``).
    """
    state, config = _split_source(source)
    arch = arch if arch is not None else get_arch(config)
    if dtype not in COMPUTE_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; expected one of {', '.join(COMPUTE_DTYPES)}")
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} is too old; the decoder needs opset >= {MIN_OPSET}")
    start = time.perf_counter()
    compute = DType.get(dtype).ir
    rope = arch.rope()
    facts = replace(DecoderFacts.from_arch(arch, compute), rope=rope,
                    layer_ropes=tuple(arch.layer_rope(i) for i in range(arch.num_layers)))
    if facts.attn_softcap and not cache.supports_attn_softcap:
        raise ExportError(
            f"{arch.model_type} soft-caps its attention scores (attn_logit_softcapping={facts.attn_softcap}), "
            f"which the {type(cache).__name__} attention does not implement"
        )
    b = GraphBuilder(opset=opset, name=f"kvq_{arch.model_type}")
    body = _Body(b, arch, facts, _Weights(state, compute, arch.model_type), fused=fuses_body(cache))

    input_ids = b.input("input_ids", ir.DataType.INT64, ["batch", "seq"])
    attention_mask = b.input("attention_mask", ir.DataType.INT64, ["batch", "seq"])
    with b.scope("cache"):
        positions = cache.begin(b, attention_mask=attention_mask, facts=facts)
    body.packed_attention = attends_packed(cache) and not any(
        body.value_rotation_in_graph(cache, layer) is not None for layer in range(arch.num_layers))
    if not fuses_rotary(cache):
        with b.scope("rope"):
            for spec in dict.fromkeys(facts.rope_for(i) for i in range(arch.num_layers)):
                if body.packed_attention:
                    body.packed_rotary_tables(positions, spec)
                else:
                    body.rotary_tables(positions, spec)

    with b.scope("embed"):
        embed = body.weights.initializer(b, arch.embed_name(), (arch.vocab_size, arch.hidden_size))
        hidden = b.op("Gather", embed, input_ids)
        if arch.embedding_scale is not None:  # in the weights' dtype, like GemmaTextScaledWordEmbedding
            hidden = b.op("Mul", hidden, b.const(np.array(arch.embedding_scale, dtype=body.weights.np_dtype)))
    pending = None  # each layer leaves its last residual add to the next norm (fused: one node for both)
    for layer in range(arch.num_layers):
        with b.scope(f"layers.{layer}"):
            hidden, pending = body.layer(layer, hidden, pending, cache)
    with b.scope("head"):
        hidden, _ = body.add_norm(hidden, pending, arch.final_norm_name())
        logits = body.lm_head(hidden, embed)
        if arch.final_logit_softcap is not None:
            logits = body.softcap(logits, arch.final_logit_softcap)
        logits = body.to_float(logits)
    b.output(logits, "logits", ir.DataType.FLOAT, ["batch", "seq", arch.vocab_size])
    with b.scope("cache"):
        cache.end(b)

    model = b.build(metadata={"kvq.model_type": arch.model_type, "kvq.dtype": dtype})
    logger.info(
        "built %s decoder body: %d layers, %s, %d nodes in %.2f s",
        arch.model_type,
        arch.num_layers,
        dtype,
        len(model.graph),
        time.perf_counter() - start,
    )
    return model


def _fold_rotation(wt: np.ndarray, rotate_out: np.ndarray | None, rotate_in: np.ndarray | None) -> np.ndarray:
    """Fold head-block rotations into a pre-transposed weight ``[in, out]`` (float64 result).

    ``rotate_out``: output columns, block by block of R's size, become ``wt[:, block] @ R`` (so
    ``x @ wt`` yields every head rotated); ``rotate_in``: input rows become ``R.T @ wt[block]`` (so a
    rotated input is rotated back before the product).
    """
    out = wt.astype(np.float64)
    if rotate_out is not None:
        d = rotate_out.shape[0]
        out = (out.reshape(out.shape[0], -1, d) @ rotate_out).reshape(out.shape)
    if rotate_in is not None:
        d = rotate_in.shape[0]
        out = (rotate_in.T @ out.reshape(-1, d, out.shape[1])).reshape(out.shape)
    return out


def _joined(names: list[str]) -> str:
    """One name for several: ``a.{q,k,v}_proj.weight`` from their common prefix and suffix."""
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[len(prefix):][::-1] for n in names])[::-1]
    middles = [n[len(prefix):len(n) - len(suffix)] for n in names]
    return f"{prefix}{{{','.join(middles)}}}{suffix}"


def _block_diag(matrix: np.ndarray, heads: int) -> np.ndarray:
    """``heads`` copies of a per-head ``R`` on the diagonal: rotates a ``[.., heads * D]`` projection."""
    return np.kron(np.eye(heads), matrix)


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


class _Weights:
    """Reads state-dict tensors as numpy arrays of the compute dtype, checking names and shapes."""

    def __init__(self, state: Mapping[str, Any], dtype: ir.DataType, model_type: str) -> None:
        self.state = state
        self.np_dtype = np.dtype(dtype.numpy())
        self.model_type = model_type

    def array(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None,
              dtype: np.dtype | None = None) -> np.ndarray:
        """Return the tensor ``name`` as a numpy array of the compute dtype (or ``dtype``), checking its shape.

        With ``rows``, ``shape`` is that of the slice ``[start:stop]`` of a fused tensor along its first axis.
        """
        np_dtype = self.np_dtype if dtype is None else np.dtype(dtype)
        if name not in self.state:
            raise ModelError(
                f"{self.model_type}: weight {name!r} is missing from the state dict "
                "(expected a *ForCausalLM state dict with transformers' names)"
            )
        tensor = self.state[name]
        if hasattr(tensor, "detach"):  # torch: cast in torch (numpy has no bfloat16)
            array = tensor.detach().to(device="cpu", dtype=DType.get(np_dtype.name).torch).numpy()
        else:
            array = np.asarray(tensor, dtype=np_dtype)
        if rows is not None:
            if rows[1] > array.shape[0]:
                raise ModelError(f"{self.model_type}: weight {name!r} has {array.shape[0]} rows; "
                                 f"expected at least {rows[1]}")
            array = array[rows[0]:rows[1]]
        if array.shape != shape:
            raise ModelError(f"{self.model_type}: weight {name!r} has shape {array.shape}, expected {shape}")
        return array

    def initializer(self, b: GraphBuilder, name: str, shape: tuple[int, ...]) -> ir.Value:
        """Add the tensor ``name`` unchanged as an initializer of the same name."""
        return b.initializer(name, self.array(name, shape))


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

    def __init__(self, b: GraphBuilder, arch: Arch, facts: DecoderFacts, weights: _Weights, *,
                 fused: bool = False) -> None:
        self.b = b
        self.arch = arch
        self.facts = facts
        self.weights = weights
        self.dtype = facts.dtype
        self.fuse_projections = fused
        self.fuse_norms = fused and self.dtype == ir.DataType.FLOAT
        if self.fuse_norms and b.opset < RMS_NORM_OPSET:
            raise ExportError(f"the fused body's RMSNormalization needs opset >= {RMS_NORM_OPSET} (got {b.opset})")
        self.tables: dict[int, tuple[ir.Value, ir.Value]] = {}  # id(RopeSpec) -> (cos, sin) [B, 1, t, R]
        #: RoPE on the packed q|k|v for a cache graph that :func:`attends_packed` (set by :func:`build_decoder`)
        self.packed_attention = False
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
        width = arch.hidden_size if width is None else width
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
            "SkipSimplifiedLayerNormalization", hidden, delta, self.norm_scale(weight_name, self.arch.hidden_size),
            num_outputs=4, domain=CONTRIB_DOMAIN, epsilon=float(self.arch.rms_norm_eps))
        return normed, total

    def softcap(self, x: ir.Value, cap: float) -> ir.Value:
        """``cap * tanh(x / cap)`` in the dtype of ``x`` (Gemma2's soft-capping)."""
        b = self.b
        c = b.const(np.array(cap, dtype=self.weights.np_dtype))
        return b.op("Mul", b.op("Tanh", b.op("Div", x, c)), c)

    def linear(self, x: ir.Value, names: LinearNames, in_features: int, out_features: int, *,
               rotate_out: np.ndarray | None = None, rotate_in: np.ndarray | None = None) -> ir.Value:
        """``x @ W.T + bias`` with W stored pre-transposed ([in, out]) under its HF name.

        ``rotate_out``: every head-sized block of outputs (and bias) is rotated, ``y_block @ R``;
        ``rotate_in``: every head-sized block of inputs is un-rotated first, ``x_block @ R.T``. Both are
        folded into the stored weight (float64, then cast to the compute dtype).
        """
        b = self.b
        wt, bias = self.linear_arrays(names, in_features, out_features, rotate_out=rotate_out, rotate_in=rotate_in)
        y = b.op("MatMul", x, b.initializer(names.initializer, wt))
        if bias is not None:
            y = b.op("Add", y, b.initializer(names.bias, bias))
        return y

    def linear_arrays(self, names: LinearNames, in_features: int, out_features: int, *,
                      rotate_out: np.ndarray | None = None,
                      rotate_in: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The stored ``[in, out]`` weight and the ``[out]`` bias (or None) of :meth:`linear`, rotations folded."""
        weight = self.weights.array(names.weight, (out_features, in_features), names.rows)
        wt = np.ascontiguousarray(weight.T)  # [in, out]
        if rotate_out is not None or rotate_in is not None:
            wt = _fold_rotation(wt, rotate_out, rotate_in).astype(weight.dtype)
        bias = None
        if names.bias is not None:
            bias = self.weights.array(names.bias, (out_features,))
            if rotate_out is not None:
                bias = _fold_rotation(bias[None, :], rotate_out, None)[0].astype(bias.dtype)
        return wt, bias

    def linears(self, x: ir.Value, in_features: int, parts: list[tuple[LinearNames, int, np.ndarray | None]]
                ) -> tuple[list[ir.Value], ir.Value | None]:
        """Several projections of the same ``x``: ``(names, out_features, rotate_out)`` each.

        Returns the outputs in order and, fused, their concatenation before the Split (else None). Unfused:
        one :meth:`linear` each. Fused: one MatMul over the concatenated ``[in, sum(out)]`` weights (plus one
        Add of the concatenated biases, zeros for a part without one), then a Split. Every output column is
        the same dot product as in its own MatMul, so only the kernel's summation order can differ.
        """
        if not self.fuse_projections:
            return [self.linear(x, names, in_features, out, rotate_out=rot) for names, out, rot in parts], None
        sizes = [out for _, out, _ in parts]
        joined = self.fused_projection(x, in_features, parts)
        outputs = self.b.op_multi("Split", joined, self.b.const(sizes), num_outputs=len(sizes), axis=-1)
        return list(outputs), joined

    def fused_projection(self, x: ir.Value, in_features: int,
                         parts: list[tuple[LinearNames, int, np.ndarray | None]]) -> ir.Value:
        """The fused form of :meth:`linears` before its Split: ``x`` times the concatenated weights, plus bias."""
        b = self.b
        arrays = [self.linear_arrays(names, in_features, out, rotate_out=rot) for names, out, rot in parts]
        weight = np.concatenate([wt for wt, _ in arrays], axis=1)
        y = b.op("MatMul", x, b.initializer(self.fused_name([names for names, _, _ in parts]), weight))
        if any(bias is not None for _, bias in arrays):
            bias = np.concatenate([np.zeros(out, weight.dtype) if bias is None else bias
                                   for (_, out, _), (_, bias) in zip(parts, arrays)])
            names = [n.bias or f"{n.initializer}.zero_bias" for n, _, _ in parts]
            y = b.op("Add", y, b.initializer(_joined(names), bias))
        return y

    def fused_name(self, parts: list[LinearNames]) -> str:
        """Initializer name of concatenated projections: ``...self_attn.{q,k,v}_proj.weight``.

        Slices of one fused tensor give its name back (``...qkv_proj.weight``; a row range when they do not
        cover all of it).
        """
        weights = {names.weight for names in parts}
        if len(weights) == 1 and all(names.rows for names in parts):
            name = parts[0].weight
            rows = [names.rows for names in parts]
            if all(a[1] == b[0] for a, b in zip(rows, rows[1:])):
                start, stop = rows[0][0], rows[-1][1]
                whole = start == 0 and stop == int(np.shape(self.weights.state[name])[0])
                return name if whole else f"{name}[{start}:{stop}]"
        return _joined([names.initializer for names in parts])

    def rotate(self, x: ir.Value, matrix: np.ndarray, *, inverse: bool = False) -> ir.Value:
        """``x @ R`` (``x @ R.T`` with ``inverse``) over the last axis, as a float32 MatMul."""
        b = self.b
        r = np.ascontiguousarray(matrix.T if inverse else matrix, dtype=np.float32)
        key = r.tobytes()
        if key not in self._rotations:
            self._rotations[key] = b.initializer(f"rotation.{len(self._rotations)}", r)
        return self.from_float(b.op("MatMul", self.to_float(x), self._rotations[key]))

    def _float_tables(self, positions: ir.Value, rope: RopeSpec) -> tuple[ir.Value, ir.Value]:
        """float32 cos/sin [B, t, R] (R = rope.rotary_dim) from int64 positions [B, t], as HF computes them."""
        b = self.b
        name = "rope.inv_freq" if rope.layer_type is None else f"rope.{rope.layer_type}.inv_freq"
        inv_freq = b.initializer(name, rope.inv_freq.astype(np.float32))
        pos = b.op("Unsqueeze", b.op("Cast", positions, to=ir.DataType.FLOAT), b.const([-1]))
        freqs = b.op("Mul", pos, inv_freq)  # [B, t, D/2]
        emb = b.op("Concat", freqs, freqs, axis=-1)  # [B, t, D]
        cos, sin = b.op("Cos", emb), b.op("Sin", emb)
        if rope.attention_scaling != 1.0:
            scale = b.const(rope.attention_scaling)
            cos, sin = b.op("Mul", cos, scale), b.op("Mul", sin, scale)
        return cos, sin

    def rotary_tables(self, positions: ir.Value, rope: RopeSpec) -> None:
        """cos/sin [B, 1, t, R] in the compute dtype, for :meth:`apply_rope`."""
        cos, sin = self._float_tables(positions, rope)
        heads_axis = self.b.const([1])  # broadcast over heads
        self.tables[id(rope)] = (self.b.op("Unsqueeze", self.from_float(cos), heads_axis),
                                 self.b.op("Unsqueeze", self.from_float(sin), heads_axis))

    def packed_rotary_tables(self, positions: ir.Value, rope: RopeSpec) -> None:
        """Tables cos and signed sin [B, t, (Hq + 2 Hkv) * D] in the compute dtype, for :meth:`apply_packed_rope`.

        Over one head: cos, and sin negated on the first half (``rotate_half``'s sign), for the R rotary channels;
        1 and 0 on the channels that pass through (partial rotary) and on the value heads, so those come out of
        the same Mul/Mul/Add unchanged (``x * 1 + y * 0 == x`` exactly).
        """
        b, f = self.b, self.facts
        cos, sin = self._float_tables(positions, rope)
        half, rest = rope.rotary_dim // 2, f.head_dim - rope.rotary_dim
        sin = b.op("Mul", sin, b.const(np.repeat(np.float32([-1, 1]), half)))
        tables = []
        for table, fill in ((cos, 1.0), (sin, 0.0)):
            if rest:
                table = b.op("Pad", table, b.const([0, 0, 0, 0, 0, rest]), b.const(np.float32(fill)))
            table = b.op("Expand", b.op("Unsqueeze", table, b.const([2, 3])),
                         b.const([1, 1, f.num_heads + f.num_kv_heads, 1, 1]))  # the q and k heads
            table = b.op("Pad", table, b.const([0, 0, 0, 0, 0, 0, 0, f.num_kv_heads, 0, 0]),
                         b.const(np.float32(fill)))  # the value heads
            # flat like the packed row, so no layer reshapes the row for them
            tables.append(self.from_float(b.op("Reshape", table, b.const([0, 0, -1]))))
        self.tables[id(rope)] = (tables[0], tables[1])

    def apply_rope(self, x: ir.Value, layer: int) -> ir.Value:
        """Return x * cos + rotate_half(x) * sin, with rotate_half(x) = concat(-x2, x1) (HF layout).

        Partial rotary: only the first ``rotary_dim`` channels rotate; the rest pass through.
        """
        b = self.b
        rope = self.facts.rope_for(layer)
        cos, sin = self.tables[id(rope)]
        rot, d = rope.rotary_dim, self.facts.head_dim
        passed = None
        if rot < d:
            x, passed = b.op_multi("Split", x, b.const([rot, d - rot]), num_outputs=2, axis=-1)
        half = rot // 2
        x1, x2 = b.op_multi("Split", x, b.const([half, half]), num_outputs=2, axis=-1)
        rotated = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
        out = b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))
        return out if passed is None else b.op("Concat", out, passed, axis=-1)

    def apply_packed_rope(self, qkv: ir.Value, layer: int, key_rotation: np.ndarray | None) -> ir.Value:
        """:meth:`apply_rope` on the q and k heads of a packed ``[B, t, (Hq + 2 Hkv) * D]`` projection.

        Per head, ``x * cos + x[rotate] * sin'`` with the tables of :meth:`packed_rotary_tables`: the same two
        products and sum as ``x * cos + rotate_half(x) * sin``, so the same floats in an fp32 body. They run on the
        flat row (one Gather swaps the halves of every head), so nothing is reshaped. (An fp16 body on ONNX
        Runtime's CPU runs these ops in float32 between casts it inserts, and may round at other points than in
        the per-head form: logits within 2e-4 on the tiny test models.) A key rotation ``R`` then multiplies each
        q and k head (a float32 MatMul per head, the identity on the value heads).
        """
        b, f = self.b, self.facts
        rope = f.rope_for(layer)
        heads = f.num_heads + 2 * f.num_kv_heads
        cos, sin = self.tables[id(rope)]
        half, d = rope.rotary_dim // 2, f.head_dim
        swap = np.concatenate([np.arange(half, 2 * half), np.arange(half), np.arange(2 * half, d)])
        swap = (np.arange(heads)[:, None] * d + swap).reshape(-1)  # within each head of the flat row
        x = b.op("Add", b.op("Mul", qkv, cos), b.op("Mul", b.op("Gather", qkv, b.const(swap), axis=2), sin))
        if key_rotation is not None:
            per_head = np.stack([key_rotation] * (f.num_heads + f.num_kv_heads) + [np.eye(d)] * f.num_kv_heads)
            x = b.op("Reshape", self.rotate(b.op("Reshape", x, b.const([0, 0, heads, 1, d])), per_head),
                     b.const([0, 0, heads * d]))
        return x

    def projections(self, x: ir.Value, layer: int, parts: list[tuple[LinearNames, int, np.ndarray | None]], *,
                    split: bool = True) -> tuple[list[ir.Value] | None, ir.Value | None]:
        """q, k, v of the normed input ``x`` (q/k normed where the family norms them), and the packed q|k|v.

        The packed value (fused body, nothing between projection and attention) is None otherwise. ``split=False``:
        a fused body without q/k norms returns the packed value alone (None for the parts: no Split node).
        """
        f, names = self.facts, self.arch.layer_names(layer)
        norms = self.arch.qk_norm is not None and (names.q_norm or names.k_norm)
        if self.fuse_projections and not norms and not split:
            return None, self.fused_projection(x, f.hidden_size, parts)
        (q, k, v), packed = self.linears(x, f.hidden_size, parts)
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
        if mode == "projection":
            return self.rms_norm(x, weight_name, num_heads * d)
        b = self.b
        per_head = b.op("Reshape", x, b.const([0, 0, num_heads, d]))
        return b.op("Reshape", self.rms_norm(per_head, weight_name, d), b.const([0, 0, num_heads * d]))

    def mlp_activation(self, gate: ir.Value, up: ir.Value) -> ir.Value:
        """act(gate) * up: SiLU, or GELU with the tanh approximation (Gemma)."""
        b = self.b
        if self.arch.activation in GELU_TANH_ACTIVATIONS:
            if b.opset < GELU_OPSET:
                raise ExportError(f"{self.arch.model_type}: GELU needs opset >= {GELU_OPSET} (got {b.opset})")
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

    def layer(self, layer: int, hidden: ir.Value, pending: ir.Value | None,
              cache: CacheGraph) -> tuple[ir.Value, ir.Value | None]:
        """One decoder layer: attention and gated MLP, each with a residual (norms as ``LayerNames`` says).

        ``hidden + pending`` is the residual stream; the layer returns it the same way, and :meth:`add_norm`
        adds each residual where the next norm reads it (a fused fp32 body: inside that norm's
        SkipSimplifiedLayerNormalization).
        """
        b, arch, f = self.b, self.arch, self.facts
        names = arch.layer_names(layer)
        q_size = f.num_heads * f.head_dim
        value_rot = cache_rotation(cache, layer, "value")
        fold = value_rot is not None and self.value_rotation_in_graph(cache, layer) is None

        with b.scope("attn"):
            x, hidden = self.add_norm(hidden, pending, names.input_norm)
            attn = self.attention(x, layer, cache, value_rot if fold else None)  # [B, t, Hq * D]
            out = self.linear(attn, names.o, q_size, f.hidden_size, rotate_in=value_rot if fold else None)
            delta = self.maybe_norm(out, names.attention_out_norm)

        with b.scope("mlp"):
            x, hidden = self.add_norm(hidden, delta, names.post_attention_norm)
            inter = arch.intermediate_size
            (gate, up), _ = self.linears(x, f.hidden_size, [(names.gate, inter, None), (names.up, inter, None)])
            out = self.linear(self.mlp_activation(gate, up), names.down, inter, f.hidden_size)
            delta = self.maybe_norm(out, names.mlp_out_norm)
        return hidden, delta

    def value_rotation_in_graph(self, cache: CacheGraph, layer: int) -> np.ndarray | None:
        """``layer``'s value rotation when the weights cannot absorb it (``Arch.folds_value_rotation`` False)."""
        value_rot = cache_rotation(cache, layer, "value")
        return value_rot if value_rot is not None and not self.arch.folds_value_rotation else None

    def attention(self, x: ir.Value, layer: int, cache: CacheGraph, folded_value_rotation: np.ndarray | None
                  ) -> ir.Value:
        """q/k/v projections of the normed input ``x``, RoPE where the body applies it, and ``cache``'s attention.

        Returns ``[B, t, Hq * D]`` for ``o_proj``. ``folded_value_rotation``: the value rotation folded into
        ``v_proj`` (``o_proj`` folds its inverse).
        """
        b, f = self.b, self.facts
        names = self.arch.layer_names(layer)
        q_size, kv_size = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
        key_rot, in_graph = cache_rotation(cache, layer, "key"), self.value_rotation_in_graph(cache, layer)
        parts = [(names.q, q_size, None), (names.k, kv_size, None), (names.v, kv_size, folded_value_rotation)]
        if self.packed_attention:
            separate, qkv = self.projections(x, layer, parts, split=False)
            qkv = qkv if separate is None else b.op("Concat", *separate, axis=-1)
            return cache.attend_packed(b, layer, self.apply_packed_rope(qkv, layer, key_rot))  # type: ignore
        if fuses_rotary(cache):  # [B, t, H*D] in and out: the cache graph's kernel applies RoPE
            if key_rot is not None:
                raise ExportError(f"layer {layer}: rotated keys need RoPE before the rotation, but this "
                                  "cache graph applies RoPE itself (export it with the body's RoPE)")
            # packed [B, t, (Hq + 2 Hkv) * D] (fused body): q, k, v side by side, for a kernel that takes them so;
            # then the parts are not even split out (None)
            separate, packed = self.projections(x, layer, parts, split=in_graph is not None)
            q, k, v = separate or (None, None, None)
            if in_graph is not None:
                v, packed = self.rotate(v, _block_diag(in_graph, f.num_kv_heads)), None
            attn = cache.attend_projected(b, layer, q, k, v, packed=packed)  # type: ignore[attr-defined]
            if in_graph is not None:
                attn = self.rotate(attn, _block_diag(in_graph, f.num_heads), inverse=True)
            return attn
        (q, k, v), _ = self.projections(x, layer, parts)  # type: ignore[misc]
        q = self.apply_rope(self.heads(q, f.num_heads), layer)
        k = self.apply_rope(self.heads(k, f.num_kv_heads), layer)
        if key_rot is not None:
            q, k = self.rotate(q, key_rot), self.rotate(k, key_rot)
        v = self.heads(v, f.num_kv_heads)
        if in_graph is not None:
            v = self.rotate(v, in_graph)
        attn = cache.attend(b, layer, q, k, v)  # [B, Hq, t, D]
        if in_graph is not None:
            attn = self.rotate(attn, in_graph, inverse=True)
        return b.op("Reshape", b.op("Transpose", attn, perm=[0, 2, 1, 3]), b.const([0, 0, q_size]))

    def lm_head(self, hidden: ir.Value, embed: ir.Value) -> ir.Value:
        """Logits [B, t, V] in the compute dtype; a tied head reuses the embedding instead of a copy."""
        b, arch = self.b, self.arch
        name = arch.lm_head_name()
        if name is not None:
            return self.linear(hidden, LinearNames(name), arch.hidden_size, arch.vocab_size)
        if self.fuse_projections:
            # ONNX Runtime folds the Transpose of the initializer into a [H, V] constant when it loads the graph
            # (the file holds the embedding once), and its MatMul runs faster than Gemm(transB=1) on it (SmolLM2,
            # H 576, V 49152, one token: measured 23.4 vs 25.8 ms on a loaded 2-core machine, equal logits)
            return b.op("MatMul", hidden, b.op("Transpose", embed, perm=[1, 0]))
        # Gemm reads the [V, H] embedding transposed in place; MatMul would need a [H, V] copy.
        flat = b.op("Reshape", hidden, b.const([-1, arch.hidden_size]))
        logits = b.op("Gemm", flat, embed, transB=1)
        out_shape = b.op("Concat", b.op("Shape", hidden, end=2), b.const([arch.vocab_size]), axis=0)
        return b.op("Reshape", logits, out_shape)
