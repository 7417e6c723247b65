"""``kvq serve``: a real server on 127.0.0.1, driven by the official ``openai`` client.

Two servers run for the module, each in a thread: the tiny ort-gqa export batched continuously over its cache
rows, and a tiny reference-flavour export on one KVQSession. Every answer is compared with
``KVQSession.generate`` (what ``kvq generate`` prints) for the same prompt run alone. Every request has a client
timeout and every wait a deadline.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest
from gqa_harness import SCHEMES, calibration
from serve_harness import NAME, TIMEOUT, chat_tokenizer, client, running, words
from tiny_models import tiny_model

from kvq_export.errors import KVQError
from kvq_export.export.exporter import export_model
from kvq_export.runtime.base import continuation_text
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.runtime.session import KVQSession
from kvq_export.serve import open_backend
from kvq_export.serve.app import bind
from kvq_export.serve.protocol import RequestError, parse_chat, parse_completion
from kvq_export.serve.text import TextTracker

openai = pytest.importorskip("openai")
pytest.importorskip("onnxruntime_genai")

KINDS = ("batch", "session")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    scheme = SCHEMES["ort-int8"]
    return {"batch": export_model(tiny_model("llama"), scheme, root / "gqa", flavor="ort-gqa",
                                   tokenizer=chat_tokenizer(), static=calibration("llama", scheme)),
            "session": export_model(tiny_model("llama"), "q4_0", root / "ref", tokenizer=chat_tokenizer())}


@pytest.fixture(scope="module")
def sessions(exports):
    """The same exports on KVQSession: the answer each prompt gets alone.

    The batch server reuses prefixes, so its every call attends over the stored codes (``stored_prefill``).
    """
    return {kind: KVQSession(directory, stored_prefill=kind == "batch") for kind, directory in exports.items()}


@pytest.fixture(scope="module")
def servers(exports):
    with running(open_backend(exports["batch"], max_seqs=8)) as batch, \
            running(open_backend(exports["session"])) as session:
        yield {"batch": batch, "session": session}


def alone(session: KVQSession, prompt, max_tokens: int) -> str:
    """``kvq generate``'s greedy text for one prompt (text, or token ids decoded after the prompt)."""
    result = session.generate([prompt], max_tokens)[0]
    return result.text if isinstance(prompt, str) else continuation_text(session.decode, prompt, result.tokens)


def chat_ids(session: KVQSession, messages) -> list[int]:
    text = session.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return session.tokenizer(text, add_special_tokens=False)["input_ids"]


# -- answers ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_alone_equals_kvq_generate(servers, sessions, kind):
    api = client(servers[kind])
    for n, max_tokens in ((3, 20), (11, 7)):
        prompt = words(n, start=n)
        reply = api.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        choice = reply.choices[0]
        assert choice.text == alone(sessions[kind], prompt, max_tokens)
        assert choice.finish_reason == "length"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (n, max_tokens)
    ids = [5, 17, 99, 3]  # a prompt of token ids
    reply = api.completions.create(model=NAME, prompt=ids, max_tokens=9, temperature=0)
    assert reply.choices[0].text == alone(sessions[kind], ids, 9)


@pytest.mark.parametrize("kind", KINDS)
def test_eight_concurrent_requests_equal_each_alone(servers, sessions, kind):
    """Greedy under load equals greedy alone: 8 prompts of different lengths and lengths to generate, at once."""
    jobs = [(words(n, start=7 * i), 10 + 3 * i) for i, n in enumerate((2, 5, 9, 14, 20, 27, 33, 41))]
    expected = [alone(sessions[kind], prompt, max_tokens) for prompt, max_tokens in jobs]
    api = client(servers[kind])

    def ask(job):
        prompt, max_tokens = job
        return api.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        served = list(pool.map(ask, jobs, timeout=4 * TIMEOUT))
    wrong = [i for i, (got, want) in enumerate(zip(served, expected)) if got != want]
    assert not wrong, f"requests {wrong} of 8 differ from the same prompt served alone"


