"""The workloads of :mod:`~kvq_export.measure.workloads` under closed-loop load on one endpoint.

``clients`` clients take the workload's jobs in order as they free up: a shared-prefix or mixed request, or a whole
chat conversation (turn k+1 goes out once turn k's reply is in, with that reply in its history; a turn that fails
ends its conversation); each request asks for the workload's answer tokens (:meth:`Workload.answer_tokens`). The
point ends when every job is done, or after ``max_requests`` requests. Then every request that was answered (every
``solo_every``-th) is sent again alone, in the order sent, with the endpoint's ``uncached_body`` (``cache_prompt:
false``: served with nothing cached), and the two greedy answers are compared.

Beside the usual figures (:func:`~kvq_export.measure.load.summarize_point`), the point reports prefix reuse
(:class:`~kvq_export.measure.reuse.PrefixReuse`): what the server says it reused during the load (its counters read
before and after it, or its per-answer timings) and what the workload allowed, from the requests in the order they
went out and the answers they got; and, for a workload that :attr:`~Workload.watches_cache` (mixed) on a server with a
metrics page, its cache occupancy (:class:`~kvq_export.measure.cache_use.CacheUse`: kvq's gauges sampled once a
second, its preemptions, the share of its budget the held tokens take by the memory model). One client count per
run: a second count would find the first one's prefixes in the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass

from kvq_export.errors import KVQError
from kvq_export.measure.cache_use import (
    PREEMPTIONS,
    WATCHED,
    CacheModel,
    CacheUse,
    bytes_per_token,
    read_health,
    summarize_cache_use,
)
from kvq_export.measure.load import (
    Answer,
    Endpoint,
    LoadConfig,
    LoadResult,
    PointResult,
    complete,
    open_client,
    record_solo,
    summarize_point,
)
from kvq_export.measure.reuse import (
    PrefixReuse,
    ReuseSource,
    allowed_reuse,
    counter_change,
    prefix_counters,
    timings_totals,
)
from kvq_export.measure.watch import MetricsWatch, RssWatch, read_metrics
from kvq_export.measure.workloads import Request, Workload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sent:
    """One request of the load, kept in the order it went out: its job, the request as sent, and its answer."""

    job: int
    request: Request
    answer: Answer


def check_config(workload: Workload, config: LoadConfig) -> None:
    """Refuse what a prefix-reuse workload cannot run: several client counts, a hostile client."""
    if len(config.clients) != 1:
        raise KVQError(f"the {workload.kind} workload runs at one client count (a second would find the first's "
                       f"prefixes cached); given clients={config.clients}")
    if config.hostile:
        raise KVQError(f"the hostile client runs with the repeated and distinct workloads, not {workload.kind}")


def run_bound(workload: Workload, config: LoadConfig) -> float:
    """Seconds the whole run may take: every request at its longest, under load and alone, plus a minute."""
    requests = min(workload.requests, config.max_requests or workload.requests)
    return 2 * requests * config.request_timeout + 60.0


async def run_jobs(client, endpoint: Endpoint, workload: Workload, clients: int,
                   config: LoadConfig) -> tuple[float, list[Sent]]:
    """Every job of ``workload`` through ``clients`` closed-loop clients; (wall seconds, requests in send order)."""
    jobs = iter(range(workload.jobs))  # shared: each client takes the next job when it is free
    sent: list[Sent | None] = []

    async def one_client() -> None:
        for job in jobs:
            replies: list[str] = []
            while (request := workload.request(job, replies)) is not None:
                if config.max_requests is not None and len(sent) >= config.max_requests:
                    return
                slot = len(sent)
                sent.append(None)
                answer = await complete(client, endpoint.model, request, workload.answer_tokens(job, config.max_tokens),
                                        config.request_timeout)
                sent[slot] = Sent(job, request, answer)
                if answer.error is not None:
                    break
                replies.append(answer.text)

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    return time.perf_counter() - start, [s for s in sent if s is not None]


async def solo_again(client, endpoint: Endpoint, workload: Workload, sent: list[Sent],
                     config: LoadConfig) -> list[Answer | None]:
    """Every ``config.solo_every``-th answered request alone, with ``endpoint.uncached_body``.

    None for the others, and where the loaded request failed.
    """
    body = endpoint.uncached_body or None
    return [None if s.answer.error is not None or i % config.solo_every else
            await complete(client, endpoint.model, s.request, workload.answer_tokens(s.job, config.max_tokens),
                           config.request_timeout, extra_body=body) for i, s in enumerate(sent)]


async def read_counters(endpoint: Endpoint) -> tuple[float, float] | None:
    """The endpoint's prefix-cache counters when it reports them on its metrics page; None otherwise."""
    if endpoint.reuse is not ReuseSource.METRICS or not endpoint.metrics_url:
        return None
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            reply = await client.get(endpoint.metrics_url)
    except httpx.HTTPError as err:
        logger.warning("metrics %s: %s", endpoint.metrics_url, err)
        return None
    counters = prefix_counters(reply.text) if reply.status_code == 200 else None
    if counters is None:
        logger.warning("%s has no prefix-cache counters: the hit rate is unknown", endpoint.metrics_url)
    return counters


