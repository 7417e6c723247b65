"""RoPE frequencies: a config's ``rope_parameters`` as a :class:`RopeSpec`, bit-identical to transformers.

:func:`rope_spec` calls transformers' own RoPE functions (per family and layer type); transformers and torch are
imported only inside it. The graph's part of RoPE (the cos/sin tables and their application) is
:class:`kvq_export.graph.rope.RotaryGraph`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_export.errors import ExportError, ModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


#: RoPE variants whose frequencies depend on the sequence length at run time: one static graph can't.
DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """RoPE: cos/sin = cos/sin(position * inv_freq) * attention_scaling (HF rotate_half layout).

    It rotates the first ``rotary_dim`` (= 2 * len(inv_freq)) channels of each head and passes the rest
    through (partial rotary). ``layer_type`` names the per-layer-type entry it came from (Gemma3), or None.
    """

    rope_type: str
    inv_freq: np.ndarray  # float32 [rotary_dim // 2]
    attention_scaling: float
    layer_type: str | None = None

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates."""
        return 2 * int(self.inv_freq.shape[-1])


def rope_spec(config: PretrainedConfig, params: dict[str, Any], layer_type: str | None, *, head_dim: int,
              partial_rotary: bool, model_type: str) -> RopeSpec:
    """Inverse frequencies and attention scaling of ``params``, computed by transformers' own RoPE functions.

    ``partial_rotary``: whether the family honours ``partial_rotary_factor`` (the default RoPE then covers that
    share of ``head_dim``); ``layer_type``: the per-layer-type entry ``params`` came from (Gemma3), or None.
    """
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

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
        factor = float(params.get("partial_rotary_factor", 1.0)) if partial_rotary else 1.0
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        attention_scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, **kwargs)
    else:
        raise ExportError(
            f"unknown rope_type {rope_type!r}; supported: default, "
            f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - DYNAMIC_ROPE_TYPES))}"
        )
    inv = inv_freq.detach().to(torch.float32).cpu().numpy()
    if not (np.isfinite(inv).all() and (inv > 0).all() and math.isfinite(float(attention_scaling))):
        raise ModelError(f"{model_type}: RoPE parameters {dict(params)} give non-finite or non-positive rotary "
                         "frequencies; allowed: a finite rope_theta > 0 (and finite scaling factors)")
    rotary = 2 * inv.shape[-1]
    if rotary > head_dim or rotary % 2:
        raise ExportError(f"{model_type}: RoPE covers {rotary} of {head_dim} head dims")
    return RopeSpec(rope_type, inv, float(attention_scaling), layer_type)
