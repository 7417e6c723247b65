"""Run a Hugging Face model on kvq's reference quantized cache.

``reference_hf_cache(scheme, num_layers)`` returns a ``transformers`` ``Cache`` whose layers store K/V
in a :class:`~kvq_export.reference.cache.ReferenceCache` and hand attention the dequantized tensors.
This is the PyTorch side every exported graph is compared against (one sequence per cache: the
reference does not model padding).

Rotated streams (``rotation`` of the scheme): Hugging Face attention keeps its unrotated queries, so the
layer stores ``x @ R`` and hands attention the dequantized K/V rotated back (``@ R.T``); scores and outputs
equal the exported graphs' rotated-basis attention up to float32 rounding, and the stored tensors equal
the graphs' present cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvq_export.reference.cache import LayerCache, ReferenceCache, StaticScales
from kvq_export.scheme import KVQuantScheme


class ReferenceLayer(DynamicLayer):
    """A DynamicLayer whose storage is a reference quantized LayerCache."""

    def __init__(self, layer: LayerCache) -> None:
        super().__init__()
        self.kvq = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new K/V and return what attention sees (dequantized, in the model dtype)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.kvq.update(key_states, value_states, key_states.dtype)
        return self.keys, self.values


def reference_hf_cache(
    scheme: KVQuantScheme, num_layers: int, static: StaticScales | None = None
) -> tuple[Cache, ReferenceCache]:
    """A transformers Cache backed by a new ReferenceCache (returned too, to inspect its state)."""
    ref = ReferenceCache(scheme, num_layers, static)
    return Cache(layers=[ReferenceLayer(layer) for layer in ref.layers]), ref
