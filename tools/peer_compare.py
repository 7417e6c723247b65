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
engines; absolute perplexities differ because llama.cpp runs 4-bit weights. ``--llama-weights fp32`` gives llama.cpp
the same weights as the others (the GGUF with every tensor dequantized to F32, :func:`dequantized_gguf`): then its
cache types compare with kvq's like for like, and ``--ppl-windows 8 --ppl-tokens 512 --ppl-offset 0`` is
protocol P (llama.cpp rows also report KL and top-1 agreement with its own f16 cache).

Peers and the kvq preset each one lines up with:

======================  ==================================  =====================================
engine                  cache                               kvq preset
======================  ==================================  =====================================
llama.cpp (flash attn)  f16 / q8_0 / q4_0 / q4_1 (rotated)  fp16 / q8_0-rot / q4_0-rot / q4_1-rot
                        also q5_0, K q8_0 + V q4_0          q5_0-rot, k-q8_0-v-q4_0-rot
transformers            QuantizedCache quanto int4 / int2   kivi-4 / kivi-2 (per-channel, R=128)
transformers            QuantizedCache hqq int4 / int2      kivi-4 / kivi-2
transformers            QuantizedCache fp8 (per tensor)     fp8
onnxruntime-genai       builder int8/int4_per_channel       ort-int8 / ort-int4 (--flavor ort-gqa)
======================  ==================================  =====================================

The onnxruntime-genai peer (``--peers genai``, :func:`run_genai`) runs the same fp32 weights in both runtimes'
own loops, on protocol P (8 x 512 britannica tokens from token 0) and at several contexts, with the builder's
scales from kvq's calibration and from its own calibrator.

The deployer's comparison (``--peers deploy``, :func:`run_deploy`) puts each runtime's 4-bit weights side by side:
kvq ``--flavor ort-gqa`` with int4 weights (unquantized buffer, ``ort-int8`` and ``ort-int8-asymv``, the ≤ 5-bit plan
``models/smollm2-plan-gqa-5-hc.json``; scales measured on the int4 weights it runs), the builder at ``-p int4`` (fp32
cache, ``int8_per_channel`` on kvq's scale file of the same int4-weight calibration) and llama.cpp on the GGUF (f16,
q8_0, q4_0 caches): decode step per context and prefill, interleaved in one process at batch 1, file and cache
bytes, and Δppl on protocol P against each engine's own unquantized cache, with the accuracy targets met or missed
(:func:`deploy_targets`); ``--markdown`` writes the table as it fills.

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

from kvq_export.bench import PPL_OFFSET, perplexity, run_bench
from kvq_export.bench_config import BenchConfig
from kvq_export.calibration import Calibration, calibrate_static_scales, calibration_windows
from kvq_export.corpus import load_corpus, token_windows
from kvq_export.export.exporter import ensure_export
from kvq_export.measure.builder import build_with_builder, builder_calibration, model_hf_dir, stamp_matches, write_stamp
from kvq_export.memory import predict
from kvq_export.model_source import _ensure_fp32_cache, load_model, model_facts, resolve_spec
from kvq_export.presets import resolve_scheme
from kvq_export.request import DEFAULT_CALIBRATION, DEFAULT_PERCENTILE, ExportRequest, WeightSpec
from kvq_export.runtime.genai import builder_scale_file
from kvq_export.runtime.session import KVQSession
from kvq_export.validate.report import write_json

logger = logging.getLogger("peer_compare")

PEERS = ("kvq", "llama.cpp", "hf", "genai", "deploy")
#: ``--peers`` unless given: the deployer's comparison (``deploy``) runs only when asked for
DEFAULT_PEERS = ("kvq", "llama.cpp", "hf", "genai")
KVQ_PRESETS = ("q8_0", "q4_0", "q4_1", "kivi-4", "kivi-2", "fp8")
#: llama.cpp cache -> (ggml key type, ggml value type, kvq preset). llama.cpp stores a quantized cache in a
#: Hadamard-rotated basis (unless ``LLAMA_ATTN_ROT_DISABLE=1``), hence the ``-rot`` counterparts.
LLAMA_CPP_TYPES = {"f16": ("GGML_TYPE_F16", "GGML_TYPE_F16", "fp16"),
                   "q8_0": ("GGML_TYPE_Q8_0", "GGML_TYPE_Q8_0", "q8_0-rot"),
                   "k-q8_0-v-q4_0": ("GGML_TYPE_Q8_0", "GGML_TYPE_Q4_0", "k-q8_0-v-q4_0-rot"),
                   "q5_0": ("GGML_TYPE_Q5_0", "GGML_TYPE_Q5_0", "q5_0-rot"),
                   "q4_1": ("GGML_TYPE_Q4_1", "GGML_TYPE_Q4_1", "q4_1-rot"),
                   "q4_0": ("GGML_TYPE_Q4_0", "GGML_TYPE_Q4_0", "q4_0-rot")}
LLAMA_CPP_DEFAULT = ("f16", "q8_0", "q4_0", "q4_1")
#: ``--llama-weights``: the GGUF's own (quantized) weights, or the same file with every tensor dequantized to F32
LLAMA_WEIGHTS = ("gguf", "fp32")
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
    mean_kl: float | None = None  # llama.cpp: mean KL of the next-token distribution from its own f16 cache's
    top1: float | None = None  # llama.cpp: share of tokens whose argmax agrees with the f16 cache's
    decode_ms: float | None = None  # median single-token step at --context tokens
    speed_ratio: float | None = None  # decode_ms / the engine's baseline decode_ms (< 1: faster)
    note: str = ""
    decode_ms_at: dict[int, float] | None = None  # genai peer: median step per context
    prefill_tok_s: float | None = None  # genai peer: chunked prefill of the longest context
    cache_bytes: int | None = None  # genai peer: cache buffers held at the longest context
    weights: str = ""  # genai peer: how the weights are stored (fp32, int4)
    decode_ms_batch: dict[int, dict[int, float]] | None = None  # genai peer: batch -> context -> median step
    prefill_tok_s_at: dict[int, float] | None = None  # genai peer: context -> prefill tok/s (batch 1)
    dir_bytes: int | None = None  # genai peer: bytes of the export directory's files
    bits_4096: float | None = None  # kvq rows of the genai/deploy peers: the scheme's bits/element at 4096 tokens
    cache_bytes_at: dict[int, int] | None = None  # genai/deploy peers: context -> cache bytes held (batch 1)


