"""Prefix reuse in ``kvq serve``: a reused prefix gives the answer the request gets alone with no cache, bit for bit.

:class:`~kvq_export.serve.cache_pool.CachePool` is checked on its own (which row a prompt gets, what it reuses, what is
evicted), then the scheduler under arrival orders Hypothesis draws, with prompts sharing prefixes of random lengths
on so few rows that rows are evicted, cut back and copied; every answer is compared with the same request served
alone with ``cache_prompt`` off. The slow test does the same on SmolLM2 with corpus prompts and a chat of several turns.
"""

from __future__ import annotations

import numpy as np
import pytest
from gqa_harness import SCHEMES, calibration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import NAME, chat_tokenizer, client, running, served
from tiny_models import tiny_model

from kvq_export.errors import StoredPrefillError
from kvq_export.export.exporter import export_model
from kvq_export.runtime.rows import rows_within
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.runtime.session import KVQSession
from kvq_export.serve import open_backend
from kvq_export.serve.backends import Job, ServeLimits
from kvq_export.serve.cache_pool import MIN_SHARED, CachePool
from kvq_export.serve.segments import RowState, Sizing, Slot, capacity_classes

GREEDY = SamplingConfig()
CHUNK = 8


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    scheme = SCHEMES["ort-int4"]  # 4-bit codes: a prompt attending over its own exact K/V instead changes answers
    return export_model(tiny_model("llama"), scheme, tmp_path_factory.mktemp("prefix") / "gqa", flavor="ort-gqa",
                        tokenizer=chat_tokenizer(), static=calibration("llama", scheme))


@pytest.fixture(scope="module")
def session(export):
    return KVQSession(export, tokenizer=False, last_logits=True, stored_prefill=True)


def ids(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(n) * 11 + start) % 90 + 5


def pool_of(session, rows: int, *, capacity: int = 64, smallest: int = 64, prefix_cache: bool = True) -> CachePool:
    """A pool whose budget holds ``rows`` rows of ``capacity`` tokens, in rows of ``smallest`` and up."""
    row = rows_within(session, 1, capacity)
    sizing = Sizing.of(session, row.static_bytes + rows * row.row_bytes, capacity, smallest)
    return CachePool(session, sizing, prefix_cache=prefix_cache)


def place(slot: Slot) -> tuple:
    return slot.segment, slot.row


def fed(pool: CachePool, slot: Slot, prompt: np.ndarray, start: int = 0) -> np.ndarray:
    """Feed ``prompt[start:]`` to ``slot``'s row in one call; its last logits."""
    return pool.run(slot.segment, slot.row, prompt[None, start:]).copy()


# -- the pool -----------------------------------------------------------------------------------------------------
def test_an_idle_row_serves_its_prefix_in_place_and_a_full_hit_computes_the_last_token(session):
    pool = pool_of(session, 2)
    first = ids(30)
    lease = pool.acquire(first, max_tokens=4)
    assert lease.reused == 0
    want = fed(pool, lease.slot, first)
    pool.release(lease.slot)
    assert pool._state(lease.slot) is RowState.IDLE and pool.cached() == 1 and pool.busy() == 0
    again = pool.acquire(first, max_tokens=4)  # the whole prompt is cached: all but its last token are reused
    assert (place(again.slot), again.reused) == (place(lease.slot), 29)
    assert np.array_equal(fed(pool, again.slot, first, 29), want)
    pool.release(again.slot)
    longer = np.concatenate([first, ids(9, start=3)])
    assert pool.acquire(longer, max_tokens=4).reused == 30


def test_a_busy_rows_prefix_is_copied_and_a_prompt_being_prefilled_makes_sharers_wait(session):
    pool = pool_of(session, 3)
    shared = ids(24)
    a = np.concatenate([shared, ids(10, start=1)])
    b = np.concatenate([shared, ids(7, start=2)])
    first = pool.acquire(a, max_tokens=4).slot
    assert pool.acquire(b, max_tokens=4).wait  # the busy row will hold the 24 shared tokens: compute them once
    fed(pool, first, a)
    lease = pool.acquire(b, max_tokens=4)
    assert place(lease.slot) != place(first) and lease.reused == 24
    solo = pool_of(session, 1, prefix_cache=False)
    assert np.array_equal(fed(pool, lease.slot, b, 24), fed(solo, solo.acquire(b, max_tokens=4).slot, b))