@pytest.mark.parametrize("kind", KINDS)
def test_streaming_gives_the_same_text(servers, sessions, kind):
    api = client(servers[kind])
    prompt = words(6, start=3)
    chunks = list(api.completions.create(model=NAME, prompt=prompt, max_tokens=15, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone(sessions[kind], prompt, 15)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 15 and not chunks[-1].choices

    messages = [{"role": "system", "content": "w8 w9"}, {"role": "user", "content": words(5, start=40)}]
    want = alone(sessions[kind], chat_ids(sessions[kind], messages), 12)
    reply = api.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == want and reply.choices[0].message.role == "assistant"
    chunks = list(api.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_cuts_the_text_and_frees_the_request(servers, sessions, kind):
    api = client(servers[kind])
    prompt = words(4, start=21)
    full = alone(sessions[kind], prompt, 24)
    stop = full.split()[4]  # the fifth word: the answer ends before its first occurrence
    want = full[:full.index(stop)]
    reply = api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (want, "stop")
    chunks = list(api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    _wait_idle(servers[kind])


def test_seeded_sampling_repeats_on_every_backend(servers, sessions):
    prompt, sampling = words(5), SamplingConfig(temperature=0.9, top_p=0.95, seed=7)
    ask = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    for kind in KINDS:
        api = client(servers[kind])
        first, second = (api.completions.create(**ask).choices[0].text for _ in range(2))
        # kvq's own sampler with the request's seed: kvq generate's sample, every time
        assert first == second == sessions[kind].generate([prompt], 12, sampling)[0].text, kind


# -- refusals --------------------------------------------------------------------------------------------------------
BAD = [
    ("completions", {"prompt": "w1", "n": 2}, 400, "n"),
    ("completions", {"prompt": "w1", "logprobs": 3}, 400, "logprobs"),
    ("completions", {"prompt": "w1", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "w1", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "w1", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "w1", "temperature": 1e-310}, 400, "temperature"),  # float32 0 in the engine
    ("completions", {"prompt": "w1", "temperature": 1e300}, 400, "temperature"),  # float32 inf
    ("completions", {"prompt": "w1", "temperature": 1, "top_p": 1e-300}, 400, "top_p"),
    ("completions", {"prompt": "w1", "temperature": 1, "top_k": 2**31}, 400, "top_k"),  # past int32
    ("completions", {"prompt": "w1", "stop": ["w1", "w2", "w3", "w4", "w5"]}, 400, "stop"),
    ("completions", {"prompt": ["w1", "w2"]}, 400, "prompt"),
    ("completions", {"prompt": [5, 1000]}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "w1", "model": "other"}, 404, "model"),
    ("chat/completions", {"messages": [{"role": "user", "content": "w1"}], "tools": []}, 400, "tools"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "w1"}]}, 400, "messages"),
    ("chat/completions", {"messages": []}, 400, "messages"),
]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_requests_get_4xx_json_naming_the_field(servers, kind):
    with httpx.Client(base_url=servers[kind], timeout=TIMEOUT) as http:
        for endpoint, body, status, param in BAD:
            response = http.post(f"/v1/{endpoint}", json={"model": NAME, **body})
            error = response.json()["error"]
            assert response.status_code == status and error["param"] == param, (endpoint, body, response.text)
            assert param in error["message"] and error["type"]
        for body in (b"{not json", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):  # deep: no 500
            response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
        response = http.get("/v1/nothing")
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError, match="unsupported field"):
        client(servers[kind]).completions.create(model=NAME, prompt="w1", n=2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_beyond_the_context_is_refused_with_the_numbers(servers, kind):
    api = client(servers[kind])
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=NAME, prompt=words(1000), max_tokens=100)
    message = info.value.body["message"]
    assert all(str(n) in message for n in (1000, 100, 1100, 1024, 24)), message
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="no room"):
        api.completions.create(model=NAME, prompt=words(1024), max_tokens=1)
    # chat without max_tokens: bounded by the rest of the context (1024 - 1010 prompt tokens)
    reply = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": words(1008)}],
                                        temperature=0)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (1010, 14)
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_at_the_ends_of_the_accepted_ranges_answers(servers, kind):
    """What the protocol accepts, every backend samples: top_k past the vocabulary keeps every token (og refused it)."""
    api = client(servers[kind])
    for extreme in ({"temperature": 1.2e-38, "top_p": 1.2e-38}, {"temperature": 3.4e38, "top_k": 2**31 - 1}):
        reply = api.completions.create(model=NAME, prompt="w1 w2", max_tokens=3, extra_body=extreme)
        assert reply.usage.completion_tokens <= 3 and reply.choices[0].finish_reason in ("length", "stop")


