"""Continuous batching in ``kvq serve`` on the tiny ort-gqa export: answers never depend on the load.

The scheduler is driven directly (no HTTP) for the arrival schedules Hypothesis draws, and over HTTP for what a
production server adds: the API key, the bounded wait queue, deadlines, ``/metrics`` and ``/health``. Every answer
is compared with the same request served alone by the same server; a request served alone is also compared with
:class:`~kvq_export.runtime.session.KVQSession` fed the same prompt chunks, so "alone" is kvq's own loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from gqa_harness import SCHEMES, calibration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import NAME, TIMEOUT, chat_tokenizer, client, running, served, words
from tiny_models import tiny_model

from kvq_export.errors import KVQError
from kvq_export.export.exporter import export_model
from kvq_export.manifest import Manifest
from kvq_export.memory import predict
from kvq_export.runtime.rows import RowCache, rows_within
from kvq_export.runtime.sampling import Sampler, SamplingConfig
from kvq_export.runtime.session import KVQSession
from kvq_export.serve import open_backend
from kvq_export.serve.backends import Job, ServeLimits, StreamEnd
from kvq_export.serve.scheduler import BatchBackend, DecodeMode
from kvq_export.serve.selfcheck import InvarianceCheck, check_batch_invariance

openai = pytest.importorskip("openai")
GREEDY = SamplingConfig()
CHUNK = 4  # prompt tokens per prefill call in these tests: most prompts take several


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    scheme = SCHEMES["ort-int8"]
    return export_model(tiny_model("llama"), scheme, tmp_path_factory.mktemp("batch") / "gqa", flavor="ort-gqa",
                        tokenizer=chat_tokenizer(), static=calibration("llama", scheme))


@pytest.fixture(scope="module")
def backend(export):
    served = open_backend(export, max_seqs=3, prefill_chunk=CHUNK, limits=ServeLimits(max_waiting=64))
    served.start()
    yield served
    served.close()


def prompt_ids(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(int(t) for t in (np.arange(n) * 7 + start) % 90 + 5)


class Alone:
    """Each job's answer served with nothing else running (memoized)."""

    def __init__(self, backend) -> None:
        self.backend, self.answers = backend, {}

    def __call__(self, job: Job) -> list[int]:
        if job not in self.answers:
            self.answers[job] = served(self.backend, [job])[0][0]
        return self.answers[job]


@pytest.fixture(scope="module")
def alone(backend):
    return Alone(backend)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_alone_is_kvq_session_fed_the_same_chunks(export, backend, alone, prefix_cache):
    """A prompt of several chunks, served alone, gives what KVQSession gives stepping those chunks itself.

    Every call attends over the stored codes, as ``KVQSession(stored_prefill=True)`` does, with prefix reuse and rows
    sized by tokens (the default) and without either (``--no-prefix-cache --fixed-rows``).
    """
    if not prefix_cache:
        backend = open_backend(export, max_seqs=2, prefill_chunk=CHUNK, prefix_cache=False, fixed_rows=True)
        backend.start()
        alone = Alone(backend)
        assert backend.pool.sizing.classes == (backend.max_positions,)
    assert backend.pool.prefix_cache is prefix_cache
    session = KVQSession(export, stored_prefill=True)
    for n, max_tokens in ((3, 6), (CHUNK, 5), (2 * CHUNK + 3, 9)):
        prompt = prompt_ids(n, start=n)
        cache, fed = session.empty_cache(1, capacity=64), []
        for start in range(0, n, CHUNK):
            logits, cache = session.step(np.array([prompt[start:start + CHUNK]]), cache=cache)
        for _ in range(max_tokens):
            fed.append(int(np.argmax(logits[0, -1])))
            logits, cache = session.step(np.array([[fed[-1]]]), cache=cache)
        assert alone(Job(prompt, max_tokens, GREEDY)) == fed, n
    if not prefix_cache:
        backend.close()


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3 * CHUNK + 2), st.integers(1, 10),
                          st.one_of(st.none(), st.integers(1, 4))), min_size=1, max_size=7))
