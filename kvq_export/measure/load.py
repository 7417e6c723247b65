"""Closed-loop load on any OpenAI-compatible endpoint, driven by the official ``openai`` client (``AsyncOpenAI``).

For each client count, that many clients each send one prompt after another (a new one as soon as the last one
ends), streaming, greedy (temperature 0), for ``duration`` seconds or until ``max_requests`` were sent. Each
request records its time to first token and its latency; the point reports generated tokens/s (completion tokens
from each reply's ``usage``, over the point's wall time), TTFT and latency p50/p99, requests done, errors, and how
many answers differ from the same prompt's *solo* answer: each prompt served once with no other load, before the
loaded points. Greedy decoding gives equal text unless batching changes the arithmetic. With ``distinct``, every
loaded request sends a prompt never sent before (no server can reuse a cached prefix), and the solo answers of the
prompts used come after the load.

:func:`complete` sends a text prompt to ``/v1/completions`` and chat messages to ``/v1/chat/completions``; the
prefix-reuse workloads (:mod:`~kvq_export.measure.prefix_load`) drive it with their own loop.

Beside the clients, optionally: a hostile client (:mod:`~kvq_export.measure.hostile`), the server's resident
memory and a gauge from its metrics page (:mod:`~kvq_export.measure.watch`). Every request has a timeout and the
whole run a bound (:meth:`LoadConfig.run_bound`); a run cut by its bound keeps the points it finished.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvq_export.errors import DependencyError, KVQError
from kvq_export.measure.cache_use import CacheUse
from kvq_export.measure.hostile import HOSTILE_TIMEOUT, HostileResult, hostile_cases, hostile_loop
from kvq_export.measure.reuse import PrefixReuse, ReuseSource
from kvq_export.measure.watch import GaugeWatch, RssSummary, RssWatch

logger = logging.getLogger(__name__)

DEFAULT_CLIENTS = (1, 4, 8, 16, 32, 64)
#: the gauge of running sequences kvq serve exports
DEFAULT_GAUGE = "kvq_sequences_running"
#: distinct error messages kept per point
ERROR_SAMPLES = 5


@dataclass(frozen=True)
class Endpoint:
    """A server to load: base URL (with or without ``/v1``), the model name clients send, and what else is known.

    ``pid``: the server's process (its RSS is sampled); ``metrics_url``: a Prometheus text page scraped for
    ``gauge``; ``reuse``: where its prefix reuse is read from; ``uncached_body``: body fields that serve a request
    without any cached prefix (sent with the solo answers of the prefix-reuse workloads); ``health_url``: its health
    page (kvq serve's gives its cache budget); ``export_dir``: the kvq export it serves (its memory model).
    """

    base_url: str
    model: str
    api_key: str | None = None
    pid: int | None = None
    metrics_url: str | None = None
    gauge: str = DEFAULT_GAUGE
    reuse: ReuseSource = ReuseSource.NONE
    uncached_body: dict[str, Any] = field(default_factory=dict)
    health_url: str | None = None
    export_dir: str | None = None

    @property
    def v1(self) -> str:
        """The OpenAI base URL (ending in ``/v1``)."""
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"


@dataclass(frozen=True)
class LoadConfig:
    """What load to apply: client counts, seconds (and at most how many requests) per count, tokens per answer.

    ``context_tokens``: the server's context, which the hostile client's long prompt exceeds.
    """

    clients: tuple[int, ...] = DEFAULT_CLIENTS
    duration: float = 60.0
    max_requests: int | None = None
    max_tokens: int = 32
    request_timeout: float = 300.0
    hostile: bool = False
    context_tokens: int = 8192
    distinct: bool = False  # every loaded request a prompt never sent before; solo answers come after the load
    solo_every: int = 1  # prefix-reuse workloads: every n-th loaded request is sent again alone (1: every one)

    def __post_init__(self) -> None:
        object.__setattr__(self, "clients", tuple(self.clients))
        if not self.clients or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.clients):
            raise KVQError(f"invalid clients={self.clients!r}: allowed: one or more integers >= 1")
        for name in ("duration", "request_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise KVQError(f"invalid {name}={value!r}: allowed: a number of seconds > 0")
        for name, least in (("max_tokens", 1), ("context_tokens", 1), ("max_requests", 1), ("solo_every", 1)):
            value = getattr(self, name)
            if value is None and name == "max_requests":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise KVQError(f"invalid {name}={value!r}: allowed: an integer >= {least}")

    def prompts_needed(self, tokens_per_s: float) -> int:
        """Prompts a distinct-prompt run may use if every count reached ``tokens_per_s`` (at most ``max_requests``)."""
        per_point = self.max_requests or math.ceil(self.duration * tokens_per_s / self.max_tokens) + max(self.clients)
        return per_point * len(self.clients)

    def run_bound(self, prompts: int) -> float:
        """Seconds the whole run may take: every solo answer and every point at their longest, plus a minute."""
        hostile = HOSTILE_TIMEOUT if self.hostile else 0.0
        point = self.duration + self.request_timeout + hostile + 5.0
        return prompts * self.request_timeout + len(self.clients) * point + 60.0


@dataclass(frozen=True)
class Answer:
    """One request: its text, seconds to the first text and to the end, completion tokens (from usage), error."""

    text: str = ""
    ttft: float | None = None
    latency: float | None = None
    completion_tokens: int | None = None
    error: str | None = None
    resent: bool = False  # sent a second time after the connection failed before any answer
    cache_n: int | None = None  # llama-server's timings: prompt tokens taken from its cache
    prompt_n: int | None = None  # and prompt tokens it computed


@dataclass
class PointResult:
    """One client count's figures."""

    clients: int
    wall_s: float
    requests: int
    errors: int
    completion_tokens: int
    compared: int  # answers whose prompt has a solo answer
    differ: int  # of those, answers that differ from it
    missing_usage: int  # answers that came without a usage block (their tokens are not counted)
    resent: int = 0  # requests sent a second time after a connection failed before any answer (see open_stream)
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    latency_p50: float | None = None
    latency_p99: float | None = None
    error_samples: dict[str, int] = field(default_factory=dict)
    hostile: HostileResult | None = None
    gauge_max: float | None = None
    out_of_prompts: bool = False  # a distinct-prompt point that used up its fresh prompts before its duration
    reuse: PrefixReuse | None = None  # the prefix-reuse workloads: reuse allowed and reused
    cache_use: CacheUse | None = None  # the mixed workload on a server with a metrics page: cache occupancy

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        nested = ("hostile", "reuse", "cache_use")
        data = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in nested}
        data["tokens_per_s"] = self.tokens_per_s
        data.update({name: None if getattr(self, name) is None else getattr(self, name).to_dict() for name in nested})
        return data


