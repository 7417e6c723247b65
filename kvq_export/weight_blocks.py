"""Block-quantized weights: ONNX Runtime's block quantizer and what its blocks dequantize to.

The int8 / int4 weight formats (:mod:`kvq_export.graph.weights` writes them into a graph as ``MatMulNBits``) are
ONNX Runtime's own ``MatMulNBitsQuantizer`` blocks; :func:`dequantized_blocks` gives the float weight those blocks
compute with, which calibration measures on (:func:`kvq_export.calibration.weights.dequantized_model`).
"""

from __future__ import annotations

import logging

import numpy as np

from kvq_export.errors import ExportError
from kvq_export.vocab import WeightFormat

WEIGHT_FORMATS = tuple(WeightFormat)
BITS = {WeightFormat.INT8: 8, WeightFormat.INT4: 4}
#: block sizes MatMulNBits and GatherBlockQuantized take on CPU (a power of two, at least 16)
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: MatMulNBits ``accuracy_level``: the activations' compute type
ACCURACY_LEVELS = {1: "float32", 2: "float16", 3: "bfloat16", 4: "int8"}
#: int8 activations: rows of a batch computed bit for bit alike, and the fast CPU kernels
DEFAULT_ACCURACY_LEVEL = 4


def check_weight_options(format: str, block_size: int, symmetric: bool, accuracy_level: int | None) -> None:
    """Raise a one-line :class:`ExportError` unless every option is one kvq can store."""
    if format not in WEIGHT_FORMATS:
        raise ExportError(f"unknown weight format {format!r}; allowed: {', '.join(WEIGHT_FORMATS)}")
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ExportError(f"invalid weight block size {block_size!r}; allowed: {', '.join(map(str, BLOCK_SIZES))}")
    if not isinstance(symmetric, bool):
        raise ExportError(f"invalid symmetric={symmetric!r}; allowed: True, False")
    if accuracy_level is not None and (isinstance(accuracy_level, bool) or accuracy_level not in ACCURACY_LEVELS):
        allowed = ", ".join(f"{level} ({name} activations)" for level, name in ACCURACY_LEVELS.items())
        raise ExportError(f"invalid accuracy_level {accuracy_level!r}; allowed: {allowed}, or None (ONNX Runtime's)")


def block_quantizer(bits: int, block_size: int, symmetric: bool):
    """ONNX Runtime's block quantizer, the one MatMulNBitsQuantizer calls for each MatMul weight."""
    ort = ort_quantizer()
    return ort.DefaultWeightOnlyQuantizer(ort.DefaultWeightOnlyQuantConfig(block_size=block_size,
                                                                           is_symmetric=symmetric, bits=bits))


def ort_quantizer():
    """ONNX Runtime's ``matmul_nbits_quantizer`` module, imported without letting it configure the root logger.

    The module calls ``logging.basicConfig(level=INFO)`` when imported, which would turn on every library's INFO
    lines in the application, and logs one INFO line per graph node: both are held back to kvq's own logging.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer as module
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    logging.getLogger(module.__name__).setLevel(logging.WARNING)
    return module


def dequantized_blocks(weight: np.ndarray, *, bits: int, block_size: int, symmetric: bool) -> np.ndarray:
    """The ``[K, N]`` float32 weight MatMulNBits (and GatherBlockQuantized) computes with for ``weight`` ``[K, N]``.

    ONNX Runtime's block quantizer (the one :func:`quantize_weights` runs) gives the codes, scales and zero points;
    they are dequantized as MatMulNBits does: ``(q - zero_point) * scale`` per block of ``block_size`` rows, the
    zero point ``2^(bits-1)`` when ``symmetric`` (none stored).
    """
    check_weight_options(f"int{bits}", block_size, symmetric, None)
    rows, cols = weight.shape
    packed, scales, zero_points = block_quantizer(bits, block_size, symmetric).qbits_block_quant(
        np.ascontiguousarray(weight, dtype=np.float32))
    blocks = packed.shape[1]
    codes = _unpack(packed.reshape(cols, -1), bits)[:, :blocks * block_size].reshape(cols, blocks, block_size)
    if symmetric:
        zero = np.float32(1 << (bits - 1))
    else:
        zero = _unpack(zero_points, bits)[:, :blocks, None].astype(np.float32)
    scale = np.asarray(scales, np.float32).reshape(cols, blocks, 1)
    values = (codes.astype(np.float32) - zero) * scale
    return np.ascontiguousarray(values.reshape(cols, -1)[:, :rows].T)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes ``[n, bytes]`` -> codes ``[n, bytes * 8 / bits]`` (4 bits: low nibble first)."""
    if bits == 8:
        return packed.astype(np.int16)
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.int16)
