"""kvq ort-gqa exports in kvq's loop beside onnxruntime-genai builder builds in og's loop, on the same weights.

:func:`genai_engines` makes (or reuses) the exports and builds, each an unloaded runner with its :class:`Row`
(an :class:`EngineSet`); :func:`measure_engines` scores them on protocol P and times their decode steps
interleaved at several contexts; :func:`run_genai` does both.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export.calibration import Calibration, calibrate_static_scales, calibration_windows
from kvq_export.errors import DependencyError, KVQError
from kvq_export.export.exporter import ensure_export
from kvq_export.measure.builder import build_with_builder, builder_calibration, model_hf_dir
from kvq_export.measure.runners import GenaiRunner, KvqRunner
from kvq_export.measure.timing import interleaved
from kvq_export.memory import predict
from kvq_export.model_source import load_model, model_facts
from kvq_export.peer_compare.rows import PREFILL_CHUNK, Row, own_baseline_deltas
from kvq_export.peer_compare.runs import has_module, protocol_text
from kvq_export.presets import resolve_scheme
from kvq_export.request import DEFAULT_CALIBRATION, DEFAULT_PERCENTILE, ExportRequest, WeightSpec
from kvq_export.runtime.genai import builder_scale_file

logger = logging.getLogger(__name__)

#: builder ``kv_cache_quant_scheme`` -> the kvq ort-gqa preset holding the same cache (static symmetric per channel)
GENAI_SCHEMES = {"int8_per_channel": "ort-int8", "int4_per_channel": "ort-int4"}
FP32_CACHE = Path(__file__).resolve().parents[2] / "tools" / "schemes" / "fp32-cache.json"
#: untimed decode rounds before the timed ones
WARMUP = 4
GENAI_MISSING = "pip install onnxruntime-genai==0.18.0"


class EngineSet:
    """Named runners, each with its :class:`Row`; a runner is a factory until it is first scored or timed.

    A context manager: leaving it lets every loaded runner go.
    """

    def __init__(self) -> None:
        self.entries: dict[str, tuple[Row, Any]] = {}
        self._stack = ExitStack()

    def __enter__(self) -> EngineSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def add(self, name: str, row: Row, factory: Callable[[], Any]) -> None:
        self.entries[name] = (row, factory)

    def row(self, name: str) -> Row:
        return self.entries[name][0]

    def loaded(self, name: str):
        """The runner ``name``, entered on first use (a model is only loaded when it is scored or timed)."""
        row, engine = self.entries[name]
        if callable(engine):
            self.entries[name] = row, self._stack.enter_context(engine())
        return self.entries[name][1]

    def rows(self) -> list[Row]:
        return [row for row, _ in self.entries.values()]


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


@dataclass
class GenaiBuilds:
    """What :func:`genai_engines` makes the engines of: the model, where builds go, and how weights are stored."""

    model: str
    work: Path
    precision: str = "fp32"  # the builder's -p
    kvq_weights: str = "fp32"
    kvq_accuracy_level: int | None = None
    spin_twins: bool = True
    engines: EngineSet = field(default_factory=EngineSet)

    def __post_init__(self) -> None:
        self.hf = model_hf_dir(self.model)
        self.hf_model, tokenizer = load_model(self.model)
        self.facts = model_facts(self.hf_model.config)
        spec = DEFAULT_CALIBRATION
        self.calib = calibration_windows(tokenizer, spec.corpus, spec.tokens, offset=spec.offset)
        self.work.mkdir(parents=True, exist_ok=True)
        self.tag = "" if self.precision == "fp32" else f"-p{self.precision}"  # fp32 builds keep their old names

    def kvq_row(self, cache: str, preset: str, directory: Path) -> Row:
        level = self.kvq_accuracy_level
        weights = self.kvq_weights if level is None else f"{self.kvq_weights} (accuracy_level {level})"
        return Row("kvq ort-gqa", cache, preset, weights=weights, dir_bytes=dir_bytes(directory))

    def builder_row(self, cache: str, preset: str, directory: Path) -> Row:
        return Row("genai builder", cache, preset, weights=self.precision, dir_bytes=dir_bytes(directory))

    def calibrated(self, scheme, name: str, label: str, method: str, pct: float, weights: str) -> Calibration:
        """Static scales measured on the model with ``weights`` weights (int4: the blocks an export computes with).

        Saved beside the exports: calibrating again would give the same.
        """
        saved = self.work / f"kvq-static-{name}-{label}{'' if weights == 'fp32' else f'-w-{weights}'}.npz"
        if saved.is_file():
            return Calibration.load(saved)
        static = calibrate_static_scales(self.hf_model, scheme, self.calib, method=method, percentile=pct,
                                         weights=WeightSpec(weights))
        static.save(saved)
        return static

    def add_kvq(self, preset: str, method: str, pct: float) -> tuple[Any, str, Calibration]:
        """Static scales and the kvq export on them, added (with its spinning twin): (scheme, label, static)."""
        scheme, label = resolve_scheme(preset), f"p{pct:g}" if method == "percentile" else method
        name = Path(preset).stem if preset.endswith(".json") else preset
        static = self.calibrated(scheme, name, label, method, pct, self.kvq_weights)
        kvq_dir = kvq_gqa_export(self.model, preset, self.work / f"kvq-{name}-{label}", static, self.kvq_weights,
                                 self.kvq_accuracy_level)
        row = self.kvq_row(f"{name} (kvq {label} scales)", name, kvq_dir)
        row.bits_4096 = predict(scheme, self.facts, 4096).bits_per_element
        self.engines.add(f"kvq {name} {label}", row, lambda: KvqRunner(kvq_dir, chunk=PREFILL_CHUNK))
        if self.spin_twins:
            self.engines.add(f"kvq {name} {label} spin",
                             self.kvq_row(f"{name} (kvq {label} scales, spinning)", name, kvq_dir),
                             lambda: KvqRunner(kvq_dir, chunk=PREFILL_CHUNK, spinning=True))
        return scheme, label, static

    def add_build(self, name: str, row: Row, built: Path) -> None:
        self.engines.add(name, row, lambda: GenaiRunner(built, chunk=PREFILL_CHUNK))

    def add_baselines(self) -> Path:
        """Add kvq's fp32 buffer and the builder's unquantized build; returns the build's directory."""
        fp32_dir = kvq_gqa_export(self.model, str(FP32_CACHE), self.work / "kvq-fp32", None, self.kvq_weights,
                                  self.kvq_accuracy_level)
        self.engines.add("kvq fp32", self.kvq_row("fp32 buffer", "fp32-cache", fp32_dir),
                         lambda: KvqRunner(fp32_dir, chunk=PREFILL_CHUNK))
        base_dir = build_with_builder(self.hf, self.work / f"builder-fp32{self.tag}", precision=self.precision)
        self.add_build("builder fp32", self.builder_row("fp32 (no kv quant)", "fp32-cache", base_dir), base_dir)
        return base_dir

    def add_builder_scheme(self, quant: str, base_dir: Path, int4_percentile: float | None, own_scales: bool) -> None:
        """One builder cache scheme on kvq's scales (and kvq's export on them), and on its own calibrator's."""
        spec, preset = DEFAULT_CALIBRATION, GENAI_SCHEMES[quant]
        methods = [(str(spec.method), spec.percentile)] + (
            [("percentile", int4_percentile)] if "int4" in quant and int4_percentile else [])
        for method, pct in methods:
            scheme, label, static = self.add_kvq(preset, method, pct)
            if WeightSpec(self.precision).calibration_weights != static.weights:  # the builder's: on its weights
                static = self.calibrated(scheme, preset, label, method, pct, self.precision)
            scales = self.work / f"kvq-scales-{quant}-{label}{self.tag}.json"
            scales.write_text(json.dumps(builder_scale_file(static, scheme, self.facts)))
            built = build_with_builder(self.hf, self.work / f"builder-{quant}-kvq-{label}{self.tag}", quant, scales,
                                       self.precision)
            self.add_build(f"builder {quant} kvq-{label}", self.builder_row(f"{quant} (kvq {label} scales)", preset,
                                                                              built), built)
        if not own_scales:
            return
        # the builder's calibrator runs the fp32 build (its own scales do not depend on the weights' format)
        fp32_base = base_dir if self.precision == "fp32" else build_with_builder(self.hf, self.work / "builder-fp32")
        own = builder_calibration(fp32_base, self.hf, self.work / f"builder-scales-{quant}.json", quant)
        built = build_with_builder(self.hf, self.work / f"builder-{quant}-own{self.tag}", quant, own, self.precision)
        self.add_build(f"builder {quant} own", self.builder_row(f"{quant} (builder calibrator)", preset, built), built)


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
    unknown = sorted(set(schemes) - set(GENAI_SCHEMES))
    if unknown:
        raise KVQError(f"unknown builder scheme(s) {unknown}; allowed: {list(GENAI_SCHEMES)}")
    builds = GenaiBuilds(model, work, precision, kvq_weights, kvq_accuracy_level, spin_twins)
    base_dir = builds.add_baselines()
    for quant in schemes:
        builds.add_builder_scheme(quant, base_dir, int4_percentile, own_scales)
    for extra in kvq_schemes:
        builds.add_kvq(extra, str(DEFAULT_CALIBRATION.method), DEFAULT_CALIBRATION.percentile)
    return builds.engines


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
        raise KVQError(f"unknown engine(s) {unknown}; known: {list(engines.entries)}")
    with engines:
        if ppl:
            _score(engines, p_windows, ppl_engines, update)
        timed = _timed(engines, contexts, timed_engines)
        for _, engine in timed.values():  # first runs allocate and prepack: keep them out of the prefill timing
            engine.prefill([text[:PREFILL_CHUNK]], PREFILL_CHUNK + 1)
        runs = [(c, b) for c in contexts for b in batches
                if b == 1 or batch_max_context is None or c <= batch_max_context]
        for context, batch in runs if timed else ():
            _time_context(timed, text[:context - WARMUP - steps - 1], context, batch, steps)
            update()
    return own_baseline_deltas(rows)


