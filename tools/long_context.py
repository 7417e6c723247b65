#!/usr/bin/env python
"""Decode step and cache bytes at long contexts: the unquantized buffer vs int8 vs the 4-bit ort-gqa cache.

The model is random-weight with a real config's shapes (by default Qwen2.5-0.5B's: 24 layers, 14 query heads,
2 KV heads, head_dim 64, hidden 896, MLP 4864, 32768 positions; the vocabulary is cut to ``--vocab`` so the
export stays small, which changes only the lm_head's share of a step), saved as a Hugging Face directory with
``from_config`` + ``save_pretrained`` in ``--work-dir``, exported with ``--flavor ort-gqa`` for each cache and
with int4 weights (``kvq export --weights int4``). Static scales come from random
token windows: the weights are random too, so no text would be more realistic.

Each context's cache is random valid codes already holding ``context - warmup - steps`` tokens (no prefill: only
the steps are timed; the last step reaches the context, as ``kvq bench`` does), and the steps run interleaved
across the caches, one of each per round in a fresh random order (:func:`kvq_export.measure.timing.interleaved`),
so load drift on a shared machine hits them all alike. A quantized cache must never be slower than the
unquantized one at ``>= 8000`` tokens: the summary says whether that held. Rows go to ``--json`` (one object a
line) as they are measured.

    python tools/long_context.py --contexts 8192,16384,32768 --steps 8 --json long.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from kvq_export.calibration import Calibration, calibrate_static_scales
from kvq_export.export.exporter import ensure_export
from kvq_export.measure.runners import KvqRunner
from kvq_export.measure.timing import Timing, interleaved
from kvq_export.memory import predict
from kvq_export.presets import resolve_scheme
from kvq_export.request import ExportRequest, WeightSpec

logger = logging.getLogger("long_context")

SCHEMES_DIR = Path(__file__).resolve().parent / "schemes"
#: cache name -> kvq scheme (preset name or scheme file)
CACHES = {"fp32 buffer": str(SCHEMES_DIR / "fp32-cache.json"), "int8": "ort-int8", "int4": "ort-int4"}
UNQUANTIZED = "fp32 buffer"
#: Qwen2.5-0.5B's shapes
CONFIG = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
          "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
          "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
#: the slowdown that still counts as "not slower" (step medians of a few samples on a shared machine)
TOLERANCE = 1.0


def random_model_dir(work: Path, vocab: int, layers: int) -> Path:
    """A Hugging Face directory holding a random-weight model of CONFIG's shapes (made once per work dir)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = work / f"hf-random-v{vocab}-l{layers}"
    if (out / "config.json").is_file():
        return out
    settings = {**CONFIG, "vocab_size": vocab, "num_hidden_layers": layers}
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return out


