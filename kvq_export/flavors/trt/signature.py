"""The TensorRT plugin's signature, derived from the scheme and the cache naming (written once, here).

One fused attention node per layer replaces the reference flavour's dequantize + attention. Its
signature — plugin name and namespace, ordered inputs with their roles and dtypes, attributes — comes from
:func:`plugin_signature`; the ``trt`` export flavour emits nodes from it and
:mod:`kvq_plugins.trt_plugin` registers the TensorRT plugin from it, so neither spells a name, an input
or an attribute on its own.

Inputs, in order: the rope-applied query ``q [B, Hq, t, D]`` (compute dtype), the *present*
``seq_lengths`` (int64 ``[B]``, this call's tokens included), then for keys and then values the stored
tensors of the ``regions`` layout (:data:`kvq_export.cache_layout.REGIONS`: ``sinks``, ``codes``, ``scales``,
``zero_points``, ``recent`` — those the stream has), with a static stream's calibrated ``[kv_heads, n]`` scales
(and zero points) in their place, and for a stream with high channels its ``channel_order`` (int32
``[kv_heads, head_dim]``: stored position -> channel, a graph constant) last. One output: the attention
``[B, Hq, t, D]`` in the compute dtype.

Rotation is outside the contract: for a scheme with rotated streams (:mod:`kvq_export.rotation`) the
graph hands the plugin q already multiplied by the key stream's ``R`` (after RoPE), the stored tensors hold
rotated rows, and the output (``o @ R_value``) is rotated back by the folded ``o_proj``. The plugin attends
over whatever basis it is given, so its attributes do not carry the rotation and one plugin serves both.

The plugin name says which inputs there are: ``kvq_attention_{key}_{value}`` with ``fp16`` (only
``recent``), ``sym`` (sinks, codes, scales, recent), ``asym`` (with zero points), ``symhc`` or ``asymhc`` (either
with the channel order of its high channels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvq_plugins.layout import StreamLayout

from kvq_export.cache_layout import REGIONS
from kvq_export.dtypes import DType, onnx_name
from kvq_export.model_facts import ModelFacts
from kvq_export.naming import PARTS, tensor_name
from kvq_export.scheme import KVQuantScheme
from kvq_export.vocab import Part, plain

PLUGIN_NAMESPACE = "kvq"
PLUGIN_PREFIX = "kvq_attention"


@dataclass(frozen=True)
class PluginInput:
    """One plugin input: its argument name, role, stream, ONNX dtype and the graph value that feeds it."""

    name: str  # argument name of the plugin functions (q, seq_lengths, key_codes, ...)
    role: str  # query | seq_lengths | sinks | codes | scales | zero_points | recent
    part: Part | None  # None for the query and seq_lengths
    dtype: str  # ONNX element type name
    source: str | None  # graph value name (present cache tensor / static initializer); None for the query


@dataclass(frozen=True)
class PluginSignature:
    """Everything a plugin node and the plugin registration agree on."""

    name: str
    namespace: str
    inputs: tuple[PluginInput, ...]
    attributes: tuple[tuple[str, int | float | str], ...]  # ordered (name, value)
    output_dtype: str

    @property
    def plugin_id(self) -> str:
        """``namespace::name`` as ``tensorrt.plugin.register`` takes it."""
        return f"{self.namespace}::{self.name}"

    @property
    def attribute_dict(self) -> dict[str, int | float | str]:
        """Attributes by name, in order."""
        return dict(self.attributes)

    def node_attributes(self, *, aot: bool = True) -> dict[str, int | float | str]:
        """The ONNX node's attributes: the plugin attributes plus ``plugin_namespace`` and ``aot``.

        TensorRT's ONNX parser reads those two; ``aot=1`` picks the ahead-of-time implementation.
        """
        return {**self.attribute_dict, "plugin_namespace": self.namespace, "aot": int(aot)}

    def io_types(self, compute: str | None = None) -> list[str]:
        """TensorRT type names of every input then the output (q and output in ``compute``, if given)."""
        out = self.output_dtype if compute is None else onnx_name(compute)
        types = [out if i.role == "query" else i.dtype for i in self.inputs] + [out]
        return [DType.get(t).trt_tuning for t in types]

    def structure(self) -> tuple:
        """What a registration fixes: name, input names and attribute names with their Python types."""
        return (self.plugin_id, tuple(i.name for i in self.inputs),
                tuple((k, type(v).__name__) for k, v in self.attributes))


def plugin_signature(scheme: KVQuantScheme, layer: int, facts: ModelFacts, *, dtype: str = "fp32") -> PluginSignature:
    """The signature of ``layer``'s plugin node for the model of ``facts`` (heads, head_dim, scaling, window)."""
    from kvq_export.graph.codec import static_name  # lazy: imports torch and onnx

    compute = onnx_name(dtype)
    lengths = tensor_name("present", None, None, "seq_lengths")
    inputs = [PluginInput("q", "query", None, compute, None),
              PluginInput("seq_lengths", "seq_lengths", None, "int64", lengths)]
    attributes: dict[str, Any] = {
        "num_heads": int(facts.num_heads), "num_kv_heads": int(facts.num_kv_heads), "head_dim": int(facts.head_dim),
        "scale": float(facts.scaling), "window": int(facts.window(layer) or 0),
        "sink_tokens": scheme.sink_tokens, "hp_dtype": scheme.hp_dtype,
    }
    tags = []
    for part, tq in zip(PARTS, scheme.for_layer(layer)):
        layout = StreamLayout.of(tq, scheme, facts.head_dim)
        stored = {t.role: t for t in REGIONS.stream_tensors("present", layer, part, tq, scheme, facts)}
        for role in layout.roles:
            if role in stored:
                inputs.append(PluginInput(f"{part}_{role}", role, part, stored[role].dtype, stored[role].name))
            else:  # static metadata or the channel order: a graph constant, not cache state
                dtype = "int32" if role == "channel_order" else onnx_name(tq.scale_dtype)
                inputs.append(PluginInput(f"{part}_{role}", role, part, dtype, static_name(layer, part, role)))
        tags.append(layout.tag)
        # plain str/int/float: ONNX attributes and TensorRT plugin fields are typed by their Python type
        attributes.update({key: plain(value) for key, value in layout.attributes(part).items()})
    return PluginSignature(f"{PLUGIN_PREFIX}_{tags[0]}_{tags[1]}", PLUGIN_NAMESPACE, tuple(inputs),
                           tuple(attributes.items()), compute)


def manifest_signatures(manifest) -> list[PluginSignature]:
    """Every layer's signature for an export's :class:`~kvq_export.manifest.Manifest` (its model facts)."""
    return [plugin_signature(manifest.scheme, layer, manifest.model, dtype=manifest.dtype)
            for layer in range(manifest.num_layers)]