@dataclass
class LoadResult:
    """A whole run on one endpoint: the solo answers' count and errors, each point, the server's RSS."""

    name: str
    model: str
    solo_answers: int = 0
    solo_errors: int = 0
    solo_error_samples: dict[str, int] = field(default_factory=dict)
    solo_resent: int = 0
    points: list[PointResult] = field(default_factory=list)
    rss: RssSummary | None = None
    incomplete: str | None = None  # why the run stopped before its last point
    load_average: tuple[float, float] | None = None  # the machine's 1-minute load average at the start and the end

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "model": self.model, "solo_answers": self.solo_answers,
                "solo_errors": self.solo_errors, "solo_error_samples": self.solo_error_samples,
                "solo_resent": self.solo_resent,
                "points": [p.to_dict() for p in self.points],
                "rss": None if self.rss is None else self.rss.to_dict(), "incomplete": self.incomplete,
                "load_average": self.load_average}


def percentiles(values: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99) of ``values`` (linear interpolation), (None, None) for none."""
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99])
    return float(p50), float(p99)


def _openai():
    try:
        import openai
    except ImportError:
        raise DependencyError("the load driver needs the openai client: pip install openai") from None
    return openai


def open_client(endpoint: Endpoint, config: LoadConfig):
    """An ``AsyncOpenAI`` client for ``endpoint``: no retries, ``request_timeout`` per request."""
    openai = _openai()
    return openai.AsyncOpenAI(base_url=endpoint.v1, api_key=endpoint.api_key or "none", max_retries=0,
                              timeout=config.request_timeout)


async def open_stream(client, **request: Any) -> tuple[Any, bool]:
    """``client.completions.create(**request)`` (chat's, with ``messages``), sent again if the connection failed.

    Sent once more only if the connection failed before any answer. As every OpenAI client does by default: a
    kept-alive connection the server closed just as the request went out ("Server disconnected without sending a
    response") is a race of HTTP, not a refusal. Returns (the stream, whether it was sent again); a second failure,
    a timeout or an HTTP error is raised.
    """
    openai = _openai()
    create = client.chat.completions.create if "messages" in request else client.completions.create
    try:
        return await create(**request), False
    except openai.APITimeoutError:
        raise
    except openai.APIConnectionError as err:
        logger.debug("sent again after a connection error: %s (%s)", err, err.__cause__)
    return await create(**request), True


def _chunk_text(chunk) -> str | None:
    """A streamed event's text: a completion's ``text`` or a chat delta's ``content``."""
    if not chunk.choices:
        return None
    choice = chunk.choices[0]
    delta = getattr(choice, "delta", None)
    return getattr(choice, "text", None) if delta is None else delta.content


def _timings(chunk) -> tuple[int | None, int | None] | None:
    """llama-server's ``(cache_n, prompt_n)`` from an event's ``timings`` block (an extra field), None without."""
    timings = (chunk.model_extra or {}).get("timings")
    if not isinstance(timings, dict):
        return None
    return timings.get("cache_n"), timings.get("prompt_n")


async def complete(client, model: str, prompt: str | Sequence[dict[str, str]], max_tokens: int, timeout: float, *,
                   extra_body: dict[str, Any] | None = None) -> Answer:
    """One streamed greedy answer to ``prompt`` (chat ``messages`` when not a string), bounded by ``timeout`` s.

    ``extra_body``: fields beyond OpenAI's (``cache_prompt``). llama-server's ``timings`` are kept when sent.
    """
    start = time.perf_counter()
    first, parts, tokens, timings = None, [], None, None
    body = {"prompt": prompt} if isinstance(prompt, str) else {"messages": list(prompt)}
    try:
        async with asyncio.timeout(timeout):
            stream, resent = await open_stream(client, model=model, **body, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               **({"extra_body": extra_body} if extra_body else {}))
            async for chunk in stream:
                text = _chunk_text(chunk)
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                timings = _timings(chunk) or timings
    except TimeoutError:
        return Answer(error=f"no complete answer in {timeout:g} s")
    except Exception as err:  # noqa: BLE001 - any failure of the server or the connection is counted, not raised
        cause = f" ({type(err.__cause__).__name__}: {err.__cause__})" if err.__cause__ is not None else ""
        return Answer(error=f"{type(err).__name__}: {err}{cause}"[:240])
    end = time.perf_counter()
    cache_n, prompt_n = timings or (None, None)
    return Answer("".join(parts), (first or end) - start, end - start, tokens, resent=resent, cache_n=cache_n,
                  prompt_n=prompt_n)


async def solo_answers(client, endpoint: Endpoint, prompts: list[str], config: LoadConfig) -> list[Answer]:
    """Each prompt's answer with no other request in flight, one after another."""
    return [await complete(client, endpoint.model, prompt, config.max_tokens, config.request_timeout)
            for prompt in prompts]


def summarize_point(clients: int, wall: float, answers: list[tuple[int, Answer]], solo: list[Answer]) -> PointResult:
    """A point's figures from its ``(prompt index, answer)`` pairs and the solo answers."""
    good = [(i, a) for i, a in answers if a.error is None]
    compared = [(i, a) for i, a in good if solo[i].error is None]
    errors = Counter(a.error for _, a in answers if a.error is not None)
    ttft = percentiles([a.ttft for _, a in good])
    latency = percentiles([a.latency for _, a in good])
    return PointResult(clients=clients, wall_s=wall, requests=len(good), errors=sum(errors.values()),
                       completion_tokens=sum(a.completion_tokens or 0 for _, a in good), compared=len(compared),
                       differ=sum(a.text != solo[i].text for i, a in compared),
                       missing_usage=sum(a.completion_tokens is None for _, a in good),
                       resent=sum(a.resent for _, a in answers),
                       ttft_p50=ttft[0], ttft_p99=ttft[1], latency_p50=latency[0], latency_p99=latency[1],
                       error_samples=dict(errors.most_common(ERROR_SAMPLES)))


@dataclass
class _Loaded:
    """A point's raw outcome, before it is compared with solo answers."""

    clients: int
    wall: float
    answers: list[tuple[int, Answer]]
    hostile: HostileResult | None
    gauge_max: float | None
    out_of_prompts: bool = False


class _Fresh:
    """Prompt indices handed out once each, across every point of a distinct-prompt run."""

    def __init__(self, count: int) -> None:
        self.next, self.count = 0, count

    def take(self) -> int | None:
        if self.next >= self.count:
            return None
        self.next += 1
        return self.next - 1


async def run_point(client, endpoint: Endpoint, prompts: list[str], clients: int, config: LoadConfig,
                    fresh: _Fresh | None = None) -> _Loaded:
    """``clients`` closed-loop clients for ``config.duration`` seconds (at most ``config.max_requests`` requests).

    Client ``c`` sends prompts ``c, c + clients, c + 2 * clients, ...`` (modulo their count): clients in flight
    together send different prompts while there are enough. With ``fresh`` every request takes the next prompt
    never sent, and the point ends early when none is left.
    """
    deadline = time.monotonic() + config.duration
    answers: list[tuple[int, Answer]] = []
    issued, out_of_prompts = 0, False

    async def one_client(c: int) -> None:
        nonlocal issued, out_of_prompts
        k = 0
        while time.monotonic() < deadline and (config.max_requests is None or issued < config.max_requests):
            index = (c + k * clients) % len(prompts) if fresh is None else fresh.take()
            if index is None:
                out_of_prompts = True
                return
            k, issued = k + 1, issued + 1
            answers.append((index, await complete(client, endpoint.model, prompts[index], config.max_tokens,
                                                  config.request_timeout)))

    hostile, stop = (HostileResult() if config.hostile else None), asyncio.Event()
    gauge = GaugeWatch(endpoint.metrics_url, endpoint.gauge) if endpoint.metrics_url else None
    cases = hostile_cases(endpoint.model, prompts[0], config.context_tokens, api_key=endpoint.api_key)
    async with gauge or _nothing():
        rogue = asyncio.create_task(hostile_loop(endpoint.v1, cases, endpoint.api_key, stop, hostile)) \
            if hostile is not None else None
        start = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.perf_counter() - start
        stop.set()
        if rogue is not None:
            await rogue
    return _Loaded(clients, wall, answers, hostile, None if gauge is None else gauge.max, out_of_prompts)


def _summarized(loaded: _Loaded, solo: list[Answer]) -> PointResult:
    point = summarize_point(loaded.clients, loaded.wall, loaded.answers, solo)
    point.hostile, point.gauge_max, point.out_of_prompts = loaded.hostile, loaded.gauge_max, loaded.out_of_prompts
    logger.info("%d client(s): %d requests, %d errors, %.1f tok/s, %d of %d answers differ from solo",
                loaded.clients, point.requests, point.errors, point.tokens_per_s, point.differ, point.compared)
    if loaded.out_of_prompts:
        logger.warning("%d client(s): the point ran out of fresh prompts before its duration", loaded.clients)
    return point


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def record_solo(result: LoadResult, solo: list[Answer]) -> list[Answer]:
    """Count ``solo``'s answers, errors and resends into ``result``; return ``solo``."""
    result.solo_answers = sum(a.error is None for a in solo)
    result.solo_errors = len(solo) - result.solo_answers
    result.solo_error_samples = dict(Counter(a.error for a in solo if a.error is not None).most_common(ERROR_SAMPLES))
    result.solo_resent = sum(a.resent for a in solo)
    return solo


async def run_load(endpoint: Endpoint, prompts: list[str], config: LoadConfig, name: str = "") -> LoadResult:
    """Solo answers, then every client count in ``config.clients``, within :meth:`LoadConfig.run_bound` seconds."""
    if not prompts:
        raise KVQError("the load needs at least one prompt")
    result = LoadResult(name=name or endpoint.model, model=endpoint.model)
    rss = RssWatch(endpoint.pid) if endpoint.pid is not None else None
    client = open_client(endpoint, config)
    bound = config.run_bound(len(prompts))
    start_load = os.getloadavg()[0]
    try:
        async with rss or _nothing(), asyncio.timeout(bound):
            if config.distinct:  # the load sends every prompt first; their solo answers come after it
                fresh = _Fresh(len(prompts))
                loaded = [await run_point(client, endpoint, prompts, n, config, fresh) for n in config.clients]
                solo = record_solo(result, await solo_answers(client, endpoint, prompts[:fresh.next], config))
                result.points.extend(_summarized(point, solo) for point in loaded)
            else:
                solo = record_solo(result, await solo_answers(client, endpoint, prompts, config))
                for clients in config.clients:
                    result.points.append(_summarized(await run_point(client, endpoint, prompts, clients, config),
                                                     solo))
    except TimeoutError:
        result.incomplete = f"the run passed its bound of {bound:.0f} s"
        logger.warning("%s: %s after %d point(s)", result.name, result.incomplete, len(result.points))
    finally:
        await client.close()
    result.rss = None if rss is None else rss.summary()
    result.load_average = (start_load, os.getloadavg()[0])
    return result


def measure_endpoint(endpoint: Endpoint, prompts: list[str], config: LoadConfig, name: str = "") -> LoadResult:
    """:func:`run_load` in its own event loop (for callers that are not async)."""
    return asyncio.run(run_load(endpoint, prompts, config, name))
