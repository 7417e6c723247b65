"""What :func:`~kvq_export.validate.runner.validate` returns: every number of a validation, as frozen typed records.

:class:`ValidationResult` holds the run's identity (export, baseline, schemes, weights, model, config) and one
record per section: token agreement, the high-precision window, attention (key error and value error apart),
memory, the weights' own error and decode latency. :meth:`ValidationResult.as_dict` is the JSON form that
``kvq validate --json`` writes (its keys, their order and values are that file's layout) and
:meth:`ValidationResult.from_dict` reads it back (then :meth:`~ValidationResult.to_json` gives the
file's text again).

Numbers that follow from others (a ratio of two medians, perplexity's relative change, whether the measured bytes
match the prediction) are properties, not fields: a record cannot disagree with itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_export.manifest_sections import CalibrationRecord
from kvq_export.request import WeightSpec
from kvq_export.scheme import KVQuantScheme
from kvq_export.validate.attention import AttentionResult
from kvq_export.validate.config import ValidateConfig
from kvq_export.validate.scores import TokenSummary

if TYPE_CHECKING:
    from kvq_export.weight_bytes import WeightBytes


def weights_label(spec: WeightSpec) -> str:
    """``int4 (blocks of 32, symmetric, accuracy_level 4)``; ``fp32`` / ``fp16`` alone (they have no settings).

    Two exports store the same weights exactly when their labels are equal.
    """
    if not spec.quantized:
        return str(spec.format)
    if not spec.blocked:
        return f"{spec.format} (int8 per output channel, int8 activations per token)"
    return (f"{spec.format} (blocks of {spec.block_size}, {'symmetric' if spec.symmetric else 'asymmetric'}, "
            f"accuracy_level {spec.accuracy_level})")


class _Flat:
    """A record whose JSON form is its fields, in their order."""

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Parse :meth:`as_dict`'s form."""
        return cls(**data)


# -- tokens --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Greedy:
    """Free-running greedy generation of both graphs from each prompt: tokens until they first differ.

    ``tokens`` generated per prompt (None: not run); ``prompts_exceeding_window``: prompts whose row reached past
    the high-precision window (only those read a quantized token).
    """

    tokens: int | None = None
    tokens_to_divergence: tuple[int, ...] = ()
    prompts_exceeding_window: int | None = None

    @property
    def prompts(self) -> int:
        """Prompts generated from (0: not run)."""
        return len(self.tokens_to_divergence)

    @property
    def mean_tokens_to_divergence(self) -> float:
        """Mean over the prompts."""
        return float(np.mean(self.tokens_to_divergence))

    @property
    def identical_fraction(self) -> float:
        """Share of prompts whose every generated token agreed."""
        return float(np.mean([a == self.tokens for a in self.tokens_to_divergence]))

    def as_dict(self) -> dict[str, Any]:
        """JSON form (``{"prompts": 0}`` when not run)."""
        if not self.prompts:
            return {"prompts": 0}
        return {"prompts": self.prompts, "tokens": self.tokens, "tokens_to_divergence": list(self.tokens_to_divergence),
                "mean_tokens_to_divergence": self.mean_tokens_to_divergence,
                "identical_fraction": self.identical_fraction,
                "prompts_exceeding_window": self.prompts_exceeding_window}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Greedy:
        """Parse :meth:`as_dict`'s form."""
        if not data["prompts"]:
            return cls()
        return cls(data["tokens"], tuple(data["tokens_to_divergence"]), data["prompts_exceeding_window"])


