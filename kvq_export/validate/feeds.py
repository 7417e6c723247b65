"""Feeds for an export directory built from its manifest (Polygraphy data loader, ``kvq compare``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from kvq_export.runtime.session import KVQSession


def prompt_batch(vocab_size: int, *, prompt_len: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded random prompts: row r is ``prompt_len - r * prompt_len // 4`` tokens long."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (batch, prompt_len), dtype=np.int64)
    mask = np.ones_like(ids)
    for row in range(batch):
        pad = min(row * (prompt_len // 4), prompt_len - 1)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def polygraphy_feeds(directory: str | os.PathLike[str], *, prompt_len: int = 48, batch: int = 2,
                     seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """A prefill feed (empty cache) and a decode feed (this export's own cache), as numpy arrays."""
    session = KVQSession(directory)
    ids, mask = prompt_batch(session.manifest.model.vocab_size, prompt_len=prompt_len, batch=batch, seed=seed)
    empty = session.cache_arrays(session.empty_cache(batch))
    yield {"input_ids": ids, "attention_mask": mask, **empty}
    logits, cache = session.step(ids, mask)
    nxt = np.random.default_rng(seed + 1).integers(0, session.manifest.model.vocab_size, (batch, 1))
    yield {"input_ids": nxt.astype(np.int64), "attention_mask": np.ones((batch, 1), np.int64),
           **session.cache_arrays(cache)}
