"""Paged cache rows: rows of the whole context whose memory the system commits page by page as they fill.

A row's head rows are whole pages, so a row holding n tokens has exactly the pages its tokens reach resident (read
from ``/proc/self/pagemap``), and emptying or cutting back a row gives its pages back. The pool counts those pages
against the budget, evicts idle rows for room, and refuses growth the budget cannot hold (the scheduler then
preempts). The serving tests in ``test_serve_memory`` run the same schedules on paged rows and on row classes.
"""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
from gqa_harness import SCHEMES, calibration
from serve_harness import chat_tokenizer
from tiny_models import tiny_model

from kvq_export.errors import RuntimeInputError
from kvq_export.export.exporter import export_model
from kvq_export.runtime.rows import PAGE_BYTES, RowCache, paged_bytes, rows_within, token_widths
from kvq_export.runtime.session import KVQSession
from kvq_export.serve.cache_pool import CachePool
from kvq_export.serve.segments import RowState, Sizing

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap (Linux)")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    scheme = SCHEMES["ort-int4"]
    directory = export_model(tiny_model("llama"), scheme, tmp_path_factory.mktemp("paged") / "gqa", flavor="ort-gqa",
                             tokenizer=chat_tokenizer(), static=calibration("llama", scheme))
    return KVQSession(directory, tokenizer=False, last_logits=True, stored_prefill=True)


def resident_bytes(cache: RowCache) -> int:
    """Bytes of the cache's buffers resident in memory now: the present pages of their address ranges."""
    total = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for buffer in cache.buffers:
            first, pages = buffer.address // PAGE_BYTES, cache.rows * buffer.row_bytes // PAGE_BYTES
            pagemap.seek(first * 8)
            entries = struct.unpack(f"{pages}Q", pagemap.read(pages * 8))
            total += PAGE_BYTES * sum(entry >> 63 for entry in entries)
    return total


def prompt(n: int, start: int = 0) -> np.ndarray:
    return ((np.arange(n) * 7 + start) % 90 + 5)[None].astype(np.int64)


def test_a_paged_row_holds_the_pages_its_tokens_reach_and_gives_them_back(session):
    cache, whole = RowCache(session, 16, 1024, paged=True), RowCache(session, 2, 1024)
    assert resident_bytes(cache) == 0  # 16 rows of the whole context reserved, none of it held
    logits = cache.run(3, prompt(100)).copy()
    assert resident_bytes(cache) == cache.held_bytes(100) == paged_bytes(token_widths(session), 100)
    np.testing.assert_array_equal(logits, whole.run(0, prompt(100)))  # paged or not, the same answer
    cache.run(5, prompt(300, 1))
    assert resident_bytes(cache) == cache.held_bytes(100) + cache.held_bytes(300)
    cache.truncate(5, 40)
    assert resident_bytes(cache) == cache.held_bytes(100) + cache.held_bytes(40)
    cache.clear(3)
    assert resident_bytes(cache) == cache.held_bytes(40)
    np.testing.assert_array_equal(cache.run(3, prompt(100)), logits)  # a page given back reads as zeros: unread


def test_paged_rows_must_be_whole_pages(session):
    with pytest.raises(RuntimeInputError, match="whole pages"):
        RowCache(session, 2, 64, paged=True)  # 64 tokens of 16 bytes a head: a quarter of a page


def paged_pool(session, tokens: int, page_bytes: int = 256) -> CachePool:
    """A paged pool of rows of 64 tokens whose budget holds ``tokens`` tokens in pages of ``page_bytes``."""
    static = rows_within(session, 1, 64).static_bytes
    budget = static + int(paged_bytes(token_widths(session), tokens, page_bytes))
    return CachePool(session, Sizing.paged_rows(session, budget, 64, 8, page_bytes), prefix_cache=True, reserve=4)


def test_the_paged_pool_counts_pages_grows_within_the_budget_and_evicts_idle_rows(session):
    pool = paged_pool(session, 64)  # 4 pages of 16 tokens per head row
    cache = pool.segments[0].cache
    a = pool.acquire(prompt(20)[0], max_tokens=30).slot  # counted for 20 + 4 tokens: 2 pages
    pool.run(a.segment, a.row, prompt(20))
    assert pool.allocated_bytes == cache.held_bytes(24)
    assert pool.grow(a, 48) and pool.allocated_bytes == cache.held_bytes(48)
    b = pool.acquire(prompt(10, 50)[0], max_tokens=2).slot  # 12 tokens: the last page
    assert b is not None and pool.allocated_bytes == cache.held_bytes(48) + cache.held_bytes(12)
    assert pool.acquire(prompt(10, 60)[0], max_tokens=2) is None  # no page left: waits
    assert not pool.grow(b, 17)  # the scheduler preempts
    pool.run(b.segment, b.row, prompt(10, 50))
    pool.release(b)  # idle, holding 10 tokens: one page
    assert pool.segments[0].state[b.row] is RowState.IDLE
    assert pool.allocated_bytes == cache.held_bytes(48) + cache.held_bytes(10)
    assert pool.grow(a, 64)  # evicts the idle row for its page
    assert pool.segments[0].state[b.row] is RowState.FREE and pool.allocated_bytes == cache.held_bytes(64)
    assert pool.usage().used_bytes == pool.allocated_bytes <= pool.sizing.budget_bytes


def test_an_idle_row_taken_in_place_keeps_only_its_prefix(session):
    pool = paged_pool(session, 128)
    first = pool.acquire(prompt(40)[0], max_tokens=1).slot
    pool.run(first.segment, first.row, prompt(40))
    pool.release(first)
    lease = pool.acquire(np.concatenate([prompt(40)[0, :30], prompt(5, 9)[0]]), max_tokens=1)
    assert (lease.slot.row, lease.reused) == (first.row, 30)
    assert pool.segments[0].cache.lengths[first.row] == 30
    assert pool.allocated_bytes == pool.segments[0].cache.held_bytes(36)


def test_a_prompt_admitted_by_its_first_chunk_is_counted_chunk_by_chunk(session):
    pool = paged_pool(session, 64)
    cache = pool.segments[0].cache
    slot = pool.acquire(prompt(40)[0], max_tokens=8, chunk=16).slot  # its first call writes 16 tokens
    assert pool.allocated_bytes == cache.held_bytes(16)
    pool.run(slot.segment, slot.row, prompt(40)[:, :16])
    assert pool.grow(slot, 32) and pool.allocated_bytes == cache.held_bytes(32)


def test_a_platform_that_cannot_give_pages_back_gets_row_classes(session, monkeypatch):
    import kvq_export.runtime.rows as rows
    from kvq_export.serve import open_backend

    def sizing():
        backend = open_backend(session.directory, cache_budget=2**20, page_bytes=256)
        backend.start()
        try:
            return backend.pool.sizing
        finally:
            backend.close()

    assert sizing().paged  # where the platform can
    monkeypatch.setattr(rows, "PAGED_MEMORY", False)
    with pytest.raises(RuntimeInputError, match="MADV_DONTNEED"):
        RowCache(session, 2, 1024, paged=True)
    fallback = sizing()
    assert not fallback.paged and len(fallback.classes) > 1
