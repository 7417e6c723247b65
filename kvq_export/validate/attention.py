"""Attention-aware error analysis: key error before softmax, value error after it.

For one decode query ``q`` of a query head and the keys/values its kv head sees, with exact ``K, V``
(what the fp16 baseline stores) and stored-then-dequantized ``K̂, V̂``::

    a  = softmax(q Kᵀ · s)      a' = softmax(q K̂ᵀ · s)      o = a V
    keys only:   o_k = a' V     values only: o_v = a V̂      both: o_b = a' V̂
    o_b - o = (a' - a) V  +  a (V̂ - V)  +  (a' - a)(V̂ - V)
              key-induced    value-induced   cross term

Everything is float64 and exact algebra, so "values only leaves a unchanged", "keys only has no
value-induced term" and "the three terms add up to the total" hold to rounding (tested).

:func:`summarize` averages many samples per layer and head into an :class:`AttentionResult`, the attention
section of a validation result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np


class AttentionMetric(StrEnum):
    """What :func:`attention_metrics` measures per query head, in the order they are reported."""

    KEY_MSE = "key_mse"
    VALUE_MSE = "value_mse"
    KEY_REL_ERROR = "key_rel_error"
    SCORE_SHIFT_MEAN = "score_shift_mean"
    SCORE_SHIFT_MAX = "score_shift_max"
    KL_KEYS = "kl_keys"
    TV_KEYS = "tv_keys"
    TOP1_KEYS = "top1_keys"
    TOPK_KEYS = "topk_keys"
    MARGIN = "margin"
    TOP2_FLIP = "top2_flip"
    OUT_REL_KEYS = "out_rel_keys"
    OUT_REL_VALUES = "out_rel_values"
    OUT_REL_BOTH = "out_rel_both"
    KEY_INDUCED = "key_induced"
    VALUE_INDUCED = "value_induced"
    CROSS_TERM = "cross_term"
    DECOMPOSITION_RESIDUAL = "decomposition_residual"


#: Every metric, in report order.
METRICS = tuple(AttentionMetric)


@dataclass(frozen=True)
class AttentionSample:
    """One decode step of one layer for one sequence.

    Shapes: ``q`` [Hq, D]; ``keys``/``values`` exact and ``keys_hat``/``values_hat`` stored, each [Hkv, N, D].
    """

    q: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    keys_hat: np.ndarray
    values_hat: np.ndarray
    scaling: float


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _norm(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x, axis=-1)


def attention_metrics(sample: AttentionSample, *, top_k: int = 8) -> dict[AttentionMetric, np.ndarray]:
    """Every metric of :data:`METRICS` for each query head ([Hq] arrays)."""
    q = sample.q.astype(np.float64)
    hq, hkv = q.shape[0], sample.keys.shape[0]
    expand = np.repeat(np.arange(hkv), hq // hkv)  # query head -> its kv head (GQA)
    k, v = sample.keys.astype(np.float64)[expand], sample.values.astype(np.float64)[expand]
    kh, vh = sample.keys_hat.astype(np.float64)[expand], sample.values_hat.astype(np.float64)[expand]

    scores = np.einsum("hd,hnd->hn", q, k) * sample.scaling
    scores_hat = np.einsum("hd,hnd->hn", q, kh) * sample.scaling
    a, a2 = _softmax(scores), _softmax(scores_hat)
    o = np.einsum("hn,hnd->hd", a, v)
    o_keys = np.einsum("hn,hnd->hd", a2, v)
    o_values = np.einsum("hn,hnd->hd", a, vh)
    o_both = np.einsum("hn,hnd->hd", a2, vh)
    key_term = np.einsum("hn,hnd->hd", a2 - a, v)
    value_term = np.einsum("hn,hnd->hd", a, vh - v)
    cross = np.einsum("hn,hnd->hd", a2 - a, vh - v)
    o_norm = np.maximum(_norm(o), 1e-30)

    shift = np.abs(scores_hat - scores)
    kl = np.sum(a * (np.log(np.maximum(a, 1e-300)) - np.log(np.maximum(a2, 1e-300))), axis=-1)
    n = scores.shape[-1]
    k_eff = min(top_k, n)
    top = np.argsort(-scores, axis=-1)
    top_hat = np.argsort(-scores_hat, axis=-1)
    topk_overlap = np.array([len(set(top[h, :k_eff]) & set(top_hat[h, :k_eff])) / k_eff for h in range(hq)])
    if n >= 2:
        margin = scores[np.arange(hq), top[:, 0]] - scores[np.arange(hq), top[:, 1]]
        flip = scores_hat[np.arange(hq), top[:, 1]] > scores_hat[np.arange(hq), top[:, 0]]
    else:
        margin, flip = np.full(hq, np.inf), np.zeros(hq, bool)

    return {
        AttentionMetric.KEY_MSE: np.mean((kh - k) ** 2, axis=(1, 2)),
        AttentionMetric.VALUE_MSE: np.mean((vh - v) ** 2, axis=(1, 2)),
        AttentionMetric.KEY_REL_ERROR: (np.linalg.norm(kh - k, axis=(1, 2))
                                        / np.maximum(np.linalg.norm(k, axis=(1, 2)), 1e-30)),
        AttentionMetric.SCORE_SHIFT_MEAN: shift.mean(axis=-1),
        AttentionMetric.SCORE_SHIFT_MAX: shift.max(axis=-1),
        AttentionMetric.KL_KEYS: np.maximum(kl, 0.0),
        AttentionMetric.TV_KEYS: 0.5 * np.abs(a2 - a).sum(axis=-1),
        AttentionMetric.TOP1_KEYS: (top[:, 0] == top_hat[:, 0]).astype(np.float64),
        AttentionMetric.TOPK_KEYS: topk_overlap,
        AttentionMetric.MARGIN: margin,
        AttentionMetric.TOP2_FLIP: flip.astype(np.float64),
        AttentionMetric.OUT_REL_KEYS: _norm(o_keys - o) / o_norm,
        AttentionMetric.OUT_REL_VALUES: _norm(o_values - o) / o_norm,
        AttentionMetric.OUT_REL_BOTH: _norm(o_both - o) / o_norm,
        AttentionMetric.KEY_INDUCED: _norm(key_term) / o_norm,
        AttentionMetric.VALUE_INDUCED: _norm(value_term) / o_norm,
        AttentionMetric.CROSS_TERM: _norm(cross) / o_norm,
        AttentionMetric.DECOMPOSITION_RESIDUAL: _norm(o_both - o - key_term - value_term - cross) / o_norm,
    }


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x`` ascending, tied values sharing the mean of their ranks (scipy's ``rankdata``)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    order = np.argsort(x, kind="stable")
    values = x[order]
    # runs of equal values: each gets the mean of the positions it occupies
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    ends = np.r_[starts[1:], values.size]
    mean_rank = (starts + ends + 1) / 2.0  # positions start+1 .. end, averaged
    ranks = np.empty(x.size)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def rank_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation of two equally long score vectors (1 = same order), ties at average ranks.

    Heads that share a KV head have equal key error, so ties are common: ranking them arbitrarily would make
    the answer depend on the heads' order. NaN when either vector is constant (no order to agree with).
    """
    ra, rb = average_ranks(a), average_ranks(b)
    if ra.size != rb.size:
        raise ValueError(f"rank_agreement: {ra.size} vs {rb.size} scores")
    ra -= ra.mean()
    rb -= rb.mean()
    denom = np.sqrt((ra**2).sum() * (rb**2).sum())
    return float((ra * rb).sum() / denom) if denom else float("nan")


