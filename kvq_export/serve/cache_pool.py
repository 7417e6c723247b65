"""The one owner of a server's cache memory: rows sized by tokens, the prefixes rows keep, and the bytes of both.

:class:`CachePool` holds the cache within one byte budget, as one segment of paged rows of the whole context (a row
counted by the pages its tokens reach) or as segments of rows of several capacities
(:mod:`kvq_export.serve.segments`). The scheduler asks it for a row for a prompt (:meth:`CachePool.acquire`), for
room when a sequence grows (:meth:`CachePool.grow`), feeds tokens through it (:meth:`CachePool.run`), and gives the
row back when the sequence ends or is preempted (:meth:`CachePool.release`); it never touches a row itself, and a
sequence knows its row only through its :class:`~kvq_export.serve.segments.Slot`, which the pool moves.

* **Bytes, paged**: a request gets a free row (or an idle one holding its prefix) while the budget holds the pages of
  its prompt and reserve, evicting the least recently used idle rows for room; a sequence's next page is counted as
  it grows, and where the budget has no room for it the scheduler preempts a sequence.
* **Bytes, classes**: a request gets a row of the smallest class holding its prompt and a reserve (its
  ``max_tokens``, at most :data:`RESERVE`): a free row of that class or of one up to twice as large (fewer segments
  decoding, fewer calls), else one in a new segment while the budget has room, else in place of the least recently
  used idle rows (a segment none of whose rows holds anything is freed). A request that finds no room waits; a
  sequence that finds no larger row is preempted by the scheduler.
* **Prefixes** (``prefix_cache``): a row whose sequence ended stays idle with its codes (prompt and answer). A new
  prompt takes the idle row holding its longest prefix where that row is of the class the prompt needs or up to
  twice as large (the row keeps the prefix and drops the rest), else the prefix's codes are copied into its new row
  (from an idle or a busy row). A prefix shorter than :data:`MIN_SHARED` tokens is not reused; a prompt sharing a
  longer prefix with a prompt still being prefilled waits until that row holds it (:attr:`Lease.wait`), so prompts
  arriving together compute it once; a full hit still computes the prompt's last token (its logits give the first
  answer token).

Reuse and moves are exact only where what a row holds follows from its tokens alone, however they were split into
calls: the session attends over stored codes on every call (``KVQSession(stored_prefill=True)``). Matching is token
by token (no block granularity): rows are tens to hundreds, and a comparison over them is one numpy expression.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.runtime.session import KVQSession
from kvq_export.serve.segments import RowState, Segment, Sizing, Slot, copy_codes

logger = logging.getLogger(__name__)

#: shortest prefix worth reusing, copying or waiting for (tokens)
MIN_SHARED = 16
#: tokens past the prompt a new row holds at least room for (fewer where ``max_tokens`` asks for fewer)
RESERVE = 64


@dataclass(frozen=True)
class Lease:
    """What :meth:`CachePool.acquire` found: a row holding ``reused`` of the prompt's first tokens, or ``wait``.

    ``wait``: a prompt being prefilled in another row shares a longer prefix; try again after the next round.
    """

    slot: Slot | None = None
    reused: int = 0
    wait: bool = False


@dataclass(frozen=True)
class PoolUsage:
    """What a pool's rows hold at one moment (:meth:`CachePool.usage`).

    Rows busy, idle (keeping a prefix) and free in the allocated segments; bytes of the busy and idle rows; tokens the
    busy rows hold; and the smallest rows the budget could still give running sequences (idle rows count as free,
    ``max_seqs`` bounds them).
    """

    busy: int
    cached: int
    free: int
    used_bytes: int
    held_tokens: int
    available: int


class CachePool:
    """Segments of rows within ``sizing``'s budget, what every row holds, and cached prefixes (one thread owns it).

    ``prefix_cache``: keep rows after their sequence and reuse their prefixes; False: a row is emptied when its
    sequence ends. ``max_seqs``: at most this many sequences hold rows at once (None: what the bytes allow).
    ``reserve``: tokens past the prompt a new row has room for, at most (:data:`RESERVE`).
    """

    def __init__(self, session: KVQSession, sizing: Sizing, *, prefix_cache: bool, max_seqs: int | None = None,
                 reserve: int = RESERVE):
        self.session, self.sizing = session, sizing
        self.prefix_cache, self.max_seqs, self.reserve = prefix_cache, max_seqs, reserve
        self.segments: list[Segment] = []
        self.idle: OrderedDict[tuple[Segment, int], None] = OrderedDict()  # least recently used first
        self.planned: dict[tuple[Segment, int], np.ndarray] = {}  # busy rows still prefilling: their prompt
        if sizing.paged:  # one segment, allocated now: its memory is committed page by page as its rows fill
            capacity = sizing.classes[-1]
            self.segments.append(Segment.allocate(session, sizing.most_rows[capacity], capacity, paged=True,
                                                  page_bytes=sizing.page_bytes))
        #: paged: the tokens each busy row is counted for at least (its prompt and reserve, then what it grew to)
        self.promised = np.zeros(sizing.most_rows[sizing.classes[-1]] if sizing.paged else 0, dtype=np.int64)

    # -- what the pool holds -------------------------------------------------------------------------------------
    def busy(self) -> int:
        """Rows holding a running sequence."""
        return sum(state is RowState.BUSY for segment in self.segments for state in segment.state)

    def cached(self) -> int:
        """Idle rows keeping a prefix."""
        return len(self.idle)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every segment allocated now (paged: the pages its rows are counted for)."""
        if self.sizing.paged:
            return int(self._paged_bytes()[0].sum())
        return sum(segment.nbytes for segment in self.segments)

    def _paged_bytes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Paged: (bytes each row is counted for, busy rows, idle rows): a busy row's promise or its tokens."""
        segment = self.segments[0]
        busy = np.fromiter((state is RowState.BUSY for state in segment.state), bool, segment.rows)
        idle = np.fromiter((state is RowState.IDLE for state in segment.state), bool, segment.rows)
        lengths = segment.cache.lengths
        return segment.cache.held_bytes(np.where(busy, np.maximum(lengths, self.promised), lengths)), busy, idle

    def usage(self) -> PoolUsage:
        """What the rows hold now, counted in one pass (the server's gauges read it every round)."""
        if self.sizing.paged:
            held, busy, idle = self._paged_bytes()
            busy_bytes, lengths = int(held[busy].sum()), self.segments[0].cache.lengths
            free = min(int(np.count_nonzero(~busy)), (self.sizing.budget_bytes - busy_bytes)
                       // int(self.segments[0].cache.held_bytes(self.reserve)))
            available = max(0, min(free, self.max_seqs - int(busy.sum())) if self.max_seqs else free)
            return PoolUsage(int(busy.sum()), int(idle.sum()), int(np.count_nonzero(~busy & ~idle)), int(held.sum()),
                             int(lengths[busy].sum()), available)
        busy = idle = rows = used = busy_bytes = tokens = 0
        for segment in self.segments:
            row_bytes, lengths = self.sizing.row_bytes[segment.capacity], segment.cache.lengths
            rows += segment.rows
            for row, state in enumerate(segment.state):
                if state is RowState.BUSY:
                    busy, busy_bytes, tokens = busy + 1, busy_bytes + row_bytes, tokens + int(lengths[row])
                elif state is RowState.IDLE:
                    idle += 1
                used += row_bytes * (state is not RowState.FREE)
        free = (self.sizing.budget_bytes - busy_bytes) // self.sizing.row_bytes[self.sizing.classes[0]]
        available = max(0, min(free, self.max_seqs - busy) if self.max_seqs else free)
        return PoolUsage(busy, idle, rows - busy - idle, used, tokens, available)

    def preallocate(self) -> None:
        """Allocate a segment of the largest class now (rows of one size: the whole cache, held from the start)."""
        capacity = self.sizing.classes[-1]
        self.segments.append(Segment.allocate(self.session, self.sizing.most_rows[capacity], capacity))

    # -- what the scheduler asks ---------------------------------------------------------------------------------
    def acquire(self, prompt: np.ndarray, *, lookup: bool = True, max_tokens: int | None = None,
                chunk: int | None = None) -> Lease | None:
        """A row for ``prompt`` (int token ids) and up to ``max_tokens`` more, with the longest cached prefix reused.

        None: no room now (``max_seqs`` sequences run, or the budget holds no row of its class).

        ``lookup`` False: nothing cached is reused (a request that asked for no reuse). ``chunk``: paged, the row is
        counted for its first call (the reused prefix and ``chunk`` more prompt tokens), and each later chunk as it
        runs (:meth:`grow`), as a paged cache commits them; None: for the whole prompt and its reserve from the start.
        """
        prompt = np.asarray(prompt)
        usable = len(prompt) - 1  # the last prompt token is always computed
        source, held = None, 0
        if self.prefix_cache and lookup and usable > 0:
            source, held = self._longest(prompt, usable)
            if self._pending(prompt, usable, held):
                return Lease(wait=True)
        if held < MIN_SHARED:  # too short to be worth a row's cached content, or a copy
            source, held = None, 0
        if self.max_seqs is not None and self.busy() >= self.max_seqs:
            return None
        need = len(prompt) + min(max_tokens or self.reserve, self.reserve)
        capacity = self.sizing.class_for(need)
        if self.sizing.paged:
            slot = self._paged_slot(source, held, need if chunk is None else min(need, held + chunk))
            if slot is None:
                return None
        elif source is not None and capacity <= source.capacity <= 2 * capacity and \
                self._state(source) is RowState.IDLE:
            del self.idle[(source.segment, source.row)]
            source.segment.cache.truncate(source.row, held)
            slot = source
        else:
            slot = self._free_slot(capacity, protect=source)
            if slot is None:
                return None
            if held:
                copy_codes(source, slot, held)
        slot.segment.state[slot.row] = RowState.BUSY
        self.planned[(slot.segment, slot.row)] = prompt
        return Lease(slot=slot, reused=held)

    def grow(self, slot: Slot, tokens: int) -> bool:
        """Make ``slot``'s row hold ``tokens``; False: no room (the scheduler preempts a sequence).

        Where its own row is too small the sequence moves into a row of a larger class (its codes copied).
        """
        if self.sizing.paged and tokens <= slot.capacity:  # the row has room: the budget, pages for them?
            counted = max(slot.length, int(self.promised[slot.row]))
            extra = int(slot.segment.cache.held_bytes(tokens) - slot.segment.cache.held_bytes(counted))
            if extra > 0 and not self._make_room(extra, protect=slot):
                return False
            self.promised[slot.row] = max(counted, tokens)
            return True
        if tokens <= slot.capacity:
            return True
        if tokens > self.sizing.classes[-1]:
            raise KVQError(f"a row of {tokens} tokens is beyond the largest, {self.sizing.classes[-1]}")
        target = self._free_slot(self.sizing.class_for(tokens), protect=slot)
        if target is None:
            return False
        copy_codes(slot, target, slot.length)
        target.segment.state[target.row] = RowState.BUSY
        planned = self.planned.pop((slot.segment, slot.row), None)
        if planned is not None:
            self.planned[(target.segment, target.row)] = planned
        self._empty(slot.segment, slot.row)
        slot.segment, slot.row = target.segment, target.row
        return True

    def run(self, segment: Segment, start: int, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """:meth:`RowCache.run` on ``segment``'s rows ``[start, start + k)``, recording what each row now holds."""
        before = segment.cache.lengths[start:start + len(ids)].copy()
        logits = segment.cache.run(start, ids, mask)
        for offset, (n0, row_ids) in enumerate(zip(before, ids)):
            fed = row_ids if mask is None else row_ids[mask[offset].astype(bool)]
            segment.tokens[start + offset, n0:n0 + len(fed)] = fed
            key = (segment, start + offset)
            if key in self.planned and n0 + len(fed) >= len(self.planned[key]):
                del self.planned[key]  # its whole prompt is in
        return logits

    def release(self, slot: Slot, *, keep: bool = True) -> None:
        """The sequence in ``slot`` ended or was preempted: keep its codes for reuse, or empty its row.

        Kept where ``keep`` and the pool caches prefixes.
        """
        key = (slot.segment, slot.row)
        self.planned.pop(key, None)
        if self.prefix_cache and keep and slot.length > 0:
            slot.segment.state[slot.row] = RowState.IDLE
            self.idle[key] = None
        else:
            self._empty(slot.segment, slot.row)

    # -- rows ----------------------------------------------------------------------------------------------------
    def _state(self, slot: Slot) -> RowState:
        return slot.segment.state[slot.row]

    def _free_slot(self, capacity: int, *, protect: Slot | None = None) -> Slot | None:
        """A free row of ``capacity`` or more; None when there is no room.

        In a segment of that class or one up to twice as large, in a new segment of that class while the budget has
        room, else where the least recently used idle rows were (never ``protect``'s).
        """
        # a free row of this class, else of a class up to twice as large: a row already allocated beats a new
        # segment, and every segment with a decoding row costs a decode step one more call
        fits = sorted((segment for segment in self.segments if capacity <= segment.capacity <= 2 * capacity),
                      key=lambda segment: segment.capacity)
        for segment in fits:
            if (row := segment.free_row()) >= 0:
                return Slot(segment, row)
        while True:
            rows = self.sizing.segment_rows(capacity, sum(s.rows for s in self.segments if s.capacity == capacity))
            if self.allocated_bytes + rows * self.sizing.row_bytes[capacity] <= self.sizing.budget_bytes:
                segment = Segment.allocate(self.session, rows, capacity)
                self.segments.append(segment)
                return Slot(segment, 0)
            victim = self._take_victim(protect)
            if victim is None:
                return None
            segment, row = victim
            if segment.capacity == capacity:
                segment.cache.clear(row)
                segment.state[row] = RowState.FREE
                return Slot(segment, row)
            self._empty(segment, row)

    def _paged_slot(self, source: Slot | None, held: int, need: int) -> Slot | None:
        """Paged: a row for a prompt counted for ``need`` tokens whose first ``held`` ``source`` holds; None: no room.

        An idle ``source`` is taken in place (its pages past the prefix go back), else a free row (the prefix copied
        into it). Least recently used idle rows are evicted while the budget lacks the row's pages or no row is free.
        """
        segment = self.segments[0]
        need = min(need, segment.capacity)
        in_place = source is not None and self._state(source) is RowState.IDLE
        if in_place:
            del self.idle[(source.segment, source.row)]
            segment.cache.truncate(source.row, held)
            slot = source
        else:
            row = segment.free_row()
            while row < 0 and self._evict(protect=source):
                row = segment.free_row()
            if row < 0:
                return None
            slot = Slot(segment, row)
        extra = int(segment.cache.held_bytes(need) - segment.cache.held_bytes(slot.length))
        if not self._make_room(extra, protect=source):
            if in_place:  # still idle, with the prefix it was asked for
                self.idle[(segment, slot.row)] = None
            return None
        if held and not in_place:
            copy_codes(source, slot, held)
        self.promised[slot.row] = need
        return slot

    def _make_room(self, extra: int, *, protect: Slot | None) -> bool:
        """Paged: evict least recently used idle rows (never ``protect``'s) until ``extra`` more bytes fit."""
        while self.allocated_bytes + extra > self.sizing.budget_bytes:
            if not self._evict(protect=protect):
                return False
        return True

    def _evict(self, *, protect: Slot | None) -> bool:
        """Empty the least recently used idle row (never ``protect``'s); False: there is none."""
        victim = self._take_victim(protect)
        if victim is None:
            return False
        self._empty(*victim)
        return True

    def _take_victim(self, protect: Slot | None) -> tuple[Segment, int] | None:
        """The least recently used idle row (never ``protect``'s), no longer idle; None: there is none."""
        keep = None if protect is None else (protect.segment, protect.row)
        victim = next((key for key in self.idle if key != keep), None)
        if victim is not None:
            del self.idle[victim]
        return victim

    def _empty(self, segment: Segment, row: int) -> None:
        """Empty ``row``; free its segment when no row of it holds anything (and another class could use it)."""
        segment.cache.clear(row)
        segment.state[row] = RowState.FREE
        if self.sizing.paged:
            self.promised[row] = 0
        elif segment.unused() and len(self.sizing.classes) > 1:
            self.segments.remove(segment)

    # -- lookups -------------------------------------------------------------------------------------------------
    def _longest(self, prompt: np.ndarray, usable: int) -> tuple[Slot | None, int]:
        """The row holding the longest prefix of ``prompt[:usable]`` now, and its length; (None, 0) if none.

        Ties go to an idle row (reusable in place), then to the one used most recently.
        """
        recency = {key: rank for rank, key in enumerate(self.idle)}
        best, best_key = (None, 0), (0, False, -1)
        for segment in self.segments:
            lengths = segment.cache.lengths
            rows = np.flatnonzero((lengths > 0) & (segment.tokens[:, 0] == prompt[0]))
            if not len(rows):
                continue
            # the prompt's columns only: a paged row's tokens span the whole context
            shared = _shared_lengths(segment.tokens[rows, :usable], lengths[rows], prompt[:usable])
            for row, n in zip(rows.tolist(), shared.tolist()):
                key = (n, segment.state[row] is RowState.IDLE, recency.get((segment, row), -1))
                if n > 0 and key > best_key:
                    best, best_key = (Slot(segment, row), n), key
        return best

    def _pending(self, prompt: np.ndarray, usable: int, now: int) -> bool:
        """Whether a row still prefilling will hold more of ``prompt`` than the ``now`` tokens any row holds.

        More by :data:`MIN_SHARED` tokens or more; ``prompt[:usable]`` counts.
        """
        for (segment, row), planned in self.planned.items():
            n = min(len(planned) - 1, usable)
            if n - now >= MIN_SHARED:
                shared = _shared_lengths(planned[None, :n], np.array([n]), prompt[:n])[0]
                if shared - now >= MIN_SHARED and shared > segment.cache.lengths[row]:
                    return True
        return False


def _shared_lengths(held: np.ndarray, lengths: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """How many first tokens each row of ``held`` (its first ``lengths`` valid) shares with ``prompt``."""
    n = min(len(prompt), held.shape[1])
    differ = held[:, :n] != prompt[None, :n]
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), n)
    return np.minimum(first, lengths)
