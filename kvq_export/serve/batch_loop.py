"""The continuous-batching loop of :class:`~kvq_export.serve.scheduler.BatchBackend`, run by its thread.

Each round: take new requests; end cancelled and overdue ones; admit waiting requests into rows the
:class:`~kvq_export.serve.cache_pool.CachePool` gives (first come, first served; a preempted sequence first);
one decode step for every sequence with a token to feed, one call per segment's range of decoding rows (split where
:data:`MAX_GAP` rows or more between two would decode nothing); then prompt chunks until ``prefill_chunk`` tokens
or more ran. A sequence that outgrows its row is moved into a larger one first; where the budget has none left,
the most recently admitted sequence is preempted: its row is given back (kept as a cached prefix where prefixes are
cached), and it waits at the head of the queue to be prefilled again from its prompt and the tokens it generated,
which gives the same codes and the same next token as if it had run on (every call attends over stored codes).
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.runtime.base import eos_token_ids
from kvq_export.runtime.sampling import Sampler
from kvq_export.serve.backends import StreamEnd, TokenStream
from kvq_export.serve.cache_pool import CachePool
from kvq_export.serve.segments import Segment, Slot

logger = logging.getLogger(__name__)

#: rows decoding nothing between two decoding rows that split a decode step into two calls (a row costs a decode
#: call about a seventh of a call's fixed cost on SmolLM2, so a gap this wide costs more than a second call)
MAX_GAP = 8


@dataclass(eq=False)
class _Sequence:
    """A request holding a row: the tokens it prefills, how many the row holds, and its next token to feed."""

    stream: TokenStream
    slot: Slot
    sampler: Sampler
    tokens: tuple[int, ...]  # the prompt (after a preemption: the prompt and every token generated)
    fed: int = 0  # of ``tokens``, in the row
    token: int | None = None  # sampled, fed at the next decode step
    generated: list[int] = field(default_factory=list)


class LoopOwner(Protocol):
    """What the loop reads of the backend that runs it (a :class:`~kvq_export.serve.scheduler.BatchBackend`)."""

    manifest: Any
    metrics: Any  # ServeMetrics
    prefill_chunk: int
    _inbox: queue.SimpleQueue

    @property
    def batched(self) -> bool: ...

    def _started(self, stream: TokenStream) -> None: ...

    def _rows_gauges(self) -> None: ...


class BatchLoop:
    """The scheduler's state, owned by the backend's thread."""

    def __init__(self, backend: LoopOwner, pool: CachePool) -> None:
        self.backend, self.pool = backend, pool
        self.eos = eos_token_ids(backend.manifest)
        self.waiting: deque[TokenStream] = deque()
        self.running: list[_Sequence] = []  # in admission order
        self.preempted: dict[TokenStream, _Sequence] = {}  # waiting again, with what they generated
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            self._take(block=not (self.waiting or self.running))
            if self.stopping:
                break
            self._drop_ended()
            self._admit()
            self._decode()
            self._prefill()
            self.backend._rows_gauges()  # tokens held and bytes used move with every step
        for seq in list(self.running):
            self._finish(seq, StreamEnd.CANCELLED)
        while self.waiting:
            self.waiting.popleft().end(StreamEnd.CANCELLED)

    def _take(self, *, block: bool) -> None:
        """Move new requests into the wait queue (blocking for one while there is nothing to do)."""
        inbox = self.backend._inbox
        items = [inbox.get()] if block else []
        while True:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                break
        for stream in items:
            if stream is None:
                self.stopping = True
            else:
                self.waiting.append(stream)

    def _drop_ended(self) -> None:
        """End cancelled and overdue requests, waiting or running; their rows are free at once."""
        for stream in [s for s in self.waiting if s.cancelled.is_set() or s.overdue]:
            self.waiting.remove(stream)
            self.preempted.pop(stream, None)
            _close(stream, StreamEnd.CANCELLED if stream.cancelled.is_set() else None)
        for seq in [s for s in self.running if s.stream.cancelled.is_set() or s.stream.overdue]:
            self._finish(seq, StreamEnd.CANCELLED if seq.stream.cancelled.is_set() else None)

    # -- admission and preemption ----------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting requests into rows, first come first served, each reusing the longest cached prefix it can.

        A request whose prefix another one is still prefilling waits a round (later ones may go first), so the
        shared part is computed once; a request the budget has no row for stops admission until a row frees.
        Paged rows are counted chunk by chunk; where the budget could not hold every admitted prompt whole, new
        requests are admitted only while the running ones' prompt tokens still to prefill are under two rounds'
        worth: a prompt is counted when it starts, not while it waits rounds for the ones before it (and paused or
        preempted for them).
        """
        metrics, chunk, sizing = self.backend.metrics, self.backend.prefill_chunk, self.pool.sizing
        backlog = sum(len(seq.tokens) - seq.fed for seq in self.running) if sizing.paged else 0
        room = (sizing.budget_bytes - self.pool.allocated_bytes) / sizing.token_bytes() if sizing.paged else 0
        for stream in list(self.waiting):
            if backlog >= 2 * chunk and backlog + len(stream.job.prompt_tokens) > room and \
                    stream not in self.preempted:
                break
            job, resumed = stream.job, self.preempted.get(stream)
            tokens = job.prompt_tokens if resumed is None else job.prompt_tokens + tuple(resumed.generated)
            left = job.max_tokens - (0 if resumed is None else len(resumed.generated))
            lease = self.pool.acquire(np.asarray(tokens), lookup=job.cache_prompt, max_tokens=left, chunk=chunk)
            if lease is None:
                break
            if lease.wait:
                continue
            self.waiting.remove(stream)
            if sizing.paged:
                backlog += len(tokens) - lease.reused
            if resumed is None:
                if job.cache_prompt and self.pool.prefix_cache:
                    metrics.prefix_queries.inc(len(tokens))
                    metrics.prefix_hits.inc(lease.reused)
                sampler = Sampler(job.sampling)
                sampler.prime([job.prompt_tokens])
                self.running.append(_Sequence(stream, lease.slot, sampler, tokens, fed=lease.reused))
                self.backend._started(stream)
            else:
                del self.preempted[stream]
                resumed.slot, resumed.tokens, resumed.fed, resumed.token = lease.slot, tokens, lease.reused, None
                self.running.append(resumed)

    def _room(self, seq: _Sequence, tokens: int) -> bool:
        """Make ``seq``'s row hold ``tokens``; False when ``seq`` itself had to be preempted.

        While the budget has no larger row, the most recently admitted sequences are preempted.
        """
        while not self.pool.grow(seq.slot, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: _Sequence) -> None:
        """Give ``seq``'s row back and queue it first, to be prefilled again from its prompt and generated tokens."""
        self.running.remove(seq)
        self.pool.release(seq.slot, keep=seq.stream.job.cache_prompt)
        self.preempted[seq.stream] = seq
        self.waiting.appendleft(seq.stream)
        self.backend.metrics.preemptions.inc()
        logger.info("preempted a sequence of %d tokens: the cache budget has no larger row now", len(seq.tokens)
                    + len(seq.generated))

    # -- calls ---------------------------------------------------------------------------------------------------
    def _decode(self) -> None:
        """One token for every sequence that has one to feed."""
        ready = [seq for seq in self.running if seq.token is not None]
        for seq in ready:
            if seq in self.running:  # not preempted to make room for an earlier one
                self._room(seq, seq.slot.length + 1)
        ready = [seq for seq in ready if seq in self.running]  # making room may have preempted any of them
        if not ready:
            return
        if self.backend.batched:
            groups = _row_groups(ready)
        else:
            groups = [[seq] for seq in ready]
        for group in groups:
            segment, low, high = group[0].slot.segment, group[0].slot.row, group[-1].slot.row + 1
            ids = np.zeros((high - low, 1), dtype=np.int64)
            mask = np.zeros_like(ids)
            for seq in group:
                ids[seq.slot.row - low, 0], mask[seq.slot.row - low, 0] = seq.token, 1
            self._call(group, segment, low, ids, mask)

    def _prefill(self) -> None:
        """Prompt chunks, first come first served, until this round ran ``prefill_chunk`` tokens or more.

        A round stops at the first chunk boundary past the budget, so it runs fewer than two chunks' worth: short
        prompts that arrived together (a burst) share one round instead of waiting a round each. Where the cache has
        no room for a chunk while sequences decode, prefill pauses until their ends free some: a preemption would
        throw the prompt's chunks away; with nothing decoding, the newest sequences are preempted.
        """
        chunk, spent = self.backend.prefill_chunk, 0
        for seq in [s for s in self.running if s.fed < len(s.tokens)]:
            while seq in self.running and seq.fed < len(seq.tokens):
                if spent >= chunk:
                    return
                size = min(chunk, len(seq.tokens) - seq.fed)
                if not self.pool.grow(seq.slot, seq.fed + size):
                    if any(other.fed == len(other.tokens) for other in self.running):
                        return  # pause: decoding sequences will free pages
                    if not self._room(seq, seq.fed + size):
                        break
                ids = np.asarray(seq.tokens[seq.fed:seq.fed + size], dtype=np.int64)[None]
                seq.fed += size
                spent += size
                self._call([seq], seq.slot.segment, seq.slot.row, ids, None, sample=seq.fed == len(seq.tokens))

    def _call(self, seqs: list[_Sequence], segment: Segment, start: int, ids: np.ndarray, mask: np.ndarray | None,
              *, sample: bool = True) -> None:
        """Run ``segment``'s rows from ``start``; sample the next token of each of ``seqs``.

        A failed run fails ``seqs``.
        """
        try:
            logits = self.pool.run(segment, start, ids, mask)
        except Exception as err:  # noqa: BLE001 - ONNX Runtime's own errors: the requests fail, the server stays
            logger.exception("a graph run failed")
            for seq in seqs:
                self._finish(seq, error=f"the graph run failed: {err}")
            return
        if sample:
            for seq in seqs:
                self._next_token(seq, logits[seq.slot.row - start])

    def _next_token(self, seq: _Sequence, logits: np.ndarray) -> None:
        try:
            token = int(seq.sampler(logits[None])[0])
        except KVQError as err:
            self._finish(seq, error=str(err))
            return
        stream = seq.stream
        stream.put(token)
        seq.generated.append(token)
        if token in self.eos:
            self._finish(seq, StreamEnd.STOP)
        elif stream.generated >= stream.job.max_tokens:
            self._finish(seq, StreamEnd.LENGTH)
        else:
            seq.token = token

    def _finish(self, seq: _Sequence, reason: StreamEnd | None = None, *, error: str | None = None) -> None:
        """End ``seq`` (``reason``; None with no ``error``: its deadline passed) and give its row back."""
        self.running.remove(seq)
        self.pool.release(seq.slot, keep=seq.stream.job.cache_prompt and error is None)
        if error is not None:
            seq.stream.fail(error)
        else:
            _close(seq.stream, reason)


def _row_groups(ready: list[_Sequence]) -> list[list[_Sequence]]:
    """``ready`` in groups that decode in one call each: by segment, then by row.

    A group ends where :data:`MAX_GAP` rows or more before the next sequence of its segment would feed padding, or
    where a row between them is full: ONNX Runtime's GroupQueryAttention wants room for the call's token in every
    row of a call, the rows that feed padding included.
    """
    groups: list[list[_Sequence]] = []
    for seq in sorted(ready, key=lambda s: (id(s.slot.segment), s.slot.row)):
        last = groups[-1][-1].slot if groups else None
        if last is None or last.segment is not seq.slot.segment or seq.slot.row - last.row - 1 >= MAX_GAP or \
                (last.segment.cache.lengths[last.row + 1:seq.slot.row] >= last.capacity).any():
            groups.append([seq])
        else:
            groups[-1].append(seq)
    return groups


def _close(stream: TokenStream, reason: StreamEnd | None) -> None:
    """End a stream with ``reason``, or (None) fail it for its deadline."""
    if reason is None:
        stream.fail("the request's deadline passed", status=504)
    else:
        stream.end(reason)
