"""Optional heavy dependencies, imported in one place only when used.

GPU stacks (triton, tensorrt, onnxruntime-gpu) are never imported at module top; code that needs them
calls :func:`require`, which raises a one-line :class:`DependencyError` saying what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvq_export.errors import DependencyError

#: module -> how to install it
INSTALL_HINTS = {
    "triton": "pip install 'kvq[gpu]' (triton; on CPU set TRITON_INTERPRET=1 before importing it)",
    "tensorrt": "TensorRT >= 10.9 from NVIDIA (pip install 'kvq[trt]' where NVIDIA's index is reachable)",
    "tensorrt.plugin": "TensorRT >= 10.9 with the Python plugin API (pip install 'kvq[trt]')",
}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise a DependencyError naming how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        hint = INSTALL_HINTS.get(module, f"pip install {module.split('.')[0]}")
        raise DependencyError(f"{module} is not available ({err}); install: {hint}") from None


def available(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False
