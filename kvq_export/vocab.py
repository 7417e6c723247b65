"""The words kvq's schemes, cache tensors and results are spelled with, one :class:`~enum.StrEnum` per concept.

Each member is a ``str`` equal to its value, so JSON (schemes, manifests, reports) keeps plain strings and a
string read from a file compares equal to its member; inside kvq fields hold the members (:func:`parse_enum`
turns a string into one, or refuses it naming the allowed values).
"""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Any, TypeVar

from kvq_export.errors import KVQError

E = TypeVar("E", bound=StrEnum)


def parse_enum(kind: type[E], value: Any, where: str, error: type[KVQError] = KVQError) -> E:
    """``value`` as a member of ``kind``; anything else raises ``error`` naming ``where`` and the allowed values."""
    try:
        return kind(value)
    except ValueError:
        raise error(f"invalid {where}={plain(value)!r}: allowed: {', '.join(kind)}") from None


def plain(value: Any) -> Any:
    """An enum member as its plain value (JSON, ``repr`` in messages); anything else unchanged."""
    return value.value if isinstance(value, Enum) else value


# -- a stream's description (:class:`kvq_export.scheme.TensorQuant`) -----------------------------------------
class Format(StrEnum):
    """How a stream's elements are stored."""

    FP16 = "fp16"  # not quantized
    INT = "int"  # asymmetric: per-group scale and minimum
    INT_SYM = "int_sym"  # symmetric: per-group scale, codes offset by 2**(bits-1)
    FP8_E4M3 = "fp8_e4m3"  # float8 e4m3fn codes with a per-group scale


class Axis(StrEnum):
    """Which way a stream's quantization groups run."""

    TOKEN = "token"  # along head_dim within one token
    CHANNEL = "channel"  # each channel across consecutive tokens


class ScaleMode(StrEnum):
    """Where a stream's scales come from."""

    DYNAMIC = "dynamic"  # from each group as tokens arrive
    STATIC = "static"  # fixed per layer, from a calibration artifact


class Quantizer(StrEnum):
    """The rule that picks scales and codes."""

    KVQ = "kvq"
    GGML = "ggml"  # llama.cpp's reference quantizers bit for bit


class Rotation(StrEnum):
    """Rotation of the head dimension applied before a stream is stored (:mod:`kvq_export.rotation`)."""

    NONE = "none"
    HADAMARD = "hadamard"


class Basis(StrEnum):
    """Which basis a rotated stream's rows are given or read back in (``x @ R`` is what the cache stores)."""

    MODEL = "model"  # the model's own: keys after RoPE, values as projected
    STORED = "stored"  # as stored: rotated


# -- cache tensors (:mod:`kvq_export.naming`, :mod:`kvq_export.cache_layout`) -------------------------------
class Direction(StrEnum):
    """Which side of a step a cache tensor is on."""

    PAST = "past"  # graph input
    PRESENT = "present"  # graph output, fed back as the next step's past


class Part(StrEnum):
    """Which stream of a layer."""

    KEY = "key"
    VALUE = "value"


class Role(StrEnum):
    """What a cache tensor holds (the last component of its name)."""

    SEQ_LENGTHS = "seq_lengths"
    SINKS = "sinks"
    CODES = "codes"
    SCALES = "scales"
    ZERO_POINTS = "zero_points"
    RECENT = "recent"
    BUFFER = "buffer"


class LayoutName(StrEnum):
    """How a flavour's graphs hold the cache across the graph boundary (a manifest's ``layout_name``)."""

    REGIONS = "regions"
    BUFFER = "buffer"


# -- an export's weights ------------------------------------------------------------------------------------
class WeightFormat(StrEnum):
    """How the graph's linear weights are stored."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"
    W8A8 = "w8a8"  # int8 per output channel, int8 per-token activations: ONNX Runtime's QGEMM kernels


# -- generation ----------------------------------------------------------------------------------------------
class FinishReason(StrEnum):
    """Why kvq's generation loop stopped a sequence."""

    EOS = "eos"  # the model produced an end-of-sequence token
    LENGTH = "length"  # it reached the requested number of new tokens