# -- the server itself --------------------------------------------------------------------------------------------
def test_health_and_models_say_how_requests_run(servers):
    batch = httpx.get(f"{servers['batch']}/health", timeout=TIMEOUT).json()
    session = httpx.get(f"{servers['session']}/health", timeout=TIMEOUT).json()
    assert batch["status"] == session["status"] == "ok"
    assert batch["batching"] is True and batch["max_seqs"] == 8 and batch["flavor"] == "ort-gqa"
    assert batch["decode"] == "batched" and batch["batch_invariance"]["invariant"] is True
    sizes = batch["batch_invariance"]["batch_sizes"]  # up to the rows a decode call may span (paged: not max_seqs)
    assert sizes[:3] == [2, 3, 8] and sizes == sorted(sizes)
    assert session["batching"] is False and "one request at a time" in session["backend"]
    assert "regions cache layout" in session["reason"]
    assert batch["max_positions"] == session["max_positions"] == 1024
    for kind in KINDS:
        models = client(servers[kind]).models.list().data
        assert [m.id for m in models] == [NAME]
        assert models[0].model_extra["kvq"]["batching"] is (kind == "batch")


def _active(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=TIMEOUT).json()["active_requests"]


def _wait_idle(url: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while _active(url):
        assert time.monotonic() < deadline, "a request still holds its slot"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_that_goes_away_frees_its_slot(servers, sessions, kind, caplog):
    url = servers[kind]
    body = {"model": NAME, "prompt": words(3), "max_tokens": 1000, "temperature": 0}
    caplog.set_level(logging.INFO, logger="kvq_export.serve.app")
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert next(response.iter_lines()).startswith("data:")
        # the stream is closed after its first event: the request is cancelled, the backend is free again
    _wait_idle(url)
    if kind == "session":  # 1000 tokens take seconds here (a batch may be done first): both requests cancelled
        assert any(re.match(r"stream closed early .* after \d+ tokens", r.getMessage()) for r in caplog.records)
        with httpx.Client(base_url=url, timeout=httpx.Timeout(TIMEOUT, read=0.5)) as http, \
                pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
        _wait_idle(url)
        gone = [r.getMessage() for r in caplog.records if r.getMessage().startswith("client gone")]
        assert gone and int(gone[0].split()[-2]) < 1000, gone
    prompt = words(4, start=9)  # and the next request is served as if alone
    reply = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert reply.choices[0].text == alone(sessions[kind], prompt, 10)


def test_shutdown_with_a_request_in_flight_ends_cleanly(exports):
    """``kvq serve`` on the slow backend, a streaming request running: SIGINT stops it and the process (exit 0).

    SIGTERM takes the same path in uvicorn, which then re-raises it (the process ends by that signal).
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kvq_export.cli", "serve", str(exports["session"]), "--host",
                             "127.0.0.1", "--port", "0", "--model-name", NAME, "--shutdown-timeout", "5"],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        url = _served_url(lines, proc)
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=TIMEOUT, json={
                "model": NAME, "prompt": words(3), "max_tokens": 1000, "temperature": 0, "stream": True}) as response:
            try:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        if len(events) == 3:  # generating: stop the server now
                            proc.send_signal(signal.SIGINT)
            except httpx.RemoteProtocolError:
                pass  # the server closed the stream: also a clean end
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = "".join(iter_nowait(lines))
    assert 3 <= len(events) < 1000, "the request was not in flight when the signal came"
    assert "stopped kvq session" in log and "Application shutdown complete" in log and "Traceback" not in log, log


def _served_url(lines: queue.Queue, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            assert proc.poll() is None, "kvq serve exited before serving"
            continue
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            return found.group(1)
    raise AssertionError("kvq serve did not report its address within 60 s")


def iter_nowait(lines: queue.Queue):
    while True:
        try:
            yield lines.get(timeout=1.0)
        except queue.Empty:
            return


# -- pieces, without a server ---------------------------------------------------------------------------------------
def test_neutral_values_are_accepted_and_others_refused():
    request = parse_completion({"model": NAME, "prompt": "w1", "n": 1, "presence_penalty": 0, "logprobs": None,
                                "echo": False, "user": "u", "top_k": 5, "temperature": 0.5}, served=NAME)
    assert request.sampling == SamplingConfig(temperature=0.5, top_k=5)
    with pytest.raises(RequestError, match="echo"):
        parse_completion({"model": NAME, "prompt": "w1", "echo": True}, served=NAME)
    with pytest.raises(RequestError, match="logprobs"):  # logprobs=0 asks for something in completions
        parse_completion({"model": NAME, "prompt": "w1", "logprobs": 0}, served=NAME)
    chat = parse_chat({"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}],
                       "max_completion_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
                      served=NAME)
    assert (chat.max_tokens, chat.prompt, chat.include_usage) == (5, ({"role": "user", "content": "w1"},), True)


def test_every_sampling_value_the_protocol_accepts_fits_float32_and_int32():
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    numbers = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([5e-324, 1e-310, 1.2e-38, 3.5e38])

    @settings(max_examples=300, deadline=None, database=None)
    @given(temperature=numbers, top_p=numbers, top_k=st.integers(-5, 2**64))
    def check(temperature, top_p, top_k):
        body = {"model": NAME, "prompt": "w1", "temperature": temperature, "top_p": top_p, "top_k": top_k}
        try:
            sampling = parse_completion(body, served=NAME).sampling
        except RequestError as err:
            assert err.param in ("temperature", "top_p", "top_k") and err.status == 400
            return
        t, p = np.float32(sampling.temperature), np.float32(sampling.top_p)
        assert np.isfinite(t) and (t > 0 or sampling.temperature == 0) and 0 < p <= 1
        assert 1 <= sampling.top_k <= 2**31 - 1

    check()


def test_streamed_text_holds_back_a_possible_stop_string():
    tokenizer = chat_tokenizer()
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    ids = tokenizer("w1 w2")["input_ids"]
    tracker = TextTracker(decode, ids, stop=["w7 w8"])
    deltas = [tracker.add(t, stream=True) for t in tokenizer("w5 w7 w9 w7")["input_ids"]]
    assert deltas == [" w5", " ", "w7 w9", " "]  # a trailing "w7" may begin the stop string: held back
    assert not tracker.stopped
    assert tracker.add(tokenizer("w8")["input_ids"][0], stream=True) == ""
    assert tracker.stopped and tracker.text == " w5 w7 w9 " and tracker.finish() == ""
    assert tracker.add(tokenizer("w3")["input_ids"][0], stream=True) == "" and tracker.text == " w5 w7 w9 "
    quiet = TextTracker(decode, ids)
    for token in tokenizer("w3 w4")["input_ids"]:
        assert quiet.add(token, stream=False) == ""
    assert quiet.finish() == quiet.text == " w3 w4"


def test_backend_choice_and_a_taken_port_are_one_line_errors(exports):
    with pytest.raises(KVQError, match="continuous batching needs .* has the regions layout"):
        open_backend(exports["session"], kind="batch")
    with pytest.raises(KVQError, match="unknown backend 'gpu'; allowed: auto, batch, session"):
        open_backend(exports["session"], kind="gpu")
    assert open_backend(exports["batch"], kind="session").batching is False
    taken = bind("127.0.0.1", 0)
    try:
        with pytest.raises(KVQError, match=f"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
