"""kvq: deploy LLMs with a quantized KV cache through ONNX and TensorRT.

``import kvq_export`` is cheap and never imports torch, onnxruntime, triton or tensorrt; the heavier
parts are submodules (``kvq_export.reference``, ``kvq_export.memory``, ...) imported on use.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from kvq_export.errors import (
    DependencyError,
    ExportError,
    KVQError,
    ModelError,
    QuantizationError,
    RuntimeInputError,
    SchemeError,
)
from kvq_export.presets import PRESETS, get_preset, preset_names, resolve_scheme
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant

try:
    __version__ = version("kvq")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

__all__ = [
    "PRESETS",
    "DependencyError",
    "ExportError",
    "KVQError",
    "KVQuantScheme",
    "LayerOverride",
    "ModelError",
    "QuantizationError",
    "RuntimeInputError",
    "SchemeError",
    "TensorQuant",
    "get_preset",
    "preset_names",
    "resolve_scheme",
]
