"""What a server holds while it is loaded: its resident memory and gauges from its metrics page.

:class:`RssWatch` reads ``VmRSS`` of a process and of its descendants from ``/proc`` once a second;
:class:`MetricsWatch` scrapes a Prometheus text page (``/metrics``) once a second for several samples at once (each
name's largest value over its series, whatever their labels), and :class:`GaugeWatch` is the one-gauge case (its
largest value over the load). They run as asyncio tasks beside the load and never fail it: a vanished process or
an unreachable page is a sample missed, counted, not an error. :func:`read_metrics` is one scrape, for a counter
read before and after a load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvq_export.memory import resident_bytes

logger = logging.getLogger(__name__)

PROC = Path("/proc")
#: seconds between samples
INTERVAL = 1.0


def rss_bytes(pid: int, proc: Path = PROC) -> int | None:
    """Resident memory of ``pid`` and every descendant (``VmRSS`` from ``/proc/PID/status``), None if it is gone."""
    own = resident_bytes(proc / str(pid) / "status")
    if own is None:
        return None
    return own + sum(resident_bytes(proc / str(child) / "status") or 0 for child in descendants(pid, proc))


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from the parent ids in ``/proc/*/stat``."""
    parents: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


@dataclass(frozen=True)
class RssSummary:
    """Resident memory over a run (bytes): the first sample, the second minute's and the last minute's medians, max."""

    start: int
    second_minute: int | None  # None when the run was shorter than two minutes
    last_minute: int
    max: int
    samples: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def summarize_rss(samples: list[tuple[float, int]]) -> RssSummary | None:
    """:class:`RssSummary` of ``(seconds since the start, bytes)`` samples; None without any."""
    if not samples:
        return None
    end = samples[-1][0]
    second = [rss for t, rss in samples if 60.0 <= t < 120.0]
    last = [rss for t, rss in samples if t >= end - 60.0]
    return RssSummary(start=samples[0][1], second_minute=int(statistics.median(second)) if second and end >= 120.0
                      else None, last_minute=int(statistics.median(last)), max=max(r for _, r in samples),
                      samples=len(samples))


def metric_values(text: str, names: Iterable[str]) -> dict[str, float] | None:
    """The largest value of each of ``names`` on a Prometheus text page (any labels), read by prometheus_client.

    A name is a sample's name as the page writes it (a counter's ends in ``_total``); names the page lacks are left
    out of the answer, never 0. None when the page does not parse.
    """
    from prometheus_client.parser import text_string_to_metric_families

    wanted, found = set(names), {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    found[sample.name] = max(found.get(sample.name, sample.value), sample.value)
    except ValueError:
        return None
    return found


def gauge_max(text: str, name: str) -> float | None:
    """The largest value of gauge ``name`` on a Prometheus text page (any labels); None when absent or unparsed."""
    return (metric_values(text, [name]) or {}).get(name)


async def read_metrics(url: str, names: Iterable[str], timeout: float = 10.0) -> dict[str, float] | None:
    """One scrape of ``url``: :func:`metric_values` of ``names``; None (and a warning) when the page is unreachable."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            reply = await client.get(url)
    except httpx.HTTPError as err:
        logger.warning("metrics %s: %s", url, err)
        return None
    return metric_values(reply.text, names) if reply.status_code == 200 else None


class _EverySecond:
    """An asyncio task running :meth:`_run` while the watch is entered (``async with``)."""

    _task: asyncio.Task | None = None

    async def __aenter__(self):
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        raise NotImplementedError


class RssWatch(_EverySecond):
    """Samples :func:`rss_bytes` of ``pid`` once a second while running (``async with``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []

    async def _run(self) -> None:
        start = time.monotonic()
        while True:
            rss = await asyncio.to_thread(rss_bytes, self.pid)
            if rss is not None:
                self.samples.append((time.monotonic() - start, rss))
            await asyncio.sleep(INTERVAL)

    def summary(self) -> RssSummary | None:
        """The samples so far, summarized."""
        return summarize_rss(self.samples)


class MetricsWatch(_EverySecond):
    """Scrapes ``url`` once a second for :func:`metric_values` of ``names`` while running (``async with``).

    ``samples``: ``(seconds since the start, {name: value})`` per scrape that found at least one of the names; a
    scrape that found none (or failed) is counted in ``missed``.
    """

    def __init__(self, url: str, names: Iterable[str], timeout: float = 5.0) -> None:
        self.url, self.names, self.timeout = url, tuple(dict.fromkeys(names)), timeout
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.missed = 0

    @property
    def scrapes(self) -> int:
        """Scrapes that found at least one of the names."""
        return len(self.samples)

    def largest(self, name: str) -> float | None:
        """The largest value ``name`` had over the samples; None when no sample had it."""
        values = [found[name] for _, found in self.samples if name in found]
        return max(values) if values else None

    async def _run(self) -> None:
        import httpx

        start = time.monotonic()
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            while True:
                await self._scrape(client, start)
                await asyncio.sleep(INTERVAL)

    async def _scrape(self, client, start: float) -> None:
        import httpx

        try:
            reply = await client.get(self.url)
        except httpx.HTTPError as err:
            self.missed += 1
            logger.debug("metrics %s: %s", self.url, err)
            return
        found = metric_values(reply.text, self.names) if reply.status_code == 200 else None
        if not found:
            self.missed += 1
            return
        self.samples.append((time.monotonic() - start, found))


class GaugeWatch(MetricsWatch):
    """Scrapes ``url`` once a second for the largest value of gauge ``name`` while running (``async with``)."""

    def __init__(self, url: str, name: str, timeout: float = 5.0) -> None:
        super().__init__(url, [name], timeout)
        self.name = name

    @property
    def max(self) -> float | None:
        """The gauge's largest value over the samples; None when no sample had it."""
        return self.largest(self.name)
