"""The serving benchmark (:mod:`kvq_export.measure`): its load driver, hostile client, watches, peers and report.

Real servers on 127.0.0.1: ``kvq serve`` on a tiny ort-gqa export and the thin og.Engine server on a tiny byte-level
export, each a subprocess started and stopped by :class:`~kvq_export.measure.peers.ServerProcess`; and small FastAPI
apps written here that answer differently under load or accept everything. Every request has a timeout, every
load a duration and a request bound.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from gqa_harness import SCHEMES, calibration
from serve_harness import serving
from tiny_models import WORDS, byte_model, byte_tokenizer, tiny_model, tiny_tokenizer

from kvq_export.errors import KVQError
from kvq_export.export.exporter import export_model
from kvq_export.measure import Endpoint, LoadConfig, LoadResult, PointResult, measure_endpoint
from kvq_export.measure.hostile import HostileResult, hostile_cases
from kvq_export.measure.peers import ServerProcess, kvq_spec, llama_spec, og_spec
from kvq_export.measure.prompts import corpus_prompts
from kvq_export.measure.report import markdown_table, write_json, write_markdown, write_plot
from kvq_export.measure.watch import descendants, gauge_max, rss_bytes, summarize_rss

openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("onnxruntime_genai")

TIMEOUT = 30.0  # seconds, any one request
MAX_TOKENS = 6
API_KEY = "bench-key"
#: the tiny models' positions (the hostile client's long prompt goes beyond them)
CONTEXT = 1024


def words(n: int, start: int) -> str:
    """``n`` vocabulary words of the tiny tokenizer: a prompt of ``n`` tokens."""
    return " ".join(WORDS[(start + 13 * j) % len(WORDS)] for j in range(n))


PROMPTS = [words(10, start) for start in range(5)]


@pytest.fixture(scope="module")
def kvq_server(tmp_path_factory):
    """``kvq serve`` on the tiny ort-gqa export with an API key, as a subprocess."""
    root = tmp_path_factory.mktemp("serve_bench")
    scheme = SCHEMES["ort-int8"]
    export = export_model(tiny_model("llama"), scheme, root / "gqa", flavor="ort-gqa", tokenizer=tiny_tokenizer(),
                          static=calibration("llama", scheme))
    spec = kvq_spec(export, name="tiny", extra_args=("--api-key", API_KEY))
    with ServerProcess(spec, root / "kvq.log") as server:
        yield server


def load(endpoint: Endpoint, clients: tuple[int, ...], **kwargs) -> LoadResult:
    """Solo answers, then ``clients``: 1.5 s and 12 requests per count unless ``kwargs`` say otherwise."""
    config = LoadConfig(**{"clients": clients, "duration": 1.5, "max_requests": 12, "max_tokens": MAX_TOKENS,
                           "request_timeout": TIMEOUT, "context_tokens": CONTEXT, **kwargs})
    return measure_endpoint(endpoint, PROMPTS, config)


# -- against kvq serve ---------------------------------------------------------------------------------------------
def test_load_on_kvq_serve_reports_consistent_figures(kvq_server):
    assert kvq_server.endpoint().api_key == API_KEY  # the clients send the server's key
    result = load(kvq_server.endpoint(), (1, 3))
    assert result.incomplete is None and result.solo_answers == len(PROMPTS) and result.solo_errors == 0
    assert [p.clients for p in result.points] == [1, 3]
    for point in result.points:
        assert point.requests > 0 and point.errors == 0 and point.missing_usage == 0, point
        assert point.compared == point.requests and point.differ == 0, point
        # the tiny model has no end-of-sequence token: every answer runs to max_tokens
        assert point.completion_tokens == point.requests * MAX_TOKENS
        assert point.tokens_per_s == pytest.approx(point.completion_tokens / point.wall_s)
        assert 0 < point.ttft_p50 <= point.ttft_p99 <= point.latency_p99
        assert point.ttft_p50 <= point.latency_p50 <= point.latency_p99 <= TIMEOUT
    assert result.rss is not None and 0 < result.rss.start <= result.rss.max
    assert result.rss.second_minute is None  # a run of seconds has no second minute


def test_a_shared_prefix_load_on_kvq_serve_reads_its_prefix_counters(kvq_server):
    from kvq_export.measure.prefix_load import measure_workload
    from kvq_export.measure.reuse import ReuseSource
    from kvq_export.measure.workloads import SharedPrefixSizes, SharedPrefixWorkload

    prefixes = tuple(words(100, start=g) for g in range(2))
    questions = tuple(tuple(words(8, start=40 + 11 * g + q) for q in range(3)) for g in range(2))
    order = ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2))
    workload = SharedPrefixWorkload(tiny_tokenizer(), SharedPrefixSizes(2, 3, 100, 8), prefixes, questions, order)
    config = LoadConfig(clients=(2,), max_tokens=MAX_TOKENS, request_timeout=TIMEOUT)
    result = measure_workload(kvq_server.endpoint(), workload, config)
    (point,) = result.points
    assert result.solo_answers == 6 and result.solo_errors == 0, result.solo_error_samples  # cache_prompt: false
    assert point.requests == 6 and point.errors == 0 and point.compared == 6 and point.differ == 0
    reuse = point.reuse
    assert reuse.source is ReuseSource.METRICS and reuse.allowed_tokens == 4 * 100
    assert reuse.looked_up is not None and reuse.hit_rate is not None and reuse.hit_rate > 0, reuse


def test_a_mixed_load_on_kvq_serve_asks_each_answer_length_and_costs_tokens_by_its_export(kvq_server):
    from kvq_export.manifest import Manifest
    from kvq_export.measure.cache_use import token_bytes
    from kvq_export.measure.prefix_load import measure_workload
    from kvq_export.measure.workloads import MixedSizes, MixedWorkload

    answers = (2, 8, 5, 3, 7, 4)
    prompts = tuple(words(n, start=n) for n in (20, 60, 150, 35, 90, 10))
    workload = MixedWorkload(tiny_tokenizer(), MixedSizes(6, 50, 10, 150, 2, 8), prompts, answers)
    endpoint = kvq_server.endpoint()
    result = measure_workload(endpoint, workload, LoadConfig(clients=(3,), max_tokens=8, request_timeout=TIMEOUT))
    (point,) = result.points
    assert result.solo_answers == 6 and result.solo_errors == 0, result.solo_error_samples
    assert point.requests == 6 and point.errors == 0 and point.compared == 6 and point.differ == 0
    assert point.completion_tokens == sum(answers)  # the tiny model has no EOS: each answer runs to its own length
    assert point.reuse.allowed_tokens == 0  # distinct starts: nothing for a prefix cache
    use, manifest = point.cache_use, Manifest.load(endpoint.export_dir)
    assert use.bytes_per_token == token_bytes(manifest.scheme, manifest.model) > 0
    assert use.running_max is None or 0 <= use.running_max <= 3  # sampled once a second: a short load may miss it
    assert use.budget_bytes is None or use.budget_bytes > 0  # /health's cache_budget_bytes, where serve gives it


def test_every_hostile_request_gets_a_4xx_from_kvq_serve(kvq_server):
    result = load(kvq_server.endpoint(), (2,), hostile=True, duration=2.5, max_requests=500)
    point = result.points[0]
    cases = hostile_cases("tiny", PROMPTS[0], CONTEXT, api_key=API_KEY)
    assert {"no API key", "wrong API key"} <= {c.name for c in cases}
    assert point.hostile.sent >= len(cases), point.hostile  # every case at least once
    assert point.hostile.refused == point.hostile.sent and not point.hostile.failures, point.hostile
    assert point.errors == 0 and point.differ == 0  # the bad requests cost the others nothing


def test_a_server_that_cannot_start_is_a_one_line_error(tmp_path):
    spec = kvq_spec(tmp_path / "not-an-export", name="broken")
    server = ServerProcess(spec, tmp_path / "broken.log")
    with pytest.raises(KVQError, match=r"broken exited with code [1-9]\d* before it was ready; its log: .*broken"):
        server.start()
    assert server.process.poll() is not None


# -- fake endpoints: answers that change under load, a server that refuses nothing ---------------------------------
def busy_app(served: list[str]):
    """Streams ``"<prompt's first word> alone"``, or ``"... busy"`` when another request overlapped it in time."""
    app, open_requests, overlapped = FastAPI(), set(), set()

    def event(data: dict) -> str:
        head = {"id": "x", "object": "text_completion", "created": 0, "model": "m"}
        return f"data: {json.dumps({**head, **data})}\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, me = await request.json(), object()
        if open_requests:  # it overlaps every request still open, and they overlap it
            overlapped.update(open_requests, {me})
        open_requests.add(me)
        await asyncio.sleep(0.05)
        open_requests.discard(me)
        served.append("busy" if me in overlapped else "alone")
        text = f"{body['prompt'].split()[0]} {served[-1]}"
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
        events = [event({"choices": [{"index": 0, "text": text, "finish_reason": None}]}),
                  event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
                  event({"choices": [], "usage": usage}), "data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    return app


def test_answers_that_differ_from_the_solo_answer_are_counted():
    served: list[str] = []
    with serving(busy_app(served)) as url:
        result = load(Endpoint(url, "m"), (1, 4))
    alone, loaded = result.points
    assert result.solo_answers == len(PROMPTS) and served[: len(PROMPTS)] == ["alone"] * len(PROMPTS)
    assert alone.differ == 0 and alone.compared == alone.requests > 0
    # exactly the answers the server gave while another request overlapped them
    assert loaded.differ == served.count("busy") > 0
    assert loaded.completion_tokens == 2 * loaded.requests


def test_a_distinct_load_sends_each_prompt_once_then_asks_the_used_ones_alone():
    served: list[str] = []
    prompts = [f"p{i} text" for i in range(12)]
    config = LoadConfig(clients=(1, 4), duration=0.5, max_tokens=2, request_timeout=5.0, distinct=True)
    with serving(busy_app(served)) as url:
        result = measure_endpoint(Endpoint(url, "m"), prompts, config)
    loaded = sum(p.requests for p in result.points)
    # the pool ran out: every prompt went out once under load, then once alone, and nothing else was sent
    assert loaded == len(prompts) == result.solo_answers and len(served) == 2 * len(prompts)
    assert served[loaded:] == ["alone"] * len(prompts)
    assert sum(p.compared for p in result.points) == loaded and result.points[-1].to_dict()["out_of_prompts"]
    assert result.points[1].differ == served[:loaded].count("busy") - result.points[0].differ
    assert config.prompts_needed(100.0) == 2 * (math.ceil(0.5 * 100 / 2) + 4)
    assert LoadConfig(clients=(32,), max_requests=50, distinct=True).prompts_needed(1e6) == 50


def accept_all_app():
    """Answers 200 to any body at all: every hostile request is a failure."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        await request.body()
        return {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]}

    return app


