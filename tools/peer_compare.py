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

from kvq_export.request import DEFAULT_CALIBRATION, DEFAULT_PERCENTILE, CalibrationMethod

logger = logging.getLogger("peer_compare")

PEERS = ("kvq", "llama.cpp", "hf", "genai")
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


def _nll(logits: np.ndarray, target: int) -> float:
    return float(-_log_softmax(logits)[target])


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
    if not _has("llama_cpp"):
        return [Row("llama.cpp", c, _llama_cpp_counterpart(c), status="unavailable: pip install llama-cpp-python")
                for c in caches]
    import llama_cpp

    rows, engines = {}, {}
    length = max(len(w) for w in windows)
    prompt = (windows[0] * (context // len(windows[0]) + 1))[:context]
    for cache in caches:
        k_type, v_type, _ = LLAMA_CPP_TYPES[cache]
        row = rows[cache] = Row("llama.cpp", cache, _llama_cpp_counterpart(cache))
        try:
            kwargs = dict(model_path=str(gguf), n_ctx=max(context + steps + 16, length + 8), n_batch=512,
                          n_ubatch=512, type_k=getattr(llama_cpp, k_type), type_v=getattr(llama_cpp, v_type),
                          flash_attn=True, logits_all=True, verbose=False, n_threads=threads, seed=0)
            engines[cache] = llama_cpp.Llama(**{k: v for k, v in kwargs.items() if v is not None})
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
                llm.reset()
                for token in window:
                    llm.eval([token])
                logp[name] = _log_softmax(np.asarray(llm.scores[: len(window) - 1]))
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
    if _reuse(out.parent, stamp) and out.is_file():
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
    _stamp(out.parent, stamp)
    logger.info("llama.cpp weights: %s dequantized to F32 at %s", source, out)
    return out


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


# -- onnxruntime-genai and its model builder ------------------------------------------------------------------
#: builder ``kv_cache_quant_scheme`` -> the kvq ort-gqa preset holding the same cache (static symmetric per channel)
GENAI_SCHEMES = {"int8_per_channel": "ort-int8", "int4_per_channel": "ort-int4"}
PREFILL_CHUNK = 512
FP32_CACHE = Path(__file__).resolve().parent / "schemes" / "fp32-cache.json"


def model_hf_dir(model: str) -> Path:
    """The Hugging Face directory the builder reads (kvq's cached fp32 conversion for a GGUF model)."""
    from kvq_export.model_source import _ensure_fp32_cache, resolve_spec

    source = resolve_spec(model)
    return source.path if source.kind == "hf_dir" else _ensure_fp32_cache(source.path)


def _reuse(out: Path, stamp: dict) -> bool:
    """Whether ``out`` was built with exactly ``stamp`` (written beside the build as peer_stamp.json)."""
    import json

    path = out / "peer_stamp.json"
    return path.is_file() and json.loads(path.read_text()) == stamp


def _stamp(out: Path, stamp: dict) -> None:
    import json

    (out / "peer_stamp.json").write_text(json.dumps(stamp))


def build_with_builder(hf: Path, out: Path, quant: str | None = None, scale_file: Path | None = None,
                       precision: str = "fp32") -> Path:
    """``python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu`` (+ a quantized cache)."""
    import shutil
    import subprocess

    stamp = {"quant": quant, "scales": scale_file.read_text() if scale_file else None}
    if precision != "fp32":  # (builds made before the precision was a choice are fp32 and keep their stamp)
        stamp["precision"] = precision
    if _reuse(out, stamp):
        return out
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", precision,
           "-e", "cpu", "-c", str(out.parent / "builder-cache")]
    if quant:
        cmd += ["--extra_options", f"kv_cache_quant_scheme={quant}", f"kv_cache_scale_file={scale_file}"]
    logger.info("builder: %s", " ".join(cmd))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    _stamp(out, stamp)
    return out


def builder_calibration(baseline: Path, hf: Path, out: Path, quant: str) -> Path:
    """The builder's own calibrator, its defaults, on the unquantized build: the builder's default scale file.

    Its defaults: the 99.99th percentile, a RoPE pair envelope for keys, 24 x 512 tokens of its built-in corpus.
    """
    from onnxruntime_genai.models.quantization.kv_cache_calibration import calibrate_kv_scales

    if not out.is_file():
        calibrate_kv_scales(str(baseline / "model.onnx"), str(hf), str(out), quant_type=quant)
    return out


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
        total = 0.0
        for row in ids:
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=ids.shape[1], do_sample=False)
            generator = self.og.Generator(self.model, params)
            for i in range(ids.shape[1] - 1):
                generator.append_tokens(row[i:i + 1])
                total += _nll(np.asarray(generator.get_logits()).reshape(-1), int(row[i + 1]))
        return math.exp(total / (ids.shape[0] * (ids.shape[1] - 1)))

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
        from kvq_export.runtime.session import KVQSession

        self.session = KVQSession(directory, spinning=spinning)

    def perplexity(self, windows: list[list[int]]) -> float:
        """Strict decode (``kvq_export.bench.perplexity``)."""
        from kvq_export.bench import perplexity

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


