#!/usr/bin/env python
"""Peers side by side: llama.cpp's quantized KV cache and Hugging Face ``QuantizedCache`` next to kvq's presets.

Same model (SmolLM2-135M: kvq and transformers run its fp32 weights; llama.cpp runs the GGUF file they come
from, whose *weights* are Q4_1), same text (``ppl_windows`` windows of ``ppl_tokens`` tokens of the
britannica corpus from token ``kvq_export.bench.PPL_OFFSET`` on, tokenized once with the model's tokenizer
and fed to every engine as token ids), same protocol:

* **perplexity**, strict decode: every token is fed alone, so every prediction reads the stored cache;
* **decode speed**: median time of a single-token step with ``--context`` tokens in the cache, batch 1.

Each engine is compared with *its own* unquantized cache (llama.cpp f16, transformers ``DynamicCache``,
kvq ``fp16``): ``ppl_delta`` and ``speed_ratio`` (step time / baseline step time) are what line up across
engines; absolute perplexities differ because llama.cpp runs 4-bit weights.

Peers and the kvq preset each one lines up with:

======================  ==================================  =====================================
engine                  cache                               kvq preset
======================  ==================================  =====================================
llama.cpp (flash attn)  f16 / q8_0 / q4_0 / q4_1            fp16 / q8_0 / q4_0 / q4_1
transformers            QuantizedCache quanto int4 / int2   kivi-4 / kivi-2 (per-channel, R=128)
transformers            QuantizedCache hqq int4 / int2      kivi-4 / kivi-2
transformers            QuantizedCache fp8 (per tensor)     fp8
======================  ==================================  =====================================

Optional dependencies, none needed by kvq itself (install them in a throwaway venv, see tools/README.md):
``llama-cpp-python`` (llama.cpp), ``optimum-quanto`` (quanto backend), ``hqq`` (hqq backend). A missing
one is reported as ``unavailable`` with the reason and the rest still runs.

    python tools/peer_compare.py --json peers.json          # everything available
    python tools/peer_compare.py --peers llama.cpp,kvq --context 1024 --ppl-tokens 256
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("peer_compare")

PEERS = ("kvq", "llama.cpp", "hf")
KVQ_PRESETS = ("q8_0", "q4_0", "q4_1", "kivi-4", "kivi-2", "fp8")
#: llama.cpp cache type -> (ggml type name in llama_cpp, kvq preset)
LLAMA_CPP_TYPES = {"f16": ("GGML_TYPE_F16", "fp16"), "q8_0": ("GGML_TYPE_Q8_0", "q8_0"),
                   "q4_0": ("GGML_TYPE_Q4_0", "q4_0"), "q4_1": ("GGML_TYPE_Q4_1", "q4_1")}
#: transformers QuantizedCache configurations -> (backend, nbits, module it needs, kvq preset)
HF_CACHES = {"quanto-int4": ("quanto", 4, "optimum.quanto", "kivi-4"),
             "quanto-int2": ("quanto", 2, "optimum.quanto", "kivi-2"),
             "hqq-int4": ("hqq", 4, "hqq", "kivi-4"), "hqq-int2": ("hqq", 2, "hqq", "kivi-2"),
             "fp8": ("fp8", None, None, "fp8")}


@dataclass
class Row:
    """One engine + cache configuration."""

    engine: str
    cache: str
    kvq_counterpart: str
    status: str = "ok"  # ok | unavailable | failed: reason
    ppl: float | None = None
    ppl_delta: float | None = None  # vs the engine's own unquantized cache
    decode_ms: float | None = None  # median single-token step at --context tokens
    speed_ratio: float | None = None  # decode_ms / the engine's baseline decode_ms (< 1: faster)
    note: str = ""


def _has(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _nll(logits: np.ndarray, target: int) -> float:
    row = logits.astype(np.float64)
    top = row.max()
    return float(top + math.log(np.exp(row - top).sum()) - row[target])


def _finish(rows: list[Row], baseline: str) -> list[Row]:
    base = next((r for r in rows if r.cache == baseline and r.status == "ok"), None)
    for r in rows:
        if base is not None and r.status == "ok":
            r.ppl_delta = r.ppl - base.ppl if r.ppl is not None else None
            r.speed_ratio = r.decode_ms / base.decode_ms if r.decode_ms else None
    return rows


# -- kvq ---------------------------------------------------------------------------------------------------------
def run_kvq(model: str, windows: list[list[int]], context: int, steps: int, flavor: str,
            ppl: bool = True) -> list[Row]:
    """Run kvq's presets on ONNX Runtime: perplexity and decode speed through ``kvq_export.bench``."""
    from kvq_export.bench import perplexity, run_bench
    from kvq_export.runtime.session import KVQSession

    report = run_bench(model, list(KVQ_PRESETS), flavors=(flavor,), contexts=(context,), batches=(1,), steps=steps,
                       warmup=4, prefill_tokens=64, prefill_repeats=1)
    rows = []
    for result in report.results:
        session = KVQSession(report.settings["exports"][flavor][result.scheme])
        rows.append(Row("kvq " + flavor, result.scheme, result.scheme, decode_ms=result.decode_ms_median,
                        ppl=perplexity(session, windows)["ppl"] if ppl else None))
        logger.info("kvq %s: %s", flavor, rows[-1])
    return _finish(rows, "fp16")


