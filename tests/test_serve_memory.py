"""Cache memory in proportion to tokens in ``kvq serve``: moving, preempting and resuming keep every answer.

A tiny export served in a budget of three 64-token rows, a new row reserving 4 tokens past its prompt, in rows of 8 to
64 tokens (sequences start in small rows and move up as they grow) and in paged rows of 64 tokens (counted in pages of
16 tokens a head row): sequences are preempted (then prefilled again from their prompt and generated tokens) when the
budget has no room for them. Hypothesis draws prompt lengths, answer lengths and arrival orders; every answer is
compared with the same request alone with no cache. The slow test does the same on SmolLM2.
"""

from __future__ import annotations

import numpy as np
import pytest
from gqa_harness import SCHEMES, calibration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import chat_tokenizer, served
from tiny_models import tiny_model

from kvq_export.errors import KVQError
from kvq_export.export.exporter import export_model
from kvq_export.runtime.rows import rows_within
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.runtime.session import KVQSession
from kvq_export.serve import open_backend
from kvq_export.serve.backends import Job, ServeLimits

GREEDY = SamplingConfig()
CONTEXT = 64


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    scheme = SCHEMES["ort-int4"]  # 4-bit codes: attending a prompt's own exact K/V instead would change answers
    return export_model(tiny_model("llama"), scheme, tmp_path_factory.mktemp("memory") / "gqa", flavor="ort-gqa",
                        tokenizer=chat_tokenizer(), static=calibration("llama", scheme))


def budget_of(directory, rows: int, capacity: int) -> int:
    """A cache budget holding ``rows`` rows of ``capacity`` tokens (the memory model's bytes)."""
    fits = rows_within(KVQSession(directory, tokenizer=False), 1, capacity)
    return fits.static_bytes + rows * fits.row_bytes


@pytest.fixture(scope="module", params=["classes", "paged"])
def tight(export, request):
    """Rows of classes 8 to 64 tokens, or paged rows of 64 tokens counted in pages of 16 tokens a head row."""
    backend = open_backend(export, cache_budget=budget_of(export, 3, CONTEXT), smallest_row=8, row_reserve=4,
                           prefill_chunk=8, limits=ServeLimits(context=CONTEXT, max_waiting=64),
                           row_classes=request.param == "classes", page_bytes=256)
    backend.start()
    yield backend
    backend.close()


def ids(n: int, start: int) -> tuple[int, ...]:
    return tuple(int(t) for t in (np.arange(n) * 13 + start) % 90 + 5)


def alone(backend, job: Job):
    return served(backend, [Job(job.prompt_tokens, job.max_tokens, GREEDY, cache_prompt=False)])[0]


def test_rows_are_sized_by_tokens(tight):
    described = tight.describe()
    assert tight.pool.sizing.paged is not tight.row_classes
    assert described["row_capacities"] == ((64,) if tight.pool.sizing.paged else (8, 12, 16, 24, 32, 48, 64))
    assert described["cache_budget_bytes"] == tight.pool.sizing.budget_bytes


def test_sequences_that_outgrow_the_budget_are_preempted_and_answer_as_alone(tight):
    """Six sequences of 30 + 30 tokens in room for three of 64: some must be preempted, none changes its answer."""
    jobs = [Job(ids(30, start=k), 30, GREEDY) for k in range(6)]
    before = tight.metrics.preemptions._value.get()
    loaded = served(tight, jobs)
    assert tight.metrics.preemptions._value.get() > before
    assert loaded == [alone(tight, job) for job in jobs]
    assert tight.pool.allocated_bytes <= tight.pool.sizing.budget_bytes


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 23), st.integers(0, 90), st.integers(0, 30)),
                min_size=1, max_size=7))
def test_moved_grown_preempted_and_resumed_sequences_answer_as_alone(tight, schedule):
    jobs = [Job(ids(n, start), min(out, CONTEXT - n), GREEDY) for n, out, start, _ in schedule]
    loaded = served(tight, jobs, delays=[delay / 1000 for *_, delay in schedule])
    for job, got in zip(jobs, loaded):
        assert got == alone(tight, job)


def test_a_request_larger_than_what_is_free_waits_instead_of_being_refused(tight):
    long = Job(ids(50, start=3), 14, GREEDY)  # a row of 64: only once the others give theirs back
    short = [Job(ids(20, start=k), 20, GREEDY) for k in range(3)]
    loaded = served(tight, [*short, long], delays=[0, 0, 0, 0.01])
    assert all(tokens for tokens, _ in loaded) and loaded[-1] == alone(tight, long)


@pytest.mark.slow
def test_smollm2_sequences_moved_and_preempted_answer_as_alone(tmp_path_factory):
    """SmolLM2 as a deployer exports it, in a budget of two 512-token rows with rows from 64 tokens.

    8 corpus prompts of 40 to 300 tokens, 48 tokens each, at once.
    """
    from smollm2_harness import deployer_export

    from kvq_export.corpus import load_corpus
    from kvq_export.manifest import Manifest
    from kvq_export.runtime.text_codec import TextCodec

    directory = deployer_export(tmp_path_factory)
    tokens = TextCodec(directory, Manifest.load(directory)).encode(load_corpus("britannica")[40000:70000])
    jobs = [Job(tuple(tokens[400 * i:400 * i + n]), 48, GREEDY) for i, n in enumerate((40, 90, 130, 170, 210, 250,
                                                                                        280, 300))]
    backend = open_backend(directory, cache_budget=budget_of(directory, 2, 512), smallest_row=64, row_reserve=8,
                           prefill_chunk=64, limits=ServeLimits(context=512), verify_weights=False)
    backend.start()
    try:
        loaded = served(backend, jobs, delays=[0.02 * (i % 3) for i in range(len(jobs))])
        assert backend.metrics.preemptions._value.get() > 0
        assert loaded == [alone(backend, job) for job in jobs]
    finally:
        backend.close()


def test_a_full_row_between_two_decoding_rows_splits_the_decode_call(export):
    """GroupQueryAttention wants room for a call's token in every row of the call, a row feeding padding too."""
    from kvq_export.runtime.sampling import Sampler
    from kvq_export.serve.batch_loop import _row_groups, _Sequence
    from kvq_export.serve.cache_pool import CachePool
    from kvq_export.serve.segments import Sizing

    session = KVQSession(export, tokenizer=False, last_logits=True, stored_prefill=True)
    pool = CachePool(session, Sizing.of(session, budget_of(export, 128, 16), 16, 16), prefix_cache=True)  # 4 a segment
    slots = [pool.acquire(np.asarray(ids(8 if k != 1 else 15, start=k)), max_tokens=1).slot for k in range(3)]
    assert len({id(slot.segment) for slot in slots}) == 1
    for k, slot in enumerate(slots):
        pool.run(slot.segment, slot.row, np.asarray(ids(16 if k == 1 else 8, start=k))[None])
    with pytest.raises(KVQError, match="capacity of 16"):
        pool.run(slots[0].segment, 0, np.zeros((3, 1), dtype=np.int64), np.array([[1], [0], [1]]))
    seqs = [_Sequence(None, slot, Sampler(GREEDY), ()) for slot in (slots[0], slots[2])]
    assert [len(group) for group in _row_groups(seqs)] == [1, 1]