def kvq_gqa_export(model: str, scheme: str, out: Path, static, weights: str = "fp32",
                   accuracy_level: int | None = None) -> Path:
    """``kvq export --flavor ort-gqa`` with the given static scales (reused if built by this kvq from the same request).

    ``weights`` other than fp32: the request carries them, and the export goes to ``OUT-w-int4`` (``-a4`` for an
    ``accuracy_level``) beside it; :func:`~kvq_export.export.exporter.ensure_export` decides the reuse.
    """
    from kvq_export.export.exporter import ensure_export
    from kvq_export.request import ExportRequest, WeightSpec

    level = {} if accuracy_level is None else {"accuracy_level": accuracy_level}
    if weights != "fp32":
        out = out.with_name(f"{out.name}-w-{weights}{'' if accuracy_level is None else f'-a{accuracy_level}'}")
    request = ExportRequest(model, scheme, flavor="ort-gqa", weights=WeightSpec(weights, **level))
    return ensure_export(request, out, static=static)


def dir_bytes(directory: Path) -> int:
    """Bytes of the files a directory holds (what a deployer ships)."""
    stamps = ("peer_stamp.json", "weights_stamp.json")
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file() and f.name not in stamps)


def run_genai(model: str, p_windows: list[list[int]], contexts: Sequence[int], steps: int, work: Path,
              ppl: bool = True, int4_percentile: float | None = DEFAULT_PERCENTILE,
              ppl_engines: Sequence[str] | None = None, timed_engines: Sequence[str] | None = None,
              precision: str = "fp32", kvq_weights: str = "fp32",
              schemes: Sequence[str] = tuple(GENAI_SCHEMES), own_scales: bool = True,
              batches: Sequence[int] = (1,), batch_max_context: int | None = None,
              kvq_accuracy_level: int | None = None) -> list[Row]:
    """Run kvq ort-gqa (kvq's loop) vs onnxruntime-genai's builder (og's loop) on the same fp32 weights.

    Perplexity on ``p_windows`` (strict decode); kvq's static scales come from ``kvq export``'s default calibration
    (:data:`kvq_export.request.DEFAULT_CALIBRATION`: 4096 held-out britannica tokens, absmax); the builder runs
    with those same scales (written by
    ``kvq calibrate --format genai-scales``) and with its own calibrator's (its default path). Decode steps at
    each context interleaved across all engines in this process, after a chunked prefill of the context.
    ``ppl_engines`` / ``timed_engines`` pick engines by name (``kvq ort-int8 absmax``, ``builder int8_per_channel
    own``, ...; default: every engine but the spinning twins / one per runtime, scheme and spinning) so a loaded
    machine can split the work.

    ``precision`` is the builder's ``-p`` (its CPU default is int4), ``kvq_weights`` the format kvq's exports'
    weights are converted to (:mod:`kvq_export.export.weights`, with MatMulNBits' ``kvq_accuracy_level`` when
    given: 4 is the builder's int8 activations); ``schemes`` picks the builder cache schemes
    (keys of GENAI_SCHEMES), ``own_scales=False`` skips the builder's own calibrator. Each context is timed at
    every batch size in ``batches`` (a batch of copies of one prompt: og prefills it in one call, kvq copies
    its one-row cache), batches over one only up to ``batch_max_context``; prefill tok/s is batch 1's.
    """
    import json

    from kvq_export.calibration import Calibration, calibrate_static_scales, calibration_windows
    from kvq_export.corpus import load_corpus, token_windows
    from kvq_export.model_source import load_model, model_facts
    from kvq_export.presets import resolve_scheme
    from kvq_export.runtime.genai import builder_scale_file

    if not _has("onnxruntime_genai"):
        return [Row("onnxruntime-genai", "-", "-", status="unavailable: pip install onnxruntime-genai==0.18.0")]
    hf = model_hf_dir(model)
    hf_model, tokenizer = load_model(model)
    facts = model_facts(hf_model.config)
    spec = DEFAULT_CALIBRATION
    calib = calibration_windows(tokenizer, spec.corpus, spec.tokens, offset=spec.offset)
    work.mkdir(parents=True, exist_ok=True)
    engines: dict[str, tuple[Row, Any]] = {}  # name -> (row, engine or a factory that loads it)

    def add(name: str, row: Row, engine) -> None:
        engines[name] = (row, engine)

    def loaded(name: str):
        row, engine = engines[name]
        if callable(engine):  # load a model only when it is scored or timed
            engines[name] = row, engine()
        return engines[name][1]

    unknown = sorted(set(schemes) - set(GENAI_SCHEMES))
    if unknown:
        raise SystemExit(f"unknown builder scheme(s) {unknown}; allowed: {list(GENAI_SCHEMES)}")
    # the default fp32 builds keep their old folder names (and their stamps)
    tag = "" if precision == "fp32" else f"-p{precision}"

    def kvq_row(cache: str, preset: str, directory: Path) -> Row:
        weights = kvq_weights if kvq_accuracy_level is None else f"{kvq_weights} (accuracy_level {kvq_accuracy_level})"
        return Row("kvq ort-gqa", cache, preset, weights=weights, dir_bytes=dir_bytes(directory))

    def builder_row(cache: str, preset: str, directory: Path) -> Row:
        return Row("genai builder", cache, preset, weights=precision, dir_bytes=dir_bytes(directory))

    fp32_dir = kvq_gqa_export(model, str(FP32_CACHE), work / "kvq-fp32", None, kvq_weights, kvq_accuracy_level)
    add("kvq fp32", kvq_row("fp32 buffer", "fp32-cache", fp32_dir), lambda: KvqEngine(fp32_dir))
    base_dir = build_with_builder(hf, work / f"builder-fp32{tag}", precision=precision)
    add("builder fp32", builder_row("fp32 (no kv quant)", "fp32-cache", base_dir), lambda: GenaiEngine(base_dir))
    for quant in schemes:
        preset = GENAI_SCHEMES[quant]
        scheme = resolve_scheme(preset)
        methods = [(str(spec.method), spec.percentile)] + (
            [("percentile", int4_percentile)] if "int4" in quant and int4_percentile else [])
        for method, pct in methods:
            label = f"p{pct:g}" if method == CalibrationMethod.PERCENTILE else method
            saved = work / f"kvq-static-{preset}-{label}.npz"  # calibrating again would give the same scales
            if saved.is_file():
                static = Calibration.load(saved)
            else:
                static = calibrate_static_scales(hf_model, scheme, calib, method=method, percentile=pct)
                static.save(saved)
            kvq_dir = kvq_gqa_export(model, preset, work / f"kvq-{preset}-{label}", static, kvq_weights,
                                     kvq_accuracy_level)
            add(f"kvq {preset} {label}", kvq_row(f"{preset} (kvq {label} scales)", preset, kvq_dir),
                lambda d=kvq_dir: KvqEngine(d))
            add(f"kvq {preset} {label} spin", kvq_row(f"{preset} (kvq {label} scales, spinning)", preset, kvq_dir),
                lambda d=kvq_dir: KvqEngine(d, spinning=True))
            scales = work / f"kvq-scales-{quant}-{label}.json"
            scales.write_text(json.dumps(builder_scale_file(static, scheme, num_layers=facts.num_layers,
                                                            kv_heads=facts.num_kv_heads, head_dim=facts.head_dim)))
            built = build_with_builder(hf, work / f"builder-{quant}-kvq-{label}{tag}", quant, scales, precision)
            add(f"builder {quant} kvq-{label}", builder_row(f"{quant} (kvq {label} scales)", preset, built),
                lambda d=built: GenaiEngine(d))
        if not own_scales:
            continue
        # the builder's calibrator runs the fp32 build (its own scales do not depend on the weights' format)
        fp32_base = base_dir if precision == "fp32" else build_with_builder(hf, work / "builder-fp32")
        own = builder_calibration(fp32_base, hf, work / f"builder-scales-{quant}.json", quant)
        built = build_with_builder(hf, work / f"builder-{quant}-own{tag}", quant, own, precision)
        add(f"builder {quant} own", builder_row(f"{quant} (builder calibrator)", preset, built),
            lambda d=built: GenaiEngine(d))
    del hf_model

    unknown = sorted((set(ppl_engines or ()) | set(timed_engines or ())) - set(engines))
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; known: {list(engines)}")
    if ppl:
        for name in list(engines):
            if name not in ppl_engines if ppl_engines is not None else name.endswith(" spin"):
                continue  # (a spinning engine scores exactly what its twin does)
            row, engine = engines[name][0], loaded(name)
            start = time.perf_counter()
            row.ppl = engine.perplexity(p_windows)
            logger.info("%s: ppl %.4f (%.0f s)", name, row.ppl, time.perf_counter() - start)
    # timing: one engine per (runtime, scheme); the builder's calibrators do not change its speed
    timed = {name: (engines[name][0], loaded(name)) for name in list(engines) if contexts
             and (name in timed_engines if timed_engines is not None else "own" not in name and "p99" not in name)}
    text = token_windows(tokenizer, load_corpus("britannica"), 1, max(contexts))[0] if timed else []
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
            logger.info("%s ctx %d batch %d: step %.2f ms, prefill %.0f tok/s (%.0f s), cache %d B", name, context,
                        batch, ms[name], (context - warmup - steps - 1) * batch / prefill_s[name], prefill_s[name],
                        row.cache_bytes)
        del states
    rows = [row for row, _ in engines.values()]
    for engine_name, baseline in (("kvq ort-gqa", "fp32 buffer"), ("genai builder", "fp32 (no kv quant)")):
        base = next(r for r in rows if r.engine == engine_name and r.cache == baseline)
        for r in rows:
            if r.engine == engine_name and r.ppl is not None and base.ppl is not None:
                r.ppl_delta = r.ppl - base.ppl
    return rows


