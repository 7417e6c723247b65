"""The architecture registry: one small class per model family says where its weights and numbers are.

Families are registered, not branched on::

    @register("llama")
    class LlamaArch(Arch): ...

    arch = get_arch(config)          # ModelError naming the supported model_types if unknown
    arch.layer_names(0).q.weight     # 'model.layers.0.self_attn.q_proj.weight'
    arch.rope().inv_freq             # float32 [head_dim // 2], exactly transformers' own

The decoder (:mod:`kvq_export.export.decoder`) only talks to :class:`Arch`; adding a family is one
class here. transformers and torch are imported only inside :meth:`Arch.rope`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from kvq_export.errors import ExportError, ModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

#: RoPE variants whose frequencies depend on the sequence length at run time: one static graph can't.
DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})
#: Activations computed as x * sigmoid(x).
SILU_ACTIVATIONS = frozenset({"silu", "swish"})


@dataclass(frozen=True)
class LinearNames:
    """State-dict names of one ``nn.Linear``: weight [out, in] and optional bias [out]."""

    weight: str
    bias: str | None = None


@dataclass(frozen=True)
class LayerNames:
    """State-dict names of one decoder layer."""

    q: LinearNames
    k: LinearNames
    v: LinearNames
    o: LinearNames
    gate: LinearNames
    up: LinearNames
    down: LinearNames
    input_norm: str
    post_attention_norm: str


@dataclass(frozen=True)
class RopeSpec:
    """RoPE: cos/sin = cos/sin(position * inv_freq) * attention_scaling (HF rotate_half layout)."""

    rope_type: str
    inv_freq: np.ndarray  # float32 [head_dim // 2]
    attention_scaling: float


class Arch:
    """How to read one model family from its Hugging Face config and state dict.

    The base class describes the Llama layout; families override what differs (names, biases,
    sliding windows). An instance is bound to one config and checks it on construction.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    prefix: ClassVar[str] = "model."

    def __init__(self, config: PretrainedConfig) -> None:
        self.config = config
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
    def kv_groups(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

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
        )

    # ---------------------------------------------------------------------------------------- rope
    def rope_parameters(self) -> dict[str, Any]:
        """Return the config's (flat) ``rope_parameters``; older configs fall back to ``rope_theta``."""
        params = getattr(self.config, "rope_parameters", None)
        if not params:
            return {"rope_type": "default", "rope_theta": float(getattr(self.config, "rope_theta", 10000.0))}
        if any(isinstance(v, dict) for v in params.values()):
            raise ExportError(
                f"{self.model_type}: per-layer-type rope_parameters {sorted(params)} are not supported"
            )
        return dict(params)

    def rope(self) -> RopeSpec:
        """Inverse frequencies and attention scaling, computed by transformers' own RoPE functions."""
        import torch
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = self.rope_parameters()
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type in DYNAMIC_ROPE_TYPES:
            raise ExportError(
                f"rope_type {rope_type!r} changes its frequencies with the sequence length at run time; "
                f"a static ONNX graph cannot follow it (static types: default, "
                f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - DYNAMIC_ROPE_TYPES))})"
            )
        if rope_type == "default":
            # Same expression as the models' compute_default_rope_parameters (bit-identical).
            base = params["rope_theta"]
            dim = self.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            attention_scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config)
        else:
            raise ExportError(
                f"unknown rope_type {rope_type!r}; supported: default, "
                f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - DYNAMIC_ROPE_TYPES))}"
            )
        inv = inv_freq.detach().to(torch.float32).cpu().numpy()
        if 2 * inv.shape[-1] != self.head_dim:
            raise ExportError(
                f"{self.model_type}: RoPE covers {2 * inv.shape[-1]} of {self.head_dim} head dims "
                "(partial rotary is not supported)"
            )
        return RopeSpec(rope_type, inv, float(attention_scaling))

    # ------------------------------------------------------------------------------------- checks
    def _check(self) -> None:
        """Refuse configs this family description cannot export faithfully."""
        act = str(getattr(self.config, "hidden_act", "silu"))
        if act not in SILU_ACTIVATIONS:
            raise ExportError(f"{self.model_type}: hidden_act {act!r} is not supported (only silu)")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"{self.model_type}: {self.num_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads"
            )


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


@register("llama")
class LlamaArch(Arch):
    """Llama: optional attention/MLP biases (``attention_bias``, ``mlp_bias``), no sliding window."""


@register("mistral")
class MistralArch(Arch):
    """Mistral: no biases; every layer uses ``sliding_window`` when it is set."""

    def attention_biases(self) -> tuple[bool, bool]:
        """Mistral projections have no bias."""
        return False, False

    def mlp_bias(self) -> bool:
        """Mistral MLPs have no bias."""
        return False

    def layer_window(self, layer: int) -> int | None:
        """``config.sliding_window`` for every layer (None disables it)."""
        window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None


@register("qwen2")
class Qwen2Arch(Arch):
    """Qwen2: q/k/v biases; layers marked ``sliding_attention`` (``use_sliding_window``) use the window."""

    def attention_biases(self) -> tuple[bool, bool]:
        """q/k/v have a bias, o_proj has none."""
        return True, False

    def mlp_bias(self) -> bool:
        """Qwen2 MLPs have no bias."""
        return False

    def layer_window(self, layer: int) -> int | None:
        """Return the window for layers marked ``sliding_attention`` (see ``max_window_layers``)."""
        layer_types = getattr(self.config, "layer_types", None)
        window = getattr(self.config, "sliding_window", None)
        # Qwen2Config already clears sliding_window when use_sliding_window is false.
        if not window or layer_types is None:
            return None
        return int(window) if layer_types[layer] == "sliding_attention" else None