def exports(hf: Path, work: Path, weights: str, calib_tokens: int) -> dict[str, Path]:
    """One ort-gqa export per cache with ``weights`` weights, reused when this kvq built it from the same request.

    Static scales are calibrated once per model, cache and token count and kept beside the exports, so a rerun
    neither loads the model nor calibrates again before it can tell an export is current.
    """
    from transformers import AutoModelForCausalLM

    model = None
    out = {}
    for name, spec in CACHES.items():
        short = name.split()[0]
        scheme = resolve_scheme(spec)
        static = None
        if scheme.needs_calibration:
            # measured on the weights the export runs (int4 blocks dequantized), as kvq export calibrates
            scales = work / f"{hf.name}-{short}-scales-{calib_tokens}-w-{weights}.npz"
            if not scales.is_file():
                model = model or AutoModelForCausalLM.from_pretrained(hf)
                rng = np.random.default_rng(0)
                windows = rng.integers(0, model.config.vocab_size, (max(1, calib_tokens // 512), 512)).tolist()
                calibrate_static_scales(model, scheme, windows, weights=WeightSpec(weights)).save(scales)
            static = Calibration.load(scales)
        logger.info("export for %s", name)
        request = ExportRequest(str(hf), scheme, flavor="ort-gqa", weights=WeightSpec(weights))
        out[name] = ensure_export(request, work / f"kvq-{short}-w-{weights}", static=static)
    return out


def measure(directories: dict[str, Path], contexts: Sequence[int], steps: int, warmup: int,
            threads: int | None, out: Path | None) -> list[dict]:
    """Median step (ms) and cache bytes per (cache, context), steps interleaved across caches."""
    rows = []
    rng = np.random.default_rng(0)
    with ExitStack() as stack:
        runners = {name: stack.enter_context(KvqRunner(d, threads=threads, verify_weights=False))
                   for name, d in directories.items()}
        for context in contexts:
            states = {name: r.synthetic(1, context - warmup - steps, context, rng) for name, r in runners.items()}
            timings = interleaved({name: (lambda i, r=runner, s=states[name]: r.step(s))
                                   for name, runner in runners.items()}, steps, warmup=warmup, seed=1)
            for name, runner in runners.items():
                row = _row(name, context, timings, runner.cache_bytes(states[name]), runner.session.manifest)
                rows.append(row)
                logger.info("%s", json.dumps(row))
                if out is not None:
                    with open(out, "a") as f:
                        f.write(json.dumps(row) + "\n")
            del states
    return rows


def _row(name: str, context: int, timings: dict[str, Timing], cache_bytes: int, manifest) -> dict:
    """One (cache, context) row: the step's median and range, its paired ratio, the bytes held and predicted."""
    timing = timings[name]
    # each step against the unquantized cache's step of the same round: load drift cancels
    base = timings.get(UNQUANTIZED)
    paired = [t / b for t, b in zip(timing.seconds, base.seconds)] if base else []
    return {"cache": name, "context": context, "step_ms": 1e3 * timing.median,
            "paired_ratio": statistics.median(paired) if paired else None,
            "step_ms_min": 1e3 * timing.fastest, "step_ms_max": 1e3 * timing.slowest, "steps": len(timing.seconds),
            "cache_bytes": cache_bytes,
            # the memory model's bytes for the context the buffer holds
            "predicted_cache_bytes": predict(manifest.scheme, manifest.model, context).total_bytes}


def summary(rows: list[dict], floor: int = 8000) -> list[str]:
    """Per context: each cache's step and bytes as ratios of the unquantized buffer's; whether the rule held.

    The step ratio is the median of per-round ratios (each step against the unquantized step of its round), the
    verdict reads it: on a loaded machine the medians of separate samples drift apart by more than the effect.
    """
    lines = []
    for context in sorted({r["context"] for r in rows}):
        at = {r["cache"]: r for r in rows if r["context"] == context}
        base = at[UNQUANTIZED]
        parts = [f"{name} step x{r['paired_ratio']:.2f} (medians x{r['step_ms'] / base['step_ms']:.2f}), "
                 f"bytes x{r['cache_bytes'] / base['cache_bytes']:.3f}"
                 for name, r in at.items() if name != UNQUANTIZED]
        verdict = ""
        if context >= floor:
            slower = [n for n, r in at.items() if n != UNQUANTIZED and r["paired_ratio"] > TOLERANCE]
            verdict = "; holds" if not slower else f"; DOES NOT HOLD: {', '.join(slower)} slower"
        lines.append(f"@{context}: {UNQUANTIZED} {base['step_ms']:.1f} ms, {base['cache_bytes'] / 2**20:.0f} MiB; "
                     + "; ".join(parts) + verdict)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="8192,16384,32767", help="comma list of cached tokens")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per cache and context")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--weights", choices=("fp32", "fp16", "int8", "int4"), default="int4")
    parser.add_argument("--calib-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work-dir", default="/tmp/kvq-long-context")
    parser.add_argument("--json", dest="json_out", default=None, help="append one JSON object a row here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if max(contexts) > CONFIG["max_position_embeddings"] or min(contexts) <= args.warmup + args.steps:
        parser.error(f"contexts must be within {CONFIG['max_position_embeddings']} positions and longer than "
                     "--warmup + --steps")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    hf = random_model_dir(work, args.vocab, args.layers)
    directories = exports(hf, work, args.weights, args.calib_tokens)
    rows = measure(directories, contexts, args.steps, args.warmup, args.threads,
                   Path(args.json_out) if args.json_out else None)
    for line in summary(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
