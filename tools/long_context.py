#!/usr/bin/env python
"""Decode step and cache bytes at long contexts: the unquantized buffer vs int8 vs the 4-bit ort-gqa cache.

The model is random-weight with a real config's shapes (by default Qwen2.5-0.5B's: 24 layers, 14 query heads,
2 KV heads, head_dim 64, hidden 896, MLP 4864, 32768 positions; the vocabulary is cut to ``--vocab`` so the
export stays small, which changes only the lm_head's share of a step), saved as a Hugging Face directory with
``from_config`` + ``save_pretrained`` in ``--work-dir``, exported with ``--flavor ort-gqa`` for each cache and
with int4 weights (``kvq export --weights int4``). Static scales come from random
token windows: the weights are random too, so no text would be more realistic.

Each context's cache is random valid codes already holding the context (no prefill: only the step is timed),
and the steps run interleaved across the caches, one of each per round in a random order, so load drift on a
shared machine hits them all alike. A quantized cache must never be slower than the unquantized one at
``>= 8000`` tokens: the summary says whether that held. Rows go to ``--json`` (one object a line) as they are
measured.

    python tools/long_context.py --contexts 8192,16384,32768 --steps 8 --json long.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvq_export.calibration import Calibration, calibrate_static_scales
from kvq_export.export.exporter import ensure_export
from kvq_export.memory import predict
from kvq_export.presets import resolve_scheme
from kvq_export.request import ExportRequest, WeightSpec
from kvq_export.runtime.session import KVQSession

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


def synthetic_cache(session, context: int, rng: np.random.Generator):
    """A batch-1 cache of random valid codes holding ``context`` tokens, with room for one more."""
    manifest = session.manifest
    return session.cache_from_arrays(session.layout.arrays(session.past, manifest.scheme, manifest.num_layers, 1,
                                                           context, capacity=context + 1, rng=rng))


def measure(directories: dict[str, Path], contexts: Sequence[int], steps: int, warmup: int,
            threads: int | None, out: Path | None) -> list[dict]:
    """Median step (ms) and cache bytes per (cache, context), steps interleaved across caches."""
    sessions = {name: KVQSession(d, threads=threads, verify_weights=False) for name, d in directories.items()}
    rows = []
    rng = np.random.default_rng(0)
    order = np.random.default_rng(1)
    for context in contexts:
        caches = {name: synthetic_cache(s, context, rng) for name, s in sessions.items()}
        token = np.asarray([[7]], dtype=np.int64)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for i in range(warmup + steps):
            for name in order.permutation(list(sessions)):
                start = time.perf_counter()
                sessions[name].step(token, None, caches[name])  # the cache is not advanced: same context each step
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        for name, session in sessions.items():
            manifest = session.manifest
            # each step against the unquantized cache's step of the same round: load drift cancels
            paired = [t / b for t, b in zip(times[name], times[UNQUANTIZED])] if UNQUANTIZED in times else []
            row = {"cache": name, "context": context, "step_ms": 1e3 * statistics.median(times[name]),
                   "paired_ratio": statistics.median(paired) if paired else None,
                   "step_ms_min": 1e3 * min(times[name]), "step_ms_max": 1e3 * max(times[name]), "steps": steps,
                   "cache_bytes": session.cache_nbytes(caches[name]),
                   # the memory model's bytes for the tokens held (the buffer holds one position more)
                   "predicted_cache_bytes": predict(manifest.scheme, manifest.model, context).total_bytes}
            rows.append(row)
            logger.info("%s", json.dumps(row))
            if out is not None:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del caches
    return rows


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
    if max(contexts) + 1 > CONFIG["max_position_embeddings"]:
        parser.error(f"contexts must leave one position of {CONFIG['max_position_embeddings']} for the step")
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
