"""One dtype vocabulary for every cache tensor and compute type kvq names.

A scheme says ``fp16``/``fp32``; the manifest and ONNX say ``float16``/``float32``; numpy, torch, ONNX
Runtime, onnx-ir, TensorRT and Triton each have their own spelling. :class:`DType` holds one row per
element type and converts to each framework on demand (torch, onnx-ir and TensorRT are imported only by
the converter that needs them), so no module keeps a private map.

    DType.get("fp16").onnx        -> "float16"
    DType.get("float16").numpy    -> numpy.float16
    DType.get("fp32").ort_type    -> "tensor(float)"
    DType.of_onnx(10).short       -> "fp16"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvq_export._lazy import require
from kvq_export.errors import KVQError

#: Compute dtypes an export's graph can run in (``--dtype``; a manifest's ``dtype``).
COMPUTE_DTYPES = ("fp32", "fp16")


@dataclass(frozen=True)
class DType:
    """One element type under every name kvq meets it by.

    Attributes:
        onnx: the ONNX element type name (``float16``), as written in manifests.
        short: the scheme's short name (``fp16``) where a scheme can name it, else the ONNX name.
        itemsize: bytes per element.
        trt: TensorRT's ``DataType`` member name.
        triton: Triton's pointer type string for a kernel argument of this type.
        proto: the ONNX ``TensorProto`` element type number (fixed by the ONNX standard; onnx-ir's ``DataType``).
    """

    onnx: str
    short: str
    itemsize: int
    trt: str
    triton: str
    proto: int

    @staticmethod
    def get(name: str) -> DType:
        """The row for a short name (``fp16``) or an ONNX name (``float16``); unknown names list the allowed ones."""
        try:
            return _BY_NAME[name]
        except (KeyError, TypeError):
            raise KVQError(f"unknown dtype {name!r}; allowed: {', '.join(sorted(_BY_NAME))}") from None

    @staticmethod
    def of_onnx(element_type: int) -> DType:
        """The row for an ONNX element type number (``TensorProto.FLOAT16``, an onnx-ir ``DataType``)."""
        known = isinstance(element_type, int) and not isinstance(element_type, bool)  # IntEnums are ints
        row = _BY_PROTO.get(element_type) if known else None
        if row is None:
            allowed = ", ".join(f"{r.proto} ({r.onnx})" for r in _ROWS)
            raise KVQError(f"unknown ONNX element type {element_type!r}; allowed: {allowed}")
        return row

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype (float8 comes from ml_dtypes)."""
        if self.onnx == "float8e4m3fn":
            import ml_dtypes

            return np.dtype(ml_dtypes.float8_e4m3fn)
        return np.dtype(self.onnx)

    @property
    def torch(self) -> Any:
        """The torch dtype."""
        import torch

        return getattr(torch, _TORCH_NAMES.get(self.onnx, self.onnx))

    @property
    def ir(self) -> Any:
        """The onnx-ir ``DataType``."""
        import onnx_ir as ir

        return ir.DataType(self.proto)

    @property
    def ort_type(self) -> str:
        """ONNX Runtime's type string of a tensor of this type (``tensor(float16)``; float32 is ``tensor(float)``)."""
        return "tensor(float)" if self.onnx == "float32" else f"tensor({self.onnx})"

    @property
    def bits_numpy(self) -> np.dtype:
        """The numpy dtype that holds values fed to or read from ONNX Runtime (float8 as its uint8 bits)."""
        return np.dtype(np.uint8) if self.onnx == "float8e4m3fn" else self.numpy

    @property
    def trt_tuning(self) -> str:
        """The name ``tensorrt.plugin.AutoTuneCombination`` spells this type with (``FP32``, ``INT64``)."""
        return {"float32": "FP32", "float16": "FP16", "fp8": "FP8"}.get(self.trt, self.trt.upper())

    def tensorrt(self) -> Any:
        """The TensorRT ``DataType`` (imports TensorRT)."""
        return getattr(require("tensorrt"), self.trt)


_ROWS = (
    DType("float32", "fp32", 4, "float32", "*fp32", 1),
    DType("float16", "fp16", 2, "float16", "*fp16", 10),
    DType("int64", "int64", 8, "int64", "*i64", 7),
    DType("int32", "int32", 4, "int32", "*i32", 6),
    DType("int8", "int8", 1, "int8", "*i8", 3),
    DType("uint8", "uint8", 1, "uint8", "*u8", 2),
    DType("bool", "bool", 1, "bool", "*i1", 9),
    DType("float8e4m3fn", "fp8_e4m3", 1, "fp8", "*u8", 17),
)
_BY_NAME = {name: row for row in _ROWS for name in {row.onnx, row.short}}
_BY_PROTO = {row.proto: row for row in _ROWS}
_TORCH_NAMES = {"float8e4m3fn": "float8_e4m3fn"}


def onnx_name(name: str) -> str:
    """``fp16`` -> ``float16`` (ONNX names pass through)."""
    return DType.get(name).onnx