def test_any_arrival_schedule_gives_every_request_its_answer_alone(backend, alone, schedule):
    """Arrivals (ms apart), prompt lengths, lengths to generate and cancellations drawn by Hypothesis; 3 rows."""
    jobs = [Job(prompt_ids(n, start=i), m, GREEDY) for i, (_, n, m, _) in enumerate(schedule)]
    results = served(backend, jobs, delays=[ms / 1000 for ms, *_ in schedule],
                     cancel_after=[cancel for *_, cancel in schedule])
    for job, (tokens, reason), (*_, cancel) in zip(jobs, results, schedule):
        want = alone(job)
        if cancel is not None and reason is StreamEnd.CANCELLED:
            assert tokens == want[:len(tokens)]
        else:
            assert (tokens, reason) == (want, StreamEnd.LENGTH)
    _settle(backend)
    assert backend.free_slots() == 3 and backend.active == 0


def _settle(backend, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while backend.active or backend.free_slots() < backend.max_seqs:
        assert time.monotonic() < deadline, "a request still holds its row"
        time.sleep(0.01)


def test_the_rows_hold_what_the_memory_model_predicts(export):
    session = KVQSession(export, tokenizer=False)
    scheme, model = session.manifest.scheme, session.manifest.model
    budget = rows_within(session, 1 << 20, 96)
    assert budget.rows == (budget.budget_bytes - budget.static_bytes) // budget.row_bytes
    assert predict(scheme, model, 96, budget.rows).total_bytes <= 1 << 20 < predict(scheme, model, 96,
                                                                                    budget.rows + 1).total_bytes
    cache = RowCache(session, budget.rows, 96)
    assert cache.nbytes == budget.cache_bytes == predict(scheme, model, 96, budget.rows).total_bytes - \
        budget.static_bytes
    with pytest.raises(KVQError, match=r"5 sequences of 1024 tokens need .* allowed: --max-seqs <= 3"):
        BatchBackend(export, max_seqs=5, cache_budget=3 * cache.row_bytes * 1024 // 96 + 4096).start()


def test_last_position_logits_equal_the_full_graphs_bit_for_bit(export, tmp_path):
    from onnx import TensorProto, helper, save

    from kvq_export.runtime.last_logits import last_position_model

    full, last = (KVQSession(export, tokenizer=False, last_logits=flag) for flag in (False, True))
    assert last.last_logits and not full.last_logits
    prompt = np.array([prompt_ids(11)])
    (want, cache), (got, _) = (session.step(prompt) for session in (full, last))
    assert got.shape == (1, 1, want.shape[-1]) and np.array_equal(got[:, -1], want[:, -1])
    token = np.array([[int(np.argmax(want[0, -1]))]])
    stepped = last.step(token, cache=last.step(prompt)[1])[0]
    assert np.array_equal(stepped[:, -1], full.step(token, cache=cache)[0][:, -1])
    assert last.generate([list(prompt[0])], 6)[0].tokens == full.generate([list(prompt[0])], 6)[0].tokens
    # a head of another form (a Gemm here) keeps the full graph
    gemm = helper.make_graph([helper.make_node("Gemm", ["h", "w"], ["logits"], transB=1)], "g",
                             [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in ("h", "w")],
                             [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 2])])
    save(helper.make_model(gemm), tmp_path / "gemm.onnx")
    assert last_position_model(tmp_path / "gemm.onnx") is None


def test_the_self_check_sees_a_row_that_differs_in_a_batch(export):
    """A cache whose batched calls move a logit by 1e-3 fails the check; the unchanged cache passes it."""
    session = KVQSession(export, tokenizer=False)
    cache = RowCache(session, 4, 64)
    assert check_batch_invariance(cache).invariant

    class Noisy:
        def __getattr__(self, name):
            return getattr(cache, name)

        def run(self, start, ids, mask=None):
            logits = cache.run(start, ids, mask)
            return logits + np.float32(1e-3) if len(ids) > 1 else logits

    found = check_batch_invariance(Noisy())
    assert not found.invariant and found.max_abs_diff == pytest.approx(1e-3, rel=1e-2)
    assert found.batch_sizes == (2, 3, 4)


class _Varies(BatchBackend):
    def self_check(self, cache):
        return InvarianceCheck(False, (2,), 0.5, 0.0)


@pytest.mark.parametrize("allow", [False, True])
def test_a_cpu_whose_batches_differ_decodes_row_by_row_unless_told(export, alone, allow, caplog):
    caplog.set_level(logging.WARNING, logger="kvq_export.serve.scheduler")
    varies = _Varies(export, max_seqs=3, prefill_chunk=CHUNK, allow_batch_variance=allow)
    varies.start()
    try:
        assert varies.mode is (DecodeMode.BATCHED if allow else DecodeMode.ROW_BY_ROW)
        assert "differ from the same sequence alone" in caplog.text
        assert varies.describe()["batch_invariance"]["invariant"] is False
        jobs = [Job(prompt_ids(n, start=n), 8, GREEDY) for n in (2, 5, 9)]
        assert [tokens for tokens, _ in served(varies, jobs)] == [alone(job) for job in jobs]
    finally:
        varies.close()


