"""Scoring text the way every runtime can: strict decode, negative log-likelihood pooled by token.

Strict decode feeds every token alone, so each prediction reads the stored (quantized) cache. :class:`NllPool` is
protocol P's pooling: every scored token's NLL summed in float64, ``ppl = exp(total / count)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvq_export.errors import KVQError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@dataclass
class NllPool:
    """Protocol P's pooling: the NLL of every scored token summed in float64, ``ppl = exp(total / count)``.

    Windows are pooled by token, not averaged per window, so every engine's figure weighs the same 4088 tokens
    alike however it batches them.
    """

    total: float = 0.0
    count: int = 0

    def add(self, logits: np.ndarray, targets: Sequence[int] | np.ndarray) -> None:
        """Score ``targets`` [n] under ``logits`` [n, vocab] (row i predicts ``targets[i]``)."""
        targets = np.asarray(targets, dtype=np.int64).reshape(-1)
        logp = log_softmax(np.asarray(logits).reshape(len(targets), -1))
        self.total -= float(logp[np.arange(len(targets)), targets].sum())
        self.count += len(targets)

    @property
    def ppl(self) -> float:
        """``exp`` of the mean NLL of the tokens added so far."""
        if not self.count:
            raise ValueError("perplexity of no scored token")
        return math.exp(self.total / self.count)


def perplexity(session: Any, windows: Sequence[Sequence[int]]) -> dict[str, float]:
    """Strict-decode perplexity of a kvq session: every token is fed alone, so each prediction reads the cache.

    All windows run as one batch (they must have equal length). Returns ``ppl``, ``nll`` (mean, nats) and
    ``tokens`` (predictions scored) and ``seconds``.
    """
    ids = np.asarray(windows, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise KVQError("perplexity needs windows of equal length >= 2")
    start = time.perf_counter()
    capacity = session.layout.capacity_for(ids.shape[1])
    cache = session.empty_cache(ids.shape[0], capacity=capacity)
    total = 0.0
    for i in range(ids.shape[1] - 1):
        logits, cache = session.step(ids[:, i:i + 1], None, cache)
        last = logits[:, -1].astype(np.float64)
        top = last.max(axis=-1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(last - top).sum(axis=-1))
        total += float((logz - last[np.arange(ids.shape[0]), ids[:, i + 1]]).sum())
    count = ids.shape[0] * (ids.shape[1] - 1)
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "seconds": time.perf_counter() - start}
