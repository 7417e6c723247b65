"""The serving benchmark's prefix-reuse workloads: shared prefix and chat (:mod:`kvq_export.measure.workloads`).

Their generation (deterministic, the asked shape), what a perfect prefix cache could reuse, how each server's reuse
is read (kvq's counters, llama-server's timings), the load against small FastAPI apps written here (the chat's turn
order and history, the solo answers sent with ``cache_prompt: false``), and ``tools/serve_bench.py``'s options.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from serve_harness import chat_tokenizer, serving, words
from tiny_models import byte_tokenizer, tiny_tokenizer

from kvq_export.errors import KVQError
from kvq_export.measure import Endpoint, LoadConfig
from kvq_export.measure.peers import kvq_spec, llama_spec, og_spec
from kvq_export.measure.prefix_load import measure_workload
from kvq_export.measure.report import markdown_table, write_bars
from kvq_export.measure.reuse import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    PrefixReuse,
    ReuseSource,
    allowed_reuse,
    counter_change,
    prefix_counters,
    timings_totals,
)
from kvq_export.measure.workloads import (
    SEPARATOR,
    ChatSizes,
    ChatWorkload,
    SharedPrefixSizes,
    SharedPrefixWorkload,
    chat_messages,
    chat_workload,
    shared_prefix_workload,
)

pytest.importorskip("openai")
pytest.importorskip("httpx")

TIMEOUT = 30.0  # seconds, any one request
TOOLS = Path(__file__).resolve().parent.parent / "tools"
#: a chat template for the byte-level tokenizer (each message as ``<role>content``)
BYTE_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_chat_tokenizer():
    """The byte-level tokenizer (one token per byte) with :data:`BYTE_TEMPLATE`."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = BYTE_TEMPLATE
    return tokenizer


# -- generation ------------------------------------------------------------------------------------------------------
def test_the_shared_prefix_workload_is_deterministic_interleaved_and_of_the_asked_shape():
    tokenizer, sizes = byte_tokenizer(), SharedPrefixSizes(groups=4, questions=5, prefix_tokens=200,
                                                           question_tokens=24)
    workload = shared_prefix_workload(tokenizer, sizes)
    assert workload == shared_prefix_workload(tokenizer, sizes)  # the same passages, the same order
    assert workload.jobs == workload.requests == 20 and sorted(workload.order) == [(g, q) for g in range(4)
                                                                                  for q in range(5)]
    assert len(set(workload.prefixes)) == 4 and len({q for g in workload.questions for q in g}) == 20
    for job, (group, question) in enumerate(workload.order):
        prompt = workload.request(job, [])
        assert prompt == workload.prefixes[group] + SEPARATOR + workload.questions[group][question]
        assert workload.request(job, ["its answer"]) is None  # one request per job
        assert abs(len(workload.prompt_ids(prompt)) - (200 + 2 + 24)) <= 6  # stripped passages, a cut character
    groups = [g for g, _ in workload.order]
    assert len(set(groups[:4])) > 1 and sum(a == b for a, b in zip(groups, groups[1:])) < len(groups) // 2
    assert workload.order != shared_prefix_workload(tokenizer, SharedPrefixSizes(4, 5, 200, 24, seed=1)).order
    # every group's prefix was computed once: the rest of the prompt tokens are what the workload allows
    total, allowed = allowed_reuse((workload.prompt_ids(workload.request(j, [])), []) for j in range(20))
    prefix = [len(workload.prompt_ids(p + SEPARATOR)) for p in workload.prefixes]
    assert allowed >= (5 - 1) * sum(prefix) - 4 * 5 * 2 and total > allowed


