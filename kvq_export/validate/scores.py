"""Token scores: one graph's predictions of a text against a reference graph's, step by step, then summed up.

``kvq validate`` scores its windows with :class:`TokenScores` (the export against the baseline, and the baseline
against its fp32-weight twin), and ``kvq demo`` its teacher-forced continuation; both read the
:class:`TokenSummary` it gives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _logsoftmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Spread:
    """Mean, 99th percentile and largest value of a number measured many times (NaN when never measured)."""

    mean: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> Spread:
        """The spread of ``values``."""
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            return cls(float("nan"), float("nan"), float("nan"))
        return cls(float(v.mean()), float(np.percentile(v, 99)), float(v.max()))

    def as_dict(self) -> dict[str, float]:
        """JSON form."""
        return {"mean": self.mean, "p99": self.p99, "max": self.max}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Spread:
        """Parse :meth:`as_dict`'s form."""
        return cls(data["mean"], data["p99"], data["max"])


@dataclass(frozen=True)
class TokenSummary:
    """Predictions of the same targets by a scored and a reference graph: perplexities, KL and top-1 agreement.

    ``kl``: KL(reference || scored) per prediction. ``*_by_position``: the mean at each position of the window
    (None where not kept: the weight-only line).
    """

    perplexity: float
    reference_perplexity: float
    predictions: int
    kl: Spread
    top1_agreement: float
    kl_by_position: tuple[float, ...] | None = None
    top1_by_position: tuple[float, ...] | None = None

    @property
    def perplexity_delta_rel(self) -> float:
        """Relative perplexity change against the reference (0.02 = +2%)."""
        return self.perplexity / self.reference_perplexity - 1.0

    def as_dict(self, reference: str) -> dict[str, Any]:
        """JSON form; the reference's perplexity is ``perplexity_<reference>``."""
        out: dict[str, Any] = {"perplexity": self.perplexity, f"perplexity_{reference}": self.reference_perplexity,
                               "perplexity_delta_rel": self.perplexity_delta_rel, "predictions": self.predictions,
                               "kl": self.kl.as_dict()}
        if self.kl_by_position is not None:
            out["kl_by_position"] = list(self.kl_by_position)
        out["top1_agreement"] = self.top1_agreement
        if self.top1_by_position is not None:
            out["top1_by_position"] = list(self.top1_by_position)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], reference: str) -> TokenSummary:
        """Parse :meth:`as_dict`'s form."""
        kl, top1 = data.get("kl_by_position"), data.get("top1_by_position")
        return cls(data["perplexity"], data[f"perplexity_{reference}"], data["predictions"],
                   Spread.from_dict(data["kl"]), data["top1_agreement"], None if kl is None else tuple(kl),
                   None if top1 is None else tuple(top1))


@dataclass
class TokenScores:
    """Two graphs' predictions of the same targets, step by step: each one's NLL, KL(reference || scored), top-1."""

    nll: list[np.ndarray] = field(default_factory=list)
    nll_ref: list[np.ndarray] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)
    top1: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: np.ndarray, ref_logits: np.ndarray, targets: np.ndarray) -> None:
        """Score one step: ``targets`` [rows, n] are the tokens after the first n positions of the logits."""
        usable = targets.shape[1]
        lq, lb = _logsoftmax(logits[:, :usable]), _logsoftmax(ref_logits[:, :usable])
        rows = np.arange(targets.shape[0])[:, None]
        cols = np.arange(usable)[None, :]
        self.nll.append(-lq[rows, cols, targets])
        self.nll_ref.append(-lb[rows, cols, targets])
        self.kl.append(np.sum(np.exp(lb) * (lb - lq), axis=-1))
        self.top1.append(lq.argmax(-1) == lb.argmax(-1))

    def summary(self) -> TokenSummary:
        """Perplexity of both, KL and top-1 agreement, overall and by position in the window."""
        nll, nll_ref = np.concatenate(self.nll, axis=1), np.concatenate(self.nll_ref, axis=1)
        kl = np.concatenate(self.kl, axis=1)
        top1 = np.concatenate(self.top1, axis=1)
        return TokenSummary(float(np.exp(nll.mean())), float(np.exp(nll_ref.mean())), int(nll.size),
                            Spread.of(kl.ravel()), float(top1.mean()), tuple(kl.mean(axis=0).tolist()),
                            tuple(top1.mean(axis=0).tolist()))
