"""llama.cpp as a peer, through llama-cpp-python (imported only when a llama.cpp engine runs).

Flash attention on, one engine per cache type (:data:`LLAMA_CPP_TYPES`); :class:`LlamaCppRunner` is its
runner (:mod:`kvq_export.measure.runners`), :func:`run_llama_cpp` the perplexity and decode-speed comparison of
its caches, :func:`dequantized_gguf` gives it the same fp32 weights kvq runs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export.errors import DependencyError, KVQError
from kvq_export.measure.builder import stamp_matches, write_stamp
from kvq_export.measure.runners import as_ids
from kvq_export.measure.scoring import NllPool, log_softmax
from kvq_export.measure.timing import interleaved
from kvq_export.peer_compare.rows import PREFILL_CHUNK, Row, finish

logger = logging.getLogger(__name__)

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


def import_llama_cpp():
    """``llama_cpp`` (llama-cpp-python), or a one-line DependencyError naming what is missing and what to install."""
    try:
        import llama_cpp
    except ImportError as err:  # the package itself, or one of its own imports (diskcache, jinja2)
        raise DependencyError(f"llama_cpp is not importable ({err}): pip install llama-cpp-python==0.3.36 diskcache "
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


def llama_cpp_counterpart(cache: str) -> str:
    """The kvq preset ``cache`` lines up with: the rotated one unless llama.cpp's rotation is switched off."""
    preset = LLAMA_CPP_TYPES[cache][2]
    off = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0").strip()
    return preset.removesuffix("-rot") if off.lstrip("-").isdigit() and int(off) else preset


@dataclass
class LlamaState:
    """A llama.cpp context holding one sequence, and the next token to feed."""

    llm: Any
    token: int


class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) on one GGUF and one cache type, batch 1 (a runner: ``kvq_export.measure``).

    Flash attention on, ``threads`` threads for decode and prefill. Each prefill makes a context of its own
    ``capacity`` (llama.cpp allocates every cell of a context up front), freed with its state.
    """

    def __init__(self, gguf: Path, cache: str, threads: int | None) -> None:
        self.llama_cpp = import_llama_cpp()
        self.gguf, self.cache, self.threads = gguf, cache, threads

    def __enter__(self) -> LlamaCppRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def perplexity(self, windows: Sequence[Sequence[int]]) -> float:
        """Strict decode (one token per eval, each window from an empty cache), NLL pooled over the windows."""
        llm = llama_cpp_context(self.gguf, self.cache, max(len(w) for w in windows), self.threads, logits_all=True)
        pool = NllPool()
        for window in windows:
            pool.add(strict_logits(llm, window), window[1:])
        return pool.ppl

    def prefill(self, ids: Any, capacity: int) -> tuple[LlamaState, float]:
        """A context holding ``ids`` (one row, evaluated in batches of PREFILL_CHUNK)."""
        ids = as_ids(ids)
        if ids.shape[0] != 1:
            raise KVQError(f"the llama.cpp runner times batch 1 only, not {ids.shape[0]}")
        tokens = [int(t) for t in ids[0]]
        llm = llama_cpp_context(self.gguf, self.cache, capacity, self.threads)
        llm.eval(tokens[:8])  # the first decode allocates: keep it out of the timing
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        seconds = time.perf_counter() - start
        return LlamaState(llm, self._greedy(llm)), seconds

    def _greedy(self, llm) -> int:
        """The argmax of the last evaluated position's logits (what kvq's and og's greedy steps pick)."""
        logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))
        return int(logits.argmax())

    def step(self, state: LlamaState, tokens: np.ndarray | None = None) -> None:
        """One decode step: run the next token (``tokens``, or the greedy pick), pick the next greedily."""
        state.llm.eval([state.token if tokens is None else int(np.asarray(tokens).reshape(-1)[0])])
        state.token = self._greedy(state.llm)

    def cache_bytes(self, state: LlamaState) -> int:
        """Bytes llama.cpp serializes for the sequence: its K/V rows of the cells in use (and their positions)."""
        return int(self.llama_cpp.llama_state_seq_get_size(state.llm.ctx, 0))


