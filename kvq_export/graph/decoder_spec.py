"""What a cache graph needs to know about the decoder it serves: :class:`DecoderSpec`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx_ir as ir

from kvq_export.arch.rope import RopeSpec
from kvq_export.errors import ExportError

if TYPE_CHECKING:
    from kvq_export.arch import Arch
    from kvq_export.model_facts import ModelFacts


@dataclass(frozen=True)
class DecoderSpec:
    """What a cache graph needs to know about the decoder it serves: the model's facts and how the graph computes.

    The model's numbers are :attr:`facts`, the same object ``kvq.json``'s ``model`` section records (a layer's
    sliding window is ``facts.window(layer)``); the other fields are what only the graph needs: the compute dtype,
    the RoPE tables and the attention soft-cap.
    """

    facts: ModelFacts
    dtype: ir.DataType  # compute dtype of q/k/v and of the attention output
    rope: RopeSpec | None = field(default=None, compare=False)  # the global layers' RoPE
    layer_ropes: tuple[RopeSpec, ...] = field(default=(), compare=False)  # per layer; empty: ``rope`` everywhere
    attn_softcap: float | None = None  # cap * tanh(scores / cap) on the scaled scores, before the mask

    def rope_for(self, layer: int) -> RopeSpec | None:
        """The RoPE of ``layer`` (Gemma3's local layers have their own base)."""
        return self.layer_ropes[layer] if self.layer_ropes else self.rope

    @classmethod
    def of(cls, facts: ModelFacts, arch: Arch, dtype: ir.DataType) -> DecoderSpec:
        """The spec of a body computed in ``dtype`` for the model of ``facts``, with ``arch``'s RoPE and soft-cap."""
        distinct = {w for w in facts.sliding_windows if w is not None}
        if len(distinct) > 1:
            raise ExportError(f"{facts.model_type}: layers use different sliding windows {sorted(distinct)}")
        ropes = tuple(arch.layer_rope(i) for i in range(facts.num_layers))
        return cls(facts, dtype, rope=arch.rope(), layer_ropes=ropes, attn_softcap=arch.attn_logit_softcap)
