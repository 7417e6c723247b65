"""What an export is asked to be: typed, frozen, checked on construction.

Four small records describe a request, each with one default per setting that every command shares:

* :class:`CalibrationSpec` -- where static scales come from (corpus, tokens, offset, method, percentile);
* :class:`WeightSpec` -- how the graph's weights are stored (fp32, or quantized blocks);
* :class:`PlanSpec` -- a bit budget and how to plan a scheme under it (``kvq plan``'s settings);
* :class:`ExportRequest` -- model, scheme (or a plan), flavor, weights, compute dtype, opset and calibration.

Each normalizes loose input (a preset name, a plain string for an enum, a path) when it is built and refuses
anything else with a one-line error naming the field and the allowed values, so a request that exists is a
valid one. ``to_dict``/``from_dict`` give the JSON form that ``kvq.json`` records in its ``build`` section and
that :func:`kvq_export.export.exporter.ensure_export` compares to decide whether an export can be reused;
enums stay plain strings there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvq_export.dtypes import COMPUTE_DTYPES
from kvq_export.errors import ExportError, KVQError
from kvq_export.flavors import FlavorName, get_flavor
from kvq_export.model_facts import known_fields
from kvq_export.presets import resolve_scheme
from kvq_export.scheme import KVQuantScheme
from kvq_export.vocab import WeightFormat, parse_enum
from kvq_export.weight_blocks import ACCURACY_LEVELS, BLOCK_SIZES, BLOCKED_FORMATS

#: The calibration text every command reads by default (``kvq validate`` scores the same corpus).
DEFAULT_CORPUS = "britannica"
#: Calibration tokens when none are given: ``kvq export``, ``plan``, ``bench`` and the demo agree, so their scales do.
DEFAULT_CALIB_TOKENS = 4096
#: Calibration text starts this far into the corpus: past the 8 x 512 tokens ``kvq validate`` scores from token 0,
#: so a calibrated export is never scored on the text it was calibrated on.
DEFAULT_CALIB_OFFSET = 60000
#: The percentile of ``method="percentile"`` (the 99.9th clips the rare outliers that cost 4-bit codes the most).
DEFAULT_PERCENTILE = 99.9
#: The opset of an export when none is asked for, and the oldest the decoder graph can be written in (ReduceMean
#: with axes as an input needs opset 18).
DEFAULT_OPSET = 23
MIN_OPSET = 18
#: The cache length a plan's bit budget is stated at when none is given.
DEFAULT_PLAN_CONTEXT = 4096
#: The candidate set ``kvq plan`` chooses from when none is named (:data:`kvq_export.plan.CANDIDATE_SETS`).
DEFAULT_PLAN_CANDIDATES = "ort-gqa"


class CalibrationMethod(StrEnum):
    """How a static scale is chosen from the calibration K/V (see :mod:`kvq_export.calibration.methods`)."""

    ABSMAX = "absmax"
    PERCENTILE = "percentile"
    ATTENTION = "attention"


class PlanMetric(StrEnum):
    """How a plan measures a candidate's damage (see :mod:`kvq_export.plan`)."""

    ATTENTION = "attention"
    KL = "kl"


def _int(value: Any, where: str, least: int, error: type[KVQError]) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise error(f"invalid {where}={value!r}: allowed: an integer >= {least}")
    return value


