"""``kvq bench``: prefill throughput, decode-step latency, cache bytes and memory, each next to a baseline.

:func:`run_bench` takes a :class:`~kvq_export.bench_config.BenchConfig` (model, flavors, schemes, baseline,
contexts, batches, steps) and returns a :class:`BenchReport`: one :class:`BenchResult` per (flavor, scheme, context,
batch) with its decode-step times, prefill throughput, cache bytes beside the memory model's prediction and the
process's memory, and each figure as a ratio to the baseline of the same flavor, context and batch. Exports are
made once and reused (:func:`bench_export`); ``on_result`` sees each result as it is measured.
:func:`report_table`, :func:`perplexity_table` and :func:`plot` present a report; :func:`perplexity` adds a
strict-decode perplexity for quality deltas.

Timings are printed, never asserted: tests only check that a bench runs and its JSON is well formed. How each
figure is measured, and why (interleaved steps, the synthetic cache, the paired ratio): docs/howto/measure.md
(section "What each figure is").
"""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export._atomic import atomic_write
from kvq_export.bench_config import BenchConfig
from kvq_export.corpus import load_corpus, token_windows
from kvq_export.errors import DependencyError
from kvq_export.export.exporter import ensure_export, weights_key
from kvq_export.measure.cpu import cpu_name
from kvq_export.measure.runners import KvqRunner
from kvq_export.measure.scoring import perplexity
from kvq_export.measure.synthetic import synthetic_cache
from kvq_export.measure.timing import Timing, interleaved, paired_ratio
from kvq_export.memory import check_fits, check_positions, predict, resident_bytes
from kvq_export.model_source import cache_dir, load_config, load_model, model_facts
from kvq_export.presets import resolve_scheme
from kvq_export.progress import task
from kvq_export.request import DEFAULT_CALIBRATION, CalibrationSpec, ExportRequest, WeightSpec

logger = logging.getLogger(__name__)

#: measuring and scoring live in :mod:`kvq_export.measure`; these names stay importable from here
__all__ = ["BenchReport", "BenchResult", "bench_export", "paired_ratio", "perplexity", "perplexity_table", "plot",
           "report_table", "run_bench", "synthetic_cache"]

BENCH_VERSION = 2
#: Text of the perplexity windows starts this many tokens into the corpus: the text ``kvq validate`` scores
#: (calibration reads held-out text further on, :data:`kvq_export.request.DEFAULT_CALIB_OFFSET`).
PPL_OFFSET = 0


@dataclass
class BenchResult:
    """One (flavor, scheme, context, batch) measurement; ``ratio`` compares it with the baseline."""

    flavor: str
    scheme: str
    context: int
    batch: int
    baseline: str
    decode_ms_median: float
    decode_ms_p10: float
    decode_ms_p90: float
    decode_steps: int
    decode_tok_s: float  # batch tokens per second at the median step
    prefill_tokens: int  # per row
    prefill_s: float
    prefill_tok_s: float  # batch * prefill_tokens / prefill_s
    cache_bytes: int  # held by the session's cache after the decode steps
    cache_bytes_predicted: int  # the memory model for `context` tokens (static scales excluded)
    peak_rss_bytes: int
    rss_bytes: int
    ratio: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


@dataclass
class BenchReport:
    """Everything one bench run measured."""

    model: str
    baseline: str
    fill: str
    settings: dict[str, Any]
    results: list[BenchResult] = field(default_factory=list)
    perplexity: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = False  # False while measuring (and in the file of a run that was stopped)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``kvq bench --json``)."""
        return {"bench_version": BENCH_VERSION, "model": self.model, "baseline": self.baseline, "fill": self.fill,
                "complete": self.complete, "settings": self.settings, "results": [r.to_dict() for r in self.results],
                "perplexity": self.perplexity}

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