def test_short_prefixes_are_not_reused_and_the_least_recently_used_idle_row_is_evicted(session):
    pool = pool_of(session, 2)
    slots = []
    for start in (0, 1):
        prompt = ids(20, start=start)
        slots.append(pool.acquire(prompt, max_tokens=4).slot)
        fed(pool, slots[-1], prompt)
    pool.release(slots[1])
    pool.release(slots[0])  # row 1 idle longest
    near = np.concatenate([ids(MIN_SHARED - 1), ids(5, start=40)])  # shares too little with row 0
    lease = pool.acquire(near, max_tokens=4)
    assert (place(lease.slot), lease.reused) == (place(slots[1]), 0) and pool._state(slots[0]) is RowState.IDLE
    assert place(pool.acquire(ids(20), lookup=False, max_tokens=4).slot) == place(slots[0])  # no lookup: evicted
    assert pool.acquire(ids(3), max_tokens=4) is None  # every row busy


def test_a_request_without_cache_prompt_leaves_nothing_behind(session):
    pool = pool_of(session, 1, smallest=16)
    prompt = ids(20)
    slot = pool.acquire(prompt, lookup=False, max_tokens=4).slot
    fed(pool, slot, prompt)
    pool.release(slot, keep=False)
    assert pool.segments == [] and pool.allocated_bytes == 0  # its segment held nothing more: freed


# -- rows sized by tokens -----------------------------------------------------------------------------------------
def test_capacity_classes_step_by_about_the_square_root_of_two():
    assert capacity_classes(8192) == (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    assert capacity_classes(1000) == (256, 384, 512, 768, 1000) and capacity_classes(200) == (200,)


def test_a_sequence_that_outgrows_its_row_moves_and_keeps_its_logits(session):
    """Fed in pieces through rows of 16, 24, 32 and 48 tokens, a prompt gives what one row of 64 gives."""
    pool = pool_of(session, 2, smallest=16)
    prompt = ids(45, start=4)
    lease = pool.acquire(prompt[:10], max_tokens=1)
    slot, seen = lease.slot, []
    assert slot.capacity == 16
    for start, stop in ((0, 10), (10, 20), (20, 31), (31, 45)):
        assert pool.grow(slot, stop)
        seen.append(slot.capacity)
        logits = fed(pool, slot, prompt[:stop], start)
    assert seen == [16, 24, 32, 48] and slot.length == 45
    whole = pool_of(session, 1, smallest=64, prefix_cache=False)
    assert np.array_equal(logits, fed(whole, whole.acquire(prompt, max_tokens=1).slot, prompt))
    assert [segment.capacity for segment in pool.segments] == [48]  # the smaller rows' segments were freed


def test_the_budget_bounds_the_segments_and_idle_rows_give_way(session):
    pool = pool_of(session, 2, capacity=64, smallest=16)  # 128 tokens' worth
    budget = pool.sizing.budget_bytes
    held = [pool.acquire(ids(40, start=k), max_tokens=8).slot for k in range(2)]  # two rows of 48
    assert all(slot.capacity == 48 for slot in held) and pool.allocated_bytes <= budget
    assert pool.acquire(ids(40, start=9), max_tokens=8) is None  # no room for a third: it waits
    for slot, k in zip(held, range(2)):
        fed(pool, slot, ids(40, start=k))
        pool.release(slot)  # idle: kept while nothing needs the room
    third = pool.acquire(ids(40, start=9), max_tokens=8)
    assert third is not None and pool.cached() == 1 and pool.allocated_bytes <= budget
    assert pool.grow(third.slot, 60) and third.slot.capacity == 64  # the other idle row gave way
    assert pool.cached() == 0 and pool.allocated_bytes <= budget
    fourth = pool.acquire(ids(40, start=20), max_tokens=8).slot
    assert not pool.grow(fourth, 60)  # two rows of 64 and the one it moves from: beyond the budget
    assert fourth.capacity == 48 and pool.allocated_bytes <= budget

def test_an_export_without_the_switch_is_refused_by_name(export, tmp_path):
    from kvq_export.flavors.ort_gqa.graph import GQACacheGraph

    old = tmp_path / "every-call"
    original = GQACacheGraph.for_model.__func__
    try:  # fast_prefill=False: no exact branch, so no switch; an unquantized node never had one either
        GQACacheGraph.for_model = classmethod(lambda cls, scheme, facts, *, static=None, **options: original(
            cls, scheme, facts, static=static, fast_prefill=False))
        scheme = SCHEMES["ort-int8"]
        export_model(tiny_model("llama"), scheme, old, flavor="ort-gqa", tokenizer=chat_tokenizer(),
                     static=calibration("llama", scheme))
    finally:
        GQACacheGraph.for_model = classmethod(original)
    with pytest.raises(StoredPrefillError, match="exact_prefill"):
        KVQSession(old, tokenizer=False, stored_prefill=True)
    backend = open_backend(old, max_seqs=2)
    backend.start()
    try:
        assert backend.describe()["prefix_cache"] is False
    finally:
        backend.close()


# -- the scheduler ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(export):
    served_backend = open_backend(export, max_seqs=3, prefill_chunk=CHUNK, limits=ServeLimits(max_waiting=64))
    served_backend.start()
    yield served_backend
    served_backend.close()


PREFIXES = [tuple(int(t) for t in ids(40, start=7 * k)) for k in range(3)]


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 12), st.integers(1, 8),
                          st.integers(0, 30)), min_size=2, max_size=8))
