"""One timing loop: runners' steps interleaved round by round, in a fresh random order every round.

Load from other processes on a shared machine drifts over seconds; a round runs one call of every runner
within milliseconds, so the drift hits them alike. The order is drawn anew each round (seeded, so a rerun
repeats it): with a fixed or rotating order every runner would often follow the same other one and inherit its
after-effects (ONNX Runtime's worker threads keep spinning for a while after a run, onnxruntime-genai's as
kvq's). Every caller times through :func:`interleaved`::

    timings = interleaved({"fp16": lambda i: fp16.step(a), "int8": lambda i: int8.step(b)}, rounds=32, warmup=4)
    timings["int8"].median / timings["fp16"].median

:func:`paired_ratio` compares two runners round by round (a change of load between rounds cancels).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvq_export.errors import KVQError

logger = logging.getLogger(__name__)

#: One call of a runner in round ``i``: the loop times it, or (``self_timed``) it returns the seconds it measured
#: itself (a step in another process, without the pipe's round trip; a prefill, without its allocation).
Stepper = Callable[[int], Any]


@dataclass(frozen=True)
class Timing:
    """Seconds of a runner's timed calls, in round order, with their median and spread."""

    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.seconds:
            raise KVQError("a timing needs at least one timed call")

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (numpy's linear interpolation)."""
        return float(np.percentile(np.asarray(self.seconds), q))

    @property
    def spread(self) -> tuple[float, float]:
        """(10th, 90th) percentile: the band most calls fall in."""
        return self.percentile(10), self.percentile(90)

    @property
    def fastest(self) -> float:
        return min(self.seconds)

    @property
    def slowest(self) -> float:
        return max(self.seconds)


def interleaved(steppers: Mapping[str, Stepper], rounds: int, *, warmup: int = 0, seed: int = 0,
                self_timed: bool = False, failures: MutableMapping[str, str] | None = None) -> dict[str, Timing]:
    """Time ``rounds`` calls of every stepper, one call each per round in a fresh random order (``seed``).

    The first ``warmup`` rounds run untimed (first runs allocate and plan); a stepper gets the round's index,
    warm-up rounds included; its return value is ignored unless ``self_timed``: then it is the call's seconds.
    ``failures``: a stepper that raises :class:`KVQError` is dropped from later rounds
    and its message kept there by name (without it, the error propagates). Returns a :class:`Timing` per
    stepper that finished.
    """
    if rounds < 1 or warmup < 0:
        raise KVQError(f"rounds={rounds}, warmup={warmup}: allowed rounds >= 1, warmup >= 0")
    live = list(steppers)
    seconds: dict[str, list[float]] = {name: [] for name in live}
    order = np.random.default_rng(seed)
    for i in range(warmup + rounds):
        for name in order.permutation(live):
            if name not in seconds:
                continue
            try:
                elapsed = _call(steppers[name], i, self_timed)
            except KVQError as err:
                if failures is None:
                    raise
                failures[name] = str(err)
                del seconds[name]
                logger.info("%s dropped in round %d: %s", name, i, err)
                continue
            if i >= warmup:
                seconds[name].append(elapsed)
    return {name: Timing(tuple(values)) for name, values in seconds.items()}


def _call(stepper: Stepper, i: int, self_timed: bool) -> float:
    start = time.perf_counter()
    measured = stepper(i)
    return float(measured) if self_timed else time.perf_counter() - start


def paired_ratio(times: Sequence[float], base_times: Sequence[float], *, level: float = 0.9,
                 resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high) of the per-round ratios ``times[i] / base_times[i]``.

    ``low``/``high``: the ``level`` bootstrap interval of the median (percentiles of the medians of ``resamples``
    resamples of the rounds).
    """
    ratios = np.asarray(times, dtype=np.float64) / np.asarray(base_times, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, ratios.size, (resamples, ratios.size))
    medians = np.median(ratios[picks], axis=1)
    tail = 100 * (1 - level) / 2
    return float(np.median(ratios)), float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))
