"""The demo behind ``make demo``: three exports of the built-in model, one prompt, side by side.

1. the **fp16 baseline** (reference flavor: standard ONNX ops, any ONNX Runtime);
2. the **most accurate preset at <= 5 bits per element for a short prompt** (:data:`ACCURATE_SCHEME`: KIVI-style
   4-bit keys per channel and values per token, asymmetric groups of 64, no fp16 window; +0.99% perplexity on
   protocol P at 4.5 bits/element (`kvq validate`), +0.86% in the PyTorch reference), also reference flavor.
   ``k-int4-hc4-v-q4_0-rot`` (int4 keys with 4 calibrated 8-bit channels per head, rotated q4_0 values) is
   more accurate on P (+0.54% / +0.32%), but its key groups of 128 tokens keep up to 127 tokens in fp16: 6.6
   bits/element at the demo's 200 tokens against 4.7;
3. the **ort-gqa fast path** (``ort-int8`` with calibrated static scales): ONNX Runtime's fused
   GroupQueryAttention reading an int8 buffer in place, which onnxruntime-genai serves as it is.

Each generates from the same prompt with the same decoding settings (:data:`DEMO_SAMPLING`: greedy with a mild
repetition penalty, so a 135M model does not repeat one clause) and reports its continuation, how many leading
tokens agree with the baseline, the cache bytes held, the median decode time per token and its ratio to the
baseline, and how to serve the export with onnxruntime-genai (or why that export cannot be). Exports are cached
under ``$KVQ_CACHE_DIR/exports``, keyed by the model's content digest, and reused while the same kvq source made
them from the same request.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvq_export.export.exporter import cached_export_dir, ensure_export
from kvq_export.memory import predict
from kvq_export.model_source import cache_dir
from kvq_export.request import DEFAULT_CALIBRATION, CalibrationSpec, ExportRequest
from kvq_export.runtime import open_session
from kvq_export.runtime.base import Generation, Session
from kvq_export.runtime.genai import RUNTIME, serve_command
from kvq_export.runtime.sampling import SamplingConfig

logger = logging.getLogger(__name__)

#: A short, concrete opening (encyclopedic, not a story template) that SmolLM2-135M continues without looping
#: under :data:`DEMO_SAMPLING`.
DEMO_PROMPT = (
    "The lighthouse keeper had lived alone on the island for eleven years. Every evening he climbed the "
    "one hundred and twelve steps of the tower, cleaned the great lens, trimmed the wick and wrote the "
    "weather into a leather book that nobody ever read. Ships passed far out at sea, small as insects, and "
    "none of them ever stopped. Then one autumn morning, after a storm that had lasted three days and three "
    "nights, he walked down to the beach and found a wooden boat lying on its side in the sand. There was "
    "nobody in it, but under the seat he found a sealed glass bottle with a letter inside. He broke the "
    "seal, unfolded the paper and began to read."
)
#: Greedy (so the three runs are comparable token by token) with a mild CTRL repetition penalty.
DEMO_SAMPLING = SamplingConfig(repetition_penalty=1.3)
#: kivi-4 with groups of 64 and no fp16 recent window (a preset).
ACCURATE_SCHEME = "kivi-4-r0-g64"


@dataclass(frozen=True)
class DemoRun:
    """One export of the demo: what it shows, its scheme and flavor."""

    role: str
    scheme: str
    flavor: str = "reference"


DEMO_RUNS = (
    DemoRun("fp16 baseline", "fp16"),
    DemoRun("most accurate <= 5 bits", ACCURATE_SCHEME),
    DemoRun("ort-gqa fast path", "ort-int8", "ort-gqa"),
)


@dataclass(frozen=True)
class DemoRow:
    """One run's generation and measurements."""

    scheme: str
    text: str
    tokens: list[int]
    agree_with_baseline: int  # leading tokens identical to the baseline run
    cache_bytes: int
    prompt_tokens: int
    role: str = ""
    flavor: str = "reference"
    bits_per_element: float = 0.0  # the memory model's bits per K/V element at the final length
    decode_ms: float = 0.0  # median time from one generated token to the next
    decode_ratio: float = 1.0  # decode_ms / the baseline's
    directory: str = ""
    serve: str = ""  # one shell line serving the export with onnxruntime-genai, or why it cannot


def _timed_generate(session: Session, prompt: str, max_new_tokens: int,
                    sampling: SamplingConfig) -> tuple[Generation, float]:
    """Generate and return (result, median ms between consecutive tokens)."""
    stamps: list[float] = []
    result = session.generate([prompt], max_new_tokens, sampling, on_token=lambda row, token: stamps.append(
        time.perf_counter()))[0]
    gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return result, statistics.median(gaps) if gaps else 0.0


def run_demo(model_spec: str, prompt: str, max_new_tokens: int, workdir: str | os.PathLike[str] | None = None,
             sampling: SamplingConfig = DEMO_SAMPLING, runs: tuple[DemoRun, ...] = DEMO_RUNS,
             calibration: CalibrationSpec = DEFAULT_CALIBRATION,
             providers: Sequence[str] | None = None) -> list[DemoRow]:
    """Export (or reuse) each of ``runs`` and generate from ``prompt``; the first run is the baseline.

    Static-scale runs are calibrated as ``calibration`` says (``kvq export``'s defaults: held-out britannica text).
    ``providers``: ONNX Runtime providers of the sessions (None: the runtime's default choice).
    """
    root = Path(workdir) if workdir else cache_dir("exports")
    rows: list[DemoRow] = []
    for run in runs:
        request = ExportRequest(model=model_spec, scheme=run.scheme, flavor=run.flavor, calibration=calibration)
        directory = ensure_export(request, cached_export_dir(request, root))
        session = open_session(directory, providers=providers)  # kvq's loop: every flavor, timed per token
        result, decode_ms = _timed_generate(session, prompt, max_new_tokens, sampling)
        base = rows[0] if rows else None
        tokens = base.tokens if base else result.tokens
        agree = next((i for i, (a, b) in enumerate(zip(tokens, result.tokens)) if a != b),
                     min(len(tokens), len(result.tokens)))
        held = predict(session.manifest.scheme, session.manifest.model, len(result.prompt_tokens) + len(result.tokens))
        genai = session.manifest.runtimes.get(RUNTIME)
        first_sentence = prompt.split(". ")[0].rstrip(".") + "."
        serve = (serve_command(directory, first_sentence, len(result.prompt_tokens) + max_new_tokens)
                 if genai is not None and genai.supported else
                 f"not servable ({((genai and genai.reason) or '?').split(';')[0]}; details in kvq.json 'runtimes')")
        rows.append(DemoRow(
            scheme=session.manifest.scheme.name or run.scheme, text=result.text or "", tokens=result.tokens,
            agree_with_baseline=agree, cache_bytes=result.cache_bytes, prompt_tokens=len(result.prompt_tokens),
            role=run.role, flavor=run.flavor, bits_per_element=held.bits_per_element,
            decode_ms=decode_ms, decode_ratio=decode_ms / base.decode_ms if base and base.decode_ms else 1.0,
            directory=str(directory), serve=serve))
        logger.info("%s (%s, %s): %.2f ms/token, %d cache bytes", run.role, rows[-1].scheme, run.flavor, decode_ms,
                    result.cache_bytes)
    return rows