# -- exports ------------------------------------------------------------------------------------------------
def bench_export(
    model: Any, tokenizer: Any, scheme: Any, flavor: str, root: Path, *, tag: str, dtype: str = "fp32",
    calibration: CalibrationSpec = DEFAULT_CALIBRATION, spec: str | None = None, weights: WeightSpec | None = None,
) -> Path:
    """Export ``scheme`` with ``flavor`` under ``root``; reuse an earlier one made with the same parameters.

    ``model``/``tokenizer`` are loaded already (``spec``: the model spec they came from, recorded as the source).
    "Same" is :func:`kvq_export.export.exporter.ensure_export`'s rule: the same request built by the same
    kvq source (its digest, not just its version), so a code change re-exports.
    """
    weights = weights or WeightSpec()
    request = ExportRequest(model=spec, scheme=scheme, flavor=flavor, dtype=dtype, calibration=calibration,
                            weights=weights)
    stored = "" if weights == WeightSpec() else f"-{weights_key(weights)}"
    directory = root / f"{tag}-{flavor}-{(request.scheme.name or 'custom').replace('/', '_')}-{dtype}{stored}"
    start = time.perf_counter()
    out = ensure_export(request, directory, model=model, tokenizer=tokenizer)
    logger.info("export %s ready in %.1f s", directory, time.perf_counter() - start)
    return out


# -- measuring --------------------------------------------------------------------------------------------------
def _filled(runner: KvqRunner, batch: int, length: int, capacity: int, fill: str, seed: int, vocab: int):
    """A runner state holding ``length`` tokens per row, made by ``fill`` (see :class:`BenchConfig`)."""
    rng = np.random.default_rng(seed)
    if fill == "synthetic":
        return runner.synthetic(batch, length, capacity, rng)
    return runner.prefill(rng.integers(0, vocab, (batch, length)), capacity)[0]  # chunked: the runner's chunk