def test_the_chat_workload_resends_the_history_with_the_given_replies():
    tokenizer = byte_chat_tokenizer()
    sizes = ChatSizes(conversations=3, turns=4, system_tokens=100, user_tokens=30)
    workload = chat_workload(tokenizer, sizes)
    assert workload == chat_workload(tokenizer, sizes) and workload.jobs == 3 and workload.requests == 12
    users = [u for turns in workload.users for u in turns]
    assert len(set(users)) == 12 and workload.system not in users
    assert abs(len(tokenizer.encode(workload.system, add_special_tokens=False)) - 100) <= 6
    assert all(abs(len(tokenizer.encode(u, add_special_tokens=False)) - 30) <= 6 for u in users)
    replies = ["first reply", "second reply", "third reply"]
    for turn in range(4):
        messages = workload.request(1, replies[:turn])
        assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * turn + ["user"]
        assert messages[0]["content"] == workload.system and messages[-1]["content"] == workload.users[1][turn]
        assert [m["content"] for m in messages if m["role"] == "assistant"] == replies[:turn]
    assert workload.request(1, [*replies, "fourth reply"]) is None
    assert workload.request(2, [])[0] == workload.request(0, [])[0]  # one system prompt for all
    with pytest.raises(KVQError, match="chat template"):
        ChatWorkload(tiny_tokenizer(), sizes, "s", (("u",),))
    with pytest.raises(KVQError, match="one reply fewer"):
        chat_messages("s", ["u1"], ["r1"])


def test_workload_sizes_refuse_bad_values_naming_what_is_allowed():
    with pytest.raises(KVQError, match=r"invalid groups=0: allowed: an integer >= 1"):
        SharedPrefixSizes(groups=0)
    with pytest.raises(KVQError, match=r"invalid turns=True: allowed"):
        ChatSizes(turns=True)
    with pytest.raises(KVQError, match="distinct passages"):
        shared_prefix_workload(byte_tokenizer(), SharedPrefixSizes(groups=1, prefix_tokens=10**6))


# -- what the workload allows, what the servers say -----------------------------------------------------------------
def test_allowed_reuse_is_the_longest_prefix_of_an_earlier_prompt_and_its_answer():
    assert allowed_reuse([]) == (0, 0)
    # a repeat reuses all but its last token; a prompt shorter than an earlier one, all but its last too
    assert allowed_reuse([([1, 2, 3, 4], []), ([1, 2, 3, 5], []), ([1, 2, 3, 4], [])]) == (12, 0 + 3 + 3)
    assert allowed_reuse([([1, 2, 3, 4, 5], []), ([1, 2, 3], [])]) == (8, 2)
    # the next turn of a conversation: the earlier prompt, its answer, then more
    assert allowed_reuse([([1, 2], [7, 8]), ([1, 2, 7, 8, 9], [])]) == (7, 4)
    assert allowed_reuse([([1, 2], [7, 8]), ([1, 2, 7, 6], [])]) == (6, 3)
    assert allowed_reuse([([], []), ([5], [])]) == (1, 0)
    # two groups of three: prefix of 4, question of 2; only the group's first request computes its prefix
    sent = [([g] * 4 + [10 + 3 * g + q, 20 + 3 * g + q], []) for q in range(3) for g in range(2)]
    assert allowed_reuse(sent) == (36, 4 * 4)


def test_kvq_prefix_counters_read_from_a_prometheus_page_and_absent_is_none_not_zero():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    queries = Counter("kvq_prefix_cache_queries", "Prompt tokens looked up.", registry=registry)
    hits = Counter("kvq_prefix_cache_hits", "Prompt tokens reused.", registry=registry)
    Gauge("kvq_sequences_running", "Running.", registry=registry).set(3)
    queries.inc(1000)
    hits.inc(750)
    page = generate_latest(registry).decode()
    assert PREFIX_QUERIES in page and prefix_counters(page) == (1000.0, 750.0)
    written = (f"# TYPE {PREFIX_QUERIES[:-6]} counter\n{PREFIX_QUERIES} 4096\n"
               f"# TYPE {PREFIX_HITS[:-6]} counter\n{PREFIX_HITS} 1024.0\n")
    assert prefix_counters(written) == (4096.0, 1024.0)
    assert prefix_counters("kvq_sequences_running 3\n") is None  # a server without the counters
    assert prefix_counters(f"{PREFIX_QUERIES} 10\n") is None  # one of the two
    assert prefix_counters("not { a page") is None
    assert counter_change((1000.0, 750.0), (3000.0, 2250.0)) == (2000.0, 1500.0)
    assert counter_change(None, (3000.0, 2250.0)) == (None, None)
    assert PrefixReuse(100, 80, ReuseSource.METRICS, 2000.0, 1500.0).hit_rate == 0.75
    unknown = PrefixReuse(100, 80, ReuseSource.METRICS, *counter_change(None, None))
    assert unknown.hit_rate is None and unknown.of_allowed is None and unknown.allowed == 0.8


