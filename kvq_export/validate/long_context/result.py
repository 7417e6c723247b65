"""``kvq validate --long-context``'s result: frozen records, the retrieval summary the gates read, and JSON.

A *trial* pairs the baseline's and the export's outcome on one prompt. A *cell* is a task, a length and a depth
over its trials. The baseline *passes* a cell when it answers every trial of it; cells it does not pass are kept
(their log-probabilities still say something) but left out of the pass rate, which is the export's exact matches
over the trials of the cells the baseline passes. Flips are counted over every paired trial, with McNemar's exact
p-value.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvq_export.errors import KVQError
from kvq_export.scheme import KVQuantScheme
from kvq_export.validate.long_context.config import LongContextConfig
from kvq_export.validate.long_context.distance import DistanceGroup
from kvq_export.validate.long_context.retrieval import mcnemar_p


@dataclass(frozen=True)
class TrialResult:
    """The baseline and the export on one prompt."""

    task: str
    length: int
    depth: float
    trial: int
    answer: str
    baseline_hit: bool
    export_hit: bool
    baseline_logprob: float
    export_logprob: float
    baseline_said: str
    export_said: str


@dataclass(frozen=True)
class CellResult:
    """One task, length and depth over its trials."""

    task: str
    length: int
    depth: float
    trials: int
    baseline_hits: int
    export_hits: int
    logprob_delta: float  # mean of export - baseline log-probability of the gold answer

    @property
    def baseline_passes(self) -> bool:
        """Whether the baseline answered every trial (only such cells count in the pass rate)."""
        return self.baseline_hits == self.trials


@dataclass(frozen=True)
class RetrievalResult:
    """Every trial of the grid, and what is read from them."""

    trials: tuple[TrialResult, ...]

    def cells(self, task: str | None = None) -> tuple[CellResult, ...]:
        """The cells (of ``task``, or all), in task, length and depth order."""
        keys = sorted({(t.task, t.length, t.depth) for t in self.trials if task in (None, t.task)},
                      key=lambda k: (self.tasks.index(k[0]), k[1], k[2]))
        out = []
        for key in keys:
            members = [t for t in self.trials if (t.task, t.length, t.depth) == key]
            delta = sum(t.export_logprob - t.baseline_logprob for t in members) / len(members)
            out.append(CellResult(*key, len(members), sum(t.baseline_hit for t in members),
                                  sum(t.export_hit for t in members), delta))
        return tuple(out)

    @property
    def tasks(self) -> list[str]:
        """The tasks run, in the order they ran."""
        return list(dict.fromkeys(t.task for t in self.trials))

    def scored(self, task: str | None = None) -> tuple[int, int]:
        """(export hits, trials) over the cells the baseline passes."""
        passed = [c for c in self.cells(task) if c.baseline_passes]
        return sum(c.export_hits for c in passed), sum(c.trials for c in passed)

    def pass_rate(self, task: str | None = None) -> float:
        """The export's exact matches over the trials of the cells the baseline passes (NaN where none)."""
        hits, total = self.scored(task)
        return hits / total if total else float("nan")

    def flips(self, task: str | None = None) -> tuple[int, int]:
        """(lost, gained): trials the baseline answers and the export does not, and the other way round."""
        mine = [t for t in self.trials if task in (None, t.task)]
        return (sum(t.baseline_hit and not t.export_hit for t in mine),
                sum(t.export_hit and not t.baseline_hit for t in mine))

    def mcnemar_p(self, task: str | None = None) -> float:
        """Exact McNemar p-value of the flips (1.0: no flip)."""
        return mcnemar_p(*self.flips(task))

    def worst_cell_deficit(self) -> int:
        """Most trials the export misses, against the baseline, in one cell the baseline passes (0: none)."""
        return max((c.baseline_hits - c.export_hits for c in self.cells() if c.baseline_passes), default=0)

    def summary(self, task: str | None = None) -> dict[str, Any]:
        """The numbers one line of a table shows for ``task`` (or every task)."""
        hits, total = self.scored(task)
        lost, gained = self.flips(task)
        mine = [t for t in self.trials if task in (None, t.task)]
        return {"trials": len(mine), "baseline_hits": sum(t.baseline_hit for t in mine),
                "export_hits": sum(t.export_hit for t in mine), "scored_trials": total, "scored_hits": hits,
                "pass_rate": hits / total if total else None, "lost": lost, "gained": gained,
                "mcnemar_p": mcnemar_p(lost, gained),
                "logprob_delta": sum(t.export_logprob - t.baseline_logprob for t in mine) / len(mine) if mine else None}


@dataclass(frozen=True)
class LongContextResult:
    """Everything ``kvq validate --long-context`` measured (nothing is written into an export)."""

    export: str
    baseline: str
    scheme: KVQuantScheme
    baseline_scheme: KVQuantScheme
    flavor: str
    weights: str
    cpu: str
    config: LongContextConfig
    distance: tuple[DistanceGroup, ...]
    retrieval: RetrievalResult
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """JSON form: the run, the distance groups, the retrieval summary by task, cells and trials."""
        retrieval = self.retrieval
        return {
            "export": self.export, "baseline": self.baseline, "scheme": self.scheme.to_dict(),
            "baseline_scheme": self.baseline_scheme.to_dict(), "flavor": self.flavor, "weights": self.weights,
            "cpu": self.cpu, "config": asdict(self.config), "seconds": self.seconds,
            "distance": [{**asdict(g), "perplexity_delta_rel": g.perplexity_delta_rel} for g in self.distance],
            "retrieval": {
                "summary": retrieval.summary(), "worst_cell_deficit": retrieval.worst_cell_deficit(),
                "by_task": {task: retrieval.summary(task) for task in retrieval.tasks},
                "cells": [{**asdict(c), "baseline_passes": c.baseline_passes} for c in retrieval.cells()],
                "trials": [asdict(t) for t in retrieval.trials],
            },
        }

    def to_json(self) -> str:
        """:meth:`as_dict` as indented JSON."""
        return json.dumps(self.as_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LongContextResult:
        """The result :meth:`as_dict` wrote (what is derived from the trials is derived again)."""
        config = data["config"]
        return cls(
            export=data["export"], baseline=data["baseline"], scheme=KVQuantScheme.from_dict(data["scheme"]),
            baseline_scheme=KVQuantScheme.from_dict(data["baseline_scheme"]), flavor=data["flavor"],
            weights=data["weights"], cpu=data["cpu"],
            config=LongContextConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}),
            distance=tuple(DistanceGroup(**{f.name: g[f.name] for f in fields(DistanceGroup)})
                           for g in data["distance"]),
            retrieval=RetrievalResult(tuple(TrialResult(**t) for t in data["retrieval"]["trials"])),
            seconds=data["seconds"])

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LongContextResult:
        """An earlier ``--json``; one line naming the file when it is not such a result."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError, KVQError) as err:
            raise KVQError(f"{path}: not a kvq validate --long-context --json result "
                           f"({type(err).__name__}: {err})") from None