# -- the summary of many samples -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSummary:
    """Each :class:`AttentionMetric` averaged over every layer, head and sample.

    The fields are the metrics, in their order.
    """

    # the stored keys' and values' own error
    key_mse: float
    value_mse: float
    key_rel_error: float
    # what the key error does to the attention scores and probabilities
    score_shift_mean: float
    score_shift_max: float
    kl_keys: float
    tv_keys: float
    top1_keys: float
    topk_keys: float
    margin: float
    top2_flip: float
    # the attention output's relative error: keys only, values only, both
    out_rel_keys: float
    out_rel_values: float
    out_rel_both: float
    # the total split into key-induced (a'-a)V, value-induced a(V'-V) and their cross term
    key_induced: float
    value_induced: float
    cross_term: float
    decomposition_residual: float

    def as_dict(self) -> dict[str, float]:
        """JSON form."""
        return asdict(self)


@dataclass(frozen=True)
class PositionError:
    """The attention output's error at one decode position, averaged over layers, heads and windows."""

    position: int
    out_rel_keys: float
    out_rel_values: float
    out_rel_both: float
    kl_keys: float

    def as_dict(self) -> dict[str, float]:
        """JSON form (the position is its key in :meth:`AttentionResult.as_dict`)."""
        return {"out_rel_keys": self.out_rel_keys, "out_rel_values": self.out_rel_values,
                "out_rel_both": self.out_rel_both, "kl_keys": self.kl_keys}


