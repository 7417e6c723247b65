"""TensorRT: the plugin signature, engine build and comparison against ONNX Runtime.

``import kvq_export.trt`` never imports tensorrt (nor triton); :func:`build_engine` and
:func:`compare_with_onnxruntime` raise a one-line :class:`~kvq_export.errors.DependencyError` naming what
to install when TensorRT is missing::

    from kvq_export.trt import build_engine, compare_with_onnxruntime
    engine = build_engine("out/kivi4-trt", fp16=True, max_batch=8, max_context=8192)
    ok = compare_with_onnxruntime("out/kivi4-trt")       # vs the reference flavour on ONNX Runtime
"""

from __future__ import annotations

from kvq_export.flavors.trt.signature import PLUGIN_NAMESPACE, PluginSignature, manifest_signatures, plugin_signature
from kvq_export.trt.compare import compare_with_onnxruntime
from kvq_export.trt.engine import ENGINE_NAME, build_engine, engine_profiles

__all__ = [
    "ENGINE_NAME",
    "PLUGIN_NAMESPACE",
    "PluginSignature",
    "build_engine",
    "compare_with_onnxruntime",
    "engine_profiles",
    "manifest_signatures",
    "plugin_signature",
]
