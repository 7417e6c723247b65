"""Perplexity by distance: long corpus windows scored token by token against the baseline, grouped by position.

A token at position p is predicted from p tokens of context, so grouping the scored tokens by position says how
the cache's error grows with the distance attention reaches back over. Each window starts from an empty cache;
both graphs are fed the same ``chunk`` tokens per step in lockstep (on ort-gqa a chunk's tokens attend to each
other's exact K/V and to the earlier chunks' stored codes). Every group reports perplexity, KL(baseline ||
export) and top-1 agreement of the same predictions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvq_export.validate.scores import TokenScores


@dataclass(frozen=True)
class DistanceGroup:
    """The scored tokens at positions ``[start, end)`` of every window: both perplexities, KL and top-1."""

    start: int
    end: int
    predictions: int
    perplexity: float
    baseline_perplexity: float
    kl_mean: float
    top1_agreement: float

    @property
    def perplexity_delta_rel(self) -> float:
        """Relative perplexity change against the baseline (0.001 = +0.1%)."""
        return self.perplexity / self.baseline_perplexity - 1.0

    @property
    def label(self) -> str:
        """``start-end`` as the gates and tables spell it."""
        return f"{self.start}-{self.end}"


def score_window(quant, base, tokens: np.ndarray, chunk: int,
                 advance: Callable[[int], None] = lambda n: None) -> TokenScores:
    """One window ``[1, L]`` fed to both full-logit sessions in lockstep; its scores at target positions 1..L-1."""
    length = tokens.shape[1]
    scores = TokenScores()
    q_cache, b_cache = quant.empty_cache(1, capacity=length), base.empty_cache(1, capacity=length)
    for begin in range(0, length - 1, chunk):
        ids = tokens[:, begin:min(begin + chunk, length - 1)]  # the last token is only a target
        q_logits, q_cache = quant.step(ids, None, q_cache)
        b_logits, b_cache = base.step(ids, None, b_cache)
        scores.add(q_logits, b_logits, tokens[:, begin + 1:begin + 1 + ids.shape[1]])
        advance(2 * ids.shape[1])
    return scores


def group_scores(windows: Sequence[TokenScores], groups: Sequence[tuple[int, int]]) -> tuple[DistanceGroup, ...]:
    """Pool every window's predictions by target position into ``groups`` (groups no window reaches are left out)."""
    columns = {name: [np.concatenate(getattr(w, name), axis=1)[0] for w in windows]
               for name in ("nll", "nll_ref", "kl", "top1")}
    out = []
    for start, end in groups:
        pooled = {}
        for name, per_window in columns.items():
            # column j of a window is the prediction of the token at position j + 1
            pooled[name] = np.concatenate([v[max(start - 1, 0):max(end - 1, 0)] for v in per_window])
        n = pooled["nll"].size
        if n == 0:
            continue
        out.append(DistanceGroup(start, end, int(n), float(np.exp(pooled["nll"].mean())),
                                 float(np.exp(pooled["nll_ref"].mean())), float(pooled["kl"].mean()),
                                 float(pooled["top1"].mean())))
    return tuple(out)