def test_the_hostile_client_counts_every_request_that_is_not_refused():
    from kvq_export.measure.hostile import hostile_loop

    result, cases = HostileResult(), hostile_cases("m", "a prompt", CONTEXT, api_key="secret")
    assert {"no API key", "wrong API key", "bad JSON", "max_tokens 10**9"} <= {c.name for c in cases}

    async def drive(url: str) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(hostile_loop(f"{url}/v1", cases, "secret", stop, result, timeout=TIMEOUT, pause=0))
        deadline = time.monotonic() + 20
        while result.sent < len(cases) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, TIMEOUT)

    with serving(accept_all_app()) as url:
        asyncio.run(drive(url))
    assert result.sent >= len(cases) and result.refused == 0 and result.failed == result.sent
    assert {f"{c.name}: HTTP 200" for c in cases} == set(result.failures)


@contextmanager
def dropping_server(drops: int):
    """A raw HTTP server on 127.0.0.1 that closes its first ``drops`` connections unanswered, then streams " ok"."""
    events = "".join(f"data: {json.dumps(d)}\n\n" for d in (
        {"id": "x", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]},
        {"id": "x", "object": "text_completion", "created": 0, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})) + "data: [DONE]\n\n"
    reply = ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
             f"Content-Length: {len(events)}\r\n\r\n{events}").encode()
    seen = {"connections": 0}
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                conn.recv(65536)  # the request (small enough for one read here)
                seen["connections"] += 1
                if seen["connections"] > drops:
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        stop.set()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("drops", [1, 2])
def test_a_request_dropped_before_any_answer_is_sent_once_more_and_only_once(drops):
    from kvq_export.measure.load import complete, open_client

    async def one(url: str):
        client = open_client(Endpoint(url, "m"), LoadConfig(request_timeout=TIMEOUT))
        try:
            return await complete(client, "m", "a prompt", 1, TIMEOUT)
        finally:
            await client.close()

    with dropping_server(drops) as (url, seen):
        answer = asyncio.run(one(url))
    assert seen["connections"] == 2  # never a third try
    if drops == 1:
        assert answer.error is None and answer.resent and answer.text == " ok" and answer.completion_tokens == 1
    else:
        assert answer.error is not None and "APIConnectionError" in answer.error and answer.text == ""