def test_llama_timings_are_summed_over_the_answers_that_have_them():
    # llama-server's timings: cache_n tokens from the cache, prompt_n computed; looked up = both, reused = cache_n
    assert timings_totals([(100, 20), (None, None), (0, 50), (7, None)]) == (170, 100)
    assert timings_totals([(None, None)]) == (None, None) and timings_totals([]) == (None, None)
    reuse = PrefixReuse(170, 136, ReuseSource.TIMINGS, *timings_totals([(100, 20), (0, 50)]))
    assert reuse.hit_rate == pytest.approx(100 / 170) and reuse.of_allowed == pytest.approx((100 / 170) / 0.8)


def test_each_server_declares_how_its_reuse_is_read_and_switched_off():
    kvq, og = kvq_spec("/exports/x"), og_spec("/builds/og")
    llama = llama_spec("/opt/llama-server", "/m/model.gguf", slots=16, cache_prompt=True, slot_context=1280)
    assert (kvq.reuse, llama.reuse, og.reuse) == (ReuseSource.METRICS, ReuseSource.TIMINGS, ReuseSource.NONE)
    assert kvq.uncached_body == llama.uncached_body == {"cache_prompt": False} and og.uncached_body == {}
    line = " ".join(llama.command(8123))
    assert " -np 16 -c 20480 " in f" {line} " and "--no-cache-prompt" not in line and llama.context_tokens == 1280
    with pytest.raises(KVQError, match=r"invalid slot_context=0: allowed"):
        llama_spec("/opt/llama-server", "/m/model.gguf", slots=1, slot_context=0)


# -- the load, against apps written here ----------------------------------------------------------------------------
def _event(data: dict) -> str:
    return f"data: {json.dumps({'id': 'x', 'created': 0, 'model': 'm', **data})}\n\n"


