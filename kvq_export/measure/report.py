"""A serving benchmark's results as a markdown table, a plot (matplotlib, PNG) and JSON."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvq_export.measure.load import LoadResult, PointResult

logger = logging.getLogger(__name__)

HEADER = ("server", "clients", "requests", "errors", "differ from solo", "gen tok/s", "TTFT p50 s", "TTFT p99 s",
          "latency p50 s", "latency p99 s", "hostile 4xx", "gauge max", "RSS max MB")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _row(result: LoadResult, point: PointResult) -> list[str]:
    hostile = "-" if point.hostile is None else f"{point.hostile.refused}/{point.hostile.sent}"
    rss = "-" if result.rss is None else f"{result.rss.max / 2**20:.0f}"
    return [result.name, str(point.clients), str(point.requests), str(point.errors),
            f"{point.differ}/{point.compared}", f"{point.tokens_per_s:.1f}", _seconds(point.ttft_p50),
            _seconds(point.ttft_p99), _seconds(point.latency_p50), _seconds(point.latency_p99), hostile,
            "-" if point.gauge_max is None else f"{point.gauge_max:g}", rss]


def markdown_table(results: Sequence[LoadResult]) -> str:
    """One row per server and client count; notes below it for failures, incomplete runs and memory."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_row(r, p)) + " |" for r in results for p in r.points]
    notes = []
    for result in results:
        if result.incomplete:
            notes.append(f"- {result.name}: {result.incomplete}")
        if result.load_average is not None:
            notes.append(f"- {result.name}: the machine's load average {result.load_average[0]:.1f} at the start, "
                         f"{result.load_average[1]:.1f} at the end")
        if result.solo_errors:
            notes.append(f"- {result.name}: {result.solo_errors} solo answer(s) failed (their prompts not compared)")
            notes += [f"- {result.name} solo: {count} x {message}"
                      for message, count in result.solo_error_samples.items()]
        if result.solo_resent:
            notes.append(f"- {result.name} solo: {result.solo_resent} request(s) sent again after the connection "
                         "closed before any answer")
        if result.rss is not None:
            mb = [f"{label} {value / 2**20:.0f}" for label, value in (("start", result.rss.start), (
                "second minute", result.rss.second_minute), ("last minute", result.rss.last_minute),
                ("max", result.rss.max)) if value is not None]
            notes.append(f"- {result.name} RSS (MB): " + ", ".join(mb))
        for point in result.points:
            for message, count in point.error_samples.items():
                notes.append(f"- {result.name} at {point.clients} client(s): {count} x {message}")
            if point.hostile is not None:
                notes += [f"- {result.name} at {point.clients} client(s), hostile: {count} x {failure}"
                          for failure, count in point.hostile.failures.items()]
            if point.resent:
                notes.append(f"- {result.name} at {point.clients} client(s): {point.resent} request(s) sent again "
                             "after the connection closed before any answer")
            if point.missing_usage:
                notes.append(f"- {result.name} at {point.clients} client(s): {point.missing_usage} answer(s) "
                             "without usage (their tokens are not counted)")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write_plot(results: Sequence[LoadResult], path: str | os.PathLike[str], title: str = "") -> Path:
    """Generated tokens/s and p99 request latency against clients, one line per server, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for result in results:
        clients = [p.clients for p in result.points]
        speed.plot(clients, [p.tokens_per_s for p in result.points], marker="o", label=result.name)
        latency.plot(clients, [p.latency_p99 if p.latency_p99 is not None else float("nan") for p in result.points],
                     marker="o", label=result.name)
    counts = sorted({p.clients for r in results for p in r.points})
    for axis, label in ((speed, "generated tokens/s"), (latency, "request latency p99 (s)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts, [str(n) for n in counts])
        axis.set_ylim(bottom=0)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out


def write_json(results: Sequence[LoadResult], path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> Path:
    """Every result (and ``meta``: the command, the configuration) as one JSON document."""
    out = Path(path)
    out.write_text(json.dumps({**(meta or {}), "servers": [r.to_dict() for r in results]}, indent=1) + "\n")
    return out


def write_markdown(results: Sequence[LoadResult], path: str | os.PathLike[str], heading: str = "") -> Path:
    """:func:`markdown_table`, under ``heading`` lines when given."""
    out = Path(path)
    out.write_text((heading.rstrip() + "\n\n" if heading else "") + markdown_table(results))
    return out
