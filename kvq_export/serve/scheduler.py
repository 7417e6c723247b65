"""Continuous batching over kvq's cache rows: requests join at the next step and leave at once.

:class:`BatchBackend` serves a ``buffer``-layout export (``--flavor ort-gqa``). Its cache is a
:class:`~kvq_export.serve.cache_pool.CachePool`, the one owner of cache memory within one byte budget: paged rows of
the whole context whose pages the system commits as they fill (on a CPU where a row's head rows are whole pages),
else rows of several capacities in segments (:mod:`~kvq_export.serve.segments`), so a sequence holds memory in
proportion to its tokens; and the prefixes rows keep after their request. Its thread runs
:class:`~kvq_export.serve.batch_loop.BatchLoop`: admission into rows (reusing the longest cached prefix), one
decode step for every running sequence, prompt chunks, moves into larger rows and preemption.

What a request gets does not depend on the load. Every call attends over the stored codes (with prefix reuse, the
default; and wherever rows are sized by tokens, since a sequence may move or be preempted and prefilled again), so
what a row holds follows from its tokens alone, however they were split into chunks, shared with another request,
moved or recomputed; without reuse on a cache of one row size (``prefix_cache=False`` on CUDA) a prompt attends
exactly over its own chunk's tokens and its chunks start at multiples of ``prefill_chunk`` from its first token,
whatever else runs. Each chunk is a call of its own on its own row; a row's decode step sees only its own row. The
one thing batching changes is the size of a decode call and a row's place in it, and the start-up self-check
(:mod:`kvq_export.serve.selfcheck`) compares exactly that bit for bit: where this CPU's kernels give a row in a
batch other logits than alone, the server decodes each row in a call of its own (unless told to accept the
difference), which is every sequence alone. It also checks that a prompt continued from a copied or truncated
prefix gives what the whole prompt gives; where it does not, prefix reuse is off and every row has the context's
size (nothing is moved or preempted).
"""

from __future__ import annotations

import logging
import queue
from enum import StrEnum
from typing import Any

from kvq_export.errors import KVQError, RuntimeInputError, StoredPrefillError
from kvq_export.memory import resident_bytes
from kvq_export.runtime import rows
from kvq_export.runtime.rows import PAGE_BYTES, RowCache, rows_within, token_widths, whole_pages
from kvq_export.runtime.session import KVQSession
from kvq_export.serve.backends import Backend, TokenStream
from kvq_export.serve.batch_loop import BatchLoop
from kvq_export.serve.cache_pool import RESERVE, CachePool
from kvq_export.serve.segments import SMALLEST_CLASS, Sizing
from kvq_export.serve.selfcheck import InvarianceCheck, check_batch_invariance, check_prefix_reuse

logger = logging.getLogger(__name__)

#: ``--cache-budget`` when neither it nor ``--max-seqs`` is given
DEFAULT_CACHE_BUDGET = 2 << 30
#: ``--prefill-chunk``: prompt tokens per call, and per round of the loop
DEFAULT_PREFILL_CHUNK = 256
#: tokens a row of the self-checks holds (their prompts are shorter)
CHECK_CAPACITY = 64


class DecodeMode(StrEnum):
    """How decode steps run: every running row in one call, or each row in a call of its own."""

    BATCHED = "batched"
    ROW_BY_ROW = "row-by-row"


