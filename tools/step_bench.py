"""Prefill and decode steps of kvq exports side by side (and onnxruntime-genai's prefill on them), in one run.

Prefill: each round prefills one ``--tokens``-token corpus prompt into an empty cache with every runner, in a fresh
random order (:func:`kvq_export.measure.timing.interleaved`): kvq's own loop with the head on the last position
only, as ``kvq serve`` prefills, and with ``--genai`` og.Generator's ``append_tokens`` on the same export.
Decode (``--decode-batches 1,32``): one step of every export per round on a synthetic cache of ``--tokens``
tokens per row. Prints medians and ratios to the first export, with the CPU named; ``--json`` keeps every number.
Prefix reuse (``--reuse 1000``): the first export's time to first token for a ``--tokens`` prompt whose first 1000
tokens an idle cache row holds, against the same prompt cold, both as ``kvq serve`` runs them (its cache pool, every
call over the stored codes, ``--prefill-chunk`` tokens a call), and cold as ``kvq serve --no-prefix-cache`` runs it.

    python tools/step_bench.py int4=EXPORT_A w8a8=EXPORT_B --tokens 160 --rounds 30 --genai --decode-batches 1,32
    python tools/step_bench.py int4=EXPORT_A --tokens 1064 --reuse 1000 --rounds 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.measure.cpu import cpu_name
from kvq_export.measure.prompts import DEFAULT_OFFSET
from kvq_export.measure.runners import GenaiRunner, KvqRunner
from kvq_export.measure.timing import interleaved
from kvq_export.serve.scheduler import DEFAULT_PREFILL_CHUNK

logger = logging.getLogger("step_bench")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exports", nargs="+", metavar="NAME=DIR", help="kvq export directories; the first is the base")
    parser.add_argument("--tokens", type=int, default=160, help="prompt tokens (default 160)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: OMP_NUM_THREADS)")
    parser.add_argument("--genai", action="store_true", help="also og.Generator on the same directories")
    parser.add_argument("--decode-batches", default="", help="also decode steps at these batch sizes (e.g. 1,32)")
    parser.add_argument("--reuse", type=int, default=None, metavar="PREFIX",
                        help="only the time to first token with PREFIX tokens cached, against cold (first export)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="prompt tokens per call with --reuse (default: kvq serve's)")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def prompt_ids(directory: Path, tokens: int) -> list[int]:
    """``tokens`` corpus tokens from past protocol P's text, with the export's own tokenizer."""
    from kvq_export.corpus import load_corpus, token_windows
    from kvq_export.manifest import Manifest
    from kvq_export.runtime.session import load_tokenizer

    tokenizer = load_tokenizer(directory, Manifest.load(directory))  # the tokenizer alone, not a session
    return token_windows(tokenizer, load_corpus("britannica"), 1, tokens, offset=DEFAULT_OFFSET)[0]


def decode_steps(runners, batch: int, args) -> dict:
    """One decode step of every kvq runner per round, each on its own synthetic cache of ``--tokens`` per row."""
    rng = np.random.default_rng(0)
    kvq = {name: r for name, r in runners.items() if name.startswith("kvq ")}
    states = {name: r.synthetic(batch, args.tokens, args.tokens + args.rounds + args.warmup + 1, rng)
              for name, r in kvq.items()}
    return interleaved({name: (lambda i, r=r, s=states[name]: r.step(s)) for name, r in kvq.items()},
                       rounds=args.rounds, warmup=args.warmup)


def reuse_ttft(directory: Path, ids: list[int], args) -> dict:
    """Time to first token of ``ids`` with its first ``--reuse`` tokens in an idle row, cold, and cold exact."""
    from kvq_export.runtime.rows import RowCache
    from kvq_export.runtime.session import KVQSession
    from kvq_export.serve.cache_pool import CachePool

    prompt, capacity = np.asarray(ids), len(ids) + 1
    pools = {name: CachePool(RowCache(KVQSession(directory, tokenizer=False, last_logits=True, threads=args.threads,
                                                 stored_prefill=stored), 2, capacity), prefix_cache=stored)
             for name, stored in (("stored", True), ("exact", False))}

    def first_token(pool: CachePool, lookup: bool) -> None:
        lease = pool.acquire(prompt, lookup=lookup)
        for start in range(lease.reused, len(prompt), args.prefill_chunk):
            pool.run(lease.row, prompt[None, start:start + args.prefill_chunk])
        pool.release(lease.row, keep=False)

    def warm(i: int) -> None:
        pool = pools["stored"]
        lease = pool.acquire(prompt[:args.reuse + 1], lookup=False)  # an idle row holding the prefix, untimed
        pool.run(lease.row, prompt[None, :args.reuse])
        pool.release(lease.row)
        timed = time.perf_counter()
        first_token(pool, True)
        return time.perf_counter() - timed

    runs = {"reused": warm, "cold": lambda i: _timed(first_token, pools["stored"], False),
            "cold, exact prefill": lambda i: _timed(first_token, pools["exact"], False)}
    return interleaved(runs, rounds=args.rounds, warmup=args.warmup, self_timed=True)


def _timed(run, *args) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        exports = dict(item.split("=", 1) if "=" in item else (Path(item).name, item) for item in args.exports)
        ids = [prompt_ids(Path(next(iter(exports.values()))), args.tokens)]
        if args.reuse is not None:
            return report_reuse(Path(next(iter(exports.values()))), ids[0], args)
        runners = {f"kvq {name}": KvqRunner(directory, last_logits=True, threads=args.threads)
                   for name, directory in exports.items()}
        if args.genai:
            runners |= {f"og {name}": GenaiRunner(directory, threads=args.threads)
                        for name, directory in exports.items()}
    except KVQError as err:
        logger.error("error: %s", err)
        return 1
    batches = [int(b) for b in args.decode_batches.split(",") if b.strip()]
    with contextlib.ExitStack() as stack:
        for runner in runners.values():
            stack.enter_context(runner)
        steppers = {name: (lambda i, r=r: r.prefill(ids, args.tokens + 1)[1]) for name, r in runners.items()}
        timings = interleaved(steppers, rounds=args.rounds, warmup=args.warmup, self_timed=True)
        steps = {batch: decode_steps(runners, batch, args) for batch in batches}
    rates = {name: args.tokens / t.median for name, t in timings.items()}
    logger.info("prefill of a %d-token prompt, median of %d interleaved rounds, %s", args.tokens, args.rounds,
                cpu_name())
    for engine in ("kvq", "og"):
        mine = {name: rate for name, rate in rates.items() if name.startswith(engine + " ")}
        base = next(iter(mine.values()), None)
        for name, rate in mine.items():
            logger.info("  %s: %.0f tok/s (%.2fx %s)", name, rate, rate / base, next(iter(mine)))
    for batch, timing in steps.items():
        base = next(iter(timing.values())).median
        logger.info("decode step, batch %d, %d cached tokens per row:", batch, args.tokens)
        for name, t in timing.items():
            logger.info("  %s: %.2f ms (%.2fx %s)", name, 1e3 * t.median, t.median / base, next(iter(timing)))
    if args.json:
        args.json.write_text(json.dumps({
            "cpu": cpu_name(), "tokens": args.tokens, "rounds": args.rounds, "prefill_tok_s": rates,
            "prefill_seconds": {n: list(t.seconds) for n, t in timings.items()},
            "decode_ms": {str(b): {n: 1e3 * t.median for n, t in timing.items()} for b, timing in steps.items()}},
            indent=2))
    return 0


def report_reuse(directory: Path, ids: list[int], args) -> int:
    """Print (and ``--json``) :func:`reuse_ttft`'s medians and ratios to cold."""
    if not 0 < args.reuse < len(ids):
        logger.error("error: --reuse %d: allowed: 1 .. --tokens - 1 (%d)", args.reuse, len(ids) - 1)
        return 1
    timings = reuse_ttft(directory, ids, args)
    cold = timings["cold"].median
    logger.info("time to first token of a %d-token prompt, %d of its tokens cached, median of %d interleaved "
                "rounds, %s", len(ids), args.reuse, args.rounds, cpu_name())
    for name, t in timings.items():
        logger.info("  %s: %.1f ms (%.3fx cold)", name, 1e3 * t.median, t.median / cold)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "tokens": len(ids), "reused": args.reuse,
                                         "seconds": {n: list(t.seconds) for n, t in timings.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