@dataclass(frozen=True)
class CalibrationSpec:
    """Where static scales (and calibrated high channels) come from.

    ``tokens`` tokens of ``corpus`` (a built-in corpus name or a text file), cut into windows of at most 1024,
    starting ``offset`` tokens in; ``method`` picks each scale (``percentile``: the ``percentile``-th).
    """

    corpus: str = DEFAULT_CORPUS
    tokens: int = DEFAULT_CALIB_TOKENS
    offset: int = DEFAULT_CALIB_OFFSET
    method: CalibrationMethod = CalibrationMethod.ABSMAX
    percentile: float = DEFAULT_PERCENTILE

    def __post_init__(self) -> None:
        if isinstance(self.corpus, os.PathLike):
            object.__setattr__(self, "corpus", os.fspath(self.corpus))
        if not isinstance(self.corpus, str) or not self.corpus:
            raise KVQError(f"invalid calibration.corpus={self.corpus!r}: allowed: a corpus name or a text file")
        _int(self.tokens, "calibration.tokens", 1, KVQError)
        _int(self.offset, "calibration.offset", 0, KVQError)
        object.__setattr__(self, "method", parse_enum(CalibrationMethod, self.method, "calibration.method"))
        number = isinstance(self.percentile, (int, float)) and not isinstance(self.percentile, bool)
        if not number or not 50.0 < self.percentile <= 100.0:
            raise KVQError(f"invalid calibration.percentile={self.percentile!r}: allowed: a number in (50, 100]")
        object.__setattr__(self, "percentile", float(self.percentile))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the method as a plain string)."""
        return {"corpus": self.corpus, "tokens": self.tokens, "offset": self.offset, "method": str(self.method),
                "percentile": self.percentile}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationSpec:
        """Parse :meth:`to_dict`'s form; missing fields take the defaults."""
        return cls(**known_fields(data, cls, "calibration.", KVQError))


#: The calibration of every command that is given no other (a frozen, shared default).
DEFAULT_CALIBRATION = CalibrationSpec()


#: block size, symmetry and accuracy_level of int blocks when none are given (int8 activations: fast, and each row
#: of a batch computed alone); a w8a8 spec keeps them, as they do not apply to it
_BLOCK_DEFAULTS = (32, True, 4)


@dataclass(frozen=True)
class WeightSpec:
    """How the graph's linear weights are stored: as computed (``fp32``), fp16, or quantized.

    ``int8``/``int4`` quantize each weight in blocks of ``block_size`` input channels (``symmetric``: no zero
    point) for ONNX Runtime's ``MatMulNBits``, which computes with activations of ``accuracy_level`` (1: fp32,
    2: fp16, 3: bf16, 4: int8, the default: ONNX Runtime's fast CPU kernel, its activations rounded in blocks of
    each row alone; None: ONNX Runtime's choice). ``w8a8`` stores int8 codes with one scale per output channel and
    rounds each token's activations to int8 at run time, for ONNX Runtime's QGEMM kernels
    (:mod:`kvq_export.graph.qgemm`); the block settings do not apply to it and keep their defaults.
    """

    format: WeightFormat = WeightFormat.FP32
    block_size: int = _BLOCK_DEFAULTS[0]
    symmetric: bool = _BLOCK_DEFAULTS[1]
    accuracy_level: int | None = _BLOCK_DEFAULTS[2]

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", parse_enum(WeightFormat, self.format, "weights.format", ExportError))
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:
            raise ExportError(f"invalid weights.block_size={self.block_size!r}: allowed: "
                              f"{', '.join(map(str, BLOCK_SIZES))}")
        if not isinstance(self.symmetric, bool):
            raise ExportError(f"invalid weights.symmetric={self.symmetric!r}: allowed: true, false")
        level = self.accuracy_level
        if level is not None and (isinstance(level, bool) or level not in ACCURACY_LEVELS):
            raise ExportError(f"invalid weights.accuracy_level={level!r}: allowed: 1, 2, 3, 4, or null "
                              "(ONNX Runtime's)")
        if self.format == WeightFormat.W8A8 and (self.block_size, self.symmetric, level) != _BLOCK_DEFAULTS:
            raise ExportError("weights.block_size, symmetric and accuracy_level apply to int8/int4 blocks only; "
                              "w8a8 stores one scale per output channel: leave them at their defaults")

    @property
    def quantized(self) -> bool:
        """Whether the weights are stored as integer codes (blocks or w8a8)."""
        return self.blocked or self.format == WeightFormat.W8A8

    @property
    def blocked(self) -> bool:
        """Whether the weights are stored as MatMulNBits blocks (the block settings apply)."""
        return self.format in BLOCKED_FORMATS

    @property
    def calibration_weights(self) -> dict[str, Any] | None:
        """The weights a calibration for this storage is measured on (``Calibration.weights``).

        Int blocks: their format, block size and symmetry (what the weights dequantize to; ``accuracy_level`` only
        rounds activations at run time); w8a8: its format alone. None for fp32 and fp16: the model's own weights.
        """
        if not self.quantized:
            return None
        if not self.blocked:
            return {"format": str(self.format)}
        return {"format": str(self.format), "block_size": self.block_size, "symmetric": self.symmetric}

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the format as a plain string)."""
        return {"format": str(self.format), "block_size": self.block_size, "symmetric": self.symmetric,
                "accuracy_level": self.accuracy_level}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightSpec:
        """Parse :meth:`to_dict`'s form; missing fields take the defaults."""
        return cls(**known_fields(data, cls, "weights.", ExportError))


