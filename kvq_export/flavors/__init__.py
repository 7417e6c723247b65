"""The export flavours, declared: what each one builds, holds, refuses and runs on; one folder each.

A flavour is one way of putting the KV cache into the decoder graph, and lives in its own package:
``reference/`` (standard ONNX ops), ``ort_gqa/`` (ONNX Runtime's GroupQueryAttention, and the onnxruntime-genai
package of its exports), ``trt/`` (kvq's TensorRT plugin nodes). Each :class:`Flavor` row states its cache
layout, the :class:`~kvq_export.flavors.cache_graph.CacheGraph` class that builds it and checks what it can hold
(named by module path and imported only when a graph is built or a scheme checked, so ``import kvq_export``
stays light), the runtimes that can serve its exports and whether it needs kvq's plugins. Callers ask the
flavor, never its name::

    flavor = get_flavor("ort-gqa")
    flavor.unsupported(scheme, facts)  # [] or one reason per line
    graph = flavor.build(scheme, facts, static=static)

Adding a flavour is one folder and one :func:`register_flavor` line (``docs/howto/add-a-flavour.md``).
:data:`RUNTIME_FILES` names the step that writes what a runtime with files of its own reads (or says why it
cannot serve an export), run for every export.
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

    from kvq_export.flavors.cache_graph import CacheGraph
    from kvq_export.model_facts import ModelFacts
    from kvq_export.scheme import KVQuantScheme


class FlavorName(StrEnum):
    """The flavors kvq ships (a plain string in ``kvq.json``; a registered flavour may bring its own name)."""

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

    name: FlavorName | str
    layout: CacheLayout  # how the cache crosses the graph boundary
    graph: str  # "module:Class" of its CacheGraph (imported on first use)
    runtimes: tuple[Runtime, ...]
    needs_plugins: bool  # its graph calls kvq's TensorRT plugins (a runtime must register them first)
    about: str

    def graph_class(self) -> type[CacheGraph]:
        """The :class:`~kvq_export.flavors.cache_graph.CacheGraph` subclass that builds this flavor."""
        return _resolve(self.graph)

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


def _resolve(target: str) -> Any:
    """The object ``"module:name"`` names (its module imported on first use)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


#: name -> flavour: every flavour kvq can export (:func:`register_flavor` adds one)
FLAVORS: dict[str, Flavor] = {}


def register_flavor(flavor: Flavor) -> Flavor:
    """Add ``flavor`` to the table (a name taken already is refused); returns it."""
    if str(flavor.name) in FLAVORS:
        raise ExportError(f"flavor {flavor.name!r} is registered already")
    FLAVORS[str(flavor.name)] = flavor
    return flavor


register_flavor(Flavor(FlavorName.REFERENCE, REGIONS, "kvq_export.flavors.reference.graph:QuantizedCacheGraph",
                       (Runtime.ONNXRUNTIME, Runtime.TENSORRT), needs_plugins=False,
                       about="standard ONNX ops, any ONNX Runtime"))
register_flavor(Flavor(FlavorName.ORT_GQA, BUFFER, "kvq_export.flavors.ort_gqa.graph:GQACacheGraph",
                       (Runtime.ONNXRUNTIME, Runtime.GENAI), needs_plugins=False,
                       about="ONNX Runtime's fused GroupQueryAttention, static int8/int4"))
register_flavor(Flavor(FlavorName.TRT, REGIONS, "kvq_export.flavors.trt.graph:TrtCacheGraph", (Runtime.TENSORRT,),
                       needs_plugins=True, about="Triton/TensorRT plugin nodes"))

#: runtime -> "module:function" writing the files it reads into an export directory, or saying why it cannot
#: serve that export: ``(directory, manifest) -> RuntimeSupport`` (recorded in the manifest's ``runtimes``)
RUNTIME_FILES: dict[str, str] = {str(Runtime.GENAI): "kvq_export.flavors.ort_gqa.genai:write_genai_files"}


def write_runtime_files(directory: Any, manifest: Any) -> dict[str, Any]:
    """Run every :data:`RUNTIME_FILES` step on an export directory; runtime -> what each recorded."""
    return {runtime: _resolve(step)(directory, manifest) for runtime, step in RUNTIME_FILES.items()}


def flavor_names() -> list[str]:
    """Every flavor kvq can export, as ``--flavor`` spells them."""
    return [str(name) for name in FLAVORS]


def get_flavor(name: FlavorName | str) -> Flavor:
    """The flavor called ``name``; an unknown name is refused with the allowed ones."""
    try:
        return FLAVORS[str(name)]
    except KeyError:
        raise ExportError(f"unknown flavor {name!r}; allowed: {', '.join(flavor_names())}") from None