def test_answers_with_reuse_equal_each_request_alone_without_cache(backend, schedule):
    """Prompts share a prefix of random length (one of three), then a suffix of their own, in random order.

    On 3 rows, so rows are reused in place, copied from busy rows and evicted.
    """
    jobs = [Job(PREFIXES[k][:cut] + tuple(int(t) for t in ids(extra + 1, start=50 + i)), max_tokens, GREEDY)
            for i, (k, cut, extra, max_tokens, _) in enumerate(schedule)]
    loaded = served(backend, jobs, delays=[delay / 1000 for *_, delay in schedule])
    for job, got in zip(jobs, loaded):
        alone = served(backend, [Job(job.prompt_tokens, job.max_tokens, GREEDY, cache_prompt=False)])[0]
        assert got == alone


def test_hits_are_counted_in_tokens_and_a_repeated_prompt_reuses_all_but_its_last_token(backend):
    metrics = backend.metrics
    queries, hits = metrics.prefix_queries._value.get(), metrics.prefix_hits._value.get()
    job = Job(tuple(int(t) for t in ids(33, start=3)), 4, GREEDY)
    first, second = served(backend, [job]), served(backend, [job])
    assert first == second
    assert metrics.prefix_queries._value.get() - queries == 66
    assert metrics.prefix_hits._value.get() - hits == 32


@pytest.mark.slow
def test_smollm2_shared_prefixes_and_a_chat_get_their_answers_alone(tmp_path_factory):
    """SmolLM2 as a deployer exports it: 8 prompts on two shared prefixes at once, then a chat of four turns.

    The chat resends its history each turn. Every answer equals the request alone with no cache, and each later turn
    reuses the whole history up to the last answer.
    """
    from prometheus_client.parser import text_string_to_metric_families
    from smollm2_harness import deployer_export

    from kvq_export.corpus import load_corpus
    from kvq_export.manifest import Manifest
    from kvq_export.runtime.text_codec import TextCodec

    directory = deployer_export(tmp_path_factory)
    codec = TextCodec(directory, Manifest.load(directory))
    tokens = codec.encode(load_corpus("britannica")[30000:60000])
    prefixes = [tuple(tokens[:150]), tuple(tokens[1000:1200])]
    jobs = [Job(prefixes[i % 2] + tuple(tokens[2000 + 40 * i:2000 + 40 * i + 10 + 5 * i]), 12, GREEDY)
            for i in range(8)]
    backend = open_backend(directory, max_seqs=4, prefill_chunk=64, limits=ServeLimits(context=1024),
                           verify_weights=False)
    with running(backend) as url:
        loaded = served(backend, jobs, delays=[0.02 * (i % 3) for i in range(len(jobs))])
        alone = [served(backend, [Job(job.prompt_tokens, 12, GREEDY, cache_prompt=False)])[0] for job in jobs]
        assert loaded == alone
        api = client(url)
        messages = [{"role": "system", "content": codec.decode(tokens[3000:3100])}]

        def hits() -> float:
            text = api._client.get(f"{url}/metrics").text
            return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                        if s.name == "kvq_prefix_cache_hits_total")

        previous = 0  # prompt and answer tokens the previous turn left in its row
        for turn in range(4):
            messages.append({"role": "user", "content": codec.decode(tokens[3200 + 50 * turn:3240 + 50 * turn])})
            before = hits()
            reply = api.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
            reused = hits() - before
            solo = api.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0,
                                               extra_body={"cache_prompt": False})
            assert reply.choices[0].message.content == solo.choices[0].message.content
            assert reused >= previous - 2, (turn, reused, previous)
            previous = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