@dataclass(frozen=True)
class PlanSpec:
    """A bit budget and how ``kvq plan`` chooses per-layer formats under it (see :func:`kvq_export.plan.plan_scheme`).

    ``budget`` bits per cached element at ``context`` tokens; ``candidates`` a built-in set name or comma-separated
    presets / scheme files (None: the export flavor's default, :func:`kvq_export.export.budget.plan_candidates`);
    ``metric`` how damage is measured; ``sink_tokens`` / ``value_window`` high-precision tokens every layer keeps
    (first ones / newest values); ``name`` the planned scheme's name (None: ``plan-<budget>b``).
    """

    budget: float
    context: int = DEFAULT_PLAN_CONTEXT
    candidates: str | None = None
    metric: PlanMetric = PlanMetric.ATTENTION
    sink_tokens: int = 0
    value_window: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
            raise KVQError(f"invalid plan.budget={budget!r}: allowed: a positive number of bits per cached element")
        object.__setattr__(self, "budget", float(budget))
        _int(self.context, "plan.context", 1, KVQError)
        if self.candidates is not None and (not isinstance(self.candidates, str) or not self.candidates.strip()):
            raise KVQError(f"invalid plan.candidates={self.candidates!r}: allowed: a candidate set name, "
                           "comma-separated presets / scheme files, or None (the flavor's default)")
        object.__setattr__(self, "metric", parse_enum(PlanMetric, self.metric, "plan.metric"))
        _int(self.sink_tokens, "plan.sink_tokens", 0, KVQError)
        if self.value_window is not None:
            _int(self.value_window, "plan.value_window", 0, KVQError)
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise KVQError(f"invalid plan.name={self.name!r}: allowed: a non-empty string, or None")

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the metric as a plain string)."""
        return {"budget": self.budget, "context": self.context, "candidates": self.candidates,
                "metric": str(self.metric), "sink_tokens": self.sink_tokens, "value_window": self.value_window,
                "name": self.name}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanSpec:
        """Parse :meth:`to_dict`'s form; missing fields but ``budget`` take the defaults."""
        values = dict(known_fields(data, cls, "plan.", KVQError))
        if "budget" not in values:
            raise KVQError("missing plan field 'budget'")
        return cls(**values)


