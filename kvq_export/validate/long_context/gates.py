"""Opt-in pass/fail thresholds on a long-context result, as :class:`kvq_export.validate.gates.Gates` has.

``--min-retrieval`` reads the pass rate (the export's exact matches over the trials of the cells the baseline
passes); ``--max-group-ppl-delta`` the relative perplexity change of one distance group (``4096-8192=0.005``) or of
every group (``0.005``); ``--max-logprob-drop`` the gold answers' mean teacher-forced log-probability against the
baseline's, over every trial (a continuous score: it moves with the cache's error where exact matches flip on near
ties, and still reads where the baseline misses). A gate whose number was not measured (no cell the baseline
passes, a group no window reached, no trial) misses, naming why: a gate never passes on nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvq_export.errors import GateError

if TYPE_CHECKING:
    from kvq_export.validate.long_context.result import LongContextResult


def parse_group_limit(text: str) -> tuple[str | None, float]:
    """``START-END=VALUE`` (one distance group) or ``VALUE`` (every group) as (group label or None, value)."""
    group, _, value = text.rpartition("=")
    try:
        number = float(value)
        if group:
            start, end = (int(p) for p in group.split("-"))
            group = f"{start}-{end}"
    except ValueError:
        number = float("nan")
    if not math.isfinite(number) or number < 0:
        raise GateError(f"invalid --max-group-ppl-delta {text!r}: allowed: VALUE or START-END=VALUE, VALUE a finite "
                        "number >= 0 (0.005 = +0.5%), e.g. 4096-8192=0.005")
    return group or None, number


@dataclass(frozen=True)
class LongContextGates:
    """Thresholds on a :func:`~kvq_export.validate.long_context.runner.validate_long_context` result."""

    min_retrieval: float | None = None
    max_group_ppl_delta: tuple[tuple[str | None, float], ...] = ()
    max_logprob_drop: float | None = None  # nats

    def __post_init__(self) -> None:
        value = self.min_retrieval
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value <= 1):
            raise GateError(f"invalid min_retrieval={value!r}: allowed: a number in [0, 1]")
        drop = self.max_logprob_drop
        if drop is not None and (isinstance(drop, bool) or not isinstance(drop, (int, float))
                                 or not math.isfinite(drop) or drop < 0):
            raise GateError(f"invalid max_logprob_drop={drop!r}: allowed: a finite number >= 0 (nats)")

    @property
    def any(self) -> bool:
        """Whether any threshold is set."""
        return self.min_retrieval is not None or bool(self.max_group_ppl_delta) or self.max_logprob_drop is not None

    def misses(self, result: LongContextResult) -> list[str]:
        """One phrase per threshold ``result`` misses (empty: every gate passed)."""
        out = []
        if self.min_retrieval is not None:
            hits, total = result.retrieval.scored()
            if not total:
                out.append("--min-retrieval: the baseline passed no cell, so no retrieval was scored")
            elif not hits / total >= self.min_retrieval:
                out.append(f"retrieval {hits}/{total} ({hits / total:.1%}) of the trials in cells the baseline passes "
                           f"is below --min-retrieval {self.min_retrieval:g}")
        out += self._logprob_misses(result)
        groups = {g.label: g for g in result.distance}
        for label, limit in self.max_group_ppl_delta:
            for name in ([label] if label else list(groups)):
                group = groups.get(name)
                if group is None:
                    out.append(f"--max-group-ppl-delta: group {name} was not measured (measured: "
                               f"{', '.join(groups) or 'none'})")
                elif not group.perplexity_delta_rel <= limit:
                    out.append(f"perplexity at positions {name} {group.perplexity_delta_rel:+.3%} vs the baseline "
                               f"exceeds --max-group-ppl-delta {limit:g} ({limit:+.3%})")
        return out

    def _logprob_misses(self, result: LongContextResult) -> list[str]:
        if self.max_logprob_drop is None:
            return []
        summary = result.retrieval.summary()
        delta = summary["logprob_delta"]
        if delta is None:
            return ["--max-logprob-drop: no retrieval trial was run"]
        if not -delta <= self.max_logprob_drop:
            return [f"the gold answers' log-probability {delta:+.3f} nats vs the baseline (mean of "
                    f"{summary['trials']} trials) drops by more than --max-logprob-drop {self.max_logprob_drop:g}"]
        return []

    def check(self, result: LongContextResult) -> None:
        """Raise :class:`GateError` (one line naming every miss) unless ``result`` passes every gate."""
        missed = self.misses(result)
        if missed:
            raise GateError(f"long-context gate missed: {'; '.join(missed)}")