def _has(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@dataclass
class NllPool:
    """Protocol P's pooling: the NLL of every scored token summed in float64, ``ppl = exp(total / count)``.

    Windows are pooled by token, not averaged per window, so every engine's figure weighs the same 4088 tokens
    alike however it batches them.
    """

    total: float = 0.0
    count: int = 0

    def add(self, logits: np.ndarray, targets: Sequence[int] | np.ndarray) -> None:
        """Score ``targets`` [n] under ``logits`` [n, vocab] (row i predicts ``targets[i]``)."""
        targets = np.asarray(targets, dtype=np.int64).reshape(-1)
        logp = _log_softmax(np.asarray(logits).reshape(len(targets), -1))
        self.total -= float(logp[np.arange(len(targets)), targets].sum())
        self.count += len(targets)

    @property
    def ppl(self) -> float:
        """``exp`` of the mean NLL of the tokens added so far."""
        if not self.count:
            raise ValueError("perplexity of no scored token")
        return math.exp(self.total / self.count)


def _finish(rows: list[Row], baseline: str) -> list[Row]:
    """``ppl_delta`` and ``speed_ratio`` of every ok row against the ``baseline`` cache's row, where both exist."""
    base = next((r for r in rows if r.cache == baseline and r.status == "ok"), None)
    for r in rows:
        if base is not None and r.status == "ok":
            r.ppl_delta = r.ppl - base.ppl if r.ppl is not None and base.ppl is not None else None
            r.speed_ratio = r.decode_ms / base.decode_ms if r.decode_ms and base.decode_ms else None
    return rows


# -- kvq ---------------------------------------------------------------------------------------------------------
def run_kvq(model: str, windows: list[list[int]], context: int, steps: int, flavor: str,
            ppl: bool = True) -> list[Row]:
    """Run kvq's presets on ONNX Runtime: perplexity and decode speed through ``kvq_export.bench``."""
    report = run_bench(BenchConfig(model, list(KVQ_PRESETS), flavors=(flavor,), contexts=(context,), batches=(1,),
                                   steps=steps, warmup=4, prefill_tokens=64, prefill_repeats=1))
    rows = []
    for result in report.results:
        session = KVQSession(report.settings["exports"][flavor][result.scheme])
        rows.append(Row("kvq " + flavor, result.scheme, result.scheme, decode_ms=result.decode_ms_median,
                        ppl=perplexity(session, windows)["ppl"] if ppl else None))
        logger.info("kvq %s: %s", flavor, rows[-1])
    return _finish(rows, "fp16")


# -- llama.cpp -----------------------------------------------------------------------------------------------------
def _interleaved(steppers: dict[str, Callable[[int], None]], steps: int, warmup: int = 4) -> dict[str, float]:
    """Median ms of ``steps`` calls per configuration, one call each per round (load drift hits all).

    Each round runs the configurations in a fresh (seeded) random order: with a fixed cyclic order every
    configuration would always follow the same other one, and inherit its after-effects (ONNX Runtime's
    worker threads keep spinning for a while after a run, onnxruntime-genai's as kvq's).
    """
    names = list(steppers)
    times: dict[str, list[float]] = {name: [] for name in names}
    rng = np.random.default_rng(0)
    for i in range(warmup + steps):
        for name in rng.permutation(names):
            start = time.perf_counter()
            steppers[name](i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def run_llama_cpp(gguf: Path, windows: list[list[int]], context: int, steps: int, threads: int | None,
                  ppl: bool = True, caches: Sequence[str] = LLAMA_CPP_DEFAULT) -> list[Row]:
    """Run llama.cpp through llama-cpp-python: flash attention on, one engine per cache in ``caches``.

    Perplexity is strict decode on every engine, and each quantized cache's next-token distributions are
    compared with the f16 cache's (mean KL, top-1 agreement), window by window.
    """
    caches = ["f16", *(c for c in caches if c != "f16")]
    try:
        import_llama_cpp()
    except SystemExit as missing:
        return [Row("llama.cpp", c, _llama_cpp_counterpart(c), status=f"unavailable: {missing}") for c in caches]

    rows, engines = {}, {}
    length = max(len(w) for w in windows)
    prompt = (windows[0] * (context // len(windows[0]) + 1))[:context]
    for cache in caches:
        row = rows[cache] = Row("llama.cpp", cache, _llama_cpp_counterpart(cache))
        try:
            engines[cache] = llama_cpp_context(gguf, cache, max(context + steps + 16, length + 8), threads,
                                               logits_all=True)
        except Exception as err:  # a peer failing must not stop the others
            row.status = f"failed: {type(err).__name__}: {err}"
    if ppl and engines:
        for name, (value, kl, top1) in _llama_cpp_scores(engines, windows, rows).items():
            rows[name].ppl, rows[name].mean_kl, rows[name].top1 = value, kl, top1
            logger.info("llama.cpp %s: %s", name, rows[name])
    for name, llm in list(engines.items()):
        try:
            llm.reset()
            llm.eval(prompt)
        except Exception as err:
            rows[name].status = f"failed: {type(err).__name__}: {err}"
            del engines[name]
    if engines:
        speeds = _interleaved({name: (lambda i, llm=llm: llm.eval([prompt[i % len(prompt)]]))
                               for name, llm in engines.items()}, steps)
        for name, ms in speeds.items():
            rows[name].decode_ms = ms
    return _finish(list(rows.values()), "f16")


def import_llama_cpp():
    """``llama_cpp`` (llama-cpp-python), or a one-line SystemExit naming what is missing and what to install."""
    try:
        import llama_cpp
    except ImportError as err:  # the package itself, or one of its own imports (diskcache, jinja2)
        raise SystemExit(f"llama_cpp is not importable ({err}): pip install llama-cpp-python==0.3.36 diskcache "
                         "(builds llama.cpp from source, about 10 minutes; tools/README.md)") from None
    return llama_cpp


def llama_cpp_context(gguf: Path, cache: str, n_ctx: int, threads: int | None, logits_all: bool = False):
    """A ``llama_cpp.Llama`` on ``gguf`` with ``cache``'s K/V types and flash attention on.

    ``threads`` serve decode and prefill alike; prompts are evaluated in batches of PREFILL_CHUNK (as kvq and
    onnxruntime-genai prefill here).
    """
    llama_cpp = import_llama_cpp()
    k_type, v_type, _ = LLAMA_CPP_TYPES[cache]
    kwargs = dict(model_path=str(gguf), n_ctx=n_ctx, n_batch=PREFILL_CHUNK, n_ubatch=PREFILL_CHUNK,
                  type_k=getattr(llama_cpp, k_type), type_v=getattr(llama_cpp, v_type), flash_attn=True,
                  logits_all=logits_all, verbose=False, n_threads=threads, n_threads_batch=threads, seed=0)
    return llama_cpp.Llama(**{k: v for k, v in kwargs.items() if v is not None})


def strict_logits(llm, window: Sequence[int]) -> np.ndarray:
    """Strict decode of ``window`` from an empty cache on ``llm`` (made with ``logits_all``), one token per eval.

    Returns the logits of every position but the last [len - 1, vocab]; row i predicts token i + 1.
    """
    llm.reset()
    for token in window:
        llm.eval([token])
    return np.asarray(llm.scores[: len(window) - 1])


def _llama_cpp_counterpart(cache: str) -> str:
    """The kvq preset ``cache`` lines up with: the rotated one unless llama.cpp's rotation is switched off."""
    import os

    preset = LLAMA_CPP_TYPES[cache][2]
    off = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0").strip()
    return preset.removesuffix("-rot") if off.lstrip("-").isdigit() and int(off) else preset


def _llama_cpp_scores(engines: dict[str, Any], windows: list[list[int]],
                      rows: dict[str, Row]) -> dict[str, tuple[float, float | None, float | None]]:
    """Strict decode of ``windows`` on every engine: ``{cache: (ppl, mean KL from f16, top-1 agreement)}``.

    Every window is decoded one token per eval on each engine in turn; its scored positions (all but the last
    token's) are compared with the f16 engine's before the next window, so only one window of logits is held.
    An engine that fails is marked in ``rows`` and dropped.
    """
    nll = {name: 0.0 for name in engines}
    kl = {name: 0.0 for name in engines}
    agree = {name: 0 for name in engines}
    count = 0
    for window in windows:
        logp = {}
        for name, llm in list(engines.items()):
            try:
                logp[name] = _log_softmax(strict_logits(llm, window))
            except Exception as err:
                rows[name].status = f"failed: {type(err).__name__}: {err}"
                del engines[name]
        targets = np.asarray(window[1:])
        base = logp.get("f16")
        for name, lp in logp.items():
            nll[name] -= float(lp[np.arange(len(targets)), targets].sum())
            if base is not None:
                kl[name] += float((np.exp(base) * (base - lp)).sum())
                agree[name] += int((base.argmax(-1) == lp.argmax(-1)).sum())
        count += len(targets)
    has_base = "f16" in engines
    return {name: (math.exp(nll[name] / count), kl[name] / count if has_base else None,
                   agree[name] / count if has_base else None) for name in engines}


def dequantized_gguf(source: Path, out: Path) -> Path:
    """``source`` with every tensor stored as F32 (quantized ones dequantized by gguf's reference), at ``out``.

    llama.cpp then runs the very weights kvq and transformers run (kvq's fp32 conversion of a GGUF dequantizes
    the same tensors), so a cache comparison no longer mixes in the quantized matmuls' arithmetic (llama.cpp
    rounds every activation to q8 blocks before a Q4_1 matmul). Metadata and tensor order are copied; the file
    is written once and reused while the stamp beside it (``out``'s folder holds one copy) matches ``source``.
    """
    import gguf
    from gguf.quants import dequantize

    stamp = {"source": str(source), "bytes": source.stat().st_size, "mtime_ns": source.stat().st_mtime_ns}
    if stamp_matches(out.parent, stamp) and out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    write_stamp(out.parent, stamp)
    logger.info("llama.cpp weights: %s dequantized to F32 at %s", source, out)
    return out


# -- transformers ------------------------------------------------------------------------------------------------
def run_hf(model: str, windows: list[list[int]], context: int, steps: int, ppl: bool = True) -> list[Row]:
    """Run transformers' QuantizedCache backends vs DynamicCache, in PyTorch on the fp32 model."""
    import torch
    from transformers.cache_utils import DynamicCache, QuantizedCache

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
                    pool = NllPool()
                    for window in windows:
                        cache = make()
                        for i in range(len(window) - 1):
                            logits = hf_model(input_ids=torch.tensor([[window[i]]]), cache=cache,
                                              use_cache=True).logits
                            pool.add(logits[0, -1].numpy(), [window[i + 1]])
                    row.ppl = pool.ppl
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


# -- onnxruntime-genai and its model builder ------------------------------------------------------------------
#: builder ``kv_cache_quant_scheme`` -> the kvq ort-gqa preset holding the same cache (static symmetric per channel)
GENAI_SCHEMES = {"int8_per_channel": "ort-int8", "int4_per_channel": "ort-int4"}
PREFILL_CHUNK = 512
FP32_CACHE = Path(__file__).resolve().parent / "schemes" / "fp32-cache.json"


class GenaiEngine:
    """A builder (or kvq) export on onnxruntime-genai's own loop."""

    def __init__(self, directory: Path) -> None:
        import json

        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(directory))
        self.outputs = json.loads((directory / "genai_config.json").read_text())["model"]["decoder"]
        self.layers = int(self.outputs["num_hidden_layers"])

    def perplexity(self, windows: list[list[int]]) -> float:
        """Strict decode, one token per step, NLL pooled over the windows.

        One generator per window: onnxruntime-genai 0.18 refuses a second ``append_tokens`` on a batch of more
        than one row ("AppendTokens can only be called once for batch_size > 1"), so the windows run one by one.
        """
        ids = np.asarray(windows, dtype=np.int32)
        pool = NllPool()
        for row in ids:
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=ids.shape[1], do_sample=False)
            generator = self.og.Generator(self.model, params)
            for i in range(ids.shape[1] - 1):
                generator.append_tokens(row[i:i + 1])
                pool.add(generator.get_logits(), [row[i + 1]])
        return pool.ppl

    def prefill(self, tokens: list[int], max_length: int, batch: int = 1):
        """A generator holding ``tokens`` (appended in chunks of PREFILL_CHUNK); returns (state, seconds).

        ``batch`` > 1: that many copies of ``tokens`` in one call (og appends a batch's prompt only once).
        """
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False, batch_size=batch)
        generator = self.og.Generator(self.model, params)
        start = time.perf_counter()
        if batch > 1:
            generator.append_tokens(np.tile(np.asarray(tokens, dtype=np.int32), (batch, 1)))
        for i in range(0, len(tokens), PREFILL_CHUNK) if batch == 1 else ():
            generator.append_tokens(np.asarray(tokens[i:i + PREFILL_CHUNK], dtype=np.int32))
        return generator, time.perf_counter() - start

    @staticmethod
    def step(generator) -> None:
        """One decode step: run the last token, pick the next greedily (og's C++ loop)."""
        generator.generate_next_token()

    def cache_bytes(self, generator) -> int:
        """Bytes of the present key/value tensors og holds."""
        names = self.outputs["outputs"]
        return sum(int(generator.get_output(names[f"present_{part}_names"] % layer).nbytes)
                   for layer in range(self.layers) for part in ("key", "value"))


class KvqEngine:
    """A kvq ort-gqa export in kvq's Python loop (KVQSession, IO binding, one shared buffer per stream).

    ``spinning=True`` keeps ONNX Runtime's intra-op thread spinning on (its default; KVQSession, like
    onnxruntime-genai's loop, turns it off): measured on the shared 2-core machine, kvq's graph in og's loop
    steps exactly as fast as in kvq's loop without spinning, and much faster than with spinning when other
    processes load the cores.
    """

    def __init__(self, directory: Path, spinning: bool = False) -> None:
        self.session = KVQSession(directory, spinning=spinning)

    def perplexity(self, windows: list[list[int]]) -> float:
        """Strict decode (``kvq_export.bench.perplexity``)."""
        return perplexity(self.session, windows)["ppl"]

    def prefill(self, tokens: list[int], max_length: int, batch: int = 1):
        """A cache holding ``tokens`` (chunks of PREFILL_CHUNK); returns ([cache, next tokens], seconds).

        ``batch`` > 1: the one row's cache copied to ``batch`` rows (the same state og's batch of copies reaches).
        """
        cache = self.session.empty_cache(1, capacity=max_length)
        start = time.perf_counter()
        for i in range(0, len(tokens), PREFILL_CHUNK):
            logits, cache = self.session.step(np.asarray([tokens[i:i + PREFILL_CHUNK]], dtype=np.int64), None, cache)
        seconds = time.perf_counter() - start
        if batch > 1:
            cache = self.session.cache_from_arrays({name: np.repeat(array, batch, axis=0) for name, array
                                                    in self.session.cache_arrays(cache).items()})
        return [cache, np.repeat(logits[:, -1:].argmax(-1), batch, axis=0)], seconds

    def step(self, state) -> None:
        """One decode step: run the last tokens, pick the next greedily (kvq's Python loop)."""
        logits, state[0] = self.session.step(state[1], None, state[0])
        state[1] = logits[:, -1:].argmax(-1)

    def cache_bytes(self, state) -> int:
        """Bytes of the cache buffers kvq holds."""
        return self.session.cache_nbytes(state[0])


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python) on one GGUF and one cache type, with the protocol of :class:`GenaiEngine`.

    Flash attention on, ``threads`` threads for decode and prefill. Each prefill makes a context of its own
    ``max_length`` (llama.cpp allocates every cell of a context up front), freed with its state.
    """

    def __init__(self, gguf: Path, cache: str, threads: int | None) -> None:
        self.llama_cpp = import_llama_cpp()
        self.gguf, self.cache, self.threads = gguf, cache, threads

    def perplexity(self, windows: list[list[int]]) -> float:
        """Strict decode (one token per eval, each window from an empty cache), NLL pooled over the windows."""
        llm = llama_cpp_context(self.gguf, self.cache, max(len(w) for w in windows), self.threads, logits_all=True)
        pool = NllPool()
        for window in windows:
            pool.add(strict_logits(llm, window), window[1:])
        return pool.ppl

    def prefill(self, tokens: list[int], max_length: int, batch: int = 1):
        """A context holding ``tokens`` (evaluated in batches of PREFILL_CHUNK); returns ([llm, next token], s)."""
        if batch != 1:
            raise SystemExit(f"the llama.cpp engine times batch 1 only, not {batch}")
        llm = llama_cpp_context(self.gguf, self.cache, max_length, self.threads)
        llm.eval(tokens[:8])  # the first decode allocates: keep it out of the timing
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        seconds = time.perf_counter() - start
        return [llm, self._greedy(llm)], seconds

    def _greedy(self, llm) -> int:
        """The argmax of the last evaluated position's logits (what kvq's and og's greedy steps pick)."""
        logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))
        return int(logits.argmax())

    def step(self, state) -> None:
        """One decode step: run the last token, pick the next greedily."""
        state[0].eval([state[1]])
        state[1] = self._greedy(state[0])

    def cache_bytes(self, state) -> int:
        """Bytes llama.cpp serializes for the sequence: its K/V rows of the cells in use (and their positions)."""
        return int(self.llama_cpp.llama_state_seq_get_size(state[0].ctx, 0))


