"""Continuous batching over the rows of one cache: requests join at the next step and leave at once.

:class:`BatchBackend` serves a ``buffer``-layout export (``--flavor ort-gqa``) from a
:class:`~kvq_export.runtime.rows.RowCache` of ``max_seqs`` rows, each holding one sequence. Its thread loops:

1. take new requests; end those cancelled (client gone, stop string) or past their deadline, freeing their rows;
2. admit waiting requests first come, first served: the :class:`~kvq_export.serve.cache_pool.CachePool`, the one
   owner of the rows, gives each a row, with the longest prefix of its prompt that a row holds already reused;
3. one decode step: every sequence that has a sampled token feeds it, in one call over the range of rows they
   occupy (rows between them feed padding and store nothing), split where :data:`MAX_GAP` rows or more between
   two of them would decode nothing;
4. prompt chunks, first come, first served, until ``prefill_chunk`` tokens or more ran this round (fewer than
   two chunks' worth): each is one call on its own row, so a long prompt takes several rounds and stalls the
   decoding sequences by less than two chunks per round. A prompt's last chunk gives its first token.

What a request gets does not depend on the load. With prefix reuse (the default) every call attends over the stored
codes, so what a row holds follows from its tokens alone, however they were split into chunks or shared with
another request; without it (``prefix_cache=False``) a prompt attends exactly over its own chunk's tokens and its
chunks start at multiples of ``prefill_chunk`` from its first token, whatever else runs. Each chunk is a call of
its own on its own row; a row's decode step sees only its own row. The one thing batching changes is the size of a
decode call and a row's place in it, and the start-up self-check (:mod:`kvq_export.serve.selfcheck`) compares
exactly that bit for bit: where this CPU's kernels give a row in a batch other logits than alone, the server
decodes each row in a call of its own (unless told to accept the difference), which is every sequence alone. It
also checks that a prompt continued from a copied or truncated prefix gives what the whole prompt gives, and turns
prefix reuse off where it does not.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from kvq_export.errors import KVQError, StoredPrefillError
from kvq_export.memory import resident_bytes
from kvq_export.runtime.base import eos_token_ids
from kvq_export.runtime.rows import RowCache, rows_within
from kvq_export.runtime.sampling import Sampler
from kvq_export.runtime.session import KVQSession
from kvq_export.serve.backends import Backend, StreamEnd, TokenStream
from kvq_export.serve.cache_pool import CachePool
from kvq_export.serve.selfcheck import InvarianceCheck, check_batch_invariance, check_prefix_reuse

logger = logging.getLogger(__name__)

#: ``--cache-budget`` when neither it nor ``--max-seqs`` is given
DEFAULT_CACHE_BUDGET = 2 << 30
#: ``--prefill-chunk``: prompt tokens per call, and per round of the loop
DEFAULT_PREFILL_CHUNK = 256
#: rows decoding nothing between two decoding rows that split a decode step into two calls (a row costs a decode
#: call about a seventh of a call's fixed cost on SmolLM2, so a gap this wide costs more than a second call)
MAX_GAP = 8


class DecodeMode(StrEnum):
    """How decode steps run: every running row in one call, or each row in a call of its own."""

    BATCHED = "batched"
    ROW_BY_ROW = "row-by-row"


@dataclass(eq=False)
class _Sequence:
    """A request holding a row: how much of its prompt the row holds, and its next token to feed."""

    stream: TokenStream
    row: int
    sampler: Sampler
    fed: int = 0  # prompt tokens in the row
    token: int | None = None  # sampled, fed at the next decode step

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.stream.job.prompt_tokens


class BatchBackend(Backend):
    """Continuous batching on kvq's own cache rows, in ONNX Runtime (CPU, or CUDA with ``providers``)."""

    description = "continuous batching over kvq's cache rows on ONNX Runtime"
    batching = True

    def __init__(self, *args: Any, max_seqs: int | None = None, cache_budget: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, allow_batch_variance: bool = False,
                 prefix_cache: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, value in (("max_seqs", max_seqs), ("cache_budget", cache_budget), ("prefill_chunk", prefill_chunk)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise KVQError(f"invalid {name}={value!r}: allowed: an integer >= 1")
        self.max_seqs, self.prefill_chunk = max_seqs, prefill_chunk
        self.cache_budget = cache_budget if cache_budget is not None or max_seqs is not None else DEFAULT_CACHE_BUDGET
        self.allow_batch_variance = allow_batch_variance
        #: reuse cached prompt prefixes (asked for; :attr:`pool` says whether it is on)
        self.prefix_cache = prefix_cache
        self.pool: CachePool | None = None
        self.rows = 0
        self.resident_before_cache: int | None = None
        self.invariance: InvarianceCheck | None = None
        self.mode = DecodeMode.BATCHED
        self._inbox: queue.SimpleQueue[TokenStream | None] = queue.SimpleQueue()
        self._available = 0  # rows a new request could take (read by submit's thread)

    def describe(self) -> dict[str, Any]:
        """Adds the rows, the prefill chunk and the self-check's result."""
        return {**super().describe(), "max_seqs": self.rows, "prefill_chunk": self.prefill_chunk,
                "prefix_cache": bool(self.pool and self.pool.prefix_cache),
                "resident_bytes_before_cache": self.resident_before_cache,
                "decode": str(self.mode), "batch_invariance": self.invariance and self.invariance.to_dict()}

    def free_slots(self) -> int:
        return self._available

    def _rows_gauges(self) -> None:
        busy, cached = self.pool.busy(), self.pool.cached()
        self._available = self.rows - busy
        self.metrics.cache_rows_used.set(busy)
        self.metrics.cache_rows_cached.set(cached)
        self.metrics.cache_rows_free.set(self.rows - busy - cached)

    # -- loading ----------------------------------------------------------------------------------------------
    def _load(self) -> CachePool:
        session = self._open_session()
        context = self.max_positions
        if context > session.max_positions:
            raise KVQError(f"a context of {context} tokens is beyond the {session.max_positions} positions of "
                           f"{self.directory}; allowed: --context <= {session.max_positions}")
        rows = self._row_count(session, context)
        self.resident_before_cache = resident_bytes()
        cache = RowCache(session, rows, context)
        self.metrics.cache_bytes.set(cache.nbytes)
        after = resident_bytes()
        if self.resident_before_cache and after:
            logger.info("resident memory: %.0f MiB with the model loaded, %.0f MiB with the cache rows",
                        self.resident_before_cache / 2**20, after / 2**20)
        self._check_batching(cache)
        self.rows = cache.rows
        self.pool = CachePool(cache, prefix_cache=session.stored_prefill and self._prefix_reuse_holds(cache))
        self._rows_gauges()
        return self.pool

    def _open_session(self) -> KVQSession:
        """The export's session; with prefix reuse asked for, one whose every call attends over stored codes."""
        def open_one(stored: bool) -> KVQSession:
            return KVQSession(self.directory, providers=self.providers, threads=self.threads,
                              verify_weights=self.verify_weights, tokenizer=False, last_logits=True,
                              stored_prefill=stored)

        if self.prefix_cache:
            try:
                return open_one(True)
            except StoredPrefillError as err:
                logger.warning("prefix reuse off: %s", err)
        return open_one(False)

    def _check_batching(self, cache: RowCache) -> None:
        """Run the self-check; decode row by row where batching changes a row's logits (unless allowed)."""
        self.invariance = self.self_check(cache)
        self.metrics.batch_invariant.set(int(self.invariance.invariant))
        if self.invariance.invariant:
            return
        if self.allow_batch_variance:
            logger.warning("on this CPU a row's logits in a batch differ from the same sequence alone (by up to "
                           "%.3g): batching anyway (--allow-batch-variance), so an answer may depend on the load",
                           self.invariance.max_abs_diff)
        else:
            self.mode = DecodeMode.ROW_BY_ROW
            logger.warning("on this CPU a row's logits in a batch differ from the same sequence alone (by up to "
                           "%.3g): each row decodes in a call of its own so that answers do not depend on the "
                           "load (slower; --allow-batch-variance batches anyway)", self.invariance.max_abs_diff)

    def _prefix_reuse_holds(self, cache: RowCache) -> bool:
        """Whether a reused prefix gives what the whole prompt gives (:func:`check_prefix_reuse`); off where not."""
        if not self.prefix_cache:
            return False
        if cache.device != "cpu":
            logger.warning("prefix reuse off: rows are copied in host memory, and this cache is on %s", cache.device)
            return False
        difference = check_prefix_reuse(cache)
        if difference:
            logger.warning("prefix reuse off: on this CPU a prompt continued from a reused prefix gives other logits "
                           "than the whole prompt (by up to %.3g)", difference)
        return not difference

    def self_check(self, cache: RowCache) -> InvarianceCheck:
        """Whether a row's logits in a batch equal the same sequence alone (:func:`check_batch_invariance`)."""
        return check_batch_invariance(cache)

    def _row_count(self, session: KVQSession, context: int) -> int:
        """``max_seqs``, checked against the budget when both are given; else what the budget holds."""
        if self.cache_budget is None:
            return self.max_seqs
        fits = rows_within(session, self.cache_budget, context)
        if self.max_seqs is not None and self.max_seqs > fits.rows:
            need = self.max_seqs * fits.row_bytes / 2**30
            raise KVQError(f"{self.max_seqs} sequences of {context} tokens need {need:.2f} GiB of cache, beyond the "
                           f"budget of {self.cache_budget / 2**30:.2f} GiB; allowed: --max-seqs <= {fits.rows}, a "
                           "larger --cache-budget or a shorter --context")
        if fits.rows < 1:
            least = fits.row_bytes + fits.static_bytes
            raise KVQError(f"a cache budget of {self.cache_budget} bytes holds no sequence of {context} tokens (one "
                           f"needs {fits.row_bytes} bytes); allowed: --cache-budget >= {least} or a shorter --context")
        rows = self.max_seqs or fits.rows
        logger.info("%d sequences of %d tokens: %.1f MiB of cache in a budget of %.1f MiB (%d bytes a row)", rows,
                    context, rows * fits.row_bytes / 2**20, self.cache_budget / 2**20, fits.row_bytes)
        return rows

    # -- the thread's loop --------------------------------------------------------------------------------------
    def _enqueue(self, stream: TokenStream | None) -> None:
        self._inbox.put(stream)

    def _cancel(self, stream: TokenStream) -> None:
        pass  # the loop checks every running stream's flag each round

    def _serve(self, pool: CachePool) -> None:
        loop = _Loop(self, pool)
        loop.run()


class _Loop:
    """The scheduler's state, owned by the backend's thread."""

    def __init__(self, backend: BatchBackend, pool: CachePool) -> None:
        self.backend, self.pool = backend, pool
        self.eos = eos_token_ids(backend.manifest)
        self.waiting: deque[TokenStream] = deque()
        self.running: list[_Sequence] = []  # in admission order
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
            _close(stream, StreamEnd.CANCELLED if stream.cancelled.is_set() else None)
        for seq in [s for s in self.running if s.stream.cancelled.is_set() or s.stream.overdue]:
            self._finish(seq, StreamEnd.CANCELLED if seq.stream.cancelled.is_set() else None)

    def _admit(self) -> None:
        """Waiting requests into rows, first come first served, each reusing the longest cached prefix it can.

        A request whose prefix another one is still prefilling waits a round (later ones may go first), so the
        shared part is computed once.
        """
        admitted, metrics = False, self.backend.metrics
        for stream in list(self.waiting):
            if not self.pool.available():
                break
            job = stream.job
            lease = self.pool.acquire(np.asarray(job.prompt_tokens), lookup=job.cache_prompt)
            if lease is None:
                break
            if lease.wait:
                continue
            self.waiting.remove(stream)
            if job.cache_prompt and self.pool.prefix_cache:
                metrics.prefix_queries.inc(len(job.prompt_tokens))
                metrics.prefix_hits.inc(lease.reused)
            sampler = Sampler(job.sampling)
            sampler.prime([job.prompt_tokens])
            self.running.append(_Sequence(stream, lease.row, sampler, fed=lease.reused))
            self.backend._started(stream)
            admitted = True
        if admitted:
            self.backend._rows_gauges()

    def _decode(self) -> None:
        """One token for every sequence that has one to feed."""
        ready = [seq for seq in self.running if seq.token is not None]
        if not ready:
            return
        if self.backend.mode is DecodeMode.ROW_BY_ROW:
            for seq in ready:
                self._call([seq], seq.row, np.array([[seq.token]]), None)
            return
        for group in _row_groups(sorted(ready, key=lambda seq: seq.row)):
            low, high = group[0].row, group[-1].row + 1
            ids = np.zeros((high - low, 1), dtype=np.int64)
            mask = np.zeros_like(ids)
            for seq in group:
                ids[seq.row - low, 0], mask[seq.row - low, 0] = seq.token, 1
            self._call(group, low, ids, mask)

    def _prefill(self) -> None:
        """Prompt chunks, first come first served, until this round ran ``prefill_chunk`` tokens or more.

        A round stops at the first chunk boundary past the budget, so it runs fewer than two chunks' worth: short
        prompts that arrived together (a burst) share one round instead of waiting a round each.
        """
        chunk, spent = self.backend.prefill_chunk, 0
        for seq in [s for s in self.running if s.fed < len(s.prompt)]:
            while seq.fed < len(seq.prompt):
                if spent >= chunk:
                    return
                size = min(chunk, len(seq.prompt) - seq.fed)
                ids = np.asarray(seq.prompt[seq.fed:seq.fed + size], dtype=np.int64)[None]
                seq.fed += size
                spent += size
                self._call([seq], seq.row, ids, None, sample=seq.fed == len(seq.prompt))
                if seq not in self.running:  # the call failed
                    break

    def _call(self, seqs: list[_Sequence], start: int, ids: np.ndarray, mask: np.ndarray | None, *,
              sample: bool = True) -> None:
        """Run rows from ``start``; sample the next token of each of ``seqs`` (a failed run fails them)."""
        try:
            logits = self.pool.run(start, ids, mask)
        except Exception as err:  # noqa: BLE001 - ONNX Runtime's own errors: the requests fail, the server stays
            logger.exception("a graph run failed")
            for seq in seqs:
                self._finish(seq, error=f"the graph run failed: {err}")
            return
        if sample:
            for seq in seqs:
                self._next_token(seq, logits[seq.row - start])

    def _next_token(self, seq: _Sequence, logits: np.ndarray) -> None:
        try:
            token = int(seq.sampler(logits[None])[0])
        except KVQError as err:
            self._finish(seq, error=str(err))
            return
        stream = seq.stream
        stream.put(token)
        if token in self.eos:
            self._finish(seq, StreamEnd.STOP)
        elif stream.generated >= stream.job.max_tokens:
            self._finish(seq, StreamEnd.LENGTH)
        else:
            seq.token = token

    def _finish(self, seq: _Sequence, reason: StreamEnd | None = None, *, error: str | None = None) -> None:
        """End ``seq`` (``reason``; None with no ``error``: its deadline passed) and free its row."""
        self.running.remove(seq)
        self.pool.release(seq.row, keep=seq.stream.job.cache_prompt and error is None)
        if error is not None:
            seq.stream.fail(error)
        else:
            _close(seq.stream, reason)
        self.backend._rows_gauges()


def _row_groups(ready: list[_Sequence]) -> list[list[_Sequence]]:
    """``ready`` (by row) in groups that decode in one call each.

    A group ends where :data:`MAX_GAP` rows or more before the next sequence would feed padding.
    """
    groups = [[ready[0]]]
    for seq in ready[1:]:
        if seq.row - groups[-1][-1].row - 1 >= MAX_GAP:
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
