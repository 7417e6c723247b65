"""The peer comparison's rows: one engine and cache each, compared with the engine's own unquantized cache.

:mod:`kvq_export.peer_compare.compare` runs the comparison; the rows are written as JSON (``--json``), read back
(:func:`rows_from_json`) and merged across runs that split the work (:func:`merge_rows`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: tokens a prefill feeds per call, in every engine (kvq, onnxruntime-genai, llama.cpp's batch)
PREFILL_CHUNK = 512
#: each engine's rows are compared with its own unquantized cache (same weights, same runtime)
OWN_BASELINES = {"kvq ort-gqa": "fp32 buffer", "genai builder": "fp32 (no kv quant)", "llama.cpp": "f16"}


@dataclass
class Row:
    """One engine + cache configuration."""

    engine: str
    cache: str
    kvq_counterpart: str
    status: str = "ok"  # ok | unavailable | failed: reason
    ppl: float | None = None
    ppl_delta: float | None = None  # vs the engine's own unquantized cache
    mean_kl: float | None = None  # llama.cpp: mean KL of the next-token distribution from its own f16 cache's
    top1: float | None = None  # llama.cpp: share of tokens whose argmax agrees with the f16 cache's
    decode_ms: float | None = None  # median single-token step at --context tokens
    speed_ratio: float | None = None  # decode_ms / the engine's baseline decode_ms (< 1: faster)
    note: str = ""
    decode_ms_at: dict[int, float] | None = None  # genai peer: median step per context
    prefill_tok_s: float | None = None  # genai peer: chunked prefill of the longest context
    cache_bytes: int | None = None  # genai peer: cache buffers held at the longest context
    weights: str = ""  # genai peer: how the weights are stored (fp32, int4)
    decode_ms_batch: dict[int, dict[int, float]] | None = None  # genai peer: batch -> context -> median step
    prefill_tok_s_at: dict[int, float] | None = None  # genai peer: context -> prefill tok/s (batch 1)
    dir_bytes: int | None = None  # genai peer: bytes of the export directory's files
    bits_4096: float | None = None  # kvq rows of the genai/deploy peers: the scheme's bits/element at 4096 tokens
    cache_bytes_at: dict[int, int] | None = None  # genai/deploy peers: context -> cache bytes held (batch 1)

    def failed(self, err: Exception) -> None:
        """Mark the row failed with ``err`` (a peer failing must not stop the others)."""
        self.status = f"failed: {type(err).__name__}: {err}"


def finish(rows: list[Row], baseline: str) -> list[Row]:
    """``ppl_delta`` and ``speed_ratio`` of every ok row against the ``baseline`` cache's row, where both exist."""
    base = next((r for r in rows if r.cache == baseline and r.status == "ok"), None)
    for r in rows:
        if base is not None and r.status == "ok":
            r.ppl_delta = r.ppl - base.ppl if r.ppl is not None and base.ppl is not None else None
            r.speed_ratio = r.decode_ms / base.decode_ms if r.decode_ms and base.decode_ms else None
    return rows


def own_baseline_deltas(rows: list[Row]) -> list[Row]:
    """``ppl_delta`` (and ``speed_ratio``) of every row against its engine's own unquantized cache."""
    for engine, baseline in OWN_BASELINES.items():
        finish([r for r in rows if r.engine == engine], baseline)
    return rows


def delta_pct(row: Row) -> float | None:
    """``row``'s Δppl in percent of its own baseline's perplexity."""
    return None if row.ppl_delta is None else 100 * row.ppl_delta / (row.ppl - row.ppl_delta)


def rows_from_json(data: dict[str, Any]) -> list[Row]:
    """The rows of a ``--json`` file (contexts and batch sizes back to ints)."""
    def ints(value):
        return {int(k): ints(v) for k, v in value.items()} if isinstance(value, dict) else value

    rows = [Row(**{k: ints(v) for k, v in row.items()}) for row in data["rows"]]
    for row in rows:  # files written before cache_bytes_at: cache_bytes is the last (longest) context's
        if row.cache_bytes_at is None and row.cache_bytes is not None and row.decode_ms_at:
            row.cache_bytes_at = {max(row.decode_ms_at): row.cache_bytes}
    return rows


def merge_rows(runs: list[list[Row]]) -> list[Row]:
    """One row per (engine, cache) from runs that measured parts of the same engines.

    (Perplexity in one process and timing in another, say.) Later runs fill what earlier ones left unmeasured,
    per field and per context; a failure in any run is kept.
    """
    merged: dict[tuple[str, str], Row] = {}
    for rows in runs:
        for row in rows:
            key = (row.engine, row.cache)
            if key not in merged:
                merged[key] = Row(**asdict(row))
                continue
            into = merged[key]
            for name, value in asdict(row).items():
                have = getattr(into, name)
                if isinstance(value, dict) and isinstance(have, dict):
                    setattr(into, name, {**have, **value})
                elif value is not None and (have is None or have == "" or name == "status" and have == "ok"):
                    setattr(into, name, value)
    return own_baseline_deltas(list(merged.values()))