def kvq_gqa_export(model: str, scheme: str, out: Path, static, weights: str = "fp32",
                   accuracy_level: int | None = None) -> Path:
    """``kvq export --flavor ort-gqa`` with the given static scales (reused if built by this kvq from the same request).

    ``weights`` other than fp32: the request carries them, and the export goes to ``OUT-w-int4`` (``-a4`` for an
    ``accuracy_level``) beside it; :func:`~kvq_export.export.exporter.ensure_export` decides the reuse.
    """
    level = {} if accuracy_level is None else {"accuracy_level": accuracy_level}
    if weights != "fp32":
        out = out.with_name(f"{out.name}-w-{weights}{'' if accuracy_level is None else f'-a{accuracy_level}'}")
    request = ExportRequest(model, scheme, flavor="ort-gqa", weights=WeightSpec(weights, **level))
    return ensure_export(request, out, static=static)


def dir_bytes(directory: Path) -> int:
    """Bytes of the files a directory holds (what a deployer ships)."""
    stamps = ("peer_stamp.json", "weights_stamp.json")
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file() and f.name not in stamps)


class EngineSet:
    """Named engines, each with its :class:`Row`; an engine is a factory until it is first scored or timed."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[Row, Any]] = {}

    def add(self, name: str, row: Row, factory: Callable[[], Any]) -> None:
        self.entries[name] = (row, factory)

    def row(self, name: str) -> Row:
        return self.entries[name][0]

    def loaded(self, name: str):
        """The engine ``name``, loading it on first use (a model is only loaded when it is scored or timed)."""
        row, engine = self.entries[name]
        if callable(engine):
            self.entries[name] = row, engine()
        return self.entries[name][1]

    def rows(self) -> list[Row]:
        return [row for row, _ in self.entries.values()]


#: each engine's rows are compared with its own unquantized cache (same weights, same runtime)
OWN_BASELINES = {"kvq ort-gqa": "fp32 buffer", "genai builder": "fp32 (no kv quant)", "llama.cpp": "f16"}


def own_baseline_deltas(rows: list[Row]) -> list[Row]:
    """``ppl_delta`` (and ``speed_ratio``) of every row against its engine's own unquantized cache."""
    for engine, baseline in OWN_BASELINES.items():
        _finish([r for r in rows if r.engine == engine], baseline)
    return rows