class BatchBackend(Backend):
    """Continuous batching on kvq's own cache rows, in ONNX Runtime (CPU, or CUDA with ``providers``)."""

    description = "continuous batching over kvq's cache rows on ONNX Runtime"
    batching = True

    def __init__(self, *args: Any, max_seqs: int | None = None, cache_budget: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, allow_batch_variance: bool = False,
                 prefix_cache: bool = True, smallest_row: int = SMALLEST_CLASS, row_reserve: int = RESERVE,
                 fixed_rows: bool = False, row_classes: bool = False, page_bytes: int = PAGE_BYTES,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, value in (("max_seqs", max_seqs), ("cache_budget", cache_budget), ("prefill_chunk", prefill_chunk),
                            ("smallest_row", smallest_row), ("row_reserve", row_reserve)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise KVQError(f"invalid {name}={value!r}: allowed: an integer >= 1")
        self.max_seqs, self.prefill_chunk = max_seqs, prefill_chunk
        self.cache_budget = cache_budget if cache_budget is not None or max_seqs is not None else DEFAULT_CACHE_BUDGET
        self.allow_batch_variance = allow_batch_variance
        #: reuse cached prompt prefixes (asked for; :attr:`pool` says whether it is on)
        self.prefix_cache = prefix_cache
        #: tokens of the smallest row (rows step up by about sqrt(2) to the context), and the most tokens past its
        #: prompt a new sequence's row has room for
        self.smallest_row, self.row_reserve = smallest_row, row_reserve
        #: every sequence a row of the whole context (asked for), instead of rows in proportion to its tokens
        self.fixed_rows = fixed_rows
        #: rows of several capacities, moved as they grow (asked for), instead of paged rows of the whole context;
        #: the pages a paged cache counts in
        self.row_classes, self.page_bytes = row_classes, page_bytes
        self.pool: CachePool | None = None
        self.resident_before_cache: int | None = None
        self.invariance: InvarianceCheck | None = None
        self.mode = DecodeMode.BATCHED
        self._inbox: queue.SimpleQueue[TokenStream | None] = queue.SimpleQueue()
        self._available = 0  # rows a new request could take (read by submit's thread)

    def describe(self) -> dict[str, Any]:
        """Adds the cache's sizing, the prefill chunk and the self-checks' results."""
        sizing = self.pool.sizing if self.pool else None
        return {**super().describe(), "max_seqs": self.max_seqs, "prefill_chunk": self.prefill_chunk,
                "cache_budget_bytes": sizing and sizing.budget_bytes, "row_capacities": sizing and sizing.classes,
                "prefix_cache": bool(self.pool and self.pool.prefix_cache),
                "resident_bytes_before_cache": self.resident_before_cache,
                "decode": str(self.mode), "batch_invariance": self.invariance and self.invariance.to_dict()}

    @property
    def batched(self) -> bool:
        """Whether decode steps run every decoding row of a segment in one call."""
        return self.mode is DecodeMode.BATCHED

    def free_slots(self) -> int:
        return self._available

    def _rows_gauges(self) -> None:
        pool, metrics = self.pool, self.metrics
        usage = pool.usage()
        self._available = usage.available
        metrics.cache_rows_used.set(usage.busy)
        metrics.cache_rows_cached.set(usage.cached)
        metrics.cache_rows_free.set(usage.free)
        metrics.cache_bytes.set(pool.allocated_bytes)
        metrics.cache_bytes_used.set(usage.used_bytes)
        metrics.cache_bytes_free.set(pool.sizing.budget_bytes - usage.used_bytes)
        metrics.cache_tokens.set(usage.held_tokens)

    # -- loading ----------------------------------------------------------------------------------------------
    def _load(self) -> CachePool:
        session = self._open_session()
        context = self.max_positions
        if context > session.max_positions:
            raise KVQError(f"a context of {context} tokens is beyond the {session.max_positions} positions of "
                           f"{self.directory}; allowed: --context <= {session.max_positions}")
        if self.cache_budget is None:  # --max-seqs alone: that many sequences of the whole context
            one = rows_within(session, 1, context)
            budget = one.static_bytes + self.max_seqs * one.row_bytes
        else:
            budget = self.cache_budget
        fixed = self._fixed_rows(session, budget, context)
        by_tokens = self._by_tokens(session, budget, context)
        self.resident_before_cache = resident_bytes()
        check_rows = max(fixed.most_rows[context], *by_tokens.most_rows.values())
        check_capacity = min(CHECK_CAPACITY, context)
        try:  # paged where it can be (host memory, whole pages): the check's many rows hold only what it writes
            check = RowCache(session, check_rows, check_capacity, paged=True)
        except RuntimeInputError:
            check = RowCache(session, check_rows, check_capacity)
        self._check_batching(check)
        exact_moves = session.stored_prefill and self._reuse_holds(check)
        del check
        sizing = by_tokens if exact_moves and not self.fixed_rows else fixed
        self.pool = CachePool(session, sizing, prefix_cache=exact_moves and self.prefix_cache, max_seqs=self.max_seqs,
                              reserve=self.row_reserve)
        if sizing is fixed:  # the whole cache, held from the start
            self.pool.preallocate()
        smallest = sizing.classes[0]
        if sizing.paged:
            rows = (f"up to {sizing.most_rows[smallest]} rows of {smallest} tokens, each holding whole "
                    f"{sizing.page_bytes}-byte pages of its tokens (memory in proportion to tokens)")
        else:
            held = ("every sequence holds a row of the whole context" if sizing is fixed else
                    "a sequence holds rows in proportion to its tokens")
            rows = (f"rows of {', '.join(map(str, sizing.classes))} tokens, in segments of "
                    f"{sizing.first_rows[smallest]} to {sizing.most_rows[smallest]} of the smallest ({held})")
        logger.info("cache budget %.1f MiB: %d tokens at %d bytes a token; %s", budget / 2**20,
                    int(sizing.budget_bytes // sizing.token_bytes()), sizing.token_bytes(), rows)
        self._rows_gauges()
        return self.pool

    def _open_session(self) -> KVQSession:
        """The export's session, one whose every call attends over stored codes where the export can."""
        def open_one(stored: bool) -> KVQSession:
            return KVQSession(self.directory, providers=self.providers, threads=self.threads,
                              verify_weights=self.verify_weights, tokenizer=False, last_logits=True,
                              stored_prefill=stored)

        try:
            return open_one(True)
        except StoredPrefillError as err:
            logger.warning("rows of the whole context, no prefix reuse: %s", err)
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

    def _reuse_holds(self, cache: RowCache) -> bool:
        """Whether a sequence's codes can be reused, moved and recomputed exactly (:func:`check_prefix_reuse`)."""
        if cache.device != "cpu":
            logger.warning("rows of the whole context, no prefix reuse: rows are copied in host memory, and this "
                           "cache is on %s", cache.device)
            return False
        difference = check_prefix_reuse(cache)
        if difference:
            logger.warning("rows of the whole context, no prefix reuse: on this CPU a prompt continued from a reused "
                           "prefix gives other logits than the whole prompt (by up to %.3g)", difference)
        return not difference

    def self_check(self, cache: RowCache) -> InvarianceCheck:
        """Whether a row's logits in a batch equal the same sequence alone (:func:`check_batch_invariance`)."""
        return check_batch_invariance(cache)

    def _by_tokens(self, session: KVQSession, budget: int, context: int) -> Sizing:
        """Paged rows of the whole context where their head rows are whole pages of host memory, else row classes."""
        widths = token_widths(session)
        if not self.row_classes:
            if session.session.get_providers()[0] != "CPUExecutionProvider":
                logger.info("rows in classes of capacities: paged rows need host memory")
            elif not rows.PAGED_MEMORY:
                logger.info("rows in classes of capacities: this platform cannot give pages back (no MADV_DONTNEED)")
            elif not whole_pages(widths, context, self.page_bytes):
                logger.info("rows in classes of capacities: rows of %d tokens are not whole %d-byte pages (tokens of "
                            "%s bytes a head)", context, self.page_bytes, sorted(widths))
            else:
                return Sizing.paged_rows(session, budget, context, self.smallest_row, self.page_bytes)
        return Sizing.of(session, budget, context, self.smallest_row)

    def _fixed_rows(self, session: KVQSession, budget: int, context: int) -> Sizing:
        """Rows of the whole context: ``max_seqs`` (checked against the budget), else what the budget holds."""
        fits = rows_within(session, budget, context)
        if self.max_seqs is not None and self.max_seqs > fits.rows:
            need = self.max_seqs * fits.row_bytes / 2**30
            raise KVQError(f"{self.max_seqs} sequences of {context} tokens need {need:.2f} GiB of cache, beyond the "
                           f"budget of {budget / 2**30:.2f} GiB; allowed: --max-seqs <= {fits.rows}, a "
                           "larger --cache-budget or a shorter --context")
        if fits.rows < 1:
            least = fits.row_bytes + fits.static_bytes
            raise KVQError(f"a cache budget of {budget} bytes holds no sequence of {context} tokens (one "
                           f"needs {fits.row_bytes} bytes); allowed: --cache-budget >= {least} or a shorter --context")
        rows = self.max_seqs or fits.rows
        rows_of = {context: rows}
        return Sizing(budget - fits.static_bytes, (context,), rows_of, rows_of, {context: fits.row_bytes})

    # -- the thread's loop --------------------------------------------------------------------------------------
    def _enqueue(self, stream: TokenStream | None) -> None:
        self._inbox.put(stream)

    def _cancel(self, stream: TokenStream) -> None:
        pass  # the loop checks every running stream's flag each round

    def _serve(self, pool: CachePool) -> None:
        BatchLoop(self, pool).run()
