"""The serving benchmark's closed-loop workloads: shared prefix, chat and mixed (:mod:`kvq_export.measure.workloads`).

Their generation (deterministic, the asked shape; mixed: the length distribution, no shared 16-token prefix), what a
perfect prefix cache could reuse, how each server's reuse is read (kvq's counters, llama-server's timings), the
cache occupancy read from several gauges at once and the memory model's share of the budget
(:mod:`kvq_export.measure.cache_use`), the load against small FastAPI apps written here (the chat's turn order and
history, the solo answers sent with ``cache_prompt: false``, each mixed request's own answer tokens), and
``tools/serve_bench.py``'s options.
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
from kvq_export.measure.cache_use import (
    BYTES_USED,
    PREEMPTIONS,
    RUNNING,
    TOKENS,
    WAITING,
    CacheModel,
    bytes_per_token,
    summarize_cache_use,
    token_bytes,
)
from kvq_export.measure.peers import kvq_spec, llama_spec, og_spec
from kvq_export.measure.prefix_load import measure_workload
from kvq_export.measure.prompts import corpus_windows
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
from kvq_export.measure.watch import MetricsWatch, gauge_max, metric_values
from kvq_export.measure.workloads import (
    SEPARATOR,
    ChatSizes,
    ChatWorkload,
    MixedSizes,
    MixedWorkload,
    SharedPrefixSizes,
    SharedPrefixWorkload,
    chat_messages,
    chat_workload,
    draw_lengths,
    mixed_workload,
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


def _shared_lead(prompts: list[list[int]]) -> int:
    """The longest prefix any two of ``prompts`` (token ids) share."""
    longest = 0
    for k, ids in enumerate(prompts):
        for other in prompts[:k]:
            n = next((j for j, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
            longest = max(longest, n)
    return longest


def test_mixed_lengths_are_lognormal_within_their_range_and_the_same_for_a_seed():
    sizes = MixedSizes(requests=64)
    prompts, answers = draw_lengths(sizes)
    assert (prompts, answers) == draw_lengths(MixedSizes(requests=64))  # deterministic
    assert draw_lengths(MixedSizes(requests=64, seed=1)) != (prompts, answers)
    assert len(prompts) == len(answers) == 64
    assert all(100 <= n <= 4000 for n in prompts) and all(32 <= n <= 256 for n in answers)
    for seed in range(3):  # by strata: the median is near 600 at any seed, the tail reaches past 2500
        drawn, _ = draw_lengths(MixedSizes(requests=64, seed=seed))
        assert 570 <= sorted(drawn)[32] <= 630 and max(drawn) > 2500 and min(drawn) < 160
    many, spread = draw_lengths(MixedSizes(requests=2000))
    above = sum(n > 600 for n in many) / len(many)
    assert 0.47 <= above <= 0.53 and max(many) > 3800 and min(many) < 110  # a lognormal's median, its range
    assert min(spread) == 32 and max(spread) == 256 and 134 <= sum(spread) / len(spread) <= 154  # uniform
    # one range changes, the other's draws do not
    assert draw_lengths(MixedSizes(requests=64, answer_max=64))[0] == prompts
    with pytest.raises(KVQError, match=r"min <= median <= max"):
        MixedSizes(prompt_median=50)
    with pytest.raises(KVQError, match=r"invalid answer lengths min=300 > max=256"):
        MixedSizes(answer_min=300)


def test_mixed_prompts_start_at_their_own_offsets_and_share_no_16_token_prefix(tmp_path):
    from kvq_export.corpus import load_corpus

    tokenizer = byte_tokenizer()  # one token per byte
    workload = mixed_workload(tokenizer, MixedSizes(requests=24))
    assert workload == mixed_workload(tokenizer, MixedSizes(requests=24)) and workload.jobs == workload.requests == 24
    lengths, answers = draw_lengths(workload.sizes)
    ids = [workload.prompt_ids(workload.request(job, [])) for job in range(24)]
    assert all(abs(len(i) - n) <= 4 for i, n in zip(ids, lengths))  # stripped
    assert _shared_lead(ids) < 15 and allowed_reuse((i, []) for i in ids)[1] < 15 * 24
    assert [workload.answer_tokens(job, 32) for job in range(24)] == list(answers)
    assert workload.request(3, ["its answer"]) is None and workload.context_needed(256) == 4000 + 8 + 256
    # a short corpus, and one that repeats itself: windows overlap, yet none starts like another
    text = load_corpus("britannica")[:6000]
    (tmp_path / "short.txt").write_text(text)
    (tmp_path / "periodic.txt").write_text(text[:700] * 12)
    for name in ("short.txt", "periodic.txt"):
        passages = corpus_windows(tokenizer, [900, 2500, 4000, 300, 1500] * 4, corpus=str(tmp_path / name),
                                  offset=100)
        assert len(passages) == 20 and sum(map(len, passages)) > 5 * len(text)
        assert _shared_lead([tokenizer.encode(p, add_special_tokens=False) for p in passages]) < 15
    with pytest.raises(KVQError, match="does not fit"):
        corpus_windows(tokenizer, [7000], corpus=str(tmp_path / "short.txt"))
    with pytest.raises(KVQError, match="one answer length per prompt"):
        MixedWorkload(tokenizer, MixedSizes(), ("a", "b"), (32,))


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


# -- cache occupancy ------------------------------------------------------------------------------------------------
def test_several_metrics_are_read_from_one_prometheus_page():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    for name, value in ((RUNNING, 5), (WAITING, 2), (TOKENS, 3100), (BYTES_USED, 36_000_000)):
        Gauge(name, "a gauge", registry=registry).set(value)
    Counter(PREEMPTIONS[: -len("_total")], "a counter", registry=registry).inc(7)
    Gauge("llamacpp:requests_processing", "per slot", ["slot"], registry=registry).labels("a").set(2)
    page = generate_latest(registry).decode()
    names = [RUNNING, WAITING, TOKENS, BYTES_USED, PREEMPTIONS, "llamacpp:requests_processing", "kvq_absent"]
    assert metric_values(page, names) == {RUNNING: 5.0, WAITING: 2.0, TOKENS: 3100.0, BYTES_USED: 36e6,
                                          PREEMPTIONS: 7.0, "llamacpp:requests_processing": 2.0}  # absent: left out
    labelled = 'llamacpp:requests_processing{slot="a"} 2\nllamacpp:requests_processing{slot="b"} 5.0\n'
    assert metric_values(labelled, ["llamacpp:requests_processing", RUNNING]) == {"llamacpp:requests_processing": 5.0}
    assert gauge_max(page, TOKENS) == 3100.0 and gauge_max(page, "kvq_absent") is None  # the one-gauge read
    assert metric_values("not { a page", [RUNNING]) is None
    watch = MetricsWatch("http://127.0.0.1:9/metrics", [RUNNING, TOKENS, RUNNING])
    assert watch.names == (RUNNING, TOKENS)
    watch.samples += [(0.0, {RUNNING: 2.0}), (1.0, {RUNNING: 4.0, TOKENS: 10.0})]
    assert watch.largest(RUNNING) == 4.0 and watch.largest(TOKENS) == 10.0 and watch.largest(WAITING) is None


def test_budget_use_is_held_tokens_by_the_memory_model_while_requests_wait():
    budget, per_token = 1_000_000, 100.0
    samples = [
        {RUNNING: 2, WAITING: 1, TOKENS: 3000, BYTES_USED: 400_000},  # waiting: the budget binds
        {RUNNING: 4, WAITING: 2, TOKENS: 8000, BYTES_USED: 900_000},
        {RUNNING: 1, WAITING: 0, TOKENS: 500, BYTES_USED: 60_000},  # nobody waits: not in the fair figure
        {RUNNING: 0, WAITING: 3, TOKENS: 0, BYTES_USED: 0},  # nothing runs yet
        {"llamacpp:requests_processing": 1},  # a scrape without kvq's gauges
    ]
    model = CacheModel.from_health({"status": "ok", "cache_budget_bytes": budget, "max_seqs": 4}, per_token)
    assert model == CacheModel(budget, per_token, 4)
    use = summarize_cache_use(samples, model, before={PREEMPTIONS: 3}, after={PREEMPTIONS: 5})

    def holds(s: dict) -> float:  # the memory model: sequences of the running average size the budget holds
        return budget / (s[TOKENS] / s[RUNNING] * per_token)

    assert use.utilization == pytest.approx((2 / holds(samples[0]) + 4 / holds(samples[1])) / 2) == 0.55
    assert use.utilization_running == pytest.approx((0.3 + 0.8 + 0.05) / 3)
    assert use.bytes_used_share == pytest.approx((0.4 + 0.9) / 2)
    assert (use.samples, use.waiting_samples, use.running_max, use.tokens_max) == (4, 2, 4, 8000)
    assert (use.max_seqs, use.at_max_seqs) == (4, 1)  # the second sample waited on the sequence count
    assert use.running_mean == pytest.approx(7 / 4) and use.tokens_mean == pytest.approx(11500 / 4)
    assert use.preemptions == 2 and use.to_dict()["utilization"] == use.utilization
    # a server without the gauges, the budget or the export: None, never 0
    llama = summarize_cache_use([{"llamacpp:requests_processing": 3}], CacheModel.from_health({"status": "ok"}),
                                before={}, after={})
    assert llama.samples == 0 and llama.running_mean is None and llama.utilization is None
    assert llama.preemptions is None and llama.tokens_max is None and llama.at_max_seqs is None
    no_budget = summarize_cache_use(samples, CacheModel(bytes_per_token=per_token))
    assert no_budget.utilization is None and no_budget.running_max == 4 and no_budget.preemptions is None
    assert summarize_cache_use(samples, CacheModel(budget_bytes=budget)).utilization is None  # no bytes per token
    assert CacheModel.from_health(None) == CacheModel.from_health({"cache_budget_bytes": True, "max_seqs": 0}) \
        == CacheModel()


def test_bytes_per_token_is_the_memory_models_growth_per_token(tmp_path):
    from kvq_export.model_facts import Geometry
    from kvq_export.presets import get_preset

    smollm2 = Geometry(num_layers=30, num_kv_heads=3, head_dim=64)
    assert token_bytes(get_preset("fp16"), smollm2) == 30 * 2 * 3 * 64 * 2  # keys and values, 2 bytes each
    assert token_bytes(get_preset("ort-int8"), smollm2) == 30 * 2 * 3 * 64  # 1 byte; static scales cancel out
    kivi = token_bytes(get_preset("kivi-4"), smollm2)  # its fp16 recent window is a fixed cost, not per token
    assert 30 * 2 * 3 * 64 / 2 < kivi < 30 * 2 * 3 * 64
    assert bytes_per_token(tmp_path) is None  # not an export: unknown, not 0


# -- the load, against apps written here ----------------------------------------------------------------------------
def _event(data: dict) -> str:
    return f"data: {json.dumps({'id': 'x', 'created': 0, 'model': 'm', **data})}\n\n"


def _completion_events(text: str) -> list[str]:
    """A streamed one-token completion of ``text``, its usage, and the end."""
    return [_event({"object": "text_completion",
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}),
            _event({"object": "text_completion", "choices": [],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}),
            "data: [DONE]\n\n"]


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
        return StreamingResponse(iter(_completion_events("cold" if cold else "ok")), media_type="text/event-stream")

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
    # taken in job order (the order, interleaved), though two clients' requests may reach the server either way round;
    # then alone, one after another, in the order sent
    expected = [workload.prompt(j) for j in range(6)]
    assert sorted(r["prompt"] for r in seen[:6]) == sorted(expected) and [r["prompt"] for r in seen[6:]] == expected
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


def mixed_app(seen: list[dict], kvq: bool):
    """Answers ``"ok"`` (``"cold"`` alone) after 0.3 s; ``/metrics`` with kvq's cache gauges when ``kvq``.

    Its gauges say 2 sequences run holding 3000 tokens while 1 waits; each loaded request counts a preemption.
    ``/health`` gives a budget of 10**6 bytes, 2 sequences at most and 300 positions when ``kvq``, llama-server's
    bare status when not.
    """
    app, preempted = FastAPI(), [0]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        cold = body.get("cache_prompt") is False
        seen.append({"prompt": body["prompt"], "uncached": cold, "max_tokens": body["max_tokens"]})
        preempted[0] += not cold
        await asyncio.sleep(0.3)
        return StreamingResponse(iter(_completion_events("cold" if cold else "ok")), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        if not kvq:
            return PlainTextResponse('llamacpp:requests_processing{slot="0"} 2\n')
        return PlainTextResponse(f"{RUNNING} 2\n{WAITING} 1\n{TOKENS} 3000\n{BYTES_USED} 400000\n"
                                 f"# TYPE kvq_preemptions counter\n{PREEMPTIONS} {preempted[0]}\n")

    @app.get("/health")
    async def health():
        limits = {"cache_budget_bytes": 10**6, "max_seqs": 2, "max_positions": 300}
        return {"status": "ok", **(limits if kvq else {})}

    return app


@pytest.mark.parametrize("kvq", [True, False])
def test_a_mixed_load_asks_each_requests_own_answer_tokens_and_reads_the_cache(kvq, monkeypatch, caplog):
    import kvq_export.measure.prefix_load as prefix_load

    monkeypatch.setattr(prefix_load, "bytes_per_token", lambda directory: 100.0)  # the export's memory model
    answers = (40, 33, 200, 77)
    workload = MixedWorkload(tiny_tokenizer(), MixedSizes(requests=4, prompt_median=30, prompt_min=10, prompt_max=60),
                             tuple(words(n, start=n) for n in (12, 30, 55, 21)), answers)
    seen: list[dict] = []
    gauge = RUNNING if kvq else "llamacpp:requests_processing"
    with serving(mixed_app(seen, kvq)) as url, caplog.at_level("WARNING", logger="kvq_export.measure.prefix_load"):
        endpoint = Endpoint(url, "m", metrics_url=f"{url}/metrics", gauge=gauge, reuse=ReuseSource.METRICS,
                            uncached_body={"cache_prompt": False}, health_url=f"{url}/health",
                            export_dir="/exports/x" if kvq else None)
        result = measure_workload(endpoint, workload, LoadConfig(clients=(2,), max_tokens=256,
                                                                 request_timeout=TIMEOUT))
    loaded, solo = seen[:4], seen[4:]
    asked = dict(zip(workload.prompts, answers))
    assert sorted(r["prompt"] for r in loaded) == sorted(asked) and [r["prompt"] for r in solo] == list(asked)
    assert all(r["max_tokens"] == asked[r["prompt"]] for r in seen)  # each request's own answer tokens
    assert [r["uncached"] for r in seen] == [False] * 4 + [True] * 4
    (point,) = result.points
    use = point.cache_use
    assert point.reuse.allowed_tokens == 0 and point.gauge_max == 2
    if kvq:
        assert use.samples >= 1 and use.waiting_samples == use.samples and use.running_max == 2
        assert (use.budget_bytes, use.bytes_per_token, use.preemptions) == (10**6, 100.0, 4)
        assert use.at_max_seqs == use.waiting_samples  # 2 run, the most it runs: the count keeps the waiting out
        assert use.utilization == pytest.approx(0.3) and use.bytes_used_share == pytest.approx(0.4)
        assert "serves 300 positions" in caplog.text  # fewer than 60 + 8 + 256 tokens: a warning
    else:  # llama-server: none of kvq's gauges, no budget: unknown, never 0
        assert use.samples == 0 and use.utilization is None and use.preemptions is None
        assert use.budget_bytes is None and use.bytes_per_token is None
    table = markdown_table([result])
    assert "| running mean | running max | tokens held mean | budget use | preempted |" in table
    row = table.splitlines()[2]
    assert row.endswith("| 2.0 | 2 | 3000 | 0.300 | 4 |" if kvq else "| - | - | - | - | - |")
    assert ("budget 0.9537 MiB, 100 bytes per token" in table and "with max_seqs=2 running" in table) if kvq \
        else ("has no kvq_sequences_running" in table)
    assert json.loads(json.dumps(result.to_dict()))["points"][0]["cache_use"]["utilization"] == use.utilization


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


def test_the_command_line_reads_the_mixed_workload(serve_bench):
    args = serve_bench.parse_args(["--workload", "mixed"])
    assert args.workload == "mixed" and args.clients == (16,) and args.max_requests == 64 and args.max_tokens == 256
    assert serve_bench.mixed_sizes(args) == MixedSizes()
    args = serve_bench.parse_args(["--workload", "mixed", "--clients", "8", "--max-requests", "32", "--median-tokens",
                                   "500", "--prompt-range", "50,2000", "--answer-range", "16,64", "--solo-every", "4"])
    assert serve_bench.mixed_sizes(args) == MixedSizes(32, 500, 50, 2000, 16, 64)
    assert args.clients == (8,) and args.max_tokens == 64 and args.solo_every == 4
    for wrong in (["--max-tokens", "32"], ["--prompt-range", "100"], ["--answer-range", "a,b"]):
        with pytest.raises(SystemExit):
            serve_bench.parse_args(["--workload", "mixed", *wrong])
    args = serve_bench.parse_args(["--workload", "mixed", "--max-requests", "8", "--median-tokens", "200",
                                   "--prompt-range", "100,400"])
    config = LoadConfig(clients=args.clients, max_requests=args.max_requests, max_tokens=args.max_tokens)
    work = serve_bench.load_input(args, config, byte_tokenizer())
    assert isinstance(work, MixedWorkload) and work.requests == 8 and work.sizes.prompt_max == 400
    assert serve_bench.workload_meta(args.workload, work)["requests"] == 8
    # llama-server's slots hold the longest prompt the sizes allow and the most answer tokens, rounded up
    assert serve_bench.slot_context(MixedWorkload(None), 256) == 4352
    assert kvq_spec("/exports/x").export_dir == "/exports/x" and og_spec("/builds/og").export_dir is None