# -- driver --------------------------------------------------------------------------------------------------------
def text_windows(model: str, n: int, length: int, offset: int | None = None) -> list[list[int]]:
    """The shared evaluation text as token ids (the model's own tokenizer), from ``offset`` (PPL_OFFSET)."""
    from transformers import AutoTokenizer

    from kvq_export.bench import PPL_OFFSET
    from kvq_export.corpus import load_corpus, token_windows
    from kvq_export.model_source import _ensure_fp32_cache, resolve_spec

    source = resolve_spec(model)
    directory = source.path if source.kind == "hf_dir" else _ensure_fp32_cache(source.path)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return token_windows(tokenizer, load_corpus("britannica"), n, length,
                         offset=PPL_OFFSET if offset is None else offset)


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind a model spec (the built-in smollm2 ships one), if any."""
    from kvq_export.model_source import resolve_spec

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

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        base = None if r.ppl_delta is None else r.ppl - r.ppl_delta
        delta = "-" if base is None else f"{r.ppl_delta:+.3f} ({100 * r.ppl_delta / base:+.2f}%)"
        table.add_row(r.engine, r.cache, r.weights, fmt(r.dir_bytes and r.dir_bytes / 1e6, ".1f"),
                      fmt(r.ppl, ".4f"), delta,
                      *[fmt((r.decode_ms_batch or {}).get(b, {}).get(c), ".2f") for b, c in runs],
                      *[fmt((r.prefill_tok_s_at or {}).get(c), ".0f") for c in prefills], fmt(r.cache_bytes, "d"))
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}")
    parser.add_argument("--ppl-windows", type=int, default=2)
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--ppl-offset", type=int, default=None,
                        help="corpus token the perplexity windows start at (default: kvq_export.bench.PPL_OFFSET; "
                             "0 with 8 x 512 is protocol P)")
    parser.add_argument("--context", type=int, default=1024, help="tokens in the cache for decode timing")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--kvq-flavor", default="reference")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
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
    parser.add_argument("--genai-ppl-engines", default=None, help="genai peer: comma list of engines to score")
    parser.add_argument("--genai-timed-engines", default=None, help="genai peer: comma list of engines to time")
    parser.add_argument("--genai-int4-percentile", type=float, default=DEFAULT_PERCENTILE,
                        help="genai peer: also int4 with kvq percentile scales (0: skip)")
    parser.add_argument("--genai-precision", choices=("fp32", "int4"), default="fp32",
                        help="genai peer: the builder's -p (its CPU default is int4)")
    parser.add_argument("--kvq-weights", choices=("fp32", "fp16", "int8", "int4"), default="fp32",
                        help="genai peer: kvq exports' weight format (kvq_export.export.weights)")
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

    llama_caches = [c.strip() for c in args.llama_caches.split(",") if c.strip()]
    unknown = sorted(set(llama_caches) - set(LLAMA_CPP_TYPES))
    if unknown:
        parser.error(f"unknown llama.cpp cache(s) {', '.join(unknown)}; allowed: {', '.join(LLAMA_CPP_TYPES)}")

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
        def names(text: str | None) -> list[str] | None:
            return None if text is None else [n.strip() for n in text.split(",") if n.strip()]

        genai_rows = run_genai(args.model, p_windows, [int(c) for c in args.genai_contexts.split(",") if c],
                               args.steps, Path(args.work_dir), not args.no_ppl, args.genai_int4_percentile or None,
                               names(args.genai_ppl_engines), names(args.genai_timed_engines),
                               precision=args.genai_precision, kvq_weights=args.kvq_weights,
                               schemes=names(args.genai_schemes), own_scales=not args.genai_no_own_scales,
                               batches=[int(b) for b in args.genai_batches.split(",") if b],
                               batch_max_context=args.genai_batch_max_context,
                               kvq_accuracy_level=args.kvq_accuracy_level)

    from rich.console import Console
    from rich.table import Table

    from kvq_export.bench import PPL_OFFSET

    offset = PPL_OFFSET if args.ppl_offset is None else args.ppl_offset
    table = Table(title=f"peers on {args.model}: strict-decode perplexity on {args.ppl_windows}x{args.ppl_tokens} "
                        f"britannica tokens from token {offset}; decode step at {args.context} tokens, batch 1"
                        + (f"; llama.cpp weights {args.llama_weights}" if "llama.cpp" in peers else ""))
    numbers = ("ppl", "Δppl vs own base", "KL", "top-1", "decode ms", "x own base")
    for col in ("engine", "cache", "kvq preset", *numbers, "status"):
        table.add_column(col, justify="right" if col in numbers else "left")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        delta = ("-" if r.ppl_delta is None
                 else f"{r.ppl_delta:+.3f} ({100 * r.ppl_delta / (r.ppl - r.ppl_delta):+.2f}%)")
        table.add_row(r.engine, r.cache, r.kvq_counterpart, fmt(r.ppl, ".3f"), delta, fmt(r.mean_kl, ".4f"),
                      fmt(r.top1, ".1%"), fmt(r.decode_ms, ".2f"), fmt(r.speed_ratio, ".2f"), r.status)
    if rows:
        Console(width=200).print(table)
    if genai_rows:
        Console(width=200).print(genai_table(genai_rows, args))
    if args.json_out:
        from kvq_export.validate.report import write_json

        write_json({"settings": vars(args), "rows": [asdict(r) for r in rows + genai_rows]}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