def genai_engines(model: str, work: Path, int4_percentile: float | None = DEFAULT_PERCENTILE,
                  precision: str = "fp32", kvq_weights: str = "fp32",
                  schemes: Sequence[str] = tuple(GENAI_SCHEMES), own_scales: bool = True,
                  kvq_accuracy_level: int | None = None, spin_twins: bool = True,
                  kvq_schemes: Sequence[str] = ()) -> EngineSet:
    """The kvq ort-gqa exports (kvq's loop) and onnxruntime-genai builder builds (og's loop) of ``model``, unloaded.

    kvq's static scales come from ``kvq export``'s default calibration (:data:`kvq_export.request.DEFAULT_CALIBRATION`:
    4096 held-out britannica tokens, absmax); for each builder scheme in ``schemes`` (keys of GENAI_SCHEMES) the
    builder gets those same scales (``kvq calibrate --format genai-scales``) and, unless ``own_scales`` is off, its
    own calibrator's (its default path); ``int4_percentile`` adds int4 with kvq percentile scales. Scales are measured
    on the weights each runtime runs: kvq's on ``kvq_weights`` (int4: the dequantized blocks, as ``kvq export``
    calibrates), the builder's file on ``precision`` (``kvq calibrate --weights``).
    ``kvq_schemes`` (presets or scheme/plan files) are further kvq exports with the default calibration and no
    builder twin. ``precision`` is the builder's ``-p`` (its CPU default is int4), ``kvq_weights`` the format kvq's
    exports' weights are converted to (:mod:`kvq_export.graph.weights`, with MatMulNBits' ``kvq_accuracy_level``
    when given: 4 is the builder's int8 activations). ``spin_twins`` adds every kvq export once more with ONNX
    Runtime's thread spinning on.
    """
    import json

    unknown = sorted(set(schemes) - set(GENAI_SCHEMES))
    if unknown:
        raise SystemExit(f"unknown builder scheme(s) {unknown}; allowed: {list(GENAI_SCHEMES)}")
    hf = model_hf_dir(model)
    hf_model, tokenizer = load_model(model)
    facts = model_facts(hf_model.config)
    spec = DEFAULT_CALIBRATION
    calib = calibration_windows(tokenizer, spec.corpus, spec.tokens, offset=spec.offset)
    work.mkdir(parents=True, exist_ok=True)
    engines = EngineSet()
    # the default fp32 builds keep their old folder names (and their stamps)
    tag = "" if precision == "fp32" else f"-p{precision}"

    def kvq_row(cache: str, preset: str, directory: Path) -> Row:
        weights = kvq_weights if kvq_accuracy_level is None else f"{kvq_weights} (accuracy_level {kvq_accuracy_level})"
        return Row("kvq ort-gqa", cache, preset, weights=weights, dir_bytes=dir_bytes(directory))

    def builder_row(cache: str, preset: str, directory: Path) -> Row:
        return Row("genai builder", cache, preset, weights=precision, dir_bytes=dir_bytes(directory))

    def calibrated(scheme, name: str, label: str, method: str, pct: float, weights: str) -> Calibration:
        """Static scales measured on the model with ``weights`` weights (int4: the blocks an export computes with).

        Saved beside the exports: calibrating again would give the same.
        """
        saved = work / f"kvq-static-{name}-{label}{'' if weights == 'fp32' else f'-w-{weights}'}.npz"
        if saved.is_file():
            return Calibration.load(saved)
        static = calibrate_static_scales(hf_model, scheme, calib, method=method, percentile=pct,
                                         weights=WeightSpec(weights))
        static.save(saved)
        return static

    def kvq_export(preset: str, method: str, pct: float):
        """Static scales and the export on them: (scheme, label, static)."""
        scheme, label = resolve_scheme(preset), f"p{pct:g}" if method == "percentile" else method
        name = Path(preset).stem if preset.endswith(".json") else preset
        static = calibrated(scheme, name, label, method, pct, kvq_weights)
        kvq_dir = kvq_gqa_export(model, preset, work / f"kvq-{name}-{label}", static, kvq_weights, kvq_accuracy_level)
        row = kvq_row(f"{name} (kvq {label} scales)", name, kvq_dir)
        row.bits_4096 = predict(scheme, facts, 4096).bits_per_element
        engines.add(f"kvq {name} {label}", row, lambda d=kvq_dir: KvqEngine(d))
        if spin_twins:
            engines.add(f"kvq {name} {label} spin", kvq_row(f"{name} (kvq {label} scales, spinning)", name, kvq_dir),
                        lambda d=kvq_dir: KvqEngine(d, spinning=True))
        return scheme, label, static

    fp32_dir = kvq_gqa_export(model, str(FP32_CACHE), work / "kvq-fp32", None, kvq_weights, kvq_accuracy_level)
    engines.add("kvq fp32", kvq_row("fp32 buffer", "fp32-cache", fp32_dir), lambda: KvqEngine(fp32_dir))
    base_dir = build_with_builder(hf, work / f"builder-fp32{tag}", precision=precision)
    engines.add("builder fp32", builder_row("fp32 (no kv quant)", "fp32-cache", base_dir),
                lambda: GenaiEngine(base_dir))
    for quant in schemes:
        preset = GENAI_SCHEMES[quant]
        methods = [(str(spec.method), spec.percentile)] + (
            [("percentile", int4_percentile)] if "int4" in quant and int4_percentile else [])
        for method, pct in methods:
            scheme, label, static = kvq_export(preset, method, pct)
            if WeightSpec(precision).calibration_weights != static.weights:  # the builder's scales: on its weights
                static = calibrated(scheme, preset, label, method, pct, precision)
            scales = work / f"kvq-scales-{quant}-{label}{tag}.json"
            scales.write_text(json.dumps(builder_scale_file(static, scheme, facts)))
            built = build_with_builder(hf, work / f"builder-{quant}-kvq-{label}{tag}", quant, scales, precision)
            engines.add(f"builder {quant} kvq-{label}", builder_row(f"{quant} (kvq {label} scales)", preset, built),
                        lambda d=built: GenaiEngine(d))
        if not own_scales:
            continue
        # the builder's calibrator runs the fp32 build (its own scales do not depend on the weights' format)
        fp32_base = base_dir if precision == "fp32" else build_with_builder(hf, work / "builder-fp32")
        own = builder_calibration(fp32_base, hf, work / f"builder-scales-{quant}.json", quant)
        built = build_with_builder(hf, work / f"builder-{quant}-own{tag}", quant, own, precision)
        engines.add(f"builder {quant} own", builder_row(f"{quant} (builder calibrator)", preset, built),
                    lambda d=built: GenaiEngine(d))
    for extra in kvq_schemes:
        kvq_export(extra, str(spec.method), spec.percentile)
    return engines