# -- the thin og.Engine server ---------------------------------------------------------------------------------------
def og_greedy(directory, prompt: str, max_tokens: int) -> str:
    """og.Generator's greedy continuation of ``prompt``, each token through og's TokenizerStream.

    That is how og's examples print it: a token that ends inside a UTF-8 character shows with the next one.
    """
    import onnxruntime_genai as og

    model = og.Model(str(directory))
    tokenizer = og.Tokenizer(model)
    ids = tokenizer.encode(prompt)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + max_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    stream = tokenizer.create_stream()
    tokens = generator.get_sequence(0)[len(ids):]
    assert len(tokens) == max_tokens
    return "".join(stream.decode(int(token)) for token in tokens)


#: a chat template og's tokenizer renders as transformers does (each message as ``<role>content``)
BYTE_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_the_og_server_answers_as_og_generators_greedy(tmp_path):
    # og reads BPE tokenizers only: the byte-level tiny model's, with a chat template (saved beside it)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = BYTE_TEMPLATE
    export = export_model(byte_model(), SCHEMES["fp32"], tmp_path / "bytes", flavor="ort-gqa", tokenizer=tokenizer)
    prompt, max_tokens = "Once upon a time", 8
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    expected = og_greedy(export, prompt, max_tokens)
    chat_expected = og_greedy(export, tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                    tokenize=False), max_tokens)
    with ServerProcess(og_spec(export, name="og-tiny"), tmp_path / "og.log") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["og-tiny"]
        reply = client.completions.create(model="og-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"cache_prompt": False})  # a field it does not read: ignored
        chunks = list(client.completions.create(model="og-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        chat = client.chat.completions.create(model="og-tiny", messages=messages, max_tokens=max_tokens,
                                              temperature=0)
        chat_chunks = list(client.chat.completions.create(model="og-tiny", messages=messages, temperature=0,
                                                          max_completion_tokens=max_tokens, stream=True,
                                                          stream_options={"include_usage": True}))
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == max_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == max_tokens
    assert chat.choices[0].message.content == chat_expected and chat.usage.completion_tokens == max_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == chat_expected
    assert chat_chunks[-1].usage.completion_tokens == max_tokens
    assert server.process.returncode is not None  # stopped


# -- pieces ----------------------------------------------------------------------------------------------------------
def test_llama_server_keeps_its_prompt_cache_only_when_asked():
    line = llama_spec("/opt/llama-server", "/m/model.gguf", slots=8, cache_prompt=True).command(8123)
    assert "--no-cache-prompt" not in line


def test_llama_server_command_line():
    spec = llama_spec("/opt/llama-server", "/m/model.gguf", slots=8, extra_args=("--api-key", "k"))
    command = spec.command(8123)
    line = " ".join(command)
    for part in ("-m /m/model.gguf", "-np 8", "-c 8192", "-ctk q8_0", "-ctv q8_0", "-fa on", "-t 2",
                 "--host 127.0.0.1", "--port 8123", "--metrics", "--no-cache-prompt", "--api-key k"):
        assert f" {part}" in f" {line}", part
    assert command[0] == "/opt/llama-server" and spec.api_key == "k" and spec.context_tokens == 1024
    assert spec.metrics_path == "/metrics" and spec.gauge == "llamacpp:requests_processing"
    with pytest.raises(KVQError, match=r"invalid slots=0: allowed: an integer >= 1"):
        llama_spec("/opt/llama-server", "/m/model.gguf", slots=0)


def test_kvq_serve_command_line_passes_extra_args_through():
    spec = kvq_spec("/exports/x", name="kvq", extra_args=("--max-seqs", "64", "--api-key=s3"))
    assert spec.command(9000) == [sys.executable, "-m", "kvq_export.cli", "serve", "/exports/x", "--host", "127.0.0.1",
                                  "--port", "9000", "--model-name", "kvq", "--max-seqs", "64", "--api-key=s3"]
    assert spec.api_key == "s3" and spec.model == "kvq" and spec.metrics_path == "/metrics"


def test_load_config_refuses_bad_values_naming_what_is_allowed():
    for kwargs, message in (({"clients": ()}, "clients"), ({"clients": (1, 0)}, "clients"),
                            ({"duration": 0}, "duration"), ({"max_tokens": 0}, "max_tokens"),
                            ({"max_requests": 0}, "max_requests")):
        with pytest.raises(KVQError, match=rf"invalid {message}=.*: allowed: "):
            LoadConfig(**kwargs)


def test_prompts_are_distinct_corpus_passages_of_the_asked_length():
    tokenizer = byte_tokenizer()
    prompts = corpus_prompts(tokenizer, 6, 160)
    assert len(set(prompts)) == 6
    for prompt in prompts:
        assert 150 <= len(tokenizer.encode(prompt, add_special_tokens=False)) <= 170  # stripped; a cut character
    with pytest.raises(KVQError, match="window"):
        corpus_prompts(tokenizer, 10**6, 160)


def test_gauge_and_rss_watches_read_what_is_there(tmp_path):
    page = ("# TYPE kvq_sequences_running gauge\nkvq_sequences_running 3\nkvq_sequences_running_total 99\n"
            'llamacpp:requests_processing{slot="a"} 2\nllamacpp:requests_processing{slot="b"} 5.0\n')
    assert gauge_max(page, "kvq_sequences_running") == 3.0
    assert gauge_max(page, "llamacpp:requests_processing") == 5.0
    assert gauge_max(page, "absent") is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
        own = rss_bytes(os.getpid())
        assert own is not None and own > rss_bytes(child.pid) > 0  # the child is counted in
    finally:
        child.kill()
        child.wait(10)
    samples = [(t, 100 + t) for t in range(0, 181, 1)]
    summary = summarize_rss([(float(t), int(r)) for t, r in samples])
    assert (summary.start, summary.second_minute, summary.last_minute, summary.max) == (100, 189, 250, 280)


def test_report_writes_the_table_the_plot_and_json(tmp_path):
    def point(clients: int, speed: float, p99: float) -> PointResult:
        return PointResult(clients=clients, wall_s=10.0, requests=clients * 3, errors=0,
                           completion_tokens=int(speed * 10), compared=clients * 3, differ=1, missing_usage=0,
                           ttft_p50=0.1, ttft_p99=0.2, latency_p50=p99 / 2, latency_p99=p99,
                           hostile=HostileResult(sent=4, refused=3, failures={"bad JSON: HTTP 200": 1}))
    results = [LoadResult("kvq", "m", solo_answers=5, points=[point(1, 20.0, 1.5), point(4, 50.0, 3.0)]),
               LoadResult("llama", "m", solo_answers=5, points=[point(1, 40.0, 0.8)],
                          incomplete="the run passed its bound of 9 s")]
    table = markdown_table(results)
    assert "| kvq | 4 | 12 | 0 | 1/12 | 50.0 | 0.10 | 0.20 | 1.50 | 3.00 | 3/4 | - | - |" in table
    assert "- llama: the run passed its bound of 9 s" in table and "hostile: 1 x bad JSON: HTTP 200" in table
    plot = write_plot(results, tmp_path / "serve.png", "tiny")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_markdown(results, tmp_path / "serve.md", "# run").read_text() == "# run\n\n" + table
    data = json.loads(write_json(results, tmp_path / "serve.json", {"command": "x"}).read_text())
    assert data["command"] == "x" and data["servers"][0]["points"][1]["tokens_per_s"] == 50.0