@dataclass(frozen=True)
class HeadError:
    """One query head's key error: how much it moves the output, against how large it is (rank 1: largest MSE)."""

    layer: int
    head: int
    key_induced: float
    out_rel_keys: float
    kl_keys: float
    key_mse: float
    mse_rank: int

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


@dataclass(frozen=True)
class AttentionResult:
    """Attention at sampled decode positions: exact K/V against the stored, decoded cache (``samples`` = 0: none)."""

    samples: int = 0
    summary: AttentionSummary | None = None
    per_layer_head: Mapping[AttentionMetric, tuple[tuple[float, ...], ...]] | None = None  # [layer][head]
    by_position: tuple[PositionError, ...] = ()
    key_error_hurts_most: tuple[HeadError, ...] = ()  # at most 10, largest key-induced error first
    rank_agreement_mse_vs_key_induced: float | None = None  # Spearman over heads (NaN: a constant ranking)
    rank_agreement_mse_vs_kl: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON form (``{"samples": 0}`` when nothing was sampled)."""
        if self.summary is None or self.per_layer_head is None:
            return {"samples": self.samples}
        return {
            "samples": self.samples,
            "summary": self.summary.as_dict(),
            "per_layer_head": {m: [list(row) for row in grid] for m, grid in self.per_layer_head.items()},
            "by_position": {str(p.position): p.as_dict() for p in self.by_position},
            "key_error_hurts_most": [h.as_dict() for h in self.key_error_hurts_most],
            "rank_agreement_mse_vs_key_induced": self.rank_agreement_mse_vs_key_induced,
            "rank_agreement_mse_vs_kl": self.rank_agreement_mse_vs_kl,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttentionResult:
        """Parse :meth:`as_dict`'s form."""
        if "summary" not in data:
            return cls(data["samples"])
        grids = {AttentionMetric(m): tuple(tuple(row) for row in grid) for m, grid in data["per_layer_head"].items()}
        return cls(data["samples"], AttentionSummary(**data["summary"]), grids,
                   tuple(PositionError(int(p), **e) for p, e in data["by_position"].items()),
                   tuple(HeadError(**h) for h in data["key_error_hurts_most"]),
                   data["rank_agreement_mse_vs_key_induced"], data["rank_agreement_mse_vs_kl"])


#: What :attr:`AttentionResult.by_position` reports at each sampled position.
POSITION_METRICS = (AttentionMetric.OUT_REL_KEYS, AttentionMetric.OUT_REL_VALUES, AttentionMetric.OUT_REL_BOTH,
                    AttentionMetric.KL_KEYS)


def summarize(samples: Sequence[tuple[int, int, Mapping[AttentionMetric, np.ndarray]]], num_layers: int,
              num_heads: int) -> AttentionResult:
    """Average :func:`attention_metrics` of ``(layer, position, metrics)`` samples per layer and head, and overall.

    Ranks the heads by key-induced output error, each beside its key MSE's rank: where MSE misleads.
    """
    if not samples:
        return AttentionResult()
    grid = {m: np.zeros((num_layers, num_heads)) for m in METRICS}
    counts = np.zeros(num_layers)
    by_position: dict[int, dict[AttentionMetric, list[float]]] = defaultdict(lambda: defaultdict(list))
    for layer, position, metrics in samples:
        counts[layer] += 1
        for m in METRICS:
            grid[m][layer] += metrics[m]
        for m in POSITION_METRICS:
            by_position[position][m].append(float(np.mean(metrics[m])))
    for m in METRICS:
        grid[m] /= np.maximum(counts, 1)[:, None]
    hurt = grid[AttentionMetric.KEY_INDUCED].ravel()
    mse = grid[AttentionMetric.KEY_MSE].ravel()
    order = np.argsort(-hurt)
    mse_rank = (mse[None, :] > mse[:, None]).sum(axis=1)  # heads with a larger MSE: tied heads share a rank
    top = tuple(HeadError(int(i // num_heads), int(i % num_heads), float(hurt[i]),
                          float(grid[AttentionMetric.OUT_REL_KEYS].ravel()[i]),
                          float(grid[AttentionMetric.KL_KEYS].ravel()[i]), float(mse[i]), int(mse_rank[i]) + 1)
                for i in order[:10])
    return AttentionResult(
        len(samples), AttentionSummary(**{m.value: float(np.mean(grid[m])) for m in METRICS}),
        {m: tuple(tuple(row) for row in grid[m].tolist()) for m in METRICS},
        tuple(PositionError(p, **{m.value: float(np.mean(v)) for m, v in ms.items()})
              for p, ms in sorted(by_position.items())),
        top, rank_agreement(mse, hurt), rank_agreement(mse, grid[AttentionMetric.KL_KEYS].ravel()))
