"""The contract between the decoder body and a flavour's KV cache: :class:`CacheGraph`.

What the cache graph is told about the decoder it serves is a :class:`~kvq_export.graph.decoder_spec.DecoderSpec`.

The body (:mod:`kvq_export.export.decoder`) owns the weights, norms, projections and RoPE; a cache graph declares
the past/present cache tensors and computes attention over them. One call of the graph runs in three steps, and
the data flows through their arguments and results, never through attributes set on the cache graph:

* :meth:`CacheGraph.begin` declares the past inputs and returns a frozen :class:`CallValues` record (the new
  tokens' positions and whatever per-call values the flavour's attention reads);
* :meth:`CacheGraph.attend` gets, per layer, one :class:`AttentionInputs` (that record and q/k/v in the
  :class:`AttentionForm` the cache graph declares in :attr:`CacheGraph.attention`);
* :meth:`CacheGraph.end` declares the present outputs the layers recorded in the record's ``present``.

Other declarations are class attributes with base defaults (soft-capped scores, ONNX Runtime's fused body,
rotated streams through :meth:`CacheGraph.rotation`), so the body never probes for methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import onnx_ir as ir

from kvq_export.errors import ExportError
from kvq_export.graph.builder import GraphBuilder
from kvq_export.graph.decoder_spec import DecoderSpec
from kvq_export.vocab import Part

if TYPE_CHECKING:
    from kvq_export.model_facts import ModelFacts
    from kvq_export.scheme import KVQuantScheme


class AttentionForm(StrEnum):
    """The form in which the body hands a layer's q/k/v to :meth:`CacheGraph.attend` (and gets the output back).

    * ``heads``: q ``[B, Hq, t, D]``, k/v ``[B, Hkv, t, D]``, RoPE applied -> ``[B, Hq, t, D]``;
    * ``packed``: ``qkv`` ``[B, t, (Hq + 2 Hkv) * D]`` with RoPE applied (ONNX Runtime's packed GQA input; the
      body applies RoPE on the packed projection, :meth:`kvq_export.graph.rope.RotaryGraph.apply_packed`)
      -> ``[B, t, Hq * D]``;
    * ``projected``: straight from the projections, no RoPE (the cache graph's kernel applies it from
      ``spec.rope``; :meth:`CacheGraph.begin` may then return no positions): q ``[B, t, Hq * D]``, k/v
      ``[B, t, Hkv * D]``, or the fused projection's ``concat(q, k, v)`` as ``packed`` alone -> ``[B, t, Hq * D]``.

    A cache graph that declares ``packed`` also takes ``heads``: the body falls back to it where something sits
    between RoPE and attention that the packed form cannot carry (a value rotation in the graph).
    """

    HEADS = "heads"
    PACKED = "packed"
    PROJECTED = "projected"


@dataclass(frozen=True)
class CallValues:
    """What :meth:`CacheGraph.begin` computed for one call of the graph, read by every layer's attention.

    Flavours extend it with their own per-call graph values. ``past`` holds the declared past inputs by name and
    ``present`` collects the present outputs the layers produce (by name) for :meth:`CacheGraph.end`.
    """

    spec: DecoderSpec
    #: int64 ``[B, t]`` positions of the new tokens (None when the cache graph applies RoPE itself)
    positions: ir.Value | None
    past: dict[str, ir.Value] = field(default_factory=dict)
    present: dict[str, ir.Value] = field(default_factory=dict)

    @property
    def compute_type(self) -> ir.DataType:
        """The compute dtype of q/k/v and of the attention output."""
        return self.spec.dtype


C = TypeVar("C", bound=CallValues)


@dataclass(frozen=True)
class AttentionInputs(Generic[C]):
    """One layer's attention inputs in one :class:`AttentionForm`, with the call's :class:`CallValues`.

    ``heads``: q, k, v set. ``packed``: ``packed`` set. ``projected``: q, k, v set, or ``packed`` alone.
    """

    form: AttentionForm
    call: C
    q: ir.Value | None = None
    k: ir.Value | None = None
    v: ir.Value | None = None
    packed: ir.Value | None = None

    def __post_init__(self) -> None:
        separate = self.q is not None and self.k is not None and self.v is not None
        none = self.q is None and self.k is None and self.v is None
        ok = {AttentionForm.HEADS: separate and self.packed is None,
              AttentionForm.PACKED: none and self.packed is not None,
              AttentionForm.PROJECTED: separate != (self.packed is not None) and (separate or none)}[self.form]
        if not ok:
            raise ExportError(f"attention inputs of form {self.form} need "
                              + {AttentionForm.HEADS: "q, k and v", AttentionForm.PACKED: "the packed q|k|v alone",
                                 AttentionForm.PROJECTED: "q, k and v, or the packed q|k|v alone"}[self.form])

    @property
    def qkv(self) -> tuple[ir.Value, ir.Value, ir.Value]:
        """q, k and v (forms that carry them separately)."""
        if self.q is None or self.k is None or self.v is None:
            raise ExportError(f"these {self.form} attention inputs carry the packed q|k|v, not q, k and v")
        return self.q, self.k, self.v


class CacheGraph(ABC, Generic[C]):
    """The KV-cache part of the graph: declares cache inputs/outputs and computes attention.

    Every flavour's cache graph subclasses it. What a cache graph takes and does is declared by the class
    attributes below (a variant is a small subclass); the body reads them and never probes for methods. A cache
    graph holds its configuration only: what one call computes travels in the :class:`CallValues` record
    :meth:`begin` returns.
    """

    #: the form in which :meth:`attend` takes q/k/v (see :class:`AttentionForm`)
    attention: AttentionForm = AttentionForm.HEADS
    #: it runs on ONNX Runtime anyway, so the body may use ONNX Runtime's fused nodes (see
    #: :class:`kvq_export.export.decoder._Body`)
    fuses_body: bool = False
    #: its attention applies ``spec.attn_softcap`` (Gemma2's attention soft-capping)
    supports_attn_softcap: bool = False

    @classmethod
    def unsupported(cls, scheme: KVQuantScheme, num_layers: int, head_dim: int | None = None) -> list[str]:
        """Why this cache graph cannot hold ``scheme`` (one line per reason; empty when it can)."""
        return []

    @classmethod
    def for_model(cls, scheme: KVQuantScheme, facts: ModelFacts, *,
                  static: Mapping[int, Mapping[str, Mapping[str, Any]]] | None = None) -> CacheGraph:
        """Build the cache graph for ``scheme`` on the model of ``facts`` (with calibrated ``static`` metadata)."""
        return cls(scheme, facts, static=static)

    @abstractmethod
    def begin(self, b: GraphBuilder, *, attention_mask: ir.Value, spec: DecoderSpec) -> C:
        """Declare the past-cache graph inputs; return this call's values (``positions``: int64 [B, t])."""

    @abstractmethod
    def attend(self, b: GraphBuilder, layer: int, inputs: AttentionInputs[C]) -> ir.Value:
        """``layer``'s attention over the cache, in the form of ``inputs`` (see :class:`AttentionForm`)."""

    @abstractmethod
    def end(self, b: GraphBuilder, call: C) -> None:
        """Declare the present-cache graph outputs."""

    def rotation(self, layer: int, part: Part) -> np.ndarray | None:
        """``R`` [D, D] (float64) ``layer``'s ``key``/``value`` stream is stored in, or None when it is not rotated."""
        return None
