"""The ``trt`` export flavour: the reference cache update, then one TensorRT plugin node per layer.

Per layer, :meth:`QuantizedCacheGraph.store` appends the new tokens with standard ONNX ops exactly as in
the reference flavour (so the cache inputs/outputs and the stored state are identical), and instead of
dequantizing the whole cache and running attention in the graph, one node calls the fused kernel:
``op_type`` = plugin name, ``domain`` = plugin namespace, the plugin attributes plus
``plugin_namespace`` and ``aot`` (TensorRT's ONNX parser maps such a node to the registered
``tensorrt.plugin``), all from :func:`kvq_export.flavors.trt.signature.plugin_signature`.

Rotated schemes need nothing from the plugin: the decoder body rotates q (and the stored k) after RoPE and
folds the value rotation into ``v_proj``/``o_proj``, so the plugin attends in the stored basis and its output
comes back rotated for ``o_proj`` to undo (see :mod:`kvq_export.flavors.trt.signature`).

The model carries no local function body for the plugin op: TensorRT's parser would inline a body instead
of calling the plugin. ONNX Runtime therefore cannot run this flavour; compare it with the reference
flavour through TensorRT (:func:`kvq_export.trt.compare_with_onnxruntime`).
"""

from __future__ import annotations

import onnx_ir as ir

from kvq_export.dtypes import DType
from kvq_export.flavors.cache_graph import AttentionInputs
from kvq_export.flavors.reference.graph import QuantizedCacheGraph, RegionCall, StoredStream, name_probes
from kvq_export.flavors.trt.signature import PluginSignature, plugin_signature
from kvq_export.graph.builder import GraphBuilder
from kvq_export.graph.decoder_spec import DecoderSpec
from kvq_export.model_facts import CacheGeometry
from kvq_export.scheme import KVQuantScheme
from kvq_export.vocab import Part


class TrtCacheGraph(QuantizedCacheGraph):
    """:class:`QuantizedCacheGraph` whose attention is one fused plugin node per layer.

    Args:
        scheme, geometry: as for :class:`QuantizedCacheGraph`.
        aot: mark nodes for the ahead-of-time implementation (PTX inside the engine; runs without Python).
    """

    #: the plugin kernel computes the scores itself and has no soft-capping
    supports_attn_softcap = False

    def __init__(self, scheme: KVQuantScheme, geometry: CacheGeometry, *, aot: bool = True, **options) -> None:
        super().__init__(scheme, geometry, **options)
        self.aot = aot

    def signature(self, layer: int, spec: DecoderSpec) -> PluginSignature:
        """The plugin signature of ``layer`` for the decoder of ``spec``."""
        return plugin_signature(self.scheme, layer, spec.facts, dtype=DType.of_onnx(spec.dtype).short)

    def attend(self, b: GraphBuilder, layer: int, inputs: AttentionInputs[RegionCall]) -> ir.Value:
        """Store k/v with standard ops, then one plugin node reads the stored cache and attends for q."""
        call, (q, k, v) = inputs.call, inputs.qkv
        key_tq, value_tq = self.scheme.for_layer(layer)
        name_probes(b, layer, q, k, v)
        with b.scope(f"kv{layer}"):
            states = {Part.KEY: self.store(b, call, layer, Part.KEY, key_tq, k),
                      Part.VALUE: self.store(b, call, layer, Part.VALUE, value_tq, v)}
            sig = self.signature(layer, call.spec)
            node_inputs = [q, call.n1] + [_role_value(states[i.part], i.role) for i in sig.inputs[2:]]
            out = b.op(sig.name, *node_inputs, domain=sig.namespace, **sig.node_attributes(aot=self.aot))
        return out


def _role_value(state: StoredStream, role: str) -> ir.Value:
    """The graph value of one stored role (static metadata included: the calibrated constant)."""
    value = {"sinks": state.sinks, "codes": state.codes, "scales": state.scales, "zero_points": state.zeros,
             "recent": state.recent, "channel_order": state.high.order if state.high else None}[role]
    if value is None:
        raise AssertionError(f"stream has no {role} value")  # the signature and the store disagree: a bug
    return value