def _score(engines: EngineSet, p_windows: list[list[int]], names: Sequence[str] | None,
           update: Callable[[], None]) -> None:
    """Protocol P perplexity of ``names`` (default: every engine but the spinning twins, which score the same)."""
    for name in list(engines.entries):
        if name not in names if names is not None else name.endswith(" spin"):
            continue
        row, engine = engines.row(name), engines.loaded(name)
        start = time.perf_counter()
        row.ppl = engine.perplexity(p_windows)
        logger.info("%s: ppl %.4f (%.0f s)", name, row.ppl, time.perf_counter() - start)
        update()


def _timed(engines: EngineSet, contexts: Sequence[int], names: Sequence[str] | None) -> dict[str, tuple[Row, Any]]:
    """The engines to time, loaded.

    By default one per (runtime, scheme): the builder's calibrators and percentile scales do not change its speed.
    """
    if not contexts:
        return {}
    return {name: (engines.row(name), engines.loaded(name)) for name in list(engines.entries)
            if (name in names if names is not None else "own" not in name and "p99" not in name)}


def _time_context(timed: dict[str, tuple[Row, Any]], prompt: list[int], context: int, batch: int,
                  steps: int) -> None:
    """Prefill ``batch`` copies of ``prompt`` on every engine, then time their decode steps interleaved."""
    states, prefill_s = {}, {}
    for name, (_, engine) in timed.items():
        states[name], prefill_s[name] = engine.prefill(np.tile(np.asarray(prompt), (batch, 1)), context)
    timings = interleaved({name: (lambda i, e=engine, st=states[name]: e.step(st))
                           for name, (_, engine) in timed.items()}, steps, warmup=WARMUP)
    for name, (row, engine) in timed.items():
        ms = 1e3 * timings[name].median
        row.decode_ms_batch = row.decode_ms_batch or {}
        row.decode_ms_batch.setdefault(batch, {})[context] = ms
        row.cache_bytes = engine.cache_bytes(states[name])
        if batch == 1:
            row.decode_ms_at = {**(row.decode_ms_at or {}), context: ms}
            row.decode_ms = ms
            row.prefill_tok_s = len(prompt) / prefill_s[name]
            row.prefill_tok_s_at = {**(row.prefill_tok_s_at or {}), context: row.prefill_tok_s}
            row.cache_bytes_at = {**(row.cache_bytes_at or {}), context: row.cache_bytes}
        logger.info("%s ctx %d batch %d: step %.2f ms, prefill %.0f tok/s (%.0f s), cache %d B", name, context,
                    batch, ms, len(prompt) * batch / prefill_s[name], prefill_s[name], row.cache_bytes)


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
    if not has_module("onnxruntime_genai"):
        return [Row("onnxruntime-genai", "-", "-", status=f"unavailable: {GENAI_MISSING}")]
    engines = genai_engines(model, work, int4_percentile, precision, kvq_weights, schemes, own_scales,
                            kvq_accuracy_level)
    return measure_engines(engines, p_windows, contexts, steps, protocol_text(model, list(contexts)), ppl,
                           ppl_engines, timed_engines, batches, batch_max_context, on_update)


def require_genai() -> None:
    """A one-line DependencyError unless onnxruntime_genai can be imported."""
    if not has_module("onnxruntime_genai"):
        raise DependencyError(f"this peer needs onnxruntime_genai: {GENAI_MISSING}")