@dataclass(frozen=True)
class TokenResult:
    """The export's predictions of the corpus windows against the baseline's, and greedy agreement."""

    scores: TokenSummary
    greedy: Greedy

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {**self.scores.as_dict("baseline"), "greedy": self.greedy.as_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenResult:
        """Parse :meth:`as_dict`'s form."""
        return cls(TokenSummary.from_dict(data, "baseline"), Greedy.from_dict(data["greedy"]))


@dataclass(frozen=True)
class WindowResult(_Flat):
    """The export's high-precision span in tokens, and whether the scored windows and greedy prompts left it."""

    tokens: int
    windows_exceed: bool
    greedy_prompts_exceeding: int | None


@dataclass(frozen=True)
class WeightOnlyResult:
    """The baseline (the export's weights) against its fp32-weight twin, both with the baseline's cache.

    Either ``scores`` (with the twin's ``reference`` directory and weight bytes) or why it was ``skipped``.
    """

    weights: str  # the export's weights_label
    scores: TokenSummary | None = None
    reference: str | None = None
    reference_weight_bytes: int | None = None
    skipped: str | None = None

    def __post_init__(self) -> None:
        if (self.scores is None) == (self.skipped is None):
            raise ValueError("a weight-only line has scores or says why it was skipped, not both or neither")

    @property
    def reference_weights(self) -> str:
        """The twin's weights: fp32, as built."""
        return weights_label(WeightSpec())

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        if self.scores is None:
            return {"weights": self.weights, "skipped": self.skipped}
        return {"weights": self.weights, "reference_weights": self.reference_weights, "reference": self.reference,
                "reference_weight_bytes": self.reference_weight_bytes, **self.scores.as_dict("reference")}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightOnlyResult:
        """Parse :meth:`as_dict`'s form."""
        if "skipped" in data:
            return cls(data["weights"], skipped=data["skipped"])
        return cls(data["weights"], TokenSummary.from_dict(data, "reference"), data["reference"],
                   data["reference_weight_bytes"])


# -- memory and latency --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CurvePoint:
    """The memory model's cache bytes of one sequence (batch 1) at ``seq_len`` tokens, and fp16's."""

    seq_len: int
    bytes: int
    fp16_bytes: int

    def as_dict(self) -> dict[str, int]:
        """JSON form."""
        return {"seq_len": self.seq_len, "bytes": self.bytes, "fp16_bytes": self.fp16_bytes}


@dataclass(frozen=True)
class MemoryResult:
    """The cache bytes held after the windows against the memory model's, with both graphs' weight bytes.

    ``predicted_cache_state_bytes``: the prediction less static scales (they live in the graph, not the cache).
    """

    weights: WeightBytes
    baseline_weights: WeightBytes
    seq_len: int
    batch: int
    predicted_bytes: int
    predicted_cache_state_bytes: int
    measured_bytes: int
    fp16_bytes: int
    ratio: float
    bits_per_element: float
    breakdown: Mapping[str, int]
    curve: tuple[CurvePoint, ...]

    @property
    def prediction_matches(self) -> bool:
        """Whether the cache held exactly the bytes the memory model predicts."""
        return self.measured_bytes == self.predicted_cache_state_bytes

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "weight_bytes": self.weights.total, "weight_format": self.weights.format,
            "weights": self.weights.to_dict(), "baseline_weight_bytes": self.baseline_weights.total,
            "baseline_weight_format": self.baseline_weights.format, "baseline_weights": self.baseline_weights.to_dict(),
            "seq_len": self.seq_len, "batch": self.batch, "predicted_bytes": self.predicted_bytes,
            "predicted_cache_state_bytes": self.predicted_cache_state_bytes, "measured_bytes": self.measured_bytes,
            "prediction_matches": self.prediction_matches, "fp16_bytes": self.fp16_bytes, "ratio": self.ratio,
            "bits_per_element": self.bits_per_element, "breakdown": dict(self.breakdown),
            "curve": [c.as_dict() for c in self.curve],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryResult:
        """Parse :meth:`as_dict`'s form."""
        return cls(_weight_bytes(data["weights"]), _weight_bytes(data["baseline_weights"]), data["seq_len"],
                   data["batch"], data["predicted_bytes"], data["predicted_cache_state_bytes"], data["measured_bytes"],
                   data["fp16_bytes"], data["ratio"], data["bits_per_element"], dict(data["breakdown"]),
                   tuple(CurvePoint(**c) for c in data["curve"]))


def _weight_bytes(data: Mapping[str, Any]) -> WeightBytes:
    """A :class:`~kvq_export.weight_bytes.WeightBytes` from its JSON form (``total``, ``parameters``: derived)."""
    from kvq_export.weight_bytes import WeightBytes  # lazy: imports onnx

    return WeightBytes(data["format"], data["quantized"], data["scales"], dict(data["unquantized"]), data["files"],
                       dict(data["settings"]), data["constants"])


@dataclass(frozen=True)
class Timing(_Flat):
    """Decode-step wall times: median, 10th and 90th percentile (ms) of ``steps`` steps."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    steps: int

    @classmethod
    def of(cls, ms: Sequence[float]) -> Timing:
        """The timing of ``ms``, one wall time a step."""
        v = np.asarray(ms, dtype=np.float64)
        return cls(float(np.median(v)), float(np.percentile(v, 10)), float(np.percentile(v, 90)), int(v.size))


@dataclass(frozen=True)
class LatencyBucket:
    """Both graphs' decode steps whose context length lies in ``(context_from, context_to]``."""

    context_from: int
    context_to: int
    quantized: Timing
    baseline: Timing

    @property
    def ratio(self) -> float:
        """The export's median step time over the baseline's."""
        return self.quantized.median_ms / self.baseline.median_ms

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"context_from": self.context_from, "context_to": self.context_to, "quantized": self.quantized.as_dict(),
                "baseline": self.baseline.as_dict(), "ratio": self.ratio}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyBucket:
        """Parse :meth:`as_dict`'s form."""
        return cls(data["context_from"], data["context_to"], Timing.from_dict(data["quantized"]),
                   Timing.from_dict(data["baseline"]))