@dataclass(frozen=True)
class ExportRequest:
    """Everything that shapes one export; two equal requests built by one kvq source give one export.

    Args:
        model: a model spec (built-in name, Hugging Face directory or ``.gguf`` file); None when the caller hands
            :func:`~kvq_export.export.exporter.export` an already loaded model.
        scheme: the cache scheme, or a preset name / scheme JSON file; None when ``plan`` is given.
        flavor: the graph flavor (:mod:`kvq_export.flavors`).
        weights: how the weights are stored.
        dtype: compute dtype of the graph (``fp32``, ``fp16``).
        opset: ONNX opset of the graph.
        calibration: where static scales come from; None for a scheme that needs none, or when the caller gives
            the scales themselves (a scheme that needs them is then refused without them: kvq never guesses one).
            A plan always reads calibration text: None means :data:`DEFAULT_CALIBRATION` (held-out text).
        plan: a bit budget to plan the scheme under instead of giving one (``kvq export --budget``); the export
            then runs ``kvq plan``'s planner first (:mod:`kvq_export.export.budget`).
    """

    model: str | None
    scheme: KVQuantScheme | None = None
    flavor: FlavorName = FlavorName.REFERENCE
    weights: WeightSpec = field(default_factory=WeightSpec)
    dtype: str = "fp32"
    opset: int = DEFAULT_OPSET
    calibration: CalibrationSpec | None = None
    plan: PlanSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.model is not None and not isinstance(self.model, str):
            raise ExportError(f"invalid model={type(self.model).__name__}: allowed: a model spec (a name, a "
                              "directory or a .gguf file), or None with the loaded model given to export()")
        if (self.scheme is None) == (self.plan is None):
            both = self.plan is not None
            raise ExportError("give a scheme or a plan (a bit budget), not both" if both else
                              "the request has no scheme: give a scheme, or a plan (a bit budget) to plan one",
                              cli="give either a scheme (--scheme, or --key/--value) or --budget, not both" if both
                              else "give --scheme PRESET|FILE (or --key and --value), or --budget BITS to plan a "
                              "scheme")
        if self.plan is not None:
            plan = PlanSpec.from_dict(self.plan) if isinstance(self.plan, Mapping) else self.plan
            if not isinstance(plan, PlanSpec):
                raise ExportError(f"invalid plan={plan!r}: allowed: a PlanSpec or None")
            object.__setattr__(self, "plan", plan)
            if self.calibration is None:  # planning calibrates every candidate: on held-out text by default
                object.__setattr__(self, "calibration", DEFAULT_CALIBRATION)
        else:
            scheme = self.scheme
            if isinstance(scheme, Mapping):
                scheme = KVQuantScheme.from_dict(scheme)
            object.__setattr__(self, "scheme", resolve_scheme(scheme))
        object.__setattr__(self, "flavor", get_flavor(self.flavor).name)  # unknown: refused with the allowed ones
        if isinstance(self.weights, Mapping):
            object.__setattr__(self, "weights", WeightSpec.from_dict(self.weights))
        if not isinstance(self.weights, WeightSpec):
            raise ExportError(f"invalid weights={self.weights!r}: allowed: a WeightSpec")
        if self.dtype not in COMPUTE_DTYPES:
            raise ExportError(f"invalid dtype={self.dtype!r}: allowed: {', '.join(COMPUTE_DTYPES)}")
        _int(self.opset, "opset", MIN_OPSET, ExportError)
        if isinstance(self.calibration, Mapping):
            object.__setattr__(self, "calibration", CalibrationSpec.from_dict(self.calibration))
        if self.calibration is not None and not isinstance(self.calibration, CalibrationSpec):
            raise ExportError(f"invalid calibration={self.calibration!r}: allowed: a CalibrationSpec or None")

    def to_dict(self) -> dict[str, Any]:
        """JSON form: what ``kvq.json``'s ``build.request`` records and reuse compares.

        The scheme's name is left out (a renamed copy of a scheme is the same request), and so is the calibration
        of a scheme that needs none; ``plan`` appears only in a request that plans its scheme.
        """
        if self.plan is not None:
            return {"model": self.model, "scheme": None, "flavor": str(self.flavor), "weights": self.weights.to_dict(),
                    "dtype": self.dtype, "opset": self.opset, "calibration": self.calibration.to_dict(),
                    "plan": self.plan.to_dict()}
        calibration = self.calibration if self.scheme.needs_calibration else None
        return {"model": self.model, "scheme": {**self.scheme.to_dict(), "name": None}, "flavor": str(self.flavor),
                "weights": self.weights.to_dict(), "dtype": self.dtype, "opset": self.opset,
                "calibration": calibration.to_dict() if calibration is not None else None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExportRequest:
        """Parse :meth:`to_dict`'s form."""
        values = dict(known_fields(data, cls, "", ExportError))
        if values.get("scheme") is None and values.get("plan") is None:
            raise ExportError("missing request field 'scheme' (or 'plan')")
        return cls(**{"model": None, **values})