# -- over HTTP: what a production server adds ------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(export):
    key = "sk-test-0123456789"
    limits = ServeLimits(max_waiting=1, request_timeout=20.0)
    with running(open_backend(export, max_seqs=2, prefill_chunk=CHUNK, limits=limits), api_key=key) as url:
        yield url, key


def test_the_api_key_is_required_and_never_logged(server, caplog):
    url, key = server
    caplog.set_level(logging.DEBUG)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        client(url, "wrong").completions.create(model=NAME, prompt="w1", max_tokens=2)
    response = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "w1"}, timeout=TIMEOUT)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"
    reply = client(url, key).completions.create(model=NAME, prompt=words(3), max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200  # for the supervisor: no key
    assert key not in caplog.text


def test_a_full_queue_answers_429_with_retry_after(server):
    """Two rows and one place in the queue: of four requests sent at once, one is refused."""
    url, key = server
    body = {"model": NAME, "prompt": words(3), "max_tokens": 1000, "temperature": 0}

    async def four():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4)))

    responses = asyncio.run(four())
    assert sorted(r.status_code for r in responses) == [200, 200, 200, 429]
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "queue_full"
    _wait_health_idle(url)


def _wait_health_idle(url: str, seconds: float = 15.0) -> dict:
    deadline = time.monotonic() + seconds
    while (health := httpx.get(f"{url}/health", timeout=TIMEOUT).json())["active_requests"]:
        assert time.monotonic() < deadline, "requests still run"
        time.sleep(0.05)
    return health


def test_a_request_past_its_deadline_ends_with_504(export):
    limits = ServeLimits(request_timeout=0.05)  # far shorter than 1000 tokens take on any machine
    with running(open_backend(export, max_seqs=1, prefill_chunk=CHUNK, limits=limits)) as url:
        response = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT,
                              json={"model": NAME, "prompt": words(4), "max_tokens": 1000, "temperature": 0})
        assert response.status_code == 504 and "deadline" in response.json()["error"]["message"]
        assert _wait_health_idle(url)["status"] == "ok"


def test_metrics_count_tokens_and_show_every_sequence_running(server):
    from prometheus_client.parser import text_string_to_metric_families

    url, key = server
    seen, stop = [], threading.Event()

    def scrape():
        text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        seen.append({s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples})

    def watch():
        while not stop.is_set():
            scrape()
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    api = client(url, key)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda n: api.completions.create(model=NAME, prompt=words(n), max_tokens=600, temperature=0),
                      (3, 5), timeout=4 * TIMEOUT))
    stop.set()
    watcher.join(TIMEOUT)
    scrape()  # after the last token: a scrape under way as the load ended may have missed the last few
    assert max(sample["kvq_sequences_running"] for sample in seen) == 2
    last = seen[-1]
    assert last["kvq_generation_tokens_total"] >= 1200 and last["kvq_prompt_tokens_total"] >= 8
    assert last["kvq_time_to_first_token_seconds_count"] >= 2 and last["kvq_request_latency_seconds_count"] >= 2
    budget = httpx.get(f"{url}/health", timeout=TIMEOUT).json()["cache_budget_bytes"]
    assert last["kvq_batch_invariant"] == 1 and last["kvq_cache_rows_used"] == 0 and last["kvq_cache_tokens"] == 0
    assert last["kvq_cache_rows_cached"] >= 1  # the answers' rows, kept as cached prefixes (room allowing)
    assert last["kvq_cache_bytes_used"] + last["kvq_cache_bytes_free"] == budget >= last["kvq_cache_bytes"] > 0
    assert max(sample["kvq_cache_tokens"] for sample in seen) >= 600
    assert last["process_resident_memory_bytes"] > 0


