#!/usr/bin/env python
"""Where a decode step's (or a prefill's) time goes: ONNX Runtime's profiler, summed by operator type.

Gives the *cause* behind a ``kvq bench`` latency ratio. The cache is the bench's synthetic fill (the exact
stored layout with random data); then ``--warmup`` untimed steps, one more once the profiler is on, and
``--steps`` profiled single-token steps run through :class:`kvq_export.runtime.session.KVQSession`, the
last of them ending at ``context`` tokens per row; the exports' steps are interleaved (one step of each in
turn), so the load of a shared machine hits them alike::

    python tools/profile_step.py EXPORT_DIR [EXPORT_DIR ...] --context 8192 --batch 1 --steps 16

prints, per export, the share of node time of the top operator types and the ms per step they cost, and
with ``--json`` writes every operator type's total. Each export's run is also compared with the first
export's run of the same round (the median of those paired ratios: ``x first``), which holds where the
absolute times move with the load. ``--prefill`` profiles prompts instead: each step is one prefill of
``context`` random tokens per row into an empty cache (a quantized ort-gqa layer's exact-prefill branch).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvq_export.manifest import MODEL_NAME
from kvq_export.measure.synthetic import synthetic_cache
from kvq_export.runtime.session import KVQSession, choose_providers, session_options
from kvq_export.validate.report import write_json

logger = logging.getLogger("profile_step")
#: operators whose profiled time is their subgraph's nodes, which the profile lists on their own
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def profile_export(directory: str | os.PathLike[str], *, context: int, batch: int, steps: int, warmup: int,
                   threads: int | None = None, seed: int = 0, prefill: bool = False) -> dict:
    """Profile ``steps`` single-token steps of one export; return per-operator-type microseconds per step."""
    return profile_exports([directory], context=context, batch=batch, steps=steps, warmup=warmup,
                           threads=threads, seed=seed, prefill=prefill)[0]


def profile_exports(directories: list[str | os.PathLike[str]], *, context: int, batch: int, steps: int,
                    warmup: int, threads: int | None = None, seed: int = 0, prefill: bool = False) -> list[dict]:
    """Profile ``steps`` single-token steps of each export, the exports' steps interleaved.

    Step ``i`` of every export runs before step ``i + 1`` of any, so a load that comes and goes on a shared
    machine hits them alike and their ratios hold even where the absolute times do not. ``prefill``: each step
    is one prefill of ``context`` random tokens per row into an empty cache of ``context + 1`` positions.
    """
    import onnxruntime as ort

    filled = context - warmup - 1 - steps  # the last profiled step ends exactly at ``context`` tokens
    if filled < 0 and not prefill:
        raise SystemExit(f"context {context} is shorter than warmup + 1 + steps = {warmup + 1 + steps}")
    runs = []  # [session, cache, rng, vocab] per export
    for directory in directories:
        session = KVQSession(directory, threads=threads)
        cache = None if prefill else synthetic_cache(session, batch, filled, capacity=context, seed=seed)
        runs.append([session, cache, np.random.default_rng(seed), session.manifest.model.vocab_size])

    def step_all() -> None:
        for run in runs:
            session, cache, rng, vocab = run
            if prefill:  # the same prompt for every export (each has its own generator of the same seed)
                session.step(rng.integers(0, vocab, (batch, context)), None,
                             session.empty_cache(batch, capacity=context + 1))
            else:
                _, run[1] = session.step(rng.integers(0, vocab, (batch, 1)), None, cache)

    for _ in range(warmup):
        step_all()
    with tempfile.TemporaryDirectory(prefix="kvq-profile-") as tmp:
        for i, run in enumerate(runs):
            options = session_options(threads)
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tmp) / f"step{i}")
            # the same graph, now with the profiler on (its own warm-up step first: the first run allocates)
            run[0].session = ort.InferenceSession(str(run[0].directory / MODEL_NAME), options,
                                                  providers=choose_providers(None))
        for _ in range(1 + steps):
            step_all()
        events = [json.loads(Path(run[0].session.end_profiling()).read_text()) for run in runs]
    first = _runs(events[0])[-steps:]
    return [_summary(run[0], run_events, first, context=context, batch=batch, steps=steps, prefill=prefill)
            for run, run_events in zip(runs, events)]


def _runs(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]


def _summary(session, events: list[dict], first: list[dict], *, context: int, batch: int, steps: int,
             prefill: bool = False) -> dict:
    """Per-operator-type time and node count of the last ``steps`` runs in one session's profile.

    ``first``: the first export's profiled runs, which this one's are paired with round by round.
    """
    runs = _runs(events)
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    # drop the profiler's own warm-up run: keep the last ``steps`` runs and the nodes inside them
    timed = runs[-steps:]
    start = timed[0]["ts"] if timed else 0
    by_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    branches: dict[str, float] = defaultdict(float)  # an If's time is that of the branch's nodes, listed too
    for e in nodes:
        if e["ts"] < start:
            continue
        op = e["args"].get("op_name", "?")
        if op in CONTROL_FLOW:
            branches[op] += e["dur"]
            continue
        by_op[op] += e["dur"]
        count[op] += 1
    node_us = sum(by_op.values())
    return {
        "export": str(session.directory), "scheme": session.manifest.scheme.name, "flavor": session.manifest.flavor,
        "context": context, "batch": batch, "steps": steps, "prefill": prefill,
        # the first export's run time over this one's, per round (> 1: faster than the first export)
        "speed_vs_first": float(np.median([a["dur"] / b["dur"] for a, b in zip(first, timed)])) if timed else None,
        # mean, like the node figure below, so the two are comparable (a median run hides the slow steps' nodes)
        "run_us_per_step": float(np.mean([r["dur"] for r in timed])) if timed else None,
        "node_us_per_step": node_us / steps,
        # nodes ONNX Runtime ran per step, after its own graph optimizations (fewer than the file may hold)
        "nodes_per_step": sum(count.values()) / steps,
        "op_nodes_per_step": {op: n / steps for op, n in sorted(count.items(), key=lambda kv: -kv[1])},
        "ops_us_per_step": {op: us / steps for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "control_flow_us_per_step": {op: us / steps for op, us in branches.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: profile the exports, log the top operators, write --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", help="kvq export directories")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefill", action="store_true",
                        help="profile prefills of --context tokens into an empty cache instead of decode steps")
    parser.add_argument("--top", type=int, default=6, help="operator types to print per export")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = profile_exports(args.exports, context=args.context, batch=args.batch, steps=args.steps,
                              warmup=args.warmup, threads=args.threads, prefill=args.prefill)
    what = "prefill" if args.prefill else "step"
    for r in results:
        total = r["node_us_per_step"]
        logger.info("%s %s @%d x%d: %s %.2f ms (mean), x first %.3f, node time %.2f ms, %d nodes", r["flavor"],
                    r["scheme"], r["context"], r["batch"], what, (r["run_us_per_step"] or 0) / 1e3,
                    r["speed_vs_first"] or 0, total / 1e3, r["nodes_per_step"])
        for op, us in list(r["ops_us_per_step"].items())[:args.top]:
            logger.info("  %-34s %6.2f ms  %5.1f%%  %4d nodes", op, us / 1e3, 100 * us / total,
                        r["op_nodes_per_step"][op])
    if args.json_out:
        write_json({"results": results}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
