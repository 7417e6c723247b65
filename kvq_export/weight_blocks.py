"""Quantized weights: ONNX Runtime's block quantizer, kvq's per-channel int8, and what each dequantizes to.

The int8 / int4 weight formats (:mod:`kvq_export.graph.weights` writes them into a graph as ``MatMulNBits``) are
ONNX Runtime's own ``MatMulNBitsQuantizer`` blocks; :func:`dequantized_blocks` gives the float weight those blocks
compute with. The w8a8 format (:mod:`kvq_export.graph.qgemm`) stores one int8 code per element and one scale per
output channel (:func:`channel_codes`); :func:`dequantized_channels` is its float weight. Calibration measures on
these (:func:`kvq_export.calibration.weights.dequantized_model`), and the graphs store these same codes.
"""

from __future__ import annotations

import logging

import numpy as np

from kvq_export.errors import ExportError
from kvq_export.vocab import WeightFormat

WEIGHT_FORMATS = tuple(WeightFormat)
BITS = {WeightFormat.INT8: 8, WeightFormat.INT4: 4}
#: the formats stored as MatMulNBits blocks (block size, symmetry and accuracy_level apply to these only)
BLOCKED_FORMATS = tuple(str(f) for f in BITS)
#: the oldest opset a w8a8 graph can be written in: its activations are quantized by QuantizeLinear in blocks
W8A8_MIN_OPSET = 21
#: the largest w8a8 code: symmetric int8 without -128, so a code and its negation both exist
CHANNEL_CODE_MAX = 127
#: how w8a8 stores the embedding (and a tied head reading it): symmetric int8 blocks, as ``--weights int8`` does
W8A8_TABLE_BITS, W8A8_TABLE_BLOCK = 8, 32
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


def channel_codes(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes ``[K, N]`` and float32 scales ``[N]`` of a ``[K, N]`` weight, one scale per output column.

    ``scale = max|w[:, n]| / 127`` (an all-zero column gets scale 1 and zero codes), codes rounded half to even as
    ONNX's QuantizeLinear rounds. A column's codes depend on that column alone, so a fused weight's slices are
    quantized alike whole or apart.
    """
    weight = np.asarray(weight, dtype=np.float32)
    if weight.ndim != 2:
        raise ExportError(f"a w8a8 weight must be 2-D [in, out], got shape {weight.shape}")
    peak = np.abs(weight).max(axis=0)
    scales = np.where(peak > 0, peak / CHANNEL_CODE_MAX, 1).astype(np.float32)
    codes = np.clip(np.rint(weight / scales), -CHANNEL_CODE_MAX, CHANNEL_CODE_MAX).astype(np.int8)
    return codes, scales


def dequantized_channels(weight: np.ndarray) -> np.ndarray:
    """The ``[K, N]`` float32 weight a w8a8 graph computes with for ``weight`` ``[K, N]`` (codes x column scale)."""
    codes, scales = channel_codes(weight)
    return codes.astype(np.float32) * scales