def chat_app(seen: list[dict]):
    """Streams ``"r<turn> <first word of the conversation's first user turn>"`` after a short wait.

    Records each request (its messages, whether it asked for no cache, when it arrived and when it was answered);
    its last event carries llama-server's ``timings`` (``cache_n`` = the messages it had seen before, for the sums).
    """
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        record = {"messages": body["messages"], "uncached": body.get("cache_prompt") is False,
                  "arrived": time.monotonic(), "max_tokens": body["max_tokens"]}
        seen.append(record)
        await asyncio.sleep(0.02)
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        text = f"r{len(users)} {users[0].split()[0]}"
        record["answered"] = time.monotonic()
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
        events = [_event({"object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                       "finish_reason": None}]}),
                  _event({"object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
                  _event({"object": "chat.completion.chunk", "choices": [], "usage": usage,
                          "timings": {"cache_n": 0 if record["uncached"] else 2 * len(users) - 2, "prompt_n": 3}}),
                  "data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    return app


def test_chat_turns_go_out_in_order_with_the_replies_returned_and_then_alone_without_cache():
    conversations = tuple(tuple(words(4, start=10 * c + t) for t in range(3)) for c in range(3))
    workload = ChatWorkload(chat_tokenizer(), ChatSizes(3, 3, 4, 4), words(4, start=99), conversations)
    seen: list[dict] = []
    config = LoadConfig(clients=(2,), max_tokens=48, request_timeout=TIMEOUT)
    with serving(chat_app(seen)) as url:
        endpoint = Endpoint(url, "m", reuse=ReuseSource.TIMINGS, uncached_body={"cache_prompt": False})
        result = measure_workload(endpoint, workload, config, name="fake")
    loaded, solo = seen[:9], seen[9:]
    assert not any(r["uncached"] for r in loaded) and len(solo) == 9 and all(r["uncached"] for r in solo)
    assert {r["max_tokens"] for r in seen} == {48}
    by_conversation: dict[str, list[dict]] = {}
    for record in loaded:
        by_conversation.setdefault(record["messages"][1]["content"], []).append(record)
    assert sorted(by_conversation) == sorted(turns[0] for turns in conversations)
    for first, records in by_conversation.items():
        assert [len(r["messages"]) for r in records] == [2, 4, 6]  # turn k+1 after turn k
        for k, record in enumerate(records[1:], start=1):
            assert record["arrived"] >= records[k - 1]["answered"]
            replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
            assert replies == [f"r{j + 1} {first.split()[0]}" for j in range(k)]  # the replies the server gave
    # two clients, three conversations: the third starts when one of the first two has ended
    starts = sorted(records[0]["arrived"] for records in by_conversation.values())
    ends = sorted(records[-1]["answered"] for records in by_conversation.values())
    assert starts[2] >= ends[0]
    def sent(records: list[dict]) -> list[str]:
        return sorted(json.dumps(r["messages"]) for r in records)

    assert sent(solo) == sent(loaded)  # each request as sent, alone
    (point,) = result.points
    assert result.solo_answers == 9 and point.requests == 9 and point.errors == 0
    assert point.compared == 9 and point.differ == 0 and point.completion_tokens == 18
    assert point.reuse.looked_up == 3 * (3 + 5 + 7) and point.reuse.reused == 3 * (0 + 2 + 4)
    assert 0 < point.reuse.allowed < 1 and point.reuse.of_allowed == pytest.approx(point.reuse.hit_rate
                                                                                  / point.reuse.allowed)


def completion_app(seen: list[dict], counters: bool):
    """Streams ``"ok"``, or ``"cold"`` when asked for no cache; with ``counters``, kvq's counters on ``/metrics``.

    Every cached request raises the counters by 10 tokens looked up and 6 reused.
    """
    app, totals = FastAPI(), {"queries": 0, "hits": 0}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        cold = body.get("cache_prompt") is False
        seen.append({"prompt": body["prompt"], "uncached": cold})
        if not cold:
            totals["queries"] += 10
            totals["hits"] += 6
        events = [_event({"object": "text_completion",
                          "choices": [{"index": 0, "text": "cold" if cold else "ok", "finish_reason": "length"}]}),
                  _event({"object": "text_completion", "choices": [],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}),
                  "data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        page = "kvq_sequences_running 0\n"
        if counters:
            page += f"{PREFIX_QUERIES} {totals['queries']}\n{PREFIX_HITS} {totals['hits']}\n"
        return PlainTextResponse(page)

    return app


@pytest.mark.parametrize("counters", [True, False])
def test_shared_prefix_load_reads_kvq_counters_around_the_load_only(counters, tmp_path):
    prefixes = (words(30, start=1), words(30, start=2))
    questions = tuple(tuple(words(5, start=50 + 7 * g + q) for q in range(3)) for g in range(2))
    order = ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2))
    workload = SharedPrefixWorkload(tiny_tokenizer(), SharedPrefixSizes(2, 3, 30, 5), prefixes, questions, order)
    seen: list[dict] = []
    with serving(completion_app(seen, counters)) as url:
        endpoint = Endpoint(url, "m", metrics_url=f"{url}/metrics", reuse=ReuseSource.METRICS,
                            uncached_body={"cache_prompt": False})
        result = measure_workload(endpoint, workload, LoadConfig(clients=(2,), request_timeout=TIMEOUT))
    assert [r["prompt"] for r in seen[:6]] == [workload.prompt(j) for j in range(6)]  # the order, interleaved
    assert [r["uncached"] for r in seen] == [False] * 6 + [True] * 6
    (point,) = result.points
    assert point.compared == 6 and point.differ == 6  # "cold" alone, "ok" under load: every answer counted
    assert point.reuse.prompt_tokens == 6 * 35 and point.reuse.allowed_tokens == 4 * 30
    if counters:  # the solo answers come after the second read: 6 requests x (10, 6)
        assert (point.reuse.looked_up, point.reuse.reused, point.reuse.hit_rate) == (60, 36, 0.6)
    else:
        assert point.reuse.hit_rate is None and point.reuse.looked_up is None
    table = markdown_table([result])
    assert "| prefix hit | reuse allowed | hit / allowed |" in table
    assert table.splitlines()[2].endswith("| 0.600 | 0.571 | 1.050 |" if counters else "| - | 0.571 | - |")
    assert write_bars([result], tmp_path / "bars.png", "tiny").read_bytes()[:4] == b"\x89PNG"


def test_a_prefix_workload_runs_at_one_client_count_without_the_hostile_client():
    workload = SharedPrefixWorkload(None, SharedPrefixSizes(1, 1, 1, 1), ("p",), (("q",),), ((0, 0),))
    for config, message in ((LoadConfig(clients=(1, 4)), "one client count"),
                            (LoadConfig(clients=(4,), hostile=True), "hostile")):
        with pytest.raises(KVQError, match=message):
            measure_workload(Endpoint("http://127.0.0.1:9", "m"), workload, config)


# -- the command line ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serve_bench():
    """``tools/serve_bench.py`` as a module."""
    spec = importlib.util.spec_from_file_location("serve_bench", TOOLS / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_line_reads_the_workload_options(serve_bench):
    args = serve_bench.parse_args(["--workload", "shared-prefix", "--groups", "4", "--prefix-tokens", "512"])
    assert args.workload == "shared-prefix" and args.clients == (16,) and args.max_tokens == 32
    assert (args.groups, args.questions, args.prefix_tokens, args.question_tokens) == (4, 16, 512, 64)
    args = serve_bench.parse_args(["--workload", "chat", "--clients", "8", "--turns", "3"])
    assert args.clients == (8,) and args.max_tokens == 48 and (args.conversations, args.turns) == (32, 3)
    assert (args.system_tokens, args.user_tokens) == (300, 60)
    old = serve_bench.parse_args(["--distinct"])
    assert old.workload == "distinct" and old.distinct and old.clients == (1, 4, 8, 16, 32, 64)
    assert serve_bench.parse_args([]).workload == "repeated" and not serve_bench.parse_args([]).distinct
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--distinct", "--workload", "chat"])
    assert serve_bench.slot_context(SharedPrefixWorkload(None), 32) == 1280  # 1024 + 64 + 32 and a margin
    assert serve_bench.slot_context(["a prompt"], 32) == 1024


def test_one_kvq_server_gets_its_own_extra_arguments(serve_bench):
    args = serve_bench.parse_args(["--servers", "kvq", "--kvq", "warm=/e", "--kvq", "cold=/e", "--kvq-args",
                                   "--max-seqs 16", "--kvq-extra", "cold=--no-prefix-cache"])
    warm, cold = serve_bench.server_specs(args)
    assert warm.command(1)[-2:] == ["--max-seqs", "16"]
    assert cold.command(1)[-3:] == ["--max-seqs", "16", "--no-prefix-cache"]
    args = serve_bench.parse_args(["--servers", "kvq", "--kvq", "/e", "--kvq-extra", "other=--no-prefix-cache"])
    with pytest.raises(KVQError, match=r"--kvq-extra 'other=--no-prefix-cache': allowed: .*\(kvq\)"):
        serve_bench.server_specs(args)