def measure_engines(engines: EngineSet, p_windows: list[list[int]], contexts: Sequence[int], steps: int,
                    text: list[int], ppl: bool = True, ppl_engines: Sequence[str] | None = None,
                    timed_engines: Sequence[str] | None = None, batches: Sequence[int] = (1,),
                    batch_max_context: int | None = None,
                    on_update: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Score and time ``engines``: protocol P perplexity on ``p_windows``, then decode steps per context.

    Perplexity is strict decode in each engine's own loop. Decode steps at each context are interleaved across the
    timed engines in this process, after a chunked prefill of ``text``'s first tokens (tokens/s of that prefill
    at batch 1); each context is timed at every batch size in ``batches`` (a batch of copies of one prompt),
    batches over one only up to ``batch_max_context``. ``ppl_engines`` / ``timed_engines`` pick engines by name
    (default: every engine but the spinning twins / but the builder's own and percentile scales, whose speed
    equals their twins'), so a loaded machine can split the work. ``on_update`` gets the rows (deltas against each
    engine's own unquantized cache filled in) after every perplexity and every context.
    """
    rows = engines.rows()

    def update() -> None:
        if on_update is not None:
            on_update(own_baseline_deltas(rows))

    unknown = sorted((set(ppl_engines or ()) | set(timed_engines or ())) - set(engines.entries))
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; known: {list(engines.entries)}")
    if ppl:
        for name in list(engines.entries):
            if name not in ppl_engines if ppl_engines is not None else name.endswith(" spin"):
                continue  # (a spinning engine scores exactly what its twin does)
            row, engine = engines.row(name), engines.loaded(name)
            start = time.perf_counter()
            row.ppl = engine.perplexity(p_windows)
            logger.info("%s: ppl %.4f (%.0f s)", name, row.ppl, time.perf_counter() - start)
            update()
    # timing: one engine per (runtime, scheme); the builder's calibrators do not change its speed
    timed = {name: (engines.row(name), engines.loaded(name)) for name in list(engines.entries) if contexts
             and (name in timed_engines if timed_engines is not None else "own" not in name and "p99" not in name)}
    warmup = 4
    for _, engine in timed.values():  # first runs allocate and prepack: keep them out of the prefill timing
        engine.prefill(text[:PREFILL_CHUNK], PREFILL_CHUNK + 1)
    runs = [(c, b) for c in contexts for b in batches if b == 1 or batch_max_context is None or c <= batch_max_context]
    for context, batch in runs if timed else ():
        states, prefill_s = {}, {}
        for name, (_, engine) in timed.items():
            states[name], prefill_s[name] = engine.prefill(text[:context - warmup - steps - 1], context, batch)
        ms = _interleaved({name: (lambda i, e=engine, st=states[name]: e.step(st))
                           for name, (_, engine) in timed.items()}, steps, warmup)
        for name, (row, engine) in timed.items():
            row.decode_ms_batch = row.decode_ms_batch or {}
            row.decode_ms_batch.setdefault(batch, {})[context] = ms[name]
            row.cache_bytes = engine.cache_bytes(states[name])
            if batch == 1:
                row.decode_ms_at = {**(row.decode_ms_at or {}), context: ms[name]}
                row.decode_ms = ms[name]
                row.prefill_tok_s = (context - warmup - steps - 1) / prefill_s[name]
                row.prefill_tok_s_at = {**(row.prefill_tok_s_at or {}), context: row.prefill_tok_s}
                row.cache_bytes_at = {**(row.cache_bytes_at or {}), context: row.cache_bytes}
            logger.info("%s ctx %d batch %d: step %.2f ms, prefill %.0f tok/s (%.0f s), cache %d B", name, context,
                        batch, ms[name], (context - warmup - steps - 1) * batch / prefill_s[name], prefill_s[name],
                        row.cache_bytes)
        del states
        update()
    return own_baseline_deltas(rows)


def run_genai(model: str, p_windows: list[list[int]], contexts: Sequence[int], steps: int, work: Path,
              ppl: bool = True, int4_percentile: float | None = DEFAULT_PERCENTILE,
              ppl_engines: Sequence[str] | None = None, timed_engines: Sequence[str] | None = None,
              precision: str = "fp32", kvq_weights: str = "fp32",
              schemes: Sequence[str] = tuple(GENAI_SCHEMES), own_scales: bool = True,
              batches: Sequence[int] = (1,), batch_max_context: int | None = None,
              kvq_accuracy_level: int | None = None,
              on_update: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Run kvq ort-gqa (kvq's loop) vs onnxruntime-genai's builder (og's loop) on the same weights.

    The engines of :func:`genai_engines`, scored and timed by :func:`measure_engines` (arguments as there).
    """
    if not _has("onnxruntime_genai"):
        return [Row("onnxruntime-genai", "-", "-", status="unavailable: pip install onnxruntime-genai==0.18.0")]
    engines = genai_engines(model, work, int4_percentile, precision, kvq_weights, schemes, own_scales,
                            kvq_accuracy_level)
    return measure_engines(engines, p_windows, contexts, steps, protocol_text(model, contexts), ppl, ppl_engines,
                           timed_engines, batches, batch_max_context, on_update)


def protocol_text(model: str, contexts: Sequence[int]) -> list[int]:
    """The britannica tokens from token 0 that every timed engine prefills (as many as the longest context)."""
    return text_windows(model, 1, max(contexts), offset=0)[0] if contexts else []


# -- the deployer's comparison: int4 weights in every runtime ------------------------------------------------------
#: kvq's fast-path plan (≤ 5 bits/element at 4096 tokens) beside its int8 cache
DEPLOY_PLAN = Path(__file__).resolve().parents[1] / "models" / "smollm2-plan-gqa-5-hc.json"
DEPLOY_LLAMA_CACHES = ("q8_0", "q4_0")
#: kvq's int8 caches beside the builder's: ``ort-int8`` its exact twin (symmetric, the same scales), ``ort-int8-asymv``
#: what only kvq's graph gives the node (values with zero points, added back after attention)
DEPLOY_INT8 = ("ort-int8", "ort-int8-asymv")
#: the plan's targets on protocol P: Δppl at most PLAN_DELTA_PCT % within PLAN_BITS bits/element at 4096 tokens
PLAN_DELTA_PCT, PLAN_BITS = 1.0, 5.0


def gguf_file_type(path: Path) -> str:
    """The weight format a GGUF file declares (``Q4_1`` for ``MOSTLY_Q4_1``)."""
    import gguf

    field = gguf.GGUFReader(path).fields[gguf.Keys.General.FILE_TYPE]
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")


def run_deploy(model: str, p_windows: list[list[int]], contexts: Sequence[int], steps: int, work: Path,
               threads: int | None = 2, ppl: bool = True, llama_caches: Sequence[str] = DEPLOY_LLAMA_CACHES,
               plans: Sequence[str] = (str(DEPLOY_PLAN),), ppl_engines: Sequence[str] | None = None,
               timed_engines: Sequence[str] | None = None,
               on_update: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """What a deployer weighs, side by side: each runtime's 4-bit weights, with and without a quantized cache.

    kvq ``--flavor ort-gqa`` with int4 weights (fp32 buffer, the :data:`DEPLOY_INT8` caches, ``plans``),
    onnxruntime-genai's builder at ``-p int4`` (fp32 cache, ``int8_per_channel`` on kvq's scale file) and llama.cpp
    on the model's GGUF (f16 cache and ``llama_caches``; ``threads`` threads, flash attention), all timed interleaved
    at batch 1 in one process and scored on protocol P against their own unquantized cache.
    """
    if not _has("onnxruntime_genai"):
        raise SystemExit("the deploy peer needs onnxruntime_genai: pip install onnxruntime-genai==0.18.0")
    gguf = gguf_path(model) if llama_caches else None
    if llama_caches and gguf is None:
        raise SystemExit(f"llama.cpp rows need a GGUF model, and --model {model} is not one")
    if llama_caches:
        import_llama_cpp()  # before the long builds: a missing peer is a one-line error, not a late one
    engines = genai_engines(model, work, None, "int4", "int4", ("int8_per_channel",), own_scales=False,
                            spin_twins=False,  # ort-int8 comes with the builder's int8_per_channel twin
                            kvq_schemes=(*(s for s in DEPLOY_INT8 if s not in GENAI_SCHEMES.values()), *plans))
    for cache in ("f16", *(c for c in llama_caches if c != "f16")) if llama_caches else ():
        row = Row("llama.cpp", cache, _llama_cpp_counterpart(cache), weights=f"{gguf_file_type(gguf)} (GGUF)",
                  dir_bytes=gguf.stat().st_size)
        engines.add(f"llama.cpp {cache}", row, lambda c=cache: LlamaCppEngine(gguf, c, threads))
    return measure_engines(engines, p_windows, contexts, steps, protocol_text(model, contexts), ppl, ppl_engines,
                           timed_engines, on_update=on_update)


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``-`` when it was not measured."""
    return "-" if value is None else format(value, spec)


def _fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def _pct(row: Row) -> float | None:
    """``row``'s Δppl in percent of its own baseline's perplexity."""
    return None if row.ppl_delta is None else 100 * row.ppl_delta / (row.ppl - row.ppl_delta)


def _deploy_reference(rows: list[Row]) -> Row | None:
    """The row the deployer's ratios divide by: the builder's int8 cache (int4 weights, its CPU default)."""
    return next((r for r in rows if r.engine == "genai builder" and r.kvq_counterpart == "ort-int8"), None)


def deploy_table(rows: list[Row], contexts: Sequence[int]) -> tuple[list[str], list[list[str]]]:
    """The deployer's table: column names and cells, one row per engine and cache.

    Decode steps and prefill rates are shown as measured and as a ratio to the builder's int8 cache row (step
    ``× builder`` < 1: faster; prefill > 1: faster); Δppl against each engine's own unquantized cache.
    """
    ref = _deploy_reference(rows)
    # cache bytes at the longest context any row was timed at (a run may stop before the longest asked for)
    last = max((c for r in rows for c in (r.cache_bytes_at or {})), default=max(contexts, default=None))

    def ratio(value: float | None, base: float | None) -> str:
        return "" if value is None or not base else f" ({value / base:.2f}×)"

    header = ["engine", "weights", "cache", "bits/elem @4096", "files MB", f"cache MB @{last}",
              *[f"prefill tok/s @{c} (× builder int8)" for c in contexts],
              *[f"step ms @{c} (× builder int8)" for c in contexts], "ppl on P", "Δppl vs own unquantized cache"]
    cells = []
    for r in rows:
        steps, prefills = r.decode_ms_at or {}, r.prefill_tok_s_at or {}
        ref_steps = (ref.decode_ms_at or {}) if ref else {}
        ref_prefills = (ref.prefill_tok_s_at or {}) if ref else {}
        pct = _pct(r)
        cells.append([r.engine, r.weights, r.cache, _fmt(r.bits_4096, ".3f"),
                      _fmt(r.dir_bytes and r.dir_bytes / 1e6, ".1f"),
                      _fmt((r.cache_bytes_at or {}).get(last) and r.cache_bytes_at[last] / 1e6, ".1f"),
                      *[_fmt(prefills.get(c), ".0f") + ratio(prefills.get(c), ref_prefills.get(c)) for c in contexts],
                      *[_fmt(steps.get(c), ".2f") + ratio(steps.get(c), ref_steps.get(c)) for c in contexts],
                      _fmt(r.ppl, ".4f"),
                      "-" if pct is None else f"{r.ppl_delta:+.4f} ({pct:+.2f}%)"])
    return header, cells


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    """A GitHub markdown table (``|`` in a cell escaped)."""
    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(c) for c in cells)])


def rows_from_json(data: dict) -> list[Row]:
    """The rows of a ``--json`` file (contexts and batch sizes back to ints)."""
    def ints(value):
        return {int(k): ints(v) for k, v in value.items()} if isinstance(value, dict) else value

    rows = [Row(**{k: ints(v) for k, v in row.items()}) for row in data["rows"]]
    for row in rows:  # files written before cache_bytes_at: cache_bytes is the last (longest) context's
        if row.cache_bytes_at is None and row.cache_bytes is not None and row.decode_ms_at:
            row.cache_bytes_at = {max(row.decode_ms_at): row.cache_bytes}
    return rows


def merge_rows(runs: Sequence[list[Row]]) -> list[Row]:
    """One row per (engine, cache) from runs that measured parts of the same engines.

    (Perplexity in one process and timing in another, say.) Later runs fill what earlier ones left unmeasured,
    per field and per context; a failure in any run is kept.
    """
    merged: dict[tuple[str, str], Row] = {}
    for rows in runs:
        for row in rows:
            key = (row.engine, row.cache)
            if key not in merged:
                merged[key] = Row(**asdict(row))
                continue
            into = merged[key]
            for name, value in asdict(row).items():
                have = getattr(into, name)
                if isinstance(value, dict) and isinstance(have, dict):
                    setattr(into, name, {**have, **value})
                elif value is not None and (have is None or have == "" or name == "status" and have == "ok"):
                    setattr(into, name, value)
    return own_baseline_deltas(list(merged.values()))


def this_command() -> str:
    """The command line this process runs, as it would be typed from the repository root."""
    import shlex

    return shlex.join(["python", "tools/peer_compare.py", *sys.argv[1:]])


def deploy_markdown(rows: list[Row], contexts: Sequence[int], runs: Sequence[tuple[str, Sequence[float]]]) -> str:
    """The deployer's table and targets as markdown, after each command that measured it and the load it ran at."""
    header, cells = deploy_table(rows, contexts)
    said = [f"`{command}` (1-minute load average {min(loads):g}–{max(loads):g} while it ran)" if loads
            else f"`{command}`" for command, loads in runs]
    return ("\n".join(said) + f"\n\n{markdown_table(header, cells)}\n\n"
            + "\n".join(f"- {line}" for line in deploy_targets(rows)) + "\n")


def deploy_targets(rows: list[Row]) -> list[str]:
    """The deployer's accuracy targets on protocol P, each ``met`` / ``missed`` / ``not measured`` with its numbers.

    kvq's int8 cache must lose no more than the builder's int8 cache against their own unquantized caches, and
    each plan row (bits known) at most PLAN_DELTA_PCT % within PLAN_BITS bits/element at 4096 tokens.
    """
    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else "met" if ok else "missed"

    ref = _deploy_reference(rows)
    b = _pct(ref) if ref else None
    lines = []
    for name in DEPLOY_INT8:
        kvq8 = next((r for r in rows if r.engine == "kvq ort-gqa" and r.kvq_counterpart == name), None)
        a = _pct(kvq8) if kvq8 else None
        lines.append(f"kvq {name} Δppl {_fmt_pct(a)} ≤ builder int8_per_channel Δppl {_fmt_pct(b)}: "
                     f"{verdict(None if a is None or b is None else a <= b)}")
    for r in rows:
        if r.engine == "kvq ort-gqa" and r.kvq_counterpart not in (*DEPLOY_INT8, "fp32-cache") and r.bits_4096:
            pct = _pct(r)
            ok = None if pct is None else pct <= PLAN_DELTA_PCT and r.bits_4096 <= PLAN_BITS
            lines.append(f"kvq {r.kvq_counterpart} Δppl {_fmt_pct(pct)} ≤ +{PLAN_DELTA_PCT:g}% at {r.bits_4096:.3f} "
                         f"≤ {PLAN_BITS:g} bits/elem: {verdict(ok)}")
    return lines


# -- driver --------------------------------------------------------------------------------------------------------
def text_windows(model: str, n: int, length: int, offset: int | None = None) -> list[list[int]]:
    """The shared evaluation text as token ids (the model's own tokenizer), from ``offset`` (PPL_OFFSET)."""
    from transformers import AutoTokenizer

    source = resolve_spec(model)
    directory = source.path if source.kind == "hf_dir" else _ensure_fp32_cache(source.path)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return token_windows(tokenizer, load_corpus("britannica"), n, length,
                         offset=PPL_OFFSET if offset is None else offset)


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind a model spec (the built-in smollm2 ships one), if any."""
    source = resolve_spec(model)
    return source.path if source.kind == "gguf" else None


def genai_table(rows: list[Row], args: argparse.Namespace):
    """The kvq ort-gqa vs onnxruntime-genai builder table: protocol P ppl, step ms per context, prefill, bytes."""
    from rich.table import Table

    runs = sorted({(b, c) for r in rows for b, at in (r.decode_ms_batch or {}).items() for c in at})
    prefills = sorted({c for r in rows for c in (r.prefill_tok_s_at or {})})
    table = Table(title=f"kvq ort-gqa vs onnxruntime-genai builder on {args.model}: strict-decode perplexity on "
                        f"{args.genai_ppl_windows}x{args.genai_ppl_tokens} britannica tokens from 0; decode step "
                        f"median of {args.steps} interleaved (bN: batch N)")
    columns = ["engine", "cache", "weights", "dir MB", "ppl", "Δppl vs own fp32",
               *[f"step ms @{c} b{b}" for b, c in runs], *[f"prefill tok/s @{c}" for c in prefills],
               "cache bytes (last run)"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("engine", "cache") else "right")

    for r in rows:
        base = None if r.ppl_delta is None else r.ppl - r.ppl_delta
        delta = "-" if base is None else f"{r.ppl_delta:+.3f} ({100 * r.ppl_delta / base:+.2f}%)"
        table.add_row(r.engine, r.cache, r.weights, _fmt(r.dir_bytes and r.dir_bytes / 1e6, ".1f"),
                      _fmt(r.ppl, ".4f"), delta,
                      *[_fmt((r.decode_ms_batch or {}).get(b, {}).get(c), ".2f") for b, c in runs],
                      *[_fmt((r.prefill_tok_s_at or {}).get(c), ".0f") for c in prefills], _fmt(r.cache_bytes, "d"))
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help=f"comma list of {', '.join(PEERS)} (default: {','.join(DEFAULT_PEERS)})")
    parser.add_argument("--ppl-windows", type=int, default=2)
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--ppl-offset", type=int, default=None,
                        help="corpus token the perplexity windows start at (default: kvq_export.bench.PPL_OFFSET; "
                             "0 with 8 x 512 is protocol P)")
    parser.add_argument("--context", type=int, default=1024, help="tokens in the cache for decode timing")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--kvq-flavor", default="reference")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (deploy peer: 2 unless given)")
    parser.add_argument("--llama-caches", default=",".join(LLAMA_CPP_DEFAULT),
                        help=f"llama.cpp caches, comma list of {', '.join(LLAMA_CPP_TYPES)} (f16 always runs)")
    parser.add_argument("--llama-weights", choices=LLAMA_WEIGHTS, default="gguf",
                        help="llama.cpp weights: the GGUF's own, or fp32 (the GGUF dequantized, the weights kvq "
                             "runs; written once to --work-dir)")
    parser.add_argument("--no-ppl", action="store_true", help="decode speed only (peers' perplexity skipped)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the rows as JSON here")
    parser.add_argument("--genai-contexts", default="512,2048,8192", help="genai peer: decode-step contexts")
    parser.add_argument("--genai-ppl-windows", type=int, default=8,
                        help="genai peer: protocol P windows (britannica from token 0)")
    parser.add_argument("--genai-ppl-tokens", type=int, default=512)
    parser.add_argument("--work-dir", default="/tmp/kvq-peers",
                        help="genai exports and builds, and llama.cpp's fp32 weights, are kept here")
    parser.add_argument("--genai-ppl-engines", default=None,
                        help="genai and deploy peers: comma list of engines to score")
    parser.add_argument("--genai-timed-engines", default=None,
                        help="genai and deploy peers: comma list of engines to time")
    parser.add_argument("--deploy-contexts", default="512,2048,8000", help="deploy peer: decode-step contexts")
    parser.add_argument("--deploy-llama-caches", default=",".join(DEPLOY_LLAMA_CACHES),
                        help="deploy peer: llama.cpp caches beside its f16 one ('' for no llama.cpp rows)")
    parser.add_argument("--deploy-plans", default=str(DEPLOY_PLAN),
                        help="deploy peer: comma list of kvq schemes or plan files beside the int8 caches "
                             "(DEPLOY_INT8)")
    parser.add_argument("--deploy-merge", default=None, metavar="JSON,JSON",
                        help="deploy peer: measure nothing; one table from the --json files of runs that split its "
                             "work (--genai-ppl-engines / --genai-timed-engines)")
    parser.add_argument("--markdown", default=None,
                        help="deploy peer: write its table and targets as markdown here (rewritten as rows come in)")
    parser.add_argument("--genai-int4-percentile", type=float, default=DEFAULT_PERCENTILE,
                        help="genai peer: also int4 with kvq percentile scales (0: skip)")
    parser.add_argument("--genai-precision", choices=("fp32", "int4"), default="fp32",
                        help="genai peer: the builder's -p (its CPU default is int4)")
    parser.add_argument("--kvq-weights", choices=("fp32", "fp16", "int8", "int4"), default="fp32",
                        help="genai peer: kvq exports' weight format (kvq_export.graph.weights)")
    parser.add_argument("--kvq-accuracy-level", type=int, choices=(1, 2, 3, 4), default=None,
                        help="genai peer: MatMulNBits accuracy_level of kvq's int weights (4: int8 activations, the "
                             "builder's CPU default; kvq's default is 1)")
    parser.add_argument("--genai-schemes", default=",".join(GENAI_SCHEMES),
                        help="genai peer: comma list of builder cache schemes to build")
    parser.add_argument("--genai-no-own-scales", action="store_true",
                        help="genai peer: skip the builder's own calibrator (builds with kvq's scales only)")
    parser.add_argument("--genai-batches", default="1", help="genai peer: comma list of decode batch sizes")
    parser.add_argument("--genai-batch-max-context", type=int, default=2048,
                        help="genai peer: batches over one only up to this context (og prefills a batch in one call, "
                             "and its attention scores at 4 x 8000 tokens take about 9 GB)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; allowed: {', '.join(PEERS)}")
    if args.deploy_merge:
        peers = []  # a merge measures nothing

    def names(text: str | None) -> list[str] | None:
        return None if text is None else [n.strip() for n in text.split(",") if n.strip()]

    llama_caches, deploy_caches = names(args.llama_caches), names(args.deploy_llama_caches)
    unknown = sorted(set(llama_caches + deploy_caches) - set(LLAMA_CPP_TYPES))
    if unknown:
        parser.error(f"unknown llama.cpp cache(s) {', '.join(unknown)}; allowed: {', '.join(LLAMA_CPP_TYPES)}")

    loads: list[float] = []  # the 1-minute load average at every update: the machine is shared

    def save(measured: list[Row]) -> None:
        """Rewrite --json with every row measured so far (a stopped run keeps what it measured)."""
        import os

        loads.append(round(os.getloadavg()[0], 2))
        if args.json_out:
            write_json({"settings": vars(args), "command": this_command(), "load_average_1min": loads,
                        "rows": [asdict(r) for r in measured]}, args.json_out)

    windows = text_windows(args.model, args.ppl_windows, args.ppl_tokens, args.ppl_offset)
    rows: list[Row] = []
    if "kvq" in peers:
        rows += run_kvq(args.model, windows, args.context, args.steps, args.kvq_flavor, not args.no_ppl)
    if "llama.cpp" in peers:
        gguf = gguf_path(args.model)
        if gguf is None:
            rows.append(Row("llama.cpp", "-", "-", status="unavailable: --model is not a GGUF file"))
        else:
            if args.llama_weights == "fp32":
                # one folder per source: its stamp says which file the copy was made from
                folder = Path(args.work_dir) / f"llama-fp32-{gguf.stem}"
                gguf = dequantized_gguf(gguf, folder / f"{gguf.stem}.F32.gguf")
            rows += run_llama_cpp(gguf, windows, args.context, args.steps, args.threads, not args.no_ppl,
                                  llama_caches)
    if "hf" in peers:
        rows += run_hf(args.model, windows, args.context, args.steps, not args.no_ppl)
    genai_rows: list[Row] = []
    if "genai" in peers:
        p_windows = text_windows(args.model, args.genai_ppl_windows, args.genai_ppl_tokens, offset=0)
        genai_rows = run_genai(args.model, p_windows, [int(c) for c in args.genai_contexts.split(",") if c],
                               args.steps, Path(args.work_dir), not args.no_ppl, args.genai_int4_percentile or None,
                               names(args.genai_ppl_engines), names(args.genai_timed_engines),
                               precision=args.genai_precision, kvq_weights=args.kvq_weights,
                               schemes=names(args.genai_schemes), own_scales=not args.genai_no_own_scales,
                               batches=[int(b) for b in args.genai_batches.split(",") if b],
                               batch_max_context=args.genai_batch_max_context,
                               kvq_accuracy_level=args.kvq_accuracy_level,
                               on_update=lambda measured: save(rows + measured))
    deploy_rows: list[Row] = []
    contexts = [int(c) for c in names(args.deploy_contexts)]
    if args.deploy_merge:  # runs that split the deploy peer's work: one table from their --json files
        import json

        sources = [json.loads(Path(f).read_text()) for f in names(args.deploy_merge)]
        deploy_rows = merge_rows([rows_from_json(data) for data in sources])
        if args.markdown:
            Path(args.markdown).write_text(deploy_markdown(
                deploy_rows, contexts, [(d.get("command", "?"), d.get("load_average_1min", [])) for d in sources]))
    elif "deploy" in peers:

        def progress(measured: list[Row]) -> None:
            save(rows + genai_rows + measured)
            if args.markdown:
                Path(args.markdown).write_text(deploy_markdown(measured, contexts, [(this_command(), loads)]))

        deploy_rows = run_deploy(args.model, text_windows(args.model, args.genai_ppl_windows, args.genai_ppl_tokens,
                                                          offset=0),
                                 contexts, args.steps, Path(args.work_dir), args.threads or 2, not args.no_ppl,
                                 deploy_caches, names(args.deploy_plans), names(args.genai_ppl_engines),
                                 names(args.genai_timed_engines), on_update=progress)

    from rich.console import Console
    from rich.table import Table

    offset = PPL_OFFSET if args.ppl_offset is None else args.ppl_offset
    table = Table(title=f"peers on {args.model}: strict-decode perplexity on {args.ppl_windows}x{args.ppl_tokens} "
                        f"britannica tokens from token {offset}; decode step at {args.context} tokens, batch 1"
                        + (f"; llama.cpp weights {args.llama_weights}" if "llama.cpp" in peers else ""))
    numbers = ("ppl", "Δppl vs own base", "KL", "top-1", "decode ms", "x own base")
    for col in ("engine", "cache", "kvq preset", *numbers, "status"):
        table.add_column(col, justify="right" if col in numbers else "left")

    for r in rows:
        delta = ("-" if r.ppl_delta is None
                 else f"{r.ppl_delta:+.3f} ({100 * r.ppl_delta / (r.ppl - r.ppl_delta):+.2f}%)")
        table.add_row(r.engine, r.cache, r.kvq_counterpart, _fmt(r.ppl, ".3f"), delta, _fmt(r.mean_kl, ".4f"),
                      _fmt(r.top1, ".1%"), _fmt(r.decode_ms, ".2f"), _fmt(r.speed_ratio, ".2f"), r.status)
    if rows:
        Console(width=200).print(table)
    if genai_rows:
        Console(width=200).print(genai_table(genai_rows, args))
    if deploy_rows:
        header, cells = deploy_table(deploy_rows, contexts)
        table = Table(title=f"the deployer's comparison on {args.model}: int4 weights, batch 1, steps interleaved "
                            f"({args.steps} timed); Δppl on protocol P")
        for col in header:
            table.add_column(col, justify="left" if col in ("engine", "weights", "cache") else "right")
        for line in cells:
            table.add_row(*line)
        Console(width=240).print(table)
        print("\n".join(deploy_targets(deploy_rows)))
    save(rows + genai_rows + deploy_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
