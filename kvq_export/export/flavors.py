"""The export flavors, declared: what each one builds, holds, refuses and runs on.

A flavor is one way of putting the KV cache into the decoder graph. Each :class:`Flavor` states its cache
layout, the :class:`~kvq_export.export.cache_graph.CacheGraph` class that builds it (named by module path and
imported only when a graph is built or a scheme checked, so ``import kvq_export`` stays light), the runtimes
that can serve its exports and whether it needs kvq's plugins. Callers ask the flavor, never its name::

    flavor = get_flavor("ort-gqa")
    flavor.unsupported(scheme, facts)  # [] or one reason per line
    graph = flavor.build(scheme, facts, static=static)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kvq_export.cache_layout import BUFFER, REGIONS, CacheLayout
from kvq_export.errors import ExportError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvq_export.export.cache_graph import CacheGraph
    from kvq_export.model_facts import ModelFacts
    from kvq_export.scheme import KVQuantScheme


class FlavorName(StrEnum):
    """The flavors kvq can export (a plain string in ``kvq.json``)."""

    REFERENCE = "reference"
    ORT_GQA = "ort-gqa"
    TRT = "trt"


class Runtime(StrEnum):
    """What can run an export."""

    ONNXRUNTIME = "onnxruntime"  # kvq's own loop (KVQSession) on ONNX Runtime
    GENAI = "onnxruntime-genai"  # onnxruntime-genai's C++ loop (schemes its GroupQueryAttention holds)
    TENSORRT = "tensorrt"  # a TensorRT engine built from the export (kvq build; no com.microsoft ops)


@dataclass(frozen=True)
class Flavor:
    """One export flavor and its declared capabilities."""

    name: FlavorName
    layout: CacheLayout  # how the cache crosses the graph boundary
    graph: str  # "module:Class" of its CacheGraph (imported on first use)
    runtimes: tuple[Runtime, ...]
    needs_plugins: bool  # its graph calls kvq's TensorRT plugins (a runtime must register them first)
    about: str

    def graph_class(self) -> type[CacheGraph]:
        """The :class:`~kvq_export.export.cache_graph.CacheGraph` subclass that builds this flavor."""
        module, _, name = self.graph.partition(":")
        return getattr(importlib.import_module(module), name)

    def unsupported(self, scheme: KVQuantScheme, facts: ModelFacts | None = None) -> list[str]:
        """Why this flavor cannot hold ``scheme`` (for the model of ``facts``, when given); empty when it can."""
        num_layers = facts.num_layers if facts is not None else _layers_named(scheme)
        return self.graph_class().unsupported(scheme, num_layers, facts.head_dim if facts is not None else None)

    def check(self, scheme: KVQuantScheme, facts: ModelFacts | None = None) -> None:
        """Refuse ``scheme`` in one line listing :meth:`unsupported`'s reasons, if there are any."""
        reasons = self.unsupported(scheme, facts)
        if reasons:
            raise ExportError(f"flavor {self.name} cannot hold scheme {scheme.name or 'custom'}: " + "; ".join(reasons))

    def build(self, scheme: KVQuantScheme, facts: ModelFacts, *,
              static: Mapping[int, Mapping[str, Mapping[str, Any]]] | None = None) -> CacheGraph:
        """Build the cache graph for ``scheme`` on the model of ``facts`` (refused with the reasons)."""
        self.check(scheme, facts)
        return self.graph_class().for_model(scheme, facts, static=static)

    def serves(self, runtime: Runtime | str) -> bool:
        """Whether ``runtime`` can run this flavor's exports."""
        return Runtime(runtime) in self.runtimes


def _layers_named(scheme: KVQuantScheme) -> int:
    """Enough layers to check every layer ``scheme`` names (its overrides) when the model is not known."""
    return 1 + max((o.layer for o in scheme.layer_overrides), default=0)


FLAVORS: dict[FlavorName, Flavor] = {flavor.name: flavor for flavor in (
    Flavor(FlavorName.REFERENCE, REGIONS, "kvq_export.export.kv_graph:QuantizedCacheGraph",
           (Runtime.ONNXRUNTIME, Runtime.TENSORRT), needs_plugins=False, about="standard ONNX ops, any ONNX Runtime"),
    Flavor(FlavorName.ORT_GQA, BUFFER, "kvq_export.export.gqa_flavor:GQACacheGraph",
           (Runtime.ONNXRUNTIME, Runtime.GENAI), needs_plugins=False,
           about="ONNX Runtime's fused GroupQueryAttention, static int8/int4"),
    Flavor(FlavorName.TRT, REGIONS, "kvq_export.export.trt_flavor:TrtCacheGraph", (Runtime.TENSORRT,),
           needs_plugins=True, about="Triton/TensorRT plugin nodes"),
)}


def flavor_names() -> list[str]:
    """Every flavor kvq can export, as ``--flavor`` spells them."""
    return [str(name) for name in FLAVORS]


def get_flavor(name: FlavorName | str) -> Flavor:
    """The flavor called ``name``; an unknown name is refused with the allowed ones."""
    try:
        return FLAVORS[FlavorName(name)]
    except ValueError:
        raise ExportError(f"unknown flavor {name!r}; allowed: {', '.join(flavor_names())}") from None