def _rss() -> tuple[int, int]:
    """(peak RSS so far, current RSS) of this process in bytes."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return peak, resident_bytes() or 0


def _timed_decode(runners: dict[str, KvqRunner], states: dict, tokens: np.ndarray, warmup: int,
                  seed: int) -> dict[str, Timing]:
    """Interleaved single-token steps feeding ``tokens[i]`` in round ``i`` (the states advance)."""
    return interleaved({name: (lambda i, r=runner, s=states[name]: r.step(s, tokens[i]))
                        for name, runner in runners.items()}, len(tokens) - warmup, warmup=warmup, seed=seed)


def _timed_prefill(runners: dict[str, KvqRunner], ids: np.ndarray, repeats: int, seed: int) -> dict[str, float]:
    """Median seconds of a prefill of ``ids`` from an empty cache (one untimed warm-up run each)."""
    timings = interleaved({name: (lambda i, r=runner: r.prefill(ids, ids.shape[1])[1])
                           for name, runner in runners.items()}, repeats, warmup=1, seed=seed, self_timed=True)
    return {name: timing.median for name, timing in timings.items()}


def run_bench(config: BenchConfig, *, on_result: Callable[[BenchResult], None] | None = None) -> BenchReport:
    """Benchmark ``config.schemes`` (and the baseline) for every flavor, context and batch (docs/howto/measure.md).

    The stages: resolve the schemes and check the run fits, export (or reuse) every (flavor, scheme), then per
    flavor open the sessions and measure every (batch, context). ``on_result`` is called with each result as soon
    as it is measured (progress output).
    """
    schemes = _resolve_schemes(config)
    _check_bench_size(model_facts(load_config(config.model)), list(schemes.values()), config.contexts,
                      config.batches, config.prefill_tokens)
    hf_model, tokenizer = load_model(config.model)
    run = _Run(config, schemes, model_facts(hf_model.config), on_result)
    exports = _export_all(config, schemes, hf_model, tokenizer)
    run.report.settings["exports"] = {flavor: {name: str(d) for name, d in dirs.items()}
                                      for flavor, dirs in exports.items()}
    del hf_model, tokenizer  # the PyTorch model is not needed while measuring
    gc.collect()
    for flavor in config.flavors:
        run.measure_flavor(flavor, exports[flavor])
    run.report.settings["load_average_end"] = list(os.getloadavg())  # other processes share the cores: compare ratios
    run.report.complete = True
    run.save()
    return run.report


def _resolve_schemes(config: BenchConfig) -> dict[str, Any]:
    """The baseline and every scheme by name (the baseline first; a scheme named twice is measured once)."""
    resolved: dict[str, Any] = {}
    for spec in [config.baseline, *config.schemes]:
        scheme = resolve_scheme(spec)
        resolved.setdefault(scheme.name or str(spec), scheme)
    return resolved


def _export_all(config: BenchConfig, schemes: dict[str, Any], hf_model: Any,
                tokenizer: Any) -> dict[str, dict[str, Path]]:
    """Every (flavor, scheme) exported, or reused from an earlier run: directories by flavor, then scheme name."""
    root = Path(config.work_dir) if config.work_dir else cache_dir("bench")
    tag = Path(config.model).stem if os.sep in config.model else config.model
    exports: dict[str, dict[str, Path]] = {flavor: {} for flavor in config.flavors}
    with task("bench: exports", total=len(config.flavors) * len(schemes)) as advance:
        for flavor in config.flavors:
            for name, scheme in schemes.items():
                exports[flavor][name] = bench_export(hf_model, tokenizer, scheme, flavor, root, tag=tag,
                                                     dtype=config.dtype, calibration=config.calibration,
                                                     spec=config.model, weights=config.weights)
                advance()
    return exports


class _Run:
    """One bench run in progress: its settings, the report it fills (saved after every result) and its token stream."""

    def __init__(self, config: BenchConfig, schemes: dict[str, Any], facts: Any,
                 on_result: Callable[[BenchResult], None] | None) -> None:
        self.config, self.schemes, self.facts, self.on_result = config, schemes, facts, on_result
        self.base_name = resolve_scheme(config.baseline).name or config.baseline
        self.rng = np.random.default_rng(config.seed)
        settings = {"flavors": list(config.flavors), "schemes": list(schemes), "contexts": list(config.contexts),
                    "batches": list(config.batches), "steps": config.steps, "warmup": config.warmup,
                    "prefill_tokens": config.prefill_tokens, "prefill_repeats": config.prefill_repeats,
                    "threads": config.threads, "dtype": config.dtype, "cpu_count": os.cpu_count(), "cpu": cpu_name(),
                    "calibration": config.calibration.to_dict(), "weights": config.weights.to_dict(),
                    "load_average_start": list(os.getloadavg())}
        self.report = BenchReport(model=config.model, baseline=self.base_name, fill=config.fill, settings=settings)

    def save(self) -> None:
        if self.config.json_out is not None:
            atomic_write(self.config.json_out, self.report.to_json())

    def measure_flavor(self, flavor: str, exports: dict[str, Path]) -> None:
        """Every (batch, context) of one flavor, its schemes' sessions open side by side; then its perplexities."""
        config = self.config
        with ExitStack() as stack:
            runners = {name: stack.enter_context(KvqRunner(d, chunk=config.prefill_tokens, threads=config.threads,
                                                           providers=config.providers))
                       for name, d in exports.items()}
            prefills: dict[tuple[int, int], dict[str, float]] = {}  # by (batch, length): shared by contexts
            for batch in config.batches:
                for context in config.contexts:
                    length = min(context, config.prefill_tokens)
                    if (batch, length) not in prefills:
                        ids = self.rng.integers(0, self.facts.vocab_size, (batch, length))
                        prefills[batch, length] = _timed_prefill(runners, ids, config.prefill_repeats, config.seed)
                    group, times = self._measure_decode(flavor, runners, batch, context, prefills[batch, length])
                    self._add(group, times)
            if config.ppl_windows > 0:
                sessions = {name: runner.session for name, runner in runners.items()}
                self.report.perplexity.extend(_perplexities(sessions, self.base_name, flavor,
                                                            config.calibration.corpus, config.ppl_windows,
                                                            config.ppl_tokens))
                self.save()
        gc.collect()

    def _measure_decode(self, flavor: str, runners: dict[str, KvqRunner], batch: int, context: int,
                        prefill_s: dict[str, float]) -> tuple[list[BenchResult], dict[str, Timing]]:
        """Interleaved decode steps of every scheme from a cache of the same length: a result per scheme."""
        config, vocab = self.config, self.facts.vocab_size
        states = {name: _filled(r, batch, context - config.warmup - config.steps, context, config.fill, config.seed,
                                vocab) for name, r in runners.items()}
        tokens = self.rng.integers(0, vocab, (config.warmup + config.steps, batch, 1))
        times = _timed_decode(runners, states, tokens, config.warmup, config.seed)
        peak, current = _rss()
        length = min(context, config.prefill_tokens)
        group = []
        for name, runner in runners.items():
            timing = times[name]
            predicted = predict(self.schemes[name], self.facts, context, batch)
            static = predicted.breakdown["scales"] + predicted.breakdown["zero_points"] \
                if self.schemes[name].has_static_scales else 0
            low, high = timing.spread
            group.append(BenchResult(
                flavor=flavor, scheme=name, context=context, batch=batch, baseline=self.base_name,
                decode_ms_median=1e3 * timing.median, decode_ms_p10=1e3 * low, decode_ms_p90=1e3 * high,
                decode_steps=len(timing.seconds), decode_tok_s=batch / timing.median, prefill_tokens=length,
                prefill_s=prefill_s[name], prefill_tok_s=batch * length / prefill_s[name],
                cache_bytes=runner.cache_bytes(states[name]), cache_bytes_predicted=predicted.total_bytes - static,
                peak_rss_bytes=peak, rss_bytes=current))
        del states
        gc.collect()
        return group, times

    def _add(self, group: list[BenchResult], times: dict[str, Timing]) -> None:
        """Each result of one (flavor, context, batch) with its ratios to the baseline, saved and reported."""
        base = next(r for r in group if r.scheme == self.base_name)
        for result in group:
            paired = paired_ratio(times[result.scheme].seconds, times[self.base_name].seconds)
            result.ratio = {
                "decode_ms": result.decode_ms_median / base.decode_ms_median,
                **dict(zip(("decode_ms_paired", "decode_ms_paired_low", "decode_ms_paired_high"), paired)),
                "prefill_tok_s": result.prefill_tok_s / base.prefill_tok_s,
                "cache_bytes": result.cache_bytes / base.cache_bytes,
                "cache_reduction": base.cache_bytes / result.cache_bytes,
            }
            self.report.results.append(result)
            self.save()
            if self.on_result is not None:
                self.on_result(result)


