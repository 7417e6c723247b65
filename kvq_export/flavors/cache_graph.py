"""The contract between the decoder body and a flavour's KV cache: :class:`CacheGraph`.

What the cache graph is told about the decoder it serves is a :class:`~kvq_export.graph.decoder_spec.DecoderSpec`.

The body (:mod:`kvq_export.export.decoder`) owns the weights, norms, projections and RoPE; a cache graph declares
the past/present cache tensors and computes attention over them. What a cache graph can take (raw projections,
a packed q|k|v, a fused body, soft-capped scores, rotated streams) it declares with class-level flags and hooks,
which the body reads through the small predicates at the end of this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from kvq_export.graph.builder import GraphBuilder
from kvq_export.graph.decoder_spec import DecoderSpec

if TYPE_CHECKING:
    from kvq_export.model_facts import ModelFacts
    from kvq_export.scheme import KVQuantScheme


class CacheGraph(ABC):
    """The KV-cache part of the graph: declares cache inputs/outputs and computes attention.

    Every flavour's cache graph subclasses it. What a cache graph can do is declared by the class-level flags
    below (a subclass, or an instance whose choice depends on the scheme, sets its own); the body reads the
    flags and never probes for methods. The optional hooks have base defaults: no rotation, and the fused
    attention entry points refuse unless the flag that selects them is set.
    """

    #: its attention applies RoPE itself and takes the raw projections through :meth:`attend_projected`
    #: (its :meth:`begin` may then return None: the body builds no cos/sin tables; RoPE comes from ``spec.rope``)
    fuses_rotary: bool = False
    #: its kernel reads rope-applied q|k|v packed in one value, through :meth:`attend_packed` (ONNX Runtime's
    #: packed GQA input; the body then applies RoPE on the packed projection, see
    #: :meth:`kvq_export.graph.rope.RotaryGraph.apply_packed`)
    attends_packed: bool = False
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
    def begin(self, b: GraphBuilder, *, attention_mask: ir.Value, spec: DecoderSpec) -> ir.Value | None:
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
    """Whether ``cache``'s runtime takes ONNX Runtime's fused body (``fuses_body = True``; see ``decoder._Body``)."""
    return cache.fuses_body
