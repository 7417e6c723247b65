"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a seeded generator.

``repetition_penalty`` (CTRL's, as Hugging Face and onnxruntime-genai apply it) divides the positive logits and
multiplies the negative logits of every token the row already holds (prompt and generated) before any choice, so
greedy decoding of a small model stops repeating one clause; 1 leaves the logits unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvq_export.errors import KVQError

#: repetition penalties kvq applies: beyond them float32 logits overflow to inf or collapse to 0 (1e308 or 1e-308
#: become inf and 0 in float32), far past any useful setting (Hugging Face's examples use 1.1-1.5)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; otherwise sample from the filtered, tempered distribution."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not _real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise KVQError(f"invalid temperature={self.temperature!r}: allowed: 0 (greedy) or a finite number > 0")
        if self.top_k is not None and (not _integer(self.top_k) or self.top_k < 1):
            raise KVQError(f"invalid top_k={self.top_k!r}: allowed: an integer >= 1")
        if self.top_p is not None and (not _real(self.top_p) or not 0 < self.top_p <= 1):  # NaN fails 0 < x
            raise KVQError(f"invalid top_p={self.top_p!r}: allowed: a probability in (0, 1]")
        if self.seed is not None and (not _integer(self.seed) or self.seed < 0):
            raise KVQError(f"invalid seed={self.seed!r}: allowed: an integer >= 0")
        low, high = REPETITION_PENALTY_RANGE
        if not _real(self.repetition_penalty) or not low <= self.repetition_penalty <= high:  # NaN fails too
            raise KVQError(f"invalid repetition_penalty={self.repetition_penalty!r}: allowed: a number from {low:g} "
                           f"to {high:g} (1 = off, > 1 discourages repeats)")

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
        self.seen: list[set[int]] | None = None  # tokens each row holds (for the repetition penalty)

    def prime(self, token_lists) -> None:
        """Tell the sampler each row's prompt tokens (the repetition penalty counts them too)."""
        self.seen = [{int(t) for t in tokens} for tokens in token_lists]

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """Choose one token per row."""
        if self.config.repetition_penalty == 1:
            return self._choose(logits)
        if self.seen is None:  # not primed: only generated tokens count
            self.seen = [set() for _ in range(len(logits))]
        chosen = self._choose(self.penalized(logits))
        for row, token in enumerate(chosen):
            self.seen[row].add(int(token))
        return chosen

    def penalized(self, logits: np.ndarray) -> np.ndarray:
        """The logits a penalized sampler chooses from (``logits`` itself is left alone).

        For each token a row holds, a positive logit is divided by the repetition penalty and a negative one
        multiplied (CTRL's rule).
        """
        out = np.array(logits, dtype=np.float32, copy=True)
        penalty = np.float32(self.config.repetition_penalty)
        for row, tokens in enumerate(self.seen or []):
            if tokens:
                idx = np.fromiter(tokens, dtype=np.int64)
                values = out[row, idx]
                out[row, idx] = np.where(values > 0, values / penalty, values * penalty)
        return out

    def _choose(self, logits: np.ndarray) -> np.ndarray:
        cfg = self.config
        bad = ~np.isfinite(logits).all(axis=-1)
        if bad.any():  # argmax of NaN is token 0: never hand out a token chosen from garbage
            raise KVQError(f"logits of row {int(np.flatnonzero(bad)[0])} contain NaN or Inf: refusing to sample")
        if cfg.greedy:
            return logits.argmax(axis=-1)
        # shifted first: a tiny temperature then sends every other logit to -inf instead of overflowing (inf - inf)
        with np.errstate(over="ignore"):  # -inf is the intended limit there
            scaled = (logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)) / cfg.temperature
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