def _check_bench_size(facts, schemes: Sequence[Any], contexts: Sequence[int], batches: Sequence[int],
                      prefill_tokens: int) -> None:
    """Refuse, before any export, contexts past the model's positions and runs that cannot fit in memory.

    Every scheme's cache of one (context, batch) is held at once (the memory model's bytes), with the logits
    of a prefill and of a decode step.
    """
    check_positions(contexts, facts.max_position_embeddings, "context", "bench shorter contexts")
    context, batch = max(contexts), max(batches)
    caches = sum(predict(scheme, facts, context, batch).total_bytes for scheme in schemes)
    logits = 4 * batch * facts.vocab_size * (min(context, prefill_tokens) + 1)
    check_fits(caches + logits, f"bench at context {context} and batch {batch}",
               "bench shorter contexts or smaller batches")


# -- quality ----------------------------------------------------------------------------------------------------
def _perplexities(sessions: dict, base_name: str, flavor: str, corpus: str, n: int, length: int) -> list[dict]:
    tokenizer = sessions[base_name].tokenizer
    windows = token_windows(tokenizer, load_corpus(corpus), n, length, offset=PPL_OFFSET)
    out = {name: perplexity(session, windows) for name, session in sessions.items()}
    base = out[base_name]["ppl"]
    return [{"flavor": flavor, "scheme": name, "corpus": corpus, "windows": n, "window_tokens": length,
             "offset": PPL_OFFSET, **values, "ppl_delta": values["ppl"] - base, "ppl_ratio": values["ppl"] / base}
            for name, values in out.items()]