# -- llama.cpp -----------------------------------------------------------------------------------------------------
def _interleaved(steppers: dict[str, Callable[[int], None]], steps: int, warmup: int = 4) -> dict[str, float]:
    """Median ms of ``steps`` calls per configuration, one call each in a rotating order (load drift hits all)."""
    names = list(steppers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            steppers[name](i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def run_llama_cpp(gguf: Path, windows: list[list[int]], context: int, steps: int, threads: int | None,
                  ppl: bool = True) -> list[Row]:
    """Run llama.cpp through llama-cpp-python: flash attention on, K and V cache of each type."""
    if not _has("llama_cpp"):
        return [Row("llama.cpp", c, k, status="unavailable: pip install llama-cpp-python")
                for c, (_, k) in LLAMA_CPP_TYPES.items()]
    import llama_cpp

    rows, engines = {}, {}
    length = max(len(w) for w in windows)
    prompt = (windows[0] * (context // len(windows[0]) + 1))[:context]
    for cache, (type_name, kvq_name) in LLAMA_CPP_TYPES.items():
        row = rows[cache] = Row("llama.cpp", cache, kvq_name)
        try:
            ggml_type = getattr(llama_cpp, type_name)
            kwargs = dict(model_path=str(gguf), n_ctx=max(context + steps + 16, length + 8), n_batch=512,
                          n_ubatch=512, type_k=ggml_type, type_v=ggml_type, flash_attn=True, logits_all=True,
                          verbose=False, n_threads=threads, seed=0)
            llm = llama_cpp.Llama(**{k: v for k, v in kwargs.items() if v is not None})
            if ppl:
                total = count = 0.0
                for window in windows:
                    llm.reset()
                    for token in window:  # strict decode: one token per eval
                        llm.eval([token])
                    scores = np.asarray(llm.scores[: len(window)])
                    total += sum(_nll(scores[i], window[i + 1]) for i in range(len(window) - 1))
                    count += len(window) - 1
                row.ppl = math.exp(total / count)
            llm.reset()
            llm.eval(prompt)
            engines[cache] = llm
        except Exception as err:  # a peer failing must not stop the others
            row.status = f"failed: {type(err).__name__}: {err}"
        logger.info("llama.cpp %s: %s", cache, row)
    if engines:
        speeds = _interleaved({name: (lambda i, llm=llm: llm.eval([prompt[i % len(prompt)]]))
                               for name, llm in engines.items()}, steps)
        for name, ms in speeds.items():
            rows[name].decode_ms = ms
    return _finish(list(rows.values()), "f16")


# -- transformers ------------------------------------------------------------------------------------------------
def run_hf(model: str, windows: list[list[int]], context: int, steps: int, ppl: bool = True) -> list[Row]:
    """Run transformers' QuantizedCache backends vs DynamicCache, in PyTorch on the fp32 model."""
    import torch
    from transformers.cache_utils import DynamicCache, QuantizedCache

    from kvq_export.model_source import load_model

    hf_model, _ = load_model(model)
    configs: dict[str, Callable[[], Any] | str] = {"dynamic": lambda: DynamicCache(config=hf_model.config)}
    for name, (backend, nbits, module, _) in HF_CACHES.items():
        if not _has(module):
            configs[name] = f"unavailable: pip install {'optimum-quanto' if backend == 'quanto' else backend}"
            continue
        kwargs = {} if nbits is None else {"nbits": nbits}
        configs[name] = (lambda backend=backend, kwargs=kwargs:
                         QuantizedCache(backend, hf_model.config, **kwargs))
    rows, caches = {}, {}
    prompt = (windows[0] * (context // len(windows[0]) + 1))[:context]
    with torch.inference_mode():
        for name, make in configs.items():
            row = rows[name] = Row("transformers", name, "fp16" if name == "dynamic" else HF_CACHES[name][3])
            if isinstance(make, str):
                row.status = make
                continue
            try:
                if ppl:
                    total = count = 0.0
                    for window in windows:
                        cache = make()
                        for i in range(len(window) - 1):
                            logits = hf_model(input_ids=torch.tensor([[window[i]]]), cache=cache,
                                              use_cache=True).logits
                            total += _nll(logits[0, -1].numpy(), window[i + 1])
                            count += 1
                    row.ppl = math.exp(total / count)
                cache = make()
                hf_model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
                caches[name] = cache
            except Exception as err:  # a peer failing must not stop the others
                row.status = f"failed: {type(err).__name__}: {err}"
            logger.info("transformers %s: %s", name, row)
        if caches:
            def stepper(cache):
                return lambda i: hf_model(input_ids=torch.tensor([[prompt[i % len(prompt)]]]), cache=cache,
                                          use_cache=True)

            for name, ms in _interleaved({name: stepper(c) for name, c in caches.items()}, steps).items():
                rows[name].decode_ms = ms
    return _finish(list(rows.values()), "dynamic")


# -- driver --------------------------------------------------------------------------------------------------------
def text_windows(model: str, n: int, length: int) -> list[list[int]]:
    """The shared evaluation text as token ids (the model's own tokenizer)."""
    from transformers import AutoTokenizer

    from kvq_export.bench import PPL_OFFSET
    from kvq_export.corpus import load_corpus, token_windows
    from kvq_export.model_source import _ensure_fp32_cache, resolve_spec

    source = resolve_spec(model)
    directory = source.path if source.kind == "hf_dir" else _ensure_fp32_cache(source.path)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return token_windows(tokenizer, load_corpus("britannica"), n, length, offset=PPL_OFFSET)


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind a model spec (the built-in smollm2 ships one), if any."""
    from kvq_export.model_source import resolve_spec

    source = resolve_spec(model)
    return source.path if source.kind == "gguf" else None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}")
    parser.add_argument("--ppl-windows", type=int, default=2)
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--context", type=int, default=1024, help="tokens in the cache for decode timing")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--kvq-flavor", default="reference")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    parser.add_argument("--no-ppl", action="store_true", help="decode speed only (peers' perplexity skipped)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; allowed: {', '.join(PEERS)}")

    windows = text_windows(args.model, args.ppl_windows, args.ppl_tokens)
    rows: list[Row] = []
    if "kvq" in peers:
        rows += run_kvq(args.model, windows, args.context, args.steps, args.kvq_flavor, not args.no_ppl)
    if "llama.cpp" in peers:
        gguf = gguf_path(args.model)
        if gguf is None:
            rows.append(Row("llama.cpp", "-", "-", status="unavailable: --model is not a GGUF file"))
        else:
            rows += run_llama_cpp(gguf, windows, args.context, args.steps, args.threads, not args.no_ppl)
    if "hf" in peers:
        rows += run_hf(args.model, windows, args.context, args.steps, not args.no_ppl)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"peers on {args.model}: strict-decode perplexity on {args.ppl_windows}x{args.ppl_tokens} "
                        f"britannica tokens; decode step at {args.context} tokens, batch 1")
    for col in ("engine", "cache", "kvq preset", "ppl", "Δppl vs own base", "decode ms", "x own base", "status"):
        table.add_column(col, justify="right" if col in ("ppl", "Δppl vs own base", "decode ms", "x own base")
                         else "left")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        table.add_row(r.engine, r.cache, r.kvq_counterpart, fmt(r.ppl, ".3f"), fmt(r.ppl_delta, "+.3f"),
                      fmt(r.decode_ms, ".2f"), fmt(r.speed_ratio, ".2f"), r.status)
    Console(width=200).print(table)
    if args.json_out:
        from kvq_export.validate.report import write_json

        write_json({"settings": vars(args), "rows": [asdict(r) for r in rows]}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
