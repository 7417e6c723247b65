"""The registered model families: one small :class:`~kvq_export.arch.base.Arch` subclass per ``model_type``.

Adding a family is one class here; :mod:`kvq_export.arch.base` says what each declaration means.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvq_export.arch.base import Arch, LayerNames, LinearNames, QkNorm, register

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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


def _layer_types_window(config: PretrainedConfig, layer: int) -> int | None:
    """``sliding_window`` for layers that ``config.layer_types`` marks ``sliding_attention``, else None."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not window or layer_types is None:
        return None
    return int(window) if layer_types[layer] == "sliding_attention" else None


@register("qwen3")
class Qwen3Arch(Qwen2Arch):
    """Qwen3: Qwen2's layout with an RMSNorm on each q/k head before RoPE; biases follow ``attention_bias``."""

    qk_norm = QkNorm.HEAD

    def attention_biases(self) -> tuple[bool, bool]:
        """Every attention projection has a bias iff ``attention_bias``."""
        bias = bool(getattr(self.config, "attention_bias", False))
        return bias, bias


@register("gemma")
class GemmaArch(Arch):
    """Gemma: ``x * (1 + w)`` RMSNorms in float32, embeddings times sqrt(hidden_size), GELU-tanh MLP."""

    norm_offset = 1.0
    norm_weight_in_float = True

    @property
    def embedding_scale(self) -> float | None:
        """sqrt(hidden_size), as transformers' ``GemmaTextScaledWordEmbedding``."""
        return float(self.hidden_size**0.5)

    def mlp_bias(self) -> bool:
        """Gemma MLPs have no bias."""
        return False

    def layer_window(self, layer: int) -> int | None:
        """Layers marked ``sliding_attention`` in ``layer_types`` use ``sliding_window``."""
        return _layer_types_window(self.config, layer)


@register("gemma2")
class Gemma2Arch(GemmaArch):
    """Gemma2: Gemma plus output norms, ``query_pre_attn_scalar``, soft-capping, alternating windows.

    Norms on the attention and MLP outputs, soft-capping of attention scores and of logits, layers marked
    ``sliding_attention`` use ``sliding_window``.
    """

    @property
    def activation(self) -> str:
        """``hidden_activation`` (Gemma2/3's name for it)."""
        return str(getattr(self.config, "hidden_activation", None) or "gelu_pytorch_tanh")

    @property
    def scaling(self) -> float:
        """``query_pre_attn_scalar ** -0.5`` (not head_dim's)."""
        return float(self.config.query_pre_attn_scalar) ** -0.5

    def layer_names(self, layer: int) -> LayerNames:
        """Four norms per layer: before/after attention, before/after the MLP."""
        names = super().layer_names(layer)
        p = f"{self.prefix}layers.{layer}."
        return replace(
            names,
            attention_out_norm=f"{p}post_attention_layernorm.weight",
            post_attention_norm=f"{p}pre_feedforward_layernorm.weight",
            mlp_out_norm=f"{p}post_feedforward_layernorm.weight",
        )


@register("gemma3_text")
class Gemma3TextArch(Gemma2Arch):
    """Gemma3's text model: Gemma2's layer with q/k-head norms and a RoPE per layer type.

    The q/k norms are (1 + w) RMSNorms over each head; local (sliding) and global layers use their own
    RoPE (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``).
    """

    qk_norm = QkNorm.HEAD
    global_rope_layer_type = "full_attention"

    def rope_layer_type(self, layer: int) -> str | None:
        """The layer's ``layer_types`` entry keys its RoPE parameters."""
        return str(self.config.layer_types[layer])

    def rope_parameters(self, layer_type: str | None = None) -> dict[str, Any]:
        """Per-layer-type parameters; without ``layer_type`` the whole mapping (for the manifest)."""
        if layer_type is None:
            return {key: dict(value) for key, value in self.config.rope_parameters.items()}
        return super().rope_parameters(layer_type)


@register("phi3")
class Phi3Arch(Arch):
    """Phi3: fused ``qkv_proj`` and ``gate_up_proj``, split into row ranges when the weights are read.

    No biases; ``sliding_window`` on every layer when set; partial rotary via ``partial_rotary_factor``.
    """

    partial_rotary = True

    def layer_names(self, layer: int) -> LayerNames:
        """q/k/v and gate/up are row ranges of the fused projections."""
        p = f"{self.prefix}layers.{layer}."
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.intermediate_size
        qkv, gate_up = f"{p}self_attn.qkv_proj.weight", f"{p}mlp.gate_up_proj.weight"
        return LayerNames(
            q=LinearNames(qkv, rows=(0, q_size)),
            k=LinearNames(qkv, rows=(q_size, q_size + kv_size)),
            v=LinearNames(qkv, rows=(q_size + kv_size, q_size + 2 * kv_size)),
            o=LinearNames(f"{p}self_attn.o_proj.weight"),
            gate=LinearNames(gate_up, rows=(0, inter)),
            up=LinearNames(gate_up, rows=(inter, 2 * inter)),
            down=LinearNames(f"{p}mlp.down_proj.weight"),
            input_norm=f"{p}input_layernorm.weight",
            post_attention_norm=f"{p}post_attention_layernorm.weight",
        )

    def layer_window(self, layer: int) -> int | None:
        """``config.sliding_window`` for every layer (None disables it)."""
        window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None


@register("olmo2")
class Olmo2Arch(Arch):
    """OLMo2: norms on the attention and MLP outputs only, and over the whole q/k projections.

    The norm weights multiply in float32; the q/k norms run before RoPE.
    """

    norm_weight_in_float = True
    qk_norm = QkNorm.PROJECTION

    def mlp_bias(self) -> bool:
        """OLMo2 MLPs have no bias."""
        return False

    def layer_names(self, layer: int) -> LayerNames:
        """Output norms only: ``post_attention_layernorm`` and ``post_feedforward_layernorm``."""
        names = super().layer_names(layer)
        p = f"{self.prefix}layers.{layer}."
        return replace(
            names,
            input_norm=None,
            post_attention_norm=None,
            attention_out_norm=f"{p}post_attention_layernorm.weight",
            mlp_out_norm=f"{p}post_feedforward_layernorm.weight",
        )