@dataclass(frozen=True)
class LatencyResult:
    """Decode-step times of both graphs, measured alternately (the first step left out as warm-up)."""

    buckets: tuple[LatencyBucket, ...]
    quantized: Timing
    baseline: Timing
    batch: int
    tokens_per_step: int

    @property
    def ratio(self) -> float:
        """The export's median step time over the baseline's."""
        return self.quantized.median_ms / self.baseline.median_ms

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"buckets": [b.as_dict() for b in self.buckets], "quantized": self.quantized.as_dict(),
                "baseline": self.baseline.as_dict(), "ratio": self.ratio, "batch": self.batch,
                "tokens_per_step": self.tokens_per_step}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyResult:
        """Parse :meth:`as_dict`'s form."""
        return cls(tuple(LatencyBucket.from_dict(b) for b in data["buckets"]), Timing.from_dict(data["quantized"]),
                   Timing.from_dict(data["baseline"]), data["batch"], data["tokens_per_step"])


# -- the whole result ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSummary(_Flat):
    """The validated model, as the export's manifest records it."""

    source: str | None
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class CalibrationResult:
    """How the export's static scales or high channels were chosen, and whether the scored text was that text.

    ``windows_overlap_calibration``: None when the export does not say which text calibrated it.
    """

    record: CalibrationRecord
    windows_overlap_calibration: bool | None

    @classmethod
    def of(cls, record: CalibrationRecord, config: ValidateConfig) -> CalibrationResult:
        """``record`` beside whether ``config``'s windows read any of the tokens that calibrated it."""
        overlap = None  # unknown: the export does not say which text calibrated it
        if record.calibrated and record.tokens is not None:
            # calibration read tokens [start, start + tokens) of its corpus; validation reads the windows below
            start = record.offset or 0
            end = config.offset + config.windows * config.window_len
            overlap = record.corpus == config.corpus and config.offset < start + record.tokens and start < end
        return cls(record, overlap)

    def as_dict(self) -> dict[str, Any]:
        """JSON form: the record's, and the overlap."""
        return {**self.record.to_dict(), "windows_overlap_calibration": self.windows_overlap_calibration}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationResult:
        """Parse :meth:`as_dict`'s form."""
        record = {k: v for k, v in data.items() if k != "windows_overlap_calibration"}
        return cls(CalibrationRecord.from_dict(record), data["windows_overlap_calibration"])


@dataclass(frozen=True)
class ValidationResult:
    """Every number of one ``kvq validate`` run (see the module docstring)."""

    export: str
    baseline: str
    baseline_scheme: KVQuantScheme
    baseline_flavor: str
    weights: WeightSpec  # the export's (and so the baseline's) weight storage
    scheme: KVQuantScheme
    model: ModelSummary
    flavor: str
    config: ValidateConfig
    calibration: CalibrationResult | None
    token: TokenResult
    window: WindowResult
    attention: AttentionResult
    memory: MemoryResult
    weight_only: WeightOnlyResult
    latency: LatencyResult
    seconds: float

    @property
    def weights_label(self) -> str:
        """The weights in words (:func:`weights_label`)."""
        return weights_label(self.weights)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form ``kvq validate --json`` writes."""
        return {
            "export": self.export, "baseline": self.baseline, "baseline_scheme": self.baseline_scheme.to_dict(),
            "baseline_flavor": self.baseline_flavor, "weights": self.weights.to_dict(),
            "weights_label": self.weights_label, "scheme": self.scheme.to_dict(), "model": self.model.as_dict(),
            "flavor": self.flavor, "config": {**asdict(self.config), "prompts": list(self.config.prompts)},
            "calibration": None if self.calibration is None else self.calibration.as_dict(),
            "token": self.token.as_dict(), "window": self.window.as_dict(), "attention": self.attention.as_dict(),
            "memory": self.memory.as_dict(), "weight_only": self.weight_only.as_dict(),
            "latency": self.latency.as_dict(), "seconds": self.seconds,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`as_dict` as JSON text."""
        return json.dumps(self.as_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationResult:
        """Parse :meth:`as_dict`'s form (a ``kvq validate --json`` file, loaded)."""
        calibration = data["calibration"]
        return cls(
            data["export"], data["baseline"], KVQuantScheme.from_dict(data["baseline_scheme"]), data["baseline_flavor"],
            WeightSpec.from_dict(data["weights"]), KVQuantScheme.from_dict(data["scheme"]),
            ModelSummary.from_dict(data["model"]), data["flavor"],
            ValidateConfig(**{**data["config"], "prompts": tuple(data["config"]["prompts"])}),
            None if calibration is None else CalibrationResult.from_dict(calibration),
            TokenResult.from_dict(data["token"]), WindowResult.from_dict(data["window"]),
            AttentionResult.from_dict(data["attention"]), MemoryResult.from_dict(data["memory"]),
            WeightOnlyResult.from_dict(data["weight_only"]), LatencyResult.from_dict(data["latency"]), data["seconds"])

