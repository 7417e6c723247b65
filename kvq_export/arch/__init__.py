"""The architecture registry: which model families kvq reads, and where each keeps its weights and numbers.

* :mod:`kvq_export.arch.base` -- :class:`Arch`, the declarations a family makes, and ``@register``;
* :mod:`kvq_export.arch.families` -- the registered families (llama, mistral, qwen2/3, gemma 1-3, phi3, olmo2);
* :mod:`kvq_export.arch.rope` -- RoPE frequencies, computed by transformers' own functions.
"""

from __future__ import annotations

from kvq_export.arch import families as _families  # noqa: F401 - registers the families
from kvq_export.arch.base import (
    GELU_TANH_ACTIVATIONS,
    SILU_ACTIVATIONS,
    Arch,
    LayerNames,
    LinearNames,
    QkNorm,
    get_arch,
    register,
    supported_model_types,
)

__all__ = ["GELU_TANH_ACTIVATIONS", "SILU_ACTIVATIONS", "Arch", "LayerNames", "LinearNames", "QkNorm", "get_arch",
           "register", "supported_model_types"]
