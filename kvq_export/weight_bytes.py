"""What an export directory's weights hold, by role.

The quantized payload, the scales and zero points, and the unquantized rest (by dtype), for showing beside the
cache's bytes (``kvq describe``, validation, capacity).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from kvq_export.dtypes import DType
from kvq_export.errors import ExportError
from kvq_export.graph.builder import CONTRIB_DOMAIN, EXTERNAL_DATA_SUFFIX
from kvq_export.graph.qgemm import FUNCTION_DOMAIN, QGEMM_ROWS
from kvq_export.graph.weights import WEIGHTS_KEY, attribute, is_parameter
from kvq_export.manifest import MODEL_NAME


# -- what an export's weights weigh ---------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightBytes:
    """Initializer bytes of one graph, by role (shared initializers counted once).

    ``quantized``: the integer payload of MatMulNBits / GatherBlockQuantized or of w8a8's QGemmRows;
    ``scales``: their scales and zero points; ``unquantized``: every other initializer by dtype (``fp32``, ``fp16``,
    ``int64``, ...): float weights, norms, small constants. ``constants``: the part of ``unquantized`` that is the
    graph's own (rope tables, rotations, shape constants), not the model's weights. ``settings``: what
    :func:`quantize_weights` recorded in the graph (empty if nothing). ``files``: bytes of ``model.onnx`` and its
    external data on disk.
    """

    format: str
    quantized: int
    scales: int
    unquantized: dict[str, int]
    files: int
    settings: dict[str, Any] = field(default_factory=dict)
    constants: int = 0

    @property
    def total(self) -> int:
        """All initializer bytes."""
        return self.quantized + self.scales + sum(self.unquantized.values())

    @property
    def parameters(self) -> int:
        """Bytes of the model's weights (what :func:`kvq_export.memory.predict_weights` predicts)."""
        return self.total - self.constants

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"format": self.format, "quantized": self.quantized, "scales": self.scales,
                "unquantized": dict(self.unquantized), "total": self.total, "parameters": self.parameters,
                "constants": self.constants, "files": self.files, "settings": dict(self.settings)}

    def describe(self) -> str:
        """One line: ``int4 weights 77.9 MB: 62.1 MB quantized + 15.5 MB scales/zero points + 0.3 MB unquantized``."""
        rest = sum(self.unquantized.values())
        biggest = ", ".join(f"{name} {_mb(n)}" for name, n in sorted(self.unquantized.items(), key=lambda kv: -kv[1])
                            if n >= 0.05 * rest)
        return (f"{self.format} weights {_mb(self.total)}: {_mb(self.quantized)} quantized + {_mb(self.scales)} "
                f"scales/zero points + {_mb(rest)} unquantized ({biggest or 'none'})")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def weight_bytes(directory: str | os.PathLike[str]) -> WeightBytes:
    """:class:`WeightBytes` of an export directory's ``model.onnx`` (reads the graph, not the weight data)."""
    path = Path(directory) / MODEL_NAME
    if not path.is_file():
        raise ExportError(f"{directory} has no {MODEL_NAME}")
    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    made_by = {o: n for n in graph.node for o in n.output}

    def source(name: str) -> str:  # through the Reshape a shared gather table is read by
        node = made_by.get(name)
        return node.input[0] if node is not None and node.op_type == "Reshape" else name

    payload, scales, bits = set(), set(), set()
    for node in graph.node:
        if node.domain == CONTRIB_DOMAIN and node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            payload.add(source(node.input[0] if node.op_type == "GatherBlockQuantized" else node.input[1]))
            scales.update(x for x in node.input[2:4] if x)
            bits.add(attribute(node, "bits", 4))
        elif node.domain == FUNCTION_DOMAIN and node.op_type == QGEMM_ROWS:
            payload.add(source(node.input[1]))
            scales.add(node.input[2])
    quantized = scale_bytes = constants = 0
    unquantized: dict[str, int] = {}
    for tensor in graph.initializer:
        size = _tensor_bytes(tensor)
        if tensor.name in payload:
            quantized += size
        elif tensor.name in scales:
            scale_bytes += size
        else:
            dtype = _dtype_name(tensor.data_type)
            unquantized[dtype] = unquantized.get(dtype, 0) + size
            constants += 0 if is_parameter(tensor.name) else size
    settings = {}
    for prop in proto.metadata_props:
        if prop.key == WEIGHTS_KEY:
            settings = json.loads(prop.value)
    if settings.get("format"):
        fmt = settings["format"]
    elif bits:
        fmt = "+".join(f"int{b}" for b in sorted(bits))
    else:  # as built: the float dtype holding most bytes
        floats = {k: v for k, v in unquantized.items() if k in ("fp32", "fp16", "bf16")}
        fmt = max(floats, key=floats.get) if floats else "none"
    data = path.with_name(path.name + EXTERNAL_DATA_SUFFIX)
    files = path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    return WeightBytes(fmt, quantized, scale_bytes, unquantized, files, settings, constants)


def _dtype_name(element_type: int) -> str:
    """An initializer's element type as the report names it: fp32/fp16 (DType's names), bf16, else ONNX's name."""
    if element_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        return DType.of_onnx(element_type).short
    name = onnx.TensorProto.DataType.Name(element_type).lower()
    return "bf16" if name == "bfloat16" else name  # kvq writes no bf16 tensor, so DType has no row for it


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    count = math.prod(tensor.dims)
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
