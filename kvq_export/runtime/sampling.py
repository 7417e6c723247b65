"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvq_export.errors import KVQError


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; otherwise sample from the filtered, tempered distribution."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise KVQError(f"invalid temperature={self.temperature!r}: allowed: 0 (greedy) or a finite number > 0")
        if self.top_k is not None and (not _integer(self.top_k) or self.top_k < 1):
            raise KVQError(f"invalid top_k={self.top_k!r}: allowed: an integer >= 1")
        if self.top_p is not None and (not _real(self.top_p) or not 0 < self.top_p <= 1):  # NaN fails 0 < x
            raise KVQError(f"invalid top_p={self.top_p!r}: allowed: a probability in (0, 1]")
        if self.seed is not None and (not _integer(self.seed) or self.seed < 0):
            raise KVQError(f"invalid seed={self.seed!r}: allowed: an integer >= 0")

    @property
    def greedy(self) -> bool:
        """No randomness involved."""
        return self.temperature == 0


def _real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class Sampler:
    """Turns last-position logits [B, V] into next tokens [B]."""

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """Choose one token per row."""
        cfg = self.config
        bad = ~np.isfinite(logits).all(axis=-1)
        if bad.any():  # argmax of NaN is token 0: never hand out a token chosen from garbage
            raise KVQError(f"logits of row {int(np.flatnonzero(bad)[0])} contain NaN or Inf: refusing to sample")
        if cfg.greedy:
            return logits.argmax(axis=-1)
        scaled = logits.astype(np.float64) / cfg.temperature
        if cfg.top_k is not None and cfg.top_k < scaled.shape[-1]:
            kth = np.partition(scaled, -cfg.top_k, axis=-1)[:, -cfg.top_k][:, None]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        if cfg.top_p is not None and cfg.top_p < 1:
            order = np.argsort(-probs, axis=-1)
            sorted_p = np.take_along_axis(probs, order, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < cfg.top_p
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order, keep_sorted, axis=-1)
            probs = np.where(keep, probs, 0.0)
            probs /= probs.sum(axis=-1, keepdims=True)
        return np.array([self.rng.choice(probs.shape[-1], p=row) for row in probs])
