"""Run a Hugging Face model on kvq's reference quantized cache.

``reference_hf_cache(scheme, num_layers)`` returns a ``transformers`` ``Cache`` whose layers store K/V
in a :class:`~kvq_export.reference.cache.ReferenceCache` and hand attention the dequantized tensors.
This is the PyTorch side every exported graph is compared against (one sequence per cache: the
reference does not model padding).

Rotated streams (``rotation`` of the scheme): Hugging Face attention keeps its unrotated queries, so the
layer stores ``x @ R`` and hands attention the dequantized K/V rotated back (``@ R.T``); scores and outputs
equal the exported graphs' rotated-basis attention up to float32 rounding, and the stored tensors equal
the graphs' present cache.

``exact_prefill=True`` models ``--flavor ort-gqa``'s prefill (see :mod:`kvq_export.flavors.ort_gqa.graph`): an
update of more than one token (a prompt, or a chunk of one), or the first, stores its K/V as usual but hands
attention the stored cache's earlier tokens followed by the new K/V themselves, so a call's tokens attend
exactly among themselves; a later one-token update attends over the stored cache, its own token's codes included.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvq_export.reference.cache import LayerCache, ReferenceCache, StaticScales
from kvq_export.scheme import KVQuantScheme


class ReferenceLayer(DynamicLayer):
    """A DynamicLayer whose storage is a reference quantized LayerCache."""

    def __init__(self, layer: LayerCache, *, exact_prefill: bool = False) -> None:
        super().__init__()
        self.kvq = layer
        self.exact_prefill = exact_prefill

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new K/V and return what attention sees (dequantized, in the model dtype).

        With ``exact_prefill`` an update of several tokens, or the first, returns the earlier tokens' dequantized
        K/V followed by the new K/V unchanged (they are stored all the same).
        """
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.kvq.update(key_states, value_states, key_states.dtype)
        new = key_states.shape[-2]
        if self.exact_prefill and (first or new > 1):
            held = self.keys.shape[-2] - new
            return (torch.cat([self.keys[..., :held, :], key_states], dim=-2),
                    torch.cat([self.values[..., :held, :], value_states], dim=-2))
        return self.keys, self.values


def reference_hf_cache(
    scheme: KVQuantScheme, num_layers: int, static: StaticScales | None = None, *, exact_prefill: bool = False
) -> tuple[Cache, ReferenceCache]:
    """A transformers Cache backed by a new ReferenceCache (returned too, to inspect its state)."""
    ref = ReferenceCache(scheme, num_layers, static)
    return Cache(layers=[ReferenceLayer(layer, exact_prefill=exact_prefill) for layer in ref.layers]), ref
