"""The demo behind ``make demo``: exports of the built-in model, one prompt, measured the way ``kvq validate`` does.

:func:`run_demo` takes a model spec, a prompt and a token count, exports (or reuses: by default
under ``$KVQ_CACHE_DIR/exports``) each of :data:`DEMO_RUNS` (the fp16 baseline first, then each run with the run it is
measured against) and returns a :class:`DemoResult`: per run its greedy continuation under :data:`DEMO_SAMPLING`,
where that text departs from its reference run's, teacher-forced top-1 agreement and KL against its reference run,
the directory's size, the cache's bits per element and the median decode time per token beside the baseline's.
:func:`serve_lines` gives the shell lines that serve an export and ask it for one completion. Runs whose reference is
not an earlier run, or whose roles repeat, are refused with a :class:`~kvq_export.errors.KVQError` before anything
is exported.

Which exports, and why they are compared this way: docs/design/demo.md.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.export.exporter import cached_export_dir, ensure_export
from kvq_export.manifest import Manifest
from kvq_export.memory import predict
from kvq_export.model_source import cache_dir
from kvq_export.request import DEFAULT_CALIBRATION, CalibrationSpec, ExportRequest, WeightSpec
from kvq_export.runtime.base import Generation, continuation_text
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.runtime.session import KVQSession
from kvq_export.validate.long_context.config import LongContextConfig
from kvq_export.validate.long_context.result import LongContextResult
from kvq_export.validate.long_context.runner import validate_long_context
from kvq_export.validate.scores import TokenScores, TokenSummary
from kvq_export.vocab import WeightFormat

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
#: Greedy (so the runs are comparable token by token) with a mild CTRL repetition penalty.
DEMO_SAMPLING = SamplingConfig(repetition_penalty=1.3)
#: kivi-4 with groups of 64 and no fp16 recent window (a preset).
ACCURATE_SCHEME = "kivi-4-r0-g64"
#: The weights a deployer ships: ``kvq export --weights int4`` (blocks of 32, symmetric, int8 activations).
DEPLOY_WEIGHTS = WeightSpec(format=WeightFormat.INT4)
#: Where ``kvq serve`` listens by default.
SERVE_URL = "http://127.0.0.1:8000"
#: The mark printed where a run's greedy text first departs from its reference run's.
DEPARTS = "‖"
#: The columns of the table ``kvq demo`` prints, one row per run.
TABLE_COLUMNS = ("", "scheme (flavor)", "weights", "size", "bits/elem", "against", "top-1", "KL", "greedy departs",
                 "ms/token", "x base")


@dataclass(frozen=True)
class DemoRun:
    """One export of the demo: what it shows, its scheme, flavor and weights, and the run it is measured against.

    ``against``: the role of an earlier run whose cache is fp16 on the same weights (the cache's error), or of
    the baseline (``""``: the first run).
    """

    role: str
    scheme: str
    flavor: str = "reference"
    weights: WeightSpec = WeightSpec()
    against: str = ""


DEMO_RUNS = (
    DemoRun("fp16 baseline", "fp16"),
    DemoRun("most accurate <= 5 bits", ACCURATE_SCHEME),
    DemoRun("ort-gqa fast path", "ort-int8", "ort-gqa"),
    DemoRun("int4 weights, fp16 cache", "fp16", "ort-gqa", DEPLOY_WEIGHTS),
    DemoRun("deployer's export", "ort-int8", "ort-gqa", DEPLOY_WEIGHTS, against="int4 weights, fp16 cache"),
)


@dataclass(frozen=True)
class DemoRow:
    """One run's generation and measurements."""

    role: str
    scheme: str
    flavor: str
    weights: str  # how the export stores its weights: fp32, int4, ...
    against: str  # the role of the run it is scored against (the baseline's own row: its own role)
    text: str  # its own greedy continuation
    tokens: list[int]
    departs: int | None  # first token where its greedy text differs from its reference run's (None: never)
    shared: str  # the text before that token (all of ``text`` when it never departs)
    top1: float  # teacher-forced top-1 agreement with the reference run (raw logits, as kvq validate scores)
    kl: float  # mean KL(reference || run) of the next-token distributions, nats
    kl_max: float
    predictions: int
    cache_bytes: int
    prompt_tokens: int
    bits_per_element: float  # the memory model's bits per K/V element at the final length
    directory_bytes: int  # the export directory's size on disk
    decode_ms: float  # median time from one generated token to the next
    decode_ratio: float  # decode_ms / the baseline's
    directory: str


@dataclass(frozen=True)
class DemoResult:
    """Every run's row, and the deployer's export against the baseline (its weights' and cache's error together).

    ``long_range``: the last run against the run it is measured against at the model's full positions
    (:func:`long_range`), or None when not asked for.
    """

    rows: list[DemoRow]
    combined_top1: float | None = None
    combined_kl: float | None = None
    long_range: LongContextResult | None = None

    def row(self, role: str) -> DemoRow:
        """The row of ``role``."""
        return next(r for r in self.rows if r.role == role)


def check_runs(runs: Sequence[DemoRun]) -> None:
    """Refuse, in one line, runs whose ``against`` names no earlier run or whose roles repeat."""
    roles: list[str] = []
    for run in runs:
        if run.role in roles:
            raise KVQError(f"demo run role {run.role!r} appears twice; allowed: distinct roles")
        if run.against and run.against not in roles:
            raise KVQError(f"demo run {run.role!r} is measured against {run.against!r}; allowed: an earlier run's "
                           f"role ({', '.join(map(repr, roles)) or 'none'}) or '' (the baseline)")
        roles.append(run.role)


def _timed_generate(session: KVQSession, prompt: str, max_new_tokens: int,
                    sampling: SamplingConfig) -> tuple[Generation, float]:
    """Generate and return (result, median ms between consecutive tokens)."""
    stamps: list[float] = []
    result = session.generate([prompt], max_new_tokens, sampling, on_token=lambda row, token: stamps.append(
        time.perf_counter()))[0]
    gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return result, statistics.median(gaps) if gaps else 0.0


def teacher_forced_logits(session: KVQSession, prompt_tokens: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Logits ``[1, n, vocab]`` predicting each of ``tokens`` after ``prompt_tokens``, as generation computes them.

    The prompt is prefilled in one call; then each of ``tokens`` but the last is fed one per step, so every
    prediction after the first reads the stored (quantized) cache, as a decode step does.
    """
    cache = session.empty_cache(1, capacity=len(prompt_tokens) + len(tokens))
    logits, cache = session.step(np.asarray([prompt_tokens], dtype=np.int64), None, cache)
    rows = [logits[:, -1]]
    for token in tokens[:-1]:
        logits, cache = session.step(np.asarray([[token]], dtype=np.int64), None, cache)
        rows.append(logits[:, -1])
    return np.stack(rows, axis=1)


def score(logits: np.ndarray, reference: np.ndarray, targets: Sequence[int]) -> TokenSummary:
    """``kvq validate``'s token summary of ``logits`` against ``reference`` (both ``[1, n, vocab]``)."""
    scores = TokenScores()
    scores.add(logits, reference, np.asarray([targets], dtype=np.int64))
    return scores.summary()


def departure(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first index where ``tokens`` differs from ``reference`` (None: equal over their common length)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)


def directory_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``directory`` (what a deployer copies)."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def long_range(directory: str | os.PathLike[str], baseline: str | os.PathLike[str],
               providers: Sequence[str] | None = None) -> LongContextResult:
    """``directory`` against ``baseline`` at the model's full positions, as ``kvq validate --long-context`` measures.

    One corpus window of every position (perplexity by distance) and the passkey at that length at three depths:
    what the cache costs where it matters, in about a minute on SmolLM2.
    """
    full = Manifest.load(directory).model.max_position_embeddings  # the manifest says it: no graph to open
    config = LongContextConfig(tasks=("passkey",), lengths=(full,), depths=3, ppl_windows=(full,))
    return validate_long_context(directory, baseline, config, verify_weights=False, providers=providers)


def long_range_line(role: str, against: str, result: LongContextResult) -> str:
    """One line: what ``role``'s cache costs against ``against`` at the model's full positions."""
    far, near = result.distance[-1], result.distance[0]
    summary = result.retrieval.summary()
    return (f"{role} against the {against} at {max(result.config.lengths)} tokens: perplexity "
            f"{far.perplexity_delta_rel:+.2%} at positions {far.label} ({near.perplexity_delta_rel:+.2%} at "
            f"{near.label}), KL {far.kl_mean:.2g}; passkey at {len(result.config.depth_values)} depths "
            f"{summary['export_hits']}/{summary['trials']} (its reference {summary['baseline_hits']}/"
            f"{summary['trials']})")


def run_demo(model_spec: str, prompt: str, max_new_tokens: int, workdir: str | os.PathLike[str] | None = None,
             sampling: SamplingConfig = DEMO_SAMPLING, runs: Sequence[DemoRun] = DEMO_RUNS,
             calibration: CalibrationSpec = DEFAULT_CALIBRATION,
             providers: Sequence[str] | None = None, at_full_length: bool = True) -> DemoResult:
    """Export (or reuse) each of ``runs``, generate from ``prompt`` and score it; the first run is the baseline.

    Static-scale runs are calibrated as ``calibration`` says (``kvq export``'s defaults: held-out britannica text),
    on the weights they store. ``providers``: ONNX Runtime providers of the sessions (None: the runtime's default).
    ``at_full_length``: also measure the last run against its reference at the model's positions (:func:`long_range`).
    """
    check_runs(runs)
    root = Path(workdir) if workdir else cache_dir("exports")
    rows: list[DemoRow] = []
    logits: dict[str, np.ndarray] = {}
    base: DemoRow | None = None
    for run in runs:
        request = ExportRequest(model=model_spec, scheme=run.scheme, flavor=run.flavor, weights=run.weights,
                                calibration=calibration)
        directory = ensure_export(request, cached_export_dir(request, root))  # checks the weights it reuses
        session = KVQSession(directory, verify_weights=False, providers=providers)
        result, decode_ms = _timed_generate(session, prompt, max_new_tokens, sampling)
        forced = base.tokens if base else result.tokens  # every run is fed the baseline's continuation
        logits[run.role] = teacher_forced_logits(session, result.prompt_tokens, forced)
        against = run.against or (base.role if base else run.role)
        ref = next((r for r in rows if r.role == against), None)
        scores = score(logits[run.role], logits[against], forced)
        departs = departure(result.tokens, ref.tokens) if ref else None
        text = result.text or ""
        shared = text if departs is None else continuation_text(session.decode, result.prompt_tokens,
                                                                result.tokens[:departs])
        held = predict(session.manifest.scheme, session.manifest.model, len(result.prompt_tokens) + len(result.tokens))
        row = DemoRow(
            role=run.role, scheme=session.manifest.scheme.name or run.scheme, flavor=run.flavor,
            weights=str(run.weights.format), against=against, text=text, tokens=result.tokens,
            departs=departs, shared=shared if text.startswith(shared) else "", top1=scores.top1_agreement,
            kl=scores.kl.mean, kl_max=scores.kl.max, predictions=scores.predictions,
            cache_bytes=result.cache_bytes, prompt_tokens=len(result.prompt_tokens),
            bits_per_element=held.bits_per_element, directory_bytes=directory_bytes(directory), decode_ms=decode_ms,
            decode_ratio=decode_ms / base.decode_ms if base and base.decode_ms else 1.0, directory=str(directory))
        rows.append(row)
        base = base or row
        logger.info("%s (%s, %s, %s weights): top-1 %.3f, KL %.3g against %s; %.2f ms/token", run.role, row.scheme,
                    run.flavor, row.weights, row.top1, row.kl, against, decode_ms)
    last = rows[-1]
    far = long_range(last.directory, next(r for r in rows if r.role == last.against).directory, providers) \
        if at_full_length and last.against != last.role else None
    if last.against == base.role:
        return DemoResult(rows, long_range=far)
    together = score(logits[last.role], logits[base.role], base.tokens)
    return DemoResult(rows, together.top1_agreement, together.kl.mean, far)


def serve_lines(directory: str | os.PathLike[str], prompt: str, max_tokens: int, url: str = SERVE_URL) -> list[str]:
    """Shell lines that serve ``directory`` with ``kvq serve``, then ask it for one completion with ``curl``.

    The export's absolute path sits in ``$EXPORT``; the request names the model as ``kvq serve`` does by default
    (the directory's name). The server runs in the foreground: the ``curl`` line is for a second shell.
    """
    path = Path(directory).resolve()
    body = json.dumps({"model": path.name, "prompt": prompt, "max_tokens": int(max_tokens)})
    return [f"EXPORT={shlex.quote(str(path))}",
            'kvq serve "$EXPORT"',
            f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"]
