"""A serving benchmark's results as a markdown table, a plot (matplotlib, PNG) and JSON."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvq_export.measure.cache_use import RUNNING, CacheUse
from kvq_export.measure.load import LoadResult, PointResult

logger = logging.getLogger(__name__)

HEADER = ("server", "clients", "requests", "errors", "differ from solo", "gen tok/s", "TTFT p50 s", "TTFT p99 s",
          "latency p50 s", "latency p99 s", "hostile 4xx", "gauge max", "RSS max MB")
#: the columns added when a point carries prefix reuse (the shared-prefix, chat and mixed workloads)
REUSE_HEADER = ("prefix hit", "reuse allowed", "hit / allowed")
#: the columns added when a point carries cache occupancy (the mixed workload, on a server with a metrics page)
CACHE_HEADER = ("running mean", "running max", "tokens held mean", "budget use", "preempted")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def _row(result: LoadResult, point: PointResult, reuse: bool, cache: bool) -> list[str]:
    hostile = "-" if point.hostile is None else f"{point.hostile.refused}/{point.hostile.sent}"
    rss = "-" if result.rss is None else f"{result.rss.max / 2**20:.0f}"
    row = [result.name, str(point.clients), str(point.requests), str(point.errors),
           f"{point.differ}/{point.compared}", f"{point.tokens_per_s:.1f}", _seconds(point.ttft_p50),
           _seconds(point.ttft_p99), _seconds(point.latency_p50), _seconds(point.latency_p99), hostile,
           "-" if point.gauge_max is None else f"{point.gauge_max:g}", rss]
    if reuse:
        shares = (None, None, None) if point.reuse is None else (point.reuse.hit_rate, point.reuse.allowed,
                                                                  point.reuse.of_allowed)
        row += ["-" if share is None else f"{share:.3f}" for share in shares]
    if cache:
        use = point.cache_use or CacheUse()
        row += [_number(use.running_mean, ".1f"), _number(use.running_max, "g"), _number(use.tokens_mean, ".0f"),
                _number(use.utilization, ".3f"), _number(use.preemptions, "g")]
    return row


def _cache_notes(result: LoadResult) -> list[str]:
    notes = []
    for point in result.points:
        use = point.cache_use
        if use is None:
            continue
        where = f"- {result.name} at {point.clients} client(s), cache:"
        if not use.samples:
            notes.append(f"{where} its metrics page has no {RUNNING} (occupancy unknown)")
            continue
        budget = "no budget on /health" if use.budget_bytes is None else f"budget {use.budget_bytes / 2**20:.4g} MiB"
        per_token = "no bytes per token" if use.bytes_per_token is None else f"{use.bytes_per_token:g} bytes per token"
        said = (f"{where} {budget}, {per_token} (the memory model); requests waited in {use.waiting_samples} of "
                f"{use.samples} samples")
        if use.at_max_seqs:
            said += (f", {use.at_max_seqs} of them with max_seqs={use.max_seqs} running (the sequence count, not the "
                     "budget, kept requests out)")
        if use.utilization is not None:
            said += f"; there the held tokens took {use.utilization:.3f} of the budget by the memory model"
        if use.utilization_running is not None:
            said += f" ({use.utilization_running:.3f} over every sample with a sequence running)"
        if use.bytes_used_share is not None:
            said += f", and the server counted {use.bytes_used_share:.3f} of it used"
        notes.append(said)
    return notes


def _reuse_notes(result: LoadResult) -> list[str]:
    notes = []
    for point in result.points:
        reuse = point.reuse
        if reuse is None:
            continue
        if reuse.looked_up is None:
            said = "says nothing of its prefix reuse"
        elif reuse.hit_rate is None:
            said = f"looked up no prompt tokens in a prefix cache (its {reuse.source})"
        else:
            said = f"reused {reuse.reused:.0f} of {reuse.looked_up:.0f} prompt tokens (its {reuse.source})"
        notes.append(f"- {result.name} at {point.clients} client(s): {said}; the workload allowed "
                     f"{reuse.allowed_tokens} of {reuse.prompt_tokens} prompt tokens (the tokenizer's count)")
    return notes


def markdown_table(results: Sequence[LoadResult]) -> str:
    """One row per server and client count; notes below it for failures, incomplete runs and memory.

    Points with prefix reuse add :data:`REUSE_HEADER`'s columns (fractions; "-" where unknown), points with cache
    occupancy :data:`CACHE_HEADER`'s (budget use: the memory model's share while requests waited).
    """
    reuse = any(p.reuse is not None for r in results for p in r.points)
    cache = any(p.cache_use is not None for r in results for p in r.points)
    header = HEADER + (REUSE_HEADER if reuse else ()) + (CACHE_HEADER if cache else ())
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_row(r, p, reuse, cache)) + " |" for r in results for p in r.points]
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
        notes += _reuse_notes(result) + _cache_notes(result)
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


def write_bars(results: Sequence[LoadResult], path: str | os.PathLike[str], title: str = "") -> Path:
    """Generated tokens/s and TTFT p99, one bar per server (its first point), as a PNG: one client count per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.points]
    names = [r.name for r in shown]
    fig, (speed, ttft) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(names) + 4), 4.2))
    speed.bar(names, [r.points[0].tokens_per_s for r in shown])
    ttft.bar(names, [r.points[0].ttft_p99 if r.points[0].ttft_p99 is not None else float("nan") for r in shown])
    for axis, label in ((speed, "generated tokens/s"), (ttft, "time to first token p99 (s)")):
        axis.set_ylabel(label)
        axis.grid(True, axis="y", alpha=0.3)
        axis.tick_params(axis="x", labelrotation=20)
    clients = sorted({r.points[0].clients for r in shown})
    fig.suptitle(", ".join(part for part in (title, f"{'/'.join(map(str, clients))} client(s)") if part))
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