# -- output ------------------------------------------------------------------------------------------------------
def report_table(report: BenchReport):
    """A rich Table of the results (ratios to the baseline in parentheses)."""
    from rich.table import Table

    table = Table(title=f"kvq bench on {report.model} ({report.fill} cache fill; ratios vs {report.baseline} "
                        "of the same flavor)")
    for col in ("flavor", "scheme", "ctx", "batch", "decode ms (p10-p90)", "x base (paired, 90%)", "tok/s",
                "prefill tok/s", "x base", "cache", "x less", "peak RSS"):
        table.add_column(col, justify="left" if col in ("flavor", "scheme") else "right")
    for r in report.results:
        table.add_row(
            r.flavor, r.scheme, str(r.context), str(r.batch),
            f"{r.decode_ms_median:.2f} ({r.decode_ms_p10:.2f}-{r.decode_ms_p90:.2f})",
            f"{r.ratio['decode_ms_paired']:.2f} ({r.ratio['decode_ms_paired_low']:.2f}-"
            f"{r.ratio['decode_ms_paired_high']:.2f})",
            f"{r.decode_tok_s:.1f}", f"{r.prefill_tok_s:.0f}", f"{r.ratio['prefill_tok_s']:.2f}",
            _mib(r.cache_bytes), f"{r.ratio['cache_reduction']:.2f}", _mib(r.peak_rss_bytes))
    return table


def perplexity_table(report: BenchReport):
    """A rich Table of the perplexities, if any were measured."""
    from rich.table import Table

    table = Table(title="strict-decode perplexity")
    for col in ("flavor", "scheme", "corpus", "tokens", "ppl", "Δ vs base", "x base"):
        table.add_column(col, justify="left" if col in ("flavor", "scheme", "corpus") else "right")
    for p in report.perplexity:
        table.add_row(p["flavor"], p["scheme"], p["corpus"], str(p["tokens"]), f"{p['ppl']:.3f}",
                      f"{p['ppl_delta']:+.3f}", f"{p['ppl_ratio']:.4f}")
    return table


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def plot(report: BenchReport, path: str | os.PathLike[str]) -> Path:
    """Decode latency and cache bytes against context, saved as PNG.

    One column per flavor (each against its own baseline); a scheme keeps its colour everywhere, batch
    sizes differ by line style, the baseline is drawn thicker.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise DependencyError(f"plotting needs matplotlib ({err}); install: pip install matplotlib") from None
    flavors = sorted({r.flavor for r in report.results})
    schemes = sorted({r.scheme for r in report.results}, key=lambda s: (s != report.baseline, s))
    batches = sorted({r.batch for r in report.results})
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(schemes)}
    styles = {b: ("-", "--", ":", "-.")[i % 4] for i, b in enumerate(batches)}
    fig, axes = plt.subplots(2, len(flavors), figsize=(6 * len(flavors), 8), squeeze=False, sharex=True)
    for col, flavor in enumerate(flavors):
        ax_t, ax_m = axes[0, col], axes[1, col]
        for scheme in schemes:
            for batch in batches:
                rows = sorted((r for r in report.results if (r.flavor, r.scheme, r.batch) == (flavor, scheme, batch)),
                              key=lambda r: r.context)
                if not rows:
                    continue
                xs = [r.context for r in rows]
                kw = dict(color=colors[scheme], linestyle=styles[batch], marker="o",
                          linewidth=2.5 if scheme == report.baseline else 1.5, label=f"{scheme} batch {batch}")
                ax_t.plot(xs, [r.decode_ms_median for r in rows], **kw)
                ax_m.plot(xs, [r.cache_bytes / 2**20 for r in rows], **kw)
        ax_t.set_title(f"flavor {flavor}")
        for ax, ylabel in ((ax_t, "decode step, median ms"), (ax_m, "cache held, MiB")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        ax_m.set_xlabel("context tokens")
        ax_t.legend(fontsize=7)
    fig.suptitle(f"kvq bench: {report.model} ({report.fill} cache fill; baseline {report.baseline} drawn thicker)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return atomic_write(path, buf.getvalue())