def test_health_fails_and_the_server_stops_when_the_generation_thread_dies(export, monkeypatch):
    def broken(self, token_lists):
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(Sampler, "prime", broken)  # the loop primes each request's sampler as it admits it
    failed = threading.Event()
    backend = open_backend(export, max_seqs=2, prefill_chunk=CHUNK)
    with running(backend) as url:
        backend.on_failure = failed.set
        with pytest.raises(openai.APIStatusError) as info:
            client(url).completions.create(model=NAME, prompt=words(3), max_tokens=5, temperature=0)
        assert info.value.status_code == 503
        assert failed.wait(TIMEOUT)
        health = httpx.get(f"{url}/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "failed"


def test_serve_refuses_a_budget_that_holds_no_sequence_in_one_line(export):
    from cli_harness import kvq

    result = kvq("serve", str(export), "--port", "0", "--cache-budget", "1KiB")
    assert result.returncode == 1 and "holds no sequence of 1024 tokens" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.gpu
def test_rows_on_cuda_give_the_logits_of_the_host(export):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu with CUDAExecutionProvider and a CUDA GPU; this onnxruntime has "
                    + ", ".join(ort.get_available_providers()))
    host = RowCache(KVQSession(export, tokenizer=False, providers=["CPUExecutionProvider"]), 2, 64)
    cuda = RowCache(KVQSession(export, tokenizer=False, providers=["CUDAExecutionProvider"]), 2, 64)
    assert cuda.device == "cuda" and check_batch_invariance(cuda).batch_sizes == (2,)
    for cache in (host, cuda):
        cache.run(1, np.array([prompt_ids(9)]))
    np.testing.assert_allclose(cuda.run(0, np.array([[0], [7]]), np.array([[0], [1]]))[1],
                               host.run(0, np.array([[0], [7]]), np.array([[0], [1]]))[1], atol=1e-3)


def test_serve_raises_after_stopping_when_the_generation_thread_dies(export, monkeypatch, caplog):
    """The library's ``serve`` (what ``kvq serve`` runs) stops by itself and raises, so the process exits 1."""
    import re

    from kvq_export.serve import serve

    monkeypatch.setattr(Sampler, "prime", lambda self, token_lists: (_ for _ in ()).throw(RuntimeError("a bug")))
    caplog.set_level(logging.INFO, logger="kvq_export.serve.app")
    outcome: list[BaseException | None] = []

    def main():
        try:
            serve(export, port=0, model_name=NAME, max_seqs=2, prefill_chunk=CHUNK, shutdown_timeout=1)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - what the thread ended with is the test's subject
            outcome.append(err)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not (found := re.search(r"on http://127\.0\.0\.1:(\d+)/v1", caplog.text)):
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{found.group(1)}"
    while True:  # uvicorn may still be starting
        try:
            httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": words(3)}, timeout=TIMEOUT)
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    thread.join(TIMEOUT)
    assert not thread.is_alive() and isinstance(outcome[0], KVQError)
    assert "generation thread failed" in str(outcome[0])


@pytest.mark.slow
def test_smollm2_prompts_of_many_lengths_get_their_answers_alone_under_load(tmp_path_factory):
    """SmolLM2 as a deployer exports it, prompts of 12 to 300 tokens at once: every answer is the one alone.

    The ort-int8 cache on int4 weights (tests/smollm2_harness.py); 8 corpus prompts sent together to 4 rows with
    64-token chunks, so prompts end before, on and just past a chunk's end and run over up to five chunks.
    """
    from smollm2_harness import deployer_export

    from kvq_export.corpus import load_corpus
    from kvq_export.runtime.text_codec import TextCodec

    directory = deployer_export(tmp_path_factory)
    codec = TextCodec(directory, Manifest.load(directory))
    text = load_corpus("britannica")[20000:60000]
    ids = codec.encode(text)
    lengths = (12, 40, 63, 64, 65, 129, 200, 300)
    jobs = [Job(tuple(ids[300 * i:300 * i + n]), 16, GREEDY) for i, n in enumerate(lengths)]
    backend = open_backend(directory, max_seqs=4, prefill_chunk=64, limits=ServeLimits(context=1024),
                           verify_weights=False)
    backend.start()
    try:
        assert backend.invariance.invariant and backend.mode is DecodeMode.BATCHED
        solo = [served(backend, [job])[0] for job in jobs]
        loaded = served(backend, jobs, delays=[0.05 * (i % 3) for i in range(len(jobs))])
    finally:
        backend.close()
    differ = [n for n, a, b in zip(lengths, solo, loaded) if a != b]
    assert not differ, f"prompts of {differ} tokens got other answers under load"
    assert all(reason is StreamEnd.LENGTH or tokens[-1] in backend.manifest.tokenizer.eos_ids
               for tokens, reason in loaded)