def run_llama_cpp(gguf: Path, windows: list[list[int]], context: int, steps: int, threads: int | None,
                  ppl: bool = True, caches: Sequence[str] = LLAMA_CPP_DEFAULT) -> list[Row]:
    """Run llama.cpp through llama-cpp-python: flash attention on, one engine per cache in ``caches``.

    Perplexity is strict decode on every engine, and each quantized cache's next-token distributions are
    compared with the f16 cache's (mean KL, top-1 agreement), window by window; then single-token steps at
    ``context`` tokens, interleaved across the engines.
    """
    caches = ["f16", *(c for c in caches if c != "f16")]
    try:
        import_llama_cpp()
    except DependencyError as missing:
        return [Row("llama.cpp", c, llama_cpp_counterpart(c), status=f"unavailable: {missing}") for c in caches]
    rows, engines = {}, {}
    length = max(len(w) for w in windows)
    for cache in caches:
        row = rows[cache] = Row("llama.cpp", cache, llama_cpp_counterpart(cache))
        try:
            engines[cache] = llama_cpp_context(gguf, cache, max(context + steps + 16, length + 8), threads,
                                               logits_all=True)
        except Exception as err:  # noqa: BLE001 - a peer failing must not stop the others
            row.failed(err)
    if ppl and engines:
        for name, (value, kl, top1) in llama_cpp_scores(engines, windows, rows).items():
            rows[name].ppl, rows[name].mean_kl, rows[name].top1 = value, kl, top1
            logger.info("llama.cpp %s: %s", name, rows[name])
    for name, ms in _decode_ms(engines, rows, (windows[0] * (context // len(windows[0]) + 1))[:context],
                               steps).items():
        rows[name].decode_ms = ms
    return finish(list(rows.values()), "f16")


def _decode_ms(engines: dict[str, Any], rows: dict[str, Row], prompt: list[int], steps: int) -> dict[str, float]:
    """Median ms of a single-token step after ``prompt``, interleaved across ``engines`` (failures marked)."""
    for name, llm in list(engines.items()):
        try:
            llm.reset()
            llm.eval(prompt)
        except Exception as err:  # noqa: BLE001 - a peer failing must not stop the others
            rows[name].failed(err)
            del engines[name]
    if not engines:
        return {}
    timings = interleaved({name: (lambda i, llm=llm: llm.eval([prompt[i % len(prompt)]]))
                           for name, llm in engines.items()}, steps, warmup=4)
    return {name: 1e3 * timing.median for name, timing in timings.items()}


def llama_cpp_scores(engines: dict[str, Any], windows: list[list[int]],
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
                logp[name] = log_softmax(strict_logits(llm, window))
            except Exception as err:  # noqa: BLE001 - a peer failing must not stop the others
                rows[name].failed(err)
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


def gguf_file_type(path: Path) -> str:
    """The weight format a GGUF file declares (``Q4_1`` for ``MOSTLY_Q4_1``)."""
    import gguf

    field = gguf.GGUFReader(path).fields[gguf.Keys.General.FILE_TYPE]
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")


def dequantized_gguf(source: Path, out: Path) -> Path:
    """``source`` with every tensor stored as F32 (quantized ones dequantized by gguf's reference), at ``out``.

    llama.cpp then runs the very weights kvq and transformers run (kvq's fp32 conversion of a GGUF dequantizes
    the same tensors), so a cache comparison no longer mixes in the quantized matmuls' arithmetic (llama.cpp
    rounds every activation to q8 blocks before a Q4_1 matmul). Metadata and tensor order are copied; the file
    is written once and reused while the stamp beside it (``out``'s folder holds one copy) matches ``source``.
    """
    import gguf

    stamp = {"source": str(source), "bytes": source.stat().st_size, "mtime_ns": source.stat().st_mtime_ns}
    if stamp_matches(out.parent, stamp) and out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    _copy_fields(reader, writer)
    _copy_tensors_f32(reader, writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out)
    write_stamp(out.parent, stamp)
    logger.info("llama.cpp weights: %s dequantized to F32 at %s", source, out)
    return out


def _copy_fields(reader, writer) -> None:
    """Every metadata field but those the writer writes itself; the file type becomes ALL_F32."""
    import gguf

    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)


def _copy_tensors_f32(reader, writer) -> None:
    """Every tensor, in order, dequantized to F32."""
    import gguf
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
