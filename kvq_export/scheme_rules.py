"""What a :class:`~kvq_export.scheme.TensorQuant` may say: the allowed values, the code widths, and the checks.

The scheme's field rules in one place: the bit widths, formats and block types a stream may name, how an integer
code is stored (:func:`code_planes`, :func:`pack_unit`), and :func:`check_tensor_quant`, which a ``TensorQuant``
runs on construction and which refuses a description with a one-line :class:`~kvq_export.errors.SchemeError`
that names the allowed values. The checks take the ``TensorQuant`` untyped (``Any``): the scheme imports this
module, not the other way round.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

from kvq_export.errors import SchemeError
from kvq_export.vocab import Axis, Format, Quantizer, Rotation, ScaleMode, parse_enum, plain

SCALE_DTYPES = ("fp16", "fp32")
HP_DTYPES = ("fp16", "fp32")
INT_BITS = (2, 3, 4, 6, 8)
#: quantizer ggml: (format, bits) -> ggml block type it reproduces bit for bit (blocks of GGML_BLOCK along head_dim)
GGML_TYPES = {(Format.INT_SYM, 4): "q4_0", (Format.INT, 4): "q4_1", (Format.INT_SYM, 5): "q5_0",
              (Format.INT, 5): "q5_1", (Format.INT_SYM, 8): "q8_0"}
GGML_BLOCK = 32
#: Code widths stored as two planes along head_dim: the low bits packed, then the remaining bits packed
#: (:func:`code_planes`).
PLANE_BITS = (3, 5, 6)
#: Code widths of the channels beside a stream's 8-bit high channels, and the formats that can keep them.
HIGH_CHANNEL_BITS = (2, 3, 4)
HIGH_CHANNEL_FORMATS = (Format.INT, Format.INT_SYM)

#: Largest finite float8 e4m3fn value.
FP8_E4M3_MAX = 448.0


def code_planes(bits: int) -> tuple[int, ...]:
    """Bit widths of the planes an integer code of ``bits`` is stored in, lowest bits first.

    2/4/8-bit codes are one plane (packed ``8 // bits`` per byte); 3-bit codes a 2-bit plane then a 1-bit
    plane; 5- and 6-bit codes a plane of low nibbles then a 1- or 2-bit plane (ggml's q5 layout).
    """
    if bits in PLANE_BITS:
        low = 2 if bits == 3 else 4
        return low, bits - low
    return (bits,)


def pack_unit(bits: int) -> int:
    """How many ``bits``-wide codes fill whole bytes in every plane (a packed width must be a multiple)."""
    return max(8 // width for width in code_planes(bits))


def fail(field_name: str, value: Any, allowed: str) -> SchemeError:
    """The one-line error for a field holding a value it may not hold."""
    return SchemeError(f"invalid {field_name}={plain(value)!r}: {allowed}")


def check_tensor_quant(tq: Any) -> None:
    """Refuse a :class:`~kvq_export.scheme.TensorQuant` whose fields do not describe a stream.

    The error names the allowed values. The enum fields are held as members (a string read from JSON becomes its
    member).
    """
    for name in ("format", "axis", "scale_dtype", "scales", "quantizer", "rotation"):  # not a name: refuse
        if not isinstance(getattr(tq, name), str):
            raise fail(name, getattr(tq, name), "allowed: a string")
    _parse(tq, "rotation", Rotation)
    _parse(tq, "format", Format)
    if isinstance(tq.bits, bool) or not isinstance(tq.bits, int):  # 4.0 or "4" is refused everywhere
        raise fail("bits", tq.bits, "allowed: an integer (2, 3, 4, 5, 6, 8, or 16 for fp16)")
    _parse(tq, "quantizer", Quantizer)
    if tq.quantizer == Quantizer.GGML:
        _check_ggml(tq)  # pins format/bits/axis/group/scales; the generic checks below still run
    if tq.format == Format.FP16:
        if tq.bits != 16:
            raise fail("bits", tq.bits, "allowed for format fp16: 16")
        meaningless = [(name, getattr(tq, name)) for name, default in _fp16_defaults(tq).items()
                       if isinstance(getattr(tq, name), bool) or getattr(tq, name) != default]
        if meaningless:
            name, value = meaningless[0]
            raise fail(name, value, f"format fp16 is not quantized: leave {name} out (it would mean nothing)")
        _parse(tq, "axis", Axis)  # the defaults: valid
        _parse(tq, "scales", ScaleMode)
        return
    if tq.format == Format.FP8_E4M3 and tq.bits != 8:
        raise fail("bits", tq.bits, "allowed for format fp8_e4m3: 8")
    if tq.is_int and tq.bits not in INT_BITS and tq.quantizer != Quantizer.GGML:
        raise fail("bits", tq.bits, f"allowed for {tq.format} with quantizer kvq: 2, 3, 4, 6, 8 "
                    "(5 bits: quantizer ggml)")
    _parse(tq, "axis", Axis)
    if tq.scale_dtype not in SCALE_DTYPES:
        raise fail("scale_dtype", tq.scale_dtype, f"allowed: {', '.join(SCALE_DTYPES)}")
    _parse(tq, "scales", ScaleMode)
    if tq.group_size is not None and (
        isinstance(tq.group_size, bool) or not isinstance(tq.group_size, int) or tq.group_size < 1
    ):
        raise fail("group_size", tq.group_size, "allowed: a positive integer, or null for the whole axis")
    if tq.axis == Axis.CHANNEL and tq.scales == ScaleMode.DYNAMIC and tq.group_size is None:
        raise fail(
            "group_size", None, "allowed with axis=channel and dynamic scales: a positive integer "
            "(a whole-axis channel group needs static scales)"
        )
    if tq.axis == Axis.CHANNEL and tq.scales == ScaleMode.STATIC and tq.group_size is not None:
        raise fail(
            "group_size", tq.group_size,
            "allowed with axis=channel and static scales: null (one scale per channel)",
        )
    if isinstance(tq.clip, bool) or not isinstance(tq.clip, (int, float)) or not (0.0 < tq.clip <= 1.0):
        raise fail("clip", tq.clip, "allowed: a ratio in (0, 1]")
    _check_high_channels(tq)
    r = tq.residual_length
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
        raise fail("residual_length", r, "allowed: an integer >= 0, or null for the scheme's residual_length")

def _parse(tq: Any, name: str, kind: type[StrEnum]) -> None:
    """Hold field ``name`` as a member of ``kind`` (a string read from JSON becomes its member)."""
    object.__setattr__(tq, name, parse_enum(kind, getattr(tq, name), name, SchemeError))


def _check_high_channels(tq: Any) -> None:
    n = tq.high_channels
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise fail("high_channels", n, "allowed: an integer >= 0")
    if not n:
        return
    if tq.format not in HIGH_CHANNEL_FORMATS:
        raise fail("format", tq.format, f"allowed with high_channels > 0: {', '.join(HIGH_CHANNEL_FORMATS)}")
    needs = (("axis", tq.axis, Axis.CHANNEL), ("quantizer", tq.quantizer, Quantizer.KVQ),
             ("rotation", tq.rotation, Rotation.NONE))
    for name, value, required in needs:
        if value != required:
            raise fail(name, value, f"allowed with high_channels > 0: {plain(required)!r} (8-bit channels are "
                        "chosen per channel of an unrotated, per-channel stream)")
    if tq.bits not in HIGH_CHANNEL_BITS:
        raise fail("bits", tq.bits, f"allowed with high_channels > 0: {', '.join(map(str, HIGH_CHANNEL_BITS))} "
                    "(the other channels' codes)")

def _check_ggml(tq: Any) -> None:
    """The ggml quantizer reproduces five fixed block types; anything else has no ggml meaning."""
    allowed = ", ".join(f"{fmt} {bits} ({name})" for (fmt, bits), name in GGML_TYPES.items())
    if (tq.format, tq.bits) not in GGML_TYPES:
        raise fail("format/bits", f"{tq.format} {tq.bits}", f"allowed with quantizer ggml: {allowed}")
    fixed = (("axis", tq.axis, Axis.TOKEN), ("group_size", tq.group_size, GGML_BLOCK),
             ("scale_dtype", tq.scale_dtype, "fp16"), ("scales", tq.scales, ScaleMode.DYNAMIC))
    for name, value, required in fixed:
        if value != required:
            raise fail(name, value, f"allowed with quantizer ggml: {plain(required)!r} (ggml blocks are "
                        f"{GGML_BLOCK} consecutive head_dim elements with an fp16 scale)")
    if tq.clip != 1.0:
        raise fail("clip", tq.clip, "allowed with quantizer ggml: 1.0 (ggml never clips)")


def _fp16_defaults(tq: Any) -> dict[str, Any]:
    """The fields an unquantized stream leaves at their defaults (all but format, bits and rotation)."""
    return {f.name: f.default for f in dataclasses.fields(tq) if f.name not in ("format", "bits", "rotation")}
