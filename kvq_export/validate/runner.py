"""``validate()``: run an export and its fp16 baseline side by side on real text, on ONNX Runtime.

One lockstep pass over N windows of L tokens (the windows are the rows of one batch) gives every
number: strict-decode perplexity (one token per step, so every prediction attends to the stored
cache), per-position logit KL and top-1 agreement, attention behaviour at sampled decode positions
(q and this step's exact K/V come from the quantized graph's own probes, K̂/V̂ from its stored cache
decoded with only the manifest), the cache bytes held vs the memory model, and decode-step latency of
both graphs measured alternately. Free-running greedy generation on a prompt set adds
tokens-to-divergence.

The baseline stores its weights as the export does (int4 against int4), so every number above is the cache's
error alone. The weights' own error is a line of its own: the baseline against the same cache with fp32 weights,
scored on the same windows in the same pass (skipped when the export's weights are fp32 already).
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export.corpus import load_corpus, token_windows
from kvq_export.dtypes import DType
from kvq_export.errors import KVQError
from kvq_export.export.exporter import cached_export_dir, ensure_export
from kvq_export.manifest import decode_cache, load_static
from kvq_export.memory import curve, high_precision_tokens, predict
from kvq_export.model_digest import recorded_source
from kvq_export.model_source import cache_dir
from kvq_export.request import ExportRequest, WeightFormat, WeightSpec
from kvq_export.runtime.session import KVQSession
from kvq_export.validate.attention import AttentionMetric, AttentionSample, attention_metrics, summarize
from kvq_export.validate.config import ValidateConfig
from kvq_export.validate.probe import probed_session
from kvq_export.validate.result import (
    CalibrationResult,
    CurvePoint,
    Greedy,
    LatencyBucket,
    LatencyResult,
    MemoryResult,
    ModelSummary,
    Timing,
    TokenResult,
    ValidationResult,
    WeightOnlyResult,
    WindowResult,
    weights_label,
)
from kvq_export.validate.scores import TokenScores
from kvq_export.vocab import Part

logger = logging.getLogger(__name__)


@dataclass
class _Accumulator:
    tokens: TokenScores = field(default_factory=TokenScores)  # the export against the baseline
    weights: TokenScores = field(default_factory=TokenScores)  # the baseline against its fp32-weight twin
    times: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    attention: list[tuple[int, int, dict[AttentionMetric, np.ndarray]]] = field(default_factory=list)  # layer, pos


def export_weights(directory: str | os.PathLike[str]) -> WeightSpec:
    """How an export's graph stores its weights, as the graph records it (a graph as built: ``fp32``).

    What else the graph records of its weights (a w8a8 graph's smoothing) is left out: it is measured, not asked.
    """
    from kvq_export.weight_bytes import weight_bytes  # lazy: imports onnx

    settings = weight_bytes(directory).settings
    return WeightSpec.from_dict({k: v for k, v in settings.items() if k in WeightSpec.__dataclass_fields__})


def _cached_export(manifest, scheme: Any, weights: WeightSpec, *, flavor: str | None = None,
                   dtype: str | None = None) -> Path:
    """The export's own model source (by content) with ``scheme`` and ``weights``, kept under kvq's cache."""
    source, _ = recorded_source(manifest)  # the weights the export was made from, or a one-line refusal
    request = ExportRequest(model=source, scheme=scheme, flavor=flavor or manifest.flavor, weights=weights,
                            dtype=dtype or manifest.dtype)
    return ensure_export(request, cached_export_dir(request, cache_dir("exports")))


def resolve_baseline(manifest, baseline: str | os.PathLike[str] | None, weights: WeightSpec | None = None) -> Path:
    """The baseline directory: given, or the export's own model source exported with an unquantized fp16 cache.

    The automatic baseline is the same model by content (the source's digest must equal the one the export
    recorded: a source that is gone or changed is refused, never guessed at), in the same flavour and compute
    dtype (a latency ratio then compares caches, not graph flavours) and with the export's ``weights`` (the
    comparison then measures the cache's error, not the weights'), kept under kvq's cache directory by that
    digest and reused only while current (:func:`kvq_export.export.exporter.ensure_export`); nothing is written
    into the export validated.
    """
    if baseline is not None:
        return Path(baseline)
    return _cached_export(manifest, "fp16", weights or WeightSpec())


def weight_reference(manifest, baseline) -> Path:
    """The baseline's twin with fp32 weights: its cache scheme, flavour and dtype, the export's model source."""
    return _cached_export(manifest, baseline.scheme, WeightSpec(), flavor=baseline.flavor, dtype=baseline.dtype)


def validate(export_dir: str | os.PathLike[str], baseline_dir: str | os.PathLike[str] | None = None,
             config: ValidateConfig | None = None, *, progress: bool = True,
             verify_weights: bool = True, providers: Sequence[str] | None = None) -> ValidationResult:
    """Run the whole validation; return every number (nothing is written into an export).

    :meth:`ValidationResult.as_dict` is the result's JSON form.

    ``providers``: ONNX Runtime providers of both sessions (None: the runtime's default choice).
    """
    config = config or ValidateConfig()
    quant = probed_session(export_dir, verify_weights=verify_weights, providers=providers)
    if config.window_len > quant.max_positions:  # refused before any baseline is exported or corpus read
        raise KVQError(f"window length {config.window_len} (--window-len) exceeds the {quant.max_positions} "
                       f"positions this export supports (max_position_embeddings): use at most {quant.max_positions}")
    weights = export_weights(export_dir)
    base_dir = resolve_baseline(quant.manifest, baseline_dir, weights)
    base = KVQSession(base_dir, verify_weights=verify_weights, providers=providers)
    check_same_model(quant.manifest, base.manifest, export_dir, base_dir)
    check_same_weights(weights, export_weights(base_dir), export_dir, base_dir)
    reference, skipped = _weight_reference(quant.manifest, base.manifest, weights, verify_weights, providers)
    tokens = np.asarray(token_windows(quant.tokenizer, load_corpus(config.corpus), config.windows,
                                      config.window_len, offset=config.offset), dtype=np.int64)
    start = time.perf_counter()
    window = _window(quant.manifest)
    acc, quant_cache = _lockstep(quant, base, tokens, config, progress, reference)
    greedy = _greedy(quant, base, config, window)
    model = quant.manifest.model
    return ValidationResult(
        export=str(export_dir), baseline=str(base_dir), baseline_scheme=base.manifest.scheme,
        baseline_flavor=base.manifest.flavor, weights=weights, scheme=quant.manifest.scheme,
        model=ModelSummary(model.source, model.model_type, model.num_layers, model.num_heads, model.num_kv_heads,
                           model.head_dim),
        flavor=quant.manifest.flavor, config=config,
        calibration=CalibrationResult.of(quant.manifest.calibration, config) if quant.manifest.calibration else None,
        token=TokenResult(acc.tokens.summary(), greedy),
        window=_window_section(window, config, greedy),
        attention=summarize(acc.attention, model.num_layers, model.num_heads),
        memory=_memory_section(quant, base, quant_cache, tokens.shape),
        weight_only=_weight_only_section(acc, weights, reference, skipped),
        latency=_latency_section(acc, config),
        seconds=round(time.perf_counter() - start, 1),
    )


def check_same_weights(export: WeightSpec, base: WeightSpec, export_dir, base_dir) -> None:
    """A baseline with other weights would fold the weights' error into the cache's: refuse it in one line."""
    if weights_label(export) != weights_label(base):
        raise KVQError(f"baseline {base_dir} stores {weights_label(base)} weights, the export {export_dir} "
                       f"{weights_label(export)}: the cache comparison needs the same weights on both sides; pass an "
                       "fp16-cache export with the export's --weights, or no --baseline (kvq exports one)")


def _weight_reference(quant, base, weights: WeightSpec, verify_weights: bool,
                      providers: Sequence[str] | None = None):
    """The fp32-weight twin of the baseline as a session, or None and why the weight-only line is skipped."""
    if weights.format == WeightFormat.FP32:
        return None, "the export's weights are fp32 (as built): there is no weight error to separate"
    try:
        directory = weight_reference(quant, base)
    except KVQError as err:  # a given baseline, and the export's source is gone: the cache numbers still stand
        logger.warning("no weight-only line: %s", err)
        return None, f"no fp32-weight reference could be exported: {err}"
    return KVQSession(directory, verify_weights=verify_weights, providers=providers), None


def check_same_model(quant, base, export_dir, base_dir) -> None:
    """The baseline must be the export's model: the same facts, and the same content where both record it."""
    from dataclasses import replace

    if replace(base.model, source=None) != replace(quant.model, source=None):
        raise KVQError(f"baseline {base_dir} is not the same model as {export_dir} (their kvq.json 'model' sections "
                       "differ)")
    if base.source_digest and quant.source_digest and base.source_digest != quant.source_digest:
        raise KVQError(f"baseline {base_dir} was exported from other weights than {export_dir} (model content "
                       f"{base.source_digest} vs {quant.source_digest}); pass an fp16 export of the same model")


def _lockstep(quant, base, tokens: np.ndarray, config: ValidateConfig, progress: bool, reference=None):
    """Feed the windows through both graphs; collect token metrics, attention samples and timings.

    A ``reference`` (the baseline with fp32 weights) is fed the same windows, untimed, and scored against the
    baseline: the weight-only error.
    """
    n_rows, length = tokens.shape
    step = config.chunk or 1
    manifest = quant.manifest
    hp = DType.get(manifest.scheme.hp_dtype).numpy
    scaling = manifest.model.scaling
    static = load_static(quant.directory, manifest)
    layers = manifest.num_layers
    sample_at = set(np.linspace(length // config.attention_samples, length - 1, config.attention_samples,
                                dtype=int).tolist()) if config.attention_samples else set()
    exact: dict[tuple[int, str], list[np.ndarray]] = defaultdict(list)
    acc = _Accumulator()
    # a ``buffer``-layout cache is preallocated: sized to the window, it holds exactly what the model predicts
    q_cache, b_cache = quant.empty_cache(n_rows, capacity=length), base.empty_cache(n_rows, capacity=length)
    r_cache = reference.empty_cache(n_rows, capacity=length) if reference is not None else None
    bar = _progress(progress, total=length, desc=f"validate {manifest.scheme.name or 'custom'}")
    for begin in range(0, length, step):
        chunk = tokens[:, begin:begin + step]
        end = begin + chunk.shape[1]
        order = (("quant", quant), ("base", base)) if (begin // step) % 2 == 0 else (("base", base), ("quant", quant))
        out = {}
        for name, session in order:  # alternate who goes first: neither profits from a warm cache
            cache = q_cache if name == "quant" else b_cache
            t0 = time.perf_counter()
            logits, cache = session.step(chunk, None, cache)
            acc.times[name].append((end, (time.perf_counter() - t0) * 1e3))
            out[name] = logits
            if name == "quant":
                q_cache = cache
            else:
                b_cache = cache
        for layer in range(layers):
            for part in Part:
                exact[layer, part].append(quant.last_extra[f"probe.{layer}.{part}"].astype(hp).astype(np.float32))
        # predictions for positions begin+1 .. end (the last of the window has no target)
        targets = tokens[:, begin + 1:end + 1]
        acc.tokens.add(out["quant"], out["base"], targets)
        if reference is not None:
            ref_logits, r_cache = reference.step(chunk, None, r_cache)
            acc.weights.add(out["base"], ref_logits, targets)
        if sample_at & set(range(begin, end)):
            _sample_attention(acc, quant, q_cache, exact, end - 1, scaling, config, static)
        bar.update(chunk.shape[1])
    bar.close()
    return acc, q_cache


def _sample_attention(acc, quant, cache, exact, position, scaling, config, static):
    """Attention metrics of the last query of this step, every layer and row, against the stored cache."""
    # The stored basis: a rotated stream's probes (q and k after the rotation, v out of the folded v_proj) live
    # there too, so q, exact and decoded K/V share one basis; every metric is invariant under that rotation.
    decoded = decode_cache(quant.manifest, quant.cache_arrays(cache), direction="past", static=static,
                           basis="stored")
    for layer in range(quant.manifest.num_layers):
        q = quant.last_extra[f"probe.{layer}.q"][:, :, -1].astype(np.float64)  # [B, Hq, D]
        keys = np.concatenate(exact[layer, "key"], axis=2)
        values = np.concatenate(exact[layer, "value"], axis=2)
        window = quant.manifest.model.window(layer)
        for row in range(q.shape[0]):
            k_hat, v_hat = decoded[row][layer]
            n = k_hat.shape[1]
            seen = slice(max(0, n - window) if window else 0, n)  # a sliding-window layer sees its last keys
            sample = AttentionSample(q[row], keys[row, :, seen], values[row, :, seen], k_hat[:, seen],
                                     v_hat[:, seen], scaling)
            acc.attention.append((layer, position, attention_metrics(sample, top_k=config.top_k)))


def _window(manifest) -> int:
    """Tokens a row of this export holds in high precision before the first quantized one (see the memory model)."""
    return high_precision_tokens(manifest.scheme, manifest.model, manifest.model.max_position_embeddings)


def _window_section(window: int, config: ValidateConfig, greedy: Greedy) -> WindowResult:
    """Whether the scored windows and the greedy prompts reach past the high-precision span, with warnings.

    A row that never holds more than ``window`` tokens never reads a quantized token: its numbers match the
    baseline whatever the quantizer does, and must not read as a clean bill of health.
    """
    section = WindowResult(window, config.window_len > window, greedy.prompts_exceeding_window)
    if window and not section.windows_exceed:
        logger.warning("every scored window (%d tokens) stays within the export's %d-token high-precision window: "
                       "perplexity, KL and top-1 never read a quantized token (raise --window-len above %d)",
                       config.window_len, window, window)
    if window and greedy.prompts and not greedy.prompts_exceeding_window:
        logger.warning("no greedy prompt plus its %d generated tokens leaves the export's %d-token high-precision "
                       "window: greedy agreement never reads a quantized token (raise --gen-tokens)",
                       config.gen_tokens, window)
    return section


def _greedy(quant, base, config: ValidateConfig, window: int = 0) -> Greedy:
    if not config.prompts or not config.gen_tokens:
        return Greedy()
    got = quant.generate(list(config.prompts), config.gen_tokens, stop_at_eos=False)
    ref = base.generate(list(config.prompts), config.gen_tokens, stop_at_eos=False)
    agree = [next((i for i, (a, b) in enumerate(zip(g.tokens, r.tokens)) if a != b), len(r.tokens))
             for g, r in zip(got, ref)]
    # a row stores its prompt and every generated token but the last: only past the window is one quantized
    exceeding = sum(len(g.prompt_tokens) + config.gen_tokens - 1 > window for g in got)
    return Greedy(config.gen_tokens, tuple(agree), int(exceeding))


def _weight_only_section(acc: _Accumulator, weights: WeightSpec, reference, skipped: str | None) -> WeightOnlyResult:
    """The baseline (the export's weights) against its fp32-weight twin, both with the baseline's cache."""
    from kvq_export.weight_bytes import weight_bytes  # lazy: imports onnx

    if reference is None:
        return WeightOnlyResult(weights_label(weights), skipped=skipped)
    scores = replace(acc.weights.summary(), kl_by_position=None, top1_by_position=None)
    return WeightOnlyResult(weights_label(weights), scores, str(reference.directory),
                            weight_bytes(reference.directory).total)


def _memory_section(quant, base, cache, shape) -> MemoryResult:
    """The cache bytes held vs the memory model's, with both graphs' weight bytes beside them."""
    from kvq_export.weight_bytes import weight_bytes  # lazy: imports onnx

    rows, length = shape
    geo = quant.manifest.model
    scheme = quant.manifest.scheme
    report = predict(scheme, geo, length, rows)
    static = (report.breakdown["scales"] + report.breakdown["zero_points"]) if scheme.has_static_scales else 0
    measured = quant.cache_nbytes(cache)
    lengths = sorted({64, 128, 256, 512, 1024, 2048, 4096, 8192, length})
    exported, baseline = weight_bytes(quant.directory), weight_bytes(base.directory)
    return MemoryResult(
        weights=exported, baseline_weights=baseline, seq_len=length, batch=rows, predicted_bytes=report.total_bytes,
        predicted_cache_state_bytes=report.total_bytes - static,  # static scales live in the graph
        measured_bytes=measured, fp16_bytes=report.fp16_bytes, ratio=report.ratio,
        bits_per_element=report.bits_per_element, breakdown=report.breakdown,
        curve=tuple(CurvePoint(r.seq_len, r.total_bytes, r.fp16_bytes) for r in curve(scheme, geo, lengths)))


def _latency_section(acc: _Accumulator, config: ValidateConfig) -> LatencyResult:
    length = max(pos for pos, _ in acc.times["quant"])
    edges = np.linspace(0, length, config.latency_buckets + 1)
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        q = [ms for pos, ms in acc.times["quant"][1:] if lo < pos <= hi]  # first step excluded: warm-up
        b = [ms for pos, ms in acc.times["base"][1:] if lo < pos <= hi]
        if q and b:
            buckets.append(LatencyBucket(int(lo), int(hi), Timing.of(q), Timing.of(b)))
    return LatencyResult(tuple(buckets), Timing.of([ms for _, ms in acc.times["quant"][1:]]),
                         Timing.of([ms for _, ms in acc.times["base"][1:]]), config.windows, config.chunk or 1)


def _progress(enabled: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False)
