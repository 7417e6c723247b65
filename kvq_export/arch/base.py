"""The architecture registry: one small class per model family says where its weights and numbers are.

Families are registered, not branched on::

    @register("llama")
    class LlamaArch(Arch): ...

    arch = get_arch(config)          # ModelError naming the supported model_types if unknown
    arch.layer_names(0).q.weight     # 'model.layers.0.self_attn.q_proj.weight'
    arch.rope().inv_freq             # float32 [rotary_dim // 2], exactly transformers' own

The decoder (:mod:`kvq_export.export.decoder`) only talks to :class:`Arch`; adding a family is one
class here. What differs between families is declared, and the body switches on the declarations:

* names: :meth:`Arch.layer_names` (a missing norm is None; a fused ``qkv_proj``/``gate_up_proj`` is
  described as row ranges of one tensor, split when the weights are read);
* norms: ``norm_offset`` (Gemma's ``x * (1 + w)``), ``norm_weight_in_float`` (the weight multiplies the
  float32 normalized value before the cast back: Gemma, OLMo2), ``qk_norm`` (:class:`QkNorm`: an RMSNorm over
  each head's ``head_dim`` (Qwen3, Gemma3) or over the whole q/k projection (OLMo2));
* numbers: :attr:`Arch.scaling` (Gemma's ``query_pre_attn_scalar``), :attr:`Arch.embedding_scale`,
  :attr:`Arch.final_logit_softcap`, :attr:`Arch.attn_logit_softcap`, :attr:`Arch.activation`;
* RoPE per layer: :meth:`Arch.layer_rope` (Gemma3's local and global bases), partial rotary
  (``partial_rotary_factor``: the RoPE covers the first ``rotary_dim`` of each head).

transformers and torch are imported only when a RoPE is computed (:func:`kvq_export.arch.rope.rope_spec`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvq_export.arch.rope import RopeSpec, rope_spec
from kvq_export.errors import ExportError, ModelError
from kvq_export.vocab import plain

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

#: Activations computed as x * sigmoid(x).
SILU_ACTIVATIONS = frozenset({"silu", "swish"})
#: Activations computed as GELU with the tanh approximation (ONNX ``Gelu(approximate="tanh")``).
GELU_TANH_ACTIVATIONS = frozenset({"gelu_pytorch_tanh", "gelu_python_tanh"})


class QkNorm(StrEnum):
    """The RMSNorm a family applies to q and k before RoPE (:attr:`Arch.qk_norm`; None: no norm)."""

    HEAD = "head"  # over each head's head_dim
    PROJECTION = "projection"  # over the whole q/k projection


@dataclass(frozen=True)
class LinearNames:
    """State-dict names of one ``nn.Linear``: weight [out, in] and optional bias [out].

    ``rows = (start, stop)`` takes output rows ``start:stop`` of a fused projection (Phi3's ``qkv_proj``
    and ``gate_up_proj``); the split happens when the weights are read, so the graph has plain MatMuls.
    """

    weight: str
    bias: str | None = None
    rows: tuple[int, int] | None = None

    @property
    def initializer(self) -> str:
        """Name of the graph initializer: the HF name, plus the row range for a slice of a fused tensor."""
        return self.weight if self.rows is None else f"{self.weight}[{self.rows[0]}:{self.rows[1]}]"


@dataclass(frozen=True)
class LayerNames:
    """State-dict names of one decoder layer.

    The layer is ``h += out_norm(attn(input_norm(h)))`` then ``h += mlp_out_norm(mlp(post_attention_norm(h)))``;
    a norm that is None is skipped. ``post_attention_norm`` keeps Llama's name for the norm *before* the
    MLP; the norms on the attention/MLP outputs (Gemma2/3's ``post_attention_layernorm`` and
    ``post_feedforward_layernorm``, OLMo2's) are ``attention_out_norm`` / ``mlp_out_norm``.
    """

    q: LinearNames
    k: LinearNames
    v: LinearNames
    o: LinearNames
    gate: LinearNames
    up: LinearNames
    down: LinearNames
    input_norm: str | None
    post_attention_norm: str | None
    attention_out_norm: str | None = None
    mlp_out_norm: str | None = None
    q_norm: str | None = None  # with Arch.qk_norm
    k_norm: str | None = None


class Arch:
    """How to read one model family from its Hugging Face config and state dict.

    The base class describes the Llama layout; families override what differs (names, biases,
    sliding windows). An instance is bound to one config and checks it on construction.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    prefix: ClassVar[str] = "model."
    #: RMSNorm multiplies by ``norm_offset + w`` (Gemma stores w around 0: ``x * (1 + w)``).
    norm_offset: ClassVar[float] = 0.0
    #: The norm weight multiplies the float32 normalized value, then the result is cast (Gemma, OLMo2);
    #: False: cast first, then multiply in the compute dtype (Llama).
    norm_weight_in_float: ClassVar[bool] = False
    #: RMSNorm of q and k before RoPE (None: none).
    qk_norm: ClassVar[QkNorm | None] = None
    #: Per-layer-type ``rope_parameters`` entry that :meth:`rope` describes (None: one RoPE for all layers).
    global_rope_layer_type: ClassVar[str | None] = None
    #: The family's default RoPE honours ``partial_rotary_factor`` (Phi3); others rotate the whole head.
    partial_rotary: ClassVar[bool] = False
    #: v goes straight from ``v_proj`` into the cache and attention's output straight into ``o_proj``, so a value
    #: rotation folds into those weights (False: the body rotates in the graph, see :mod:`kvq_export.export.decoder`).
    folds_value_rotation: ClassVar[bool] = True

    def __init__(self, config: PretrainedConfig) -> None:
        self.config = config
        self._ropes: dict[str | None, RopeSpec] = {}
        self._check()

    # ------------------------------------------------------------------------------------ numbers
    @property
    def model_type(self) -> str:
        """The config's ``model_type``."""
        return str(self.config.model_type)

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return int(self.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        """Query heads per layer."""
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads per layer (fewer than query heads under GQA)."""
        return int(getattr(self.config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return int(getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads)

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream."""
        return int(self.config.hidden_size)

    @property
    def intermediate_size(self) -> int:
        """Width of the MLP."""
        return int(self.config.intermediate_size)

    @property
    def vocab_size(self) -> int:
        """Number of tokens (rows of the embedding, columns of the logits)."""
        return int(self.config.vocab_size)

    @property
    def rms_norm_eps(self) -> float:
        """Epsilon of every RMSNorm."""
        return float(self.config.rms_norm_eps)

    @property
    def scaling(self) -> float:
        """Factor applied to q.k before the softmax."""
        return float(self.head_dim**-0.5)

    @property
    def activation(self) -> str:
        """The MLP activation's transformers name (``hidden_act``)."""
        return str(getattr(self.config, "hidden_act", None) or "silu")

    @property
    def embedding_scale(self) -> float | None:
        """Factor on the token embeddings (Gemma: sqrt(hidden_size)), or None."""
        return None

    @property
    def final_logit_softcap(self) -> float | None:
        """``cap * tanh(logits / cap)`` on the logits (Gemma2), or None."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        return float(cap) if cap else None

    @property
    def attn_logit_softcap(self) -> float | None:
        """``cap * tanh(scores / cap)`` on the scaled attention scores, before the mask (Gemma2), or None."""
        cap = getattr(self.config, "attn_logit_softcapping", None)
        return float(cap) if cap else None

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the lm_head reuses the token embedding."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def max_positions(self) -> int:
        """``max_position_embeddings`` of the config."""
        return int(self.config.max_position_embeddings)

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window size of ``layer`` (a key at position p is seen while q - p < window), or None."""
        return None

    # ------------------------------------------------------------------------------------- weights
    def embed_name(self) -> str:
        """State-dict name of the token embedding [vocab, hidden]."""
        return f"{self.prefix}embed_tokens.weight"

    def final_norm_name(self) -> str:
        """State-dict name of the final RMSNorm weight."""
        return f"{self.prefix}norm.weight"

    def lm_head_name(self) -> str | None:
        """State-dict name of the lm_head weight [vocab, hidden]; None when tied to the embedding."""
        return None if self.tie_word_embeddings else "lm_head.weight"

    def attention_biases(self) -> tuple[bool, bool]:
        """Whether (q/k/v, o) projections carry a bias."""
        bias = bool(getattr(self.config, "attention_bias", False))
        return bias, bias

    def mlp_bias(self) -> bool:
        """Whether gate/up/down projections carry a bias."""
        return bool(getattr(self.config, "mlp_bias", False))

    def layer_names(self, layer: int) -> LayerNames:
        """State-dict names of decoder layer ``layer``."""
        p = f"{self.prefix}layers.{layer}."
        qkv_bias, o_bias = self.attention_biases()
        mlp_bias = self.mlp_bias()

        def linear(name: str, bias: bool) -> LinearNames:
            return LinearNames(f"{p}{name}.weight", f"{p}{name}.bias" if bias else None)

        return LayerNames(
            q=linear("self_attn.q_proj", qkv_bias),
            k=linear("self_attn.k_proj", qkv_bias),
            v=linear("self_attn.v_proj", qkv_bias),
            o=linear("self_attn.o_proj", o_bias),
            gate=linear("mlp.gate_proj", mlp_bias),
            up=linear("mlp.up_proj", mlp_bias),
            down=linear("mlp.down_proj", mlp_bias),
            input_norm=f"{p}input_layernorm.weight",
            post_attention_norm=f"{p}post_attention_layernorm.weight",
            q_norm=f"{p}self_attn.q_norm.weight" if self.qk_norm else None,
            k_norm=f"{p}self_attn.k_norm.weight" if self.qk_norm else None,
        )

    # ---------------------------------------------------------------------------------------- rope
    def rope_layer_type(self, layer: int) -> str | None:
        """Key of ``layer``'s entry in per-layer-type ``rope_parameters`` (Gemma3), or None for one RoPE."""
        return None

    def rope_parameters(self, layer_type: str | None = None) -> dict[str, Any]:
        """Return the config's (flat) ``rope_parameters``; older configs fall back to ``rope_theta``.

        With ``layer_type``, the entry of per-layer-type parameters (``{"full_attention": {...}, ...}``).
        """
        params = getattr(self.config, "rope_parameters", None)
        if not params:
            return {"rope_type": "default", "rope_theta": float(getattr(self.config, "rope_theta", 10000.0))}
        if any(isinstance(v, dict) for v in params.values()):
            if layer_type is None or not isinstance(params.get(layer_type), dict):
                raise ExportError(
                    f"{self.model_type}: per-layer-type rope_parameters {sorted(params)} are not supported"
                )
            return dict(params[layer_type])
        return dict(params)

    def rope(self) -> RopeSpec:
        """The RoPE of the global (full-attention) layers; :meth:`layer_rope` says per layer."""
        return self._rope(self.global_rope_layer_type)

    def layer_rope(self, layer: int) -> RopeSpec:
        """The RoPE of ``layer`` (the same object for every layer that shares it)."""
        return self._rope(self.rope_layer_type(layer))

    def _rope(self, layer_type: str | None) -> RopeSpec:
        """Inverse frequencies and attention scaling of ``layer_type``'s RoPE (computed once per layer type)."""
        if layer_type not in self._ropes:
            self._ropes[layer_type] = rope_spec(self.config, self.rope_parameters(layer_type), layer_type,
                                                head_dim=self.head_dim, partial_rotary=self.partial_rotary,
                                                model_type=self.model_type)
        return self._ropes[layer_type]

    # ------------------------------------------------------------------------------------- checks
    def _check(self) -> None:
        """Refuse configs this family description cannot export faithfully."""
        act = self.activation
        if act not in SILU_ACTIVATIONS | GELU_TANH_ACTIVATIONS:
            raise ExportError(
                f"{self.model_type}: activation {act!r} is not supported "
                f"(allowed: {', '.join(sorted(SILU_ACTIVATIONS | GELU_TANH_ACTIVATIONS))})"
            )
        if self.qk_norm is not None and self.qk_norm not in tuple(QkNorm):
            raise ExportError(f"{self.model_type}: qk_norm {plain(self.qk_norm)!r}; allowed: None, {', '.join(QkNorm)}")
        if getattr(self.config, "use_bidirectional_attention", False):
            raise ExportError(f"{self.model_type}: use_bidirectional_attention is not causal decoding")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"{self.model_type}: {self.num_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads"
            )
        if self.vocab_size < 1:
            raise ModelError(f"{self.model_type}: vocab_size {self.vocab_size}; allowed: an integer >= 1")
        eps = getattr(self.config, "rms_norm_eps", None)  # a norm of a zero row divides by sqrt(eps)
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                                or eps <= 0):
            raise ModelError(f"{self.model_type}: rms_norm_eps {eps!r}; allowed: a finite number > 0")


_REGISTRY: dict[str, type[Arch]] = {}
_A = TypeVar("_A", bound=type[Arch])


def register(*model_types: str) -> Callable[[_A], _A]:
    """Class decorator: register an :class:`Arch` subclass for the given ``model_type`` values."""

    def wrap(cls: _A) -> _A:
        for model_type in model_types:
            if model_type in _REGISTRY:
                raise ValueError(
                    f"model_type {model_type!r} is already registered to {_REGISTRY[model_type]}"
                )
            _REGISTRY[model_type] = cls
        cls.model_types = tuple(model_types)
        return cls

    return wrap


def supported_model_types() -> tuple[str, ...]:
    """Return the registered ``model_type`` values, sorted."""
    return tuple(sorted(_REGISTRY))


def get_arch(config: PretrainedConfig) -> Arch:
    """Return the :class:`Arch` for ``config``; :class:`ModelError` lists the supported types if none."""
    model_type = getattr(config, "model_type", None)
    cls = _REGISTRY.get(str(model_type))
    if cls is None:
        raise ModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return cls(config)
