"""The one owner of a server's cache memory: which row each sequence holds, and the prefixes rows keep after.

:class:`CachePool` wraps a :class:`~kvq_export.runtime.rows.RowCache`. The scheduler asks it for a row for a
prompt (:meth:`CachePool.acquire`), feeds tokens through it (:meth:`CachePool.run`), and gives the row back when
the sequence ends (:meth:`CachePool.release`); it never touches a row itself. The pool mirrors the tokens every row
holds, so it can find the longest cached prefix of a prompt:

* a row whose sequence ended stays **idle** with its codes (prompt and answer) until it is needed, and the least
  recently used idle row is evicted first;
* a new prompt takes the idle row holding its longest prefix (the row keeps that prefix and drops the rest); where
  the longest prefix sits in a **busy** row, its codes are copied into a free row;
* a prefix shorter than :data:`MIN_SHARED` tokens is not reused (it costs a row's cached content or a copy);
* a prompt sharing a prefix with a prompt still being prefilled waits until that row holds the shared part
  (:attr:`Lease.wait`), so requests that arrive together compute it once;
* a full hit still computes the prompt's last token (its logits give the first answer token).

Reuse is exact only where what a row holds follows from its tokens alone, however they were split into calls: the
session attends over stored codes on every call (``KVQSession(stored_prefill=True)``), so a row's first ``n``
tokens are what any prompt starting with those tokens would have stored. Matching is token by token (no block
granularity): rows are few (tens to hundreds) and a comparison over them is one numpy expression.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvq_export.runtime.rows import RowCache

logger = logging.getLogger(__name__)

#: shortest prefix worth reusing, copying out of a busy row or waiting for (tokens)
MIN_SHARED = 16


class RowState(Enum):
    """What a row holds: nothing, a cached prefix with no sequence (idle), or a running sequence."""

    FREE = "free"
    IDLE = "idle"
    BUSY = "busy"


@dataclass(frozen=True)
class Lease:
    """What :meth:`CachePool.acquire` found: a row holding ``reused`` of the prompt's first tokens, or ``wait``.

    ``wait``: a prompt being prefilled in another row shares a longer prefix; try again after the next round.
    """

    row: int = -1
    reused: int = 0
    copied: bool = False
    wait: bool = False


class CachePool:
    """Rows, what each holds, and cached prefixes, for one :class:`RowCache` (one thread owns it).

    ``prefix_cache``: keep rows after their sequence and reuse their prefixes (needs a cache whose rows follow from
    their tokens alone, :attr:`RowCache.codes_only`); False: every row is emptied when its sequence ends.
    """

    def __init__(self, cache: RowCache, *, prefix_cache: bool) -> None:
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.rows = cache.rows
        self.tokens = np.zeros((cache.rows, cache.capacity), dtype=np.int32)  # what each row holds, by position
        self.state = [RowState.FREE] * cache.rows
        self.idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.planned: dict[int, np.ndarray] = {}  # busy rows still prefilling: the prompt they will hold

    # -- what the scheduler asks ------------------------------------------------------------------------------
    def available(self) -> int:
        """Rows a new sequence could take now (free, or idle and evictable)."""
        return self.rows - self.busy()

    def busy(self) -> int:
        """Rows holding a running sequence."""
        return sum(state is RowState.BUSY for state in self.state)

    def cached(self) -> int:
        """Idle rows keeping a prefix."""
        return len(self.idle)

    def acquire(self, prompt: np.ndarray, *, lookup: bool = True) -> Lease | None:
        """A row for ``prompt`` (int token ids), with the longest cached prefix it can reuse; None: no row is free.

        ``lookup`` False: an empty row, whatever is cached (a request that asked for no reuse).
        """
        prompt = np.asarray(prompt)
        usable = len(prompt) - 1  # the last prompt token is always computed
        source, held = -1, 0
        if self.prefix_cache and lookup and usable > 0:
            source, held = self._longest(prompt, usable)
            if self._pending(prompt, usable, held):
                return Lease(wait=True)
        if held < MIN_SHARED:  # too short to be worth a row's cached content, or a copy
            source, held = -1, 0
        if source >= 0 and self.state[source] is RowState.IDLE:
            row = source
            del self.idle[row]
            self.cache.truncate(row, held)
        else:
            row = self._empty_row()
            if row < 0:
                return None
            if held:
                self.cache.copy_prefix(source, row, held)
                self.tokens[row, :held] = self.tokens[source, :held]
        self.state[row] = RowState.BUSY
        self.planned[row] = prompt
        return Lease(row=row, reused=held, copied=row != source and held > 0)

    def run(self, start: int, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """:meth:`RowCache.run` on rows ``[start, start + k)``, recording what each row now holds."""
        before = self.cache.lengths[start:start + len(ids)].copy()
        logits = self.cache.run(start, ids, mask)
        for offset, (n0, row_ids) in enumerate(zip(before, ids)):
            fed = row_ids if mask is None else row_ids[mask[offset].astype(bool)]
            self.tokens[start + offset, n0:n0 + len(fed)] = fed
            if start + offset in self.planned and n0 + len(fed) >= len(self.planned[start + offset]):
                del self.planned[start + offset]  # its whole prompt is in
        return logits

    def release(self, row: int, *, keep: bool = True) -> None:
        """The sequence in ``row`` ended: keep its codes for reuse (``keep`` and the pool caches), or empty it."""
        self.planned.pop(row, None)
        if self.prefix_cache and keep and self.cache.lengths[row] > 0:
            self.state[row] = RowState.IDLE
            self.idle[row] = None
        else:
            self.cache.clear(row)
            self.state[row] = RowState.FREE

    # -- lookups -----------------------------------------------------------------------------------------------
    def _longest(self, prompt: np.ndarray, usable: int) -> tuple[int, int]:
        """(row, tokens) of the longest prefix of ``prompt[:usable]`` a row holds now; (-1, 0) if none.

        Ties go to an idle row (reused in place, no copy), then to the one used most recently.
        """
        rows = np.flatnonzero((self.cache.lengths > 0) & (self.tokens[:, 0] == prompt[0]))
        if not len(rows):
            return -1, 0
        shared = _shared_lengths(self.tokens[rows], self.cache.lengths[rows], prompt[:usable])
        recency = {row: rank for rank, row in enumerate(self.idle)}
        best = max(range(len(rows)), key=lambda i: (shared[i], self.state[rows[i]] is RowState.IDLE,
                                                      recency.get(int(rows[i]), -1)))
        return (int(rows[best]), int(shared[best])) if shared[best] > 0 else (-1, 0)

    def _pending(self, prompt: np.ndarray, usable: int, now: int) -> bool:
        """Whether a row still prefilling will hold more of ``prompt`` than the ``now`` tokens any row holds.

        More by :data:`MIN_SHARED` tokens or more; ``prompt[:usable]`` counts.
        """
        for row, planned in self.planned.items():
            n = min(len(planned) - 1, usable)
            if n - now >= MIN_SHARED:
                shared = _shared_lengths(planned[None, :n], np.array([n]), prompt[:n])[0]
                if shared - now >= MIN_SHARED and shared > self.cache.lengths[row]:
                    return True
        return False

    def _empty_row(self) -> int:
        """The lowest free row, else the least recently used idle row (evicted); -1 when every row is busy.

        Low rows first keep running sequences together, so a decode call spans few rows that are not decoding.
        """
        for row, state in enumerate(self.state):
            if state is RowState.FREE:
                return row
        if not self.idle:
            return -1
        row, _ = self.idle.popitem(last=False)
        self.cache.clear(row)
        self.state[row] = RowState.FREE
        return row


def _shared_lengths(held: np.ndarray, lengths: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """How many first tokens each row of ``held`` (its first ``lengths`` valid) shares with ``prompt``."""
    n = len(prompt)
    if held.shape[1] < n:
        prompt = prompt[:held.shape[1]]
        n = len(prompt)
    differ = held[:, :n] != prompt[None, :]
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), n)
    return np.minimum(first, lengths)