def measured_reuse(endpoint: Endpoint, workload: Workload, sent: list[Sent], before, after) -> PrefixReuse:
    """What ``workload`` allowed over ``sent`` and what the endpoint says it reused."""
    total, allowed = allowed_reuse((workload.prompt_ids(s.request), workload.answer_ids(s.answer.text))
                                   for s in sent)
    looked_up, reused = None, None
    if endpoint.reuse is ReuseSource.METRICS:
        looked_up, reused = counter_change(before, after)
    elif endpoint.reuse is ReuseSource.TIMINGS:
        looked_up, reused = timings_totals((s.answer.cache_n, s.answer.prompt_n) for s in sent)
    return PrefixReuse(total, allowed, endpoint.reuse, looked_up, reused)


def summarize(clients: int, wall: float, sent: list[Sent], solo: list[Answer | None]) -> PointResult:
    """The point's figures; a request whose loaded answer failed has no solo answer to compare with."""
    unsent = Answer(error="not sent alone")
    return summarize_point(clients, wall, [(i, s.answer) for i, s in enumerate(sent)],
                           [unsent if a is None else a for a in solo])


async def cache_model(endpoint: Endpoint, workload: Workload, config: LoadConfig) -> CacheModel:
    """The server's cache budget and sequence limit from ``/health``, bytes per token from its export.

    Warns when ``/health`` gives fewer positions than the workload's longest request may need.
    """
    health = await read_health(endpoint.health_url) if endpoint.health_url else None
    positions, needed = (health or {}).get("max_positions"), workload.context_needed(config.max_tokens)
    if isinstance(positions, int) and positions < needed:
        logger.warning("%s serves %d positions; the %s workload's longest request may need %d (it would be refused)",
                       endpoint.model, positions, workload.kind, needed)
    per_token = bytes_per_token(endpoint.export_dir) if endpoint.export_dir else None
    return CacheModel.from_health(health, per_token)


async def _metrics(endpoint: Endpoint) -> dict[str, float] | None:
    return await read_metrics(endpoint.metrics_url, [PREEMPTIONS]) if endpoint.metrics_url else None


@dataclass(frozen=True)
class Loaded:
    """The load before the solo answers: wall seconds, the requests in send order, and what the server said."""

    wall: float
    sent: list[Sent]
    reuse: PrefixReuse
    gauge_max: float | None = None  # the endpoint's gauge, largest over the load
    cache_use: CacheUse | None = None  # None unless the workload watches the cache on a metrics page


async def load_point(client, endpoint: Endpoint, workload: Workload, config: LoadConfig) -> Loaded:
    """The load alone, with the endpoint's metrics sampled during it and its counters read before and after."""
    cache = workload.watches_cache and endpoint.metrics_url is not None
    model = await cache_model(endpoint, workload, config) if cache else CacheModel()
    names = (endpoint.gauge, *WATCHED) if cache else (endpoint.gauge,)
    watch = MetricsWatch(endpoint.metrics_url, names) if endpoint.metrics_url else None
    before, first = await read_counters(endpoint), await _metrics(endpoint) if cache else None
    async with watch or contextlib.nullcontext():
        wall, sent = await run_jobs(client, endpoint, workload, config.clients[0], config)
    after, last = await read_counters(endpoint), await _metrics(endpoint) if cache else None
    reuse = measured_reuse(endpoint, workload, sent, before, after)
    if watch is None:
        return Loaded(wall, sent, reuse)
    use = summarize_cache_use([found for _, found in watch.samples], model, before=first, after=last) \
        if cache else None
    return Loaded(wall, sent, reuse, watch.largest(endpoint.gauge), use)


async def run_workload(endpoint: Endpoint, workload: Workload, config: LoadConfig, name: str = "") -> LoadResult:
    """The load, then each answered request alone, within :func:`run_bound` seconds; one point."""
    check_config(workload, config)
    result = LoadResult(name=name or endpoint.model, model=endpoint.model)
    rss = RssWatch(endpoint.pid) if endpoint.pid is not None else contextlib.nullcontext()
    client, bound, start_load = open_client(endpoint, config), run_bound(workload, config), os.getloadavg()[0]
    try:
        async with rss, asyncio.timeout(bound):
            loaded = await load_point(client, endpoint, workload, config)
            solo = await solo_again(client, endpoint, workload, loaded.sent, config)
            record_solo(result, [a for a in solo if a is not None])
            point = summarize(config.clients[0], loaded.wall, loaded.sent, solo)
            point.gauge_max, point.reuse, point.cache_use = loaded.gauge_max, loaded.reuse, loaded.cache_use
            use = loaded.cache_use
            result.points.append(point)
            logger.info("%s, %s: %d requests, %d errors, %.1f tok/s, %d of %d differ from solo, prefix hit %s of "
                        "%.2f allowed, budget use %s", result.name, workload.kind, point.requests, point.errors,
                        point.tokens_per_s, point.differ, point.compared, point.reuse.hit_rate, point.reuse.allowed,
                        None if use is None else use.utilization)
    except TimeoutError:
        result.incomplete = f"the run passed its bound of {bound:.0f} s"
        logger.warning("%s: %s", result.name, result.incomplete)
    finally:
        await client.close()
    result.rss = rss.summary() if isinstance(rss, RssWatch) else None
    result.load_average = (start_load, os.getloadavg()[0])
    return result


def measure_workload(endpoint: Endpoint, workload: Workload, config: LoadConfig, name: str = "") -> LoadResult:
    """:func:`run_workload` in its own event loop (for callers that are not async)."""
    return asyncio.run(run_workload(endpoint, workload, config, name))
