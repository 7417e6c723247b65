"""Opt-in pass/fail thresholds on a validation result, as ``polygraphy run`` has for its comparisons.

``kvq validate`` reports numbers; a deployment pipeline needs a verdict. :class:`Gates` holds the thresholds a
user set (none by default) and :meth:`Gates.misses` names every one a result misses; the CLI then exits 1 with
one line. A number that is not finite (a broken run) misses every gate that reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvq_export.errors import GateError

if TYPE_CHECKING:
    from kvq_export.validate.result import ValidationResult


@dataclass(frozen=True)
class Gates:
    """Thresholds on a :func:`~kvq_export.validate.runner.validate` result (None: not checked)."""

    max_ppl_delta: float | None = None  # relative perplexity increase over the baseline (0.02 = +2%)
    min_top1: float | None = None  # top-1 agreement with the baseline, 0..1
    max_kl: float | None = None  # mean per-token KL(baseline || export), nats

    def __post_init__(self) -> None:
        for name in ("max_ppl_delta", "min_top1", "max_kl"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise GateError(f"invalid {name}={value!r}: allowed: a finite number >= 0")
        if self.min_top1 is not None and self.min_top1 > 1:
            raise GateError(f"invalid min_top1={self.min_top1!r}: allowed: a number in [0, 1]")

    @property
    def any(self) -> bool:
        """Whether any threshold is set."""
        return any(v is not None for v in (self.max_ppl_delta, self.min_top1, self.max_kl))

    def misses(self, result: ValidationResult) -> list[str]:
        """One phrase per threshold ``result`` misses (empty: every gate passed)."""
        token = result.token.scores
        out = []
        delta = float(token.perplexity_delta_rel)
        if self.max_ppl_delta is not None and not delta <= self.max_ppl_delta:
            out.append(f"perplexity {delta:+.3%} vs the baseline exceeds --max-ppl-delta {self.max_ppl_delta:g} "
                       f"({self.max_ppl_delta:+.3%})")
        top1 = float(token.top1_agreement)
        if self.min_top1 is not None and not top1 >= self.min_top1:
            out.append(f"top-1 agreement {top1:.4f} is below --min-top1 {self.min_top1:g}")
        kl = float(token.kl.mean)
        if self.max_kl is not None and not kl <= self.max_kl:
            out.append(f"mean KL {kl:.4g} exceeds --max-kl {self.max_kl:g}")
        return out

    def check(self, result: ValidationResult) -> None:
        """Raise :class:`GateError` (one line naming every miss) unless ``result`` passes every gate."""
        missed = self.misses(result)
        if missed:
            raise GateError(f"validation gate missed: {'; '.join(missed)}")
