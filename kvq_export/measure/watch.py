"""What a server holds while it is loaded: its resident memory and a gauge from its metrics page.

:class:`RssWatch` reads ``VmRSS`` of a process and of its descendants from ``/proc`` once a second;
:class:`GaugeWatch` scrapes a Prometheus text page (``/metrics``) once a second for the largest value of one
gauge (every series of that name, whatever its labels). Both run as asyncio tasks beside the load and never fail
it: a vanished process or an unreachable page is a sample missed, counted, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
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


def gauge_max(text: str, name: str) -> float | None:
    """The largest value of gauge ``name`` on a Prometheus text page (any labels), read by prometheus_client.

    None when the page has no such series or does not parse.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                  if sample.name == name]
    except ValueError:
        return None
    return max(values) if values else None


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


class GaugeWatch(_EverySecond):
    """Scrapes ``url`` once a second for the largest value of gauge ``name`` while running (``async with``)."""

    def __init__(self, url: str, name: str, timeout: float = 5.0) -> None:
        self.url, self.name, self.timeout = url, name, timeout
        self.max: float | None = None
        self.scrapes = 0
        self.missed = 0

    async def _run(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout) as client:
            while True:
                await self._scrape(client)
                await asyncio.sleep(INTERVAL)

    async def _scrape(self, client) -> None:
        import httpx

        try:
            reply = await client.get(self.url)
        except httpx.HTTPError as err:
            self.missed += 1
            logger.debug("metrics %s: %s", self.url, err)
            return
        value = gauge_max(reply.text, self.name) if reply.status_code == 200 else None
        if value is None:
            self.missed += 1
            return
        self.scrapes += 1
        self.max = value if self.max is None else max(self.max, value)

