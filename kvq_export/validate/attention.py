"""Attention-aware error analysis: key error before softmax, value error after it.

For one decode query ``q`` of a query head and the keys/values its kv head sees, with exact ``K, V``
(what the fp16 baseline stores) and stored-then-dequantized ``K̂, V̂``::

    a  = softmax(q Kᵀ · s)      a' = softmax(q K̂ᵀ · s)      o = a V
    keys only:   o_k = a' V     values only: o_v = a V̂      both: o_b = a' V̂
    o_b - o = (a' - a) V  +  a (V̂ - V)  +  (a' - a)(V̂ - V)
              key-induced    value-induced   cross term

Everything is float64 and exact algebra, so "values only leaves a unchanged", "keys only has no
value-induced term" and "the three terms add up to the total" hold to rounding (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Metric names, per query head, in the order they are reported.
METRICS = (
    "key_mse", "value_mse", "key_rel_error", "score_shift_mean", "score_shift_max",
    "kl_keys", "tv_keys", "top1_keys", "topk_keys", "margin", "top2_flip",
    "out_rel_keys", "out_rel_values", "out_rel_both",
    "key_induced", "value_induced", "cross_term", "decomposition_residual",
)


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


def attention_metrics(sample: AttentionSample, *, top_k: int = 8) -> dict[str, np.ndarray]:
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
        "key_mse": np.mean((kh - k) ** 2, axis=(1, 2)),
        "value_mse": np.mean((vh - v) ** 2, axis=(1, 2)),
        "key_rel_error": np.linalg.norm(kh - k, axis=(1, 2)) / np.maximum(np.linalg.norm(k, axis=(1, 2)), 1e-30),
        "score_shift_mean": shift.mean(axis=-1),
        "score_shift_max": shift.max(axis=-1),
        "kl_keys": np.maximum(kl, 0.0),
        "tv_keys": 0.5 * np.abs(a2 - a).sum(axis=-1),
        "top1_keys": (top[:, 0] == top_hat[:, 0]).astype(np.float64),
        "topk_keys": topk_overlap,
        "margin": margin,
        "top2_flip": flip.astype(np.float64),
        "out_rel_keys": _norm(o_keys - o) / o_norm,
        "out_rel_values": _norm(o_values - o) / o_norm,
        "out_rel_both": _norm(o_both - o) / o_norm,
        "key_induced": _norm(key_term) / o_norm,
        "value_induced": _norm(value_term) / o_norm,
        "cross_term": _norm(cross) / o_norm,
        "decomposition_residual": _norm(o_both - o - key_term - value_term - cross) / o_norm,
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
