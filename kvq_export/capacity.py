"""Capacity: how many sequences an export serves at once within a memory budget, and how fast together.

For each directory onnxruntime-genai (og) loads, :func:`run_capacity` predicts from the decoder graph alone
(:func:`footprint`) the cache bytes one sequence holds at each context and how many sequences fit the budget beside
the weights, then measures, each export in a child process of its own, the resident set after loading and after
``concurrent`` sequences decoded together, and their aggregate tokens/s (the exports of one context interleaved by
:func:`kvq_export.measure.timing.interleaved`). It returns one :class:`CapacityRow` per export and context and
appends each context's rows to a JSON-lines file once measured; :func:`plot_capacity` draws them::

    rows = run_capacity({"int8": "exports/int8", "builder": "exports/builder-int4"}, contexts=(2048, 8000),
                        concurrent=4, budget_bytes=8 << 30, out="capacity.jsonl")
    plot_capacity(rows, "capacity.png")

:class:`Backend` says which runner of :mod:`kvq_export.measure.runners` measures an export. What is measured, how,
and why: docs/howto/measure.md#capacity-kvq-bench-serve.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.manifest import MANIFEST_NAME, MODEL_NAME
from kvq_export.measure.runners import GENAI_CONFIG, GenaiRunner, KvqRunner, OrtGraphRunner, Runner
from kvq_export.measure.timing import interleaved
from kvq_export.memory import resident_bytes

logger = logging.getLogger(__name__)


class Backend(StrEnum):
    """What measures an export (``kvq bench-serve --backend``): a runner, or a rule that picks one per directory."""

    AUTO = "auto"  # session for a kvq export, else og
    SYNTHETIC = "synthetic"  # every export on a synthetic cache: session for a kvq export, else ort
    OG = "og"  # og.Model / og.Generator (GenaiRunner), a batch of synthetic prompts prefilled together
    SESSION = "session"  # KVQSession (KvqRunner) on a synthetic cache already holding the context; kvq exports
    ORT = "ort"  # the decoder graph in ONNX Runtime (OrtGraphRunner) on a synthetic cache, stepping as og does


#: The backends that run an export (``auto`` and ``synthetic`` pick one of them per directory).
BACKENDS = (Backend.OG, Backend.SESSION, Backend.ORT)


class _Message(StrEnum):
    """What a measuring process and its parent send each other through their pipe."""

    READY = "ready"  # child: the export is set up and holds the context (with the resident set)
    STEP = "step"  # parent: time one decode step; child: its seconds
    DONE = "done"  # parent: stop stepping; child: the resident set after the steps
    FAILED = "failed"  # child: why it cannot go on


CONTEXTS = (2048, 8000)
#: untimed decode rounds before the timed ones (ONNX Runtime's first runs allocate and plan)
WARMUP = 2
#: bytes per element of the cache types og allocates
_ITEMSIZE = {1: 4, 10: 2, 16: 2, 2: 1, 3: 1}  # FLOAT, FLOAT16, BFLOAT16, UINT8, INT8


class CapacityError(KVQError):
    """A directory or option the capacity measurement cannot use."""


@dataclass(frozen=True)
class Footprint:
    """What one export needs in memory: its weights once, its cache per sequence."""

    name: str
    directory: str
    weight_bytes: int
    #: one sequence's cache bytes per token of context, every layer's keys and values
    cache_bytes_per_token: int
    #: 1 when past and present share one buffer (``past_present_share_buffer``), 2 when og holds both
    copies: int = 1

    def cache_bytes(self, context: int) -> int:
        """One sequence's cache at ``context`` tokens (og allocates the whole context up front)."""
        return self.copies * context * self.cache_bytes_per_token

    def sequences(self, budget_bytes: int, context: int, overhead_bytes: int = 0) -> int:
        """Sequences of ``context`` tokens that fit ``budget_bytes`` beside the weights and ``overhead_bytes``."""
        free = budget_bytes - self.weight_bytes - overhead_bytes
        return max(0, free // self.cache_bytes(context))


def footprint(directory: str | os.PathLike[str], name: str | None = None) -> Footprint:
    """:class:`Footprint` of an onnxruntime-genai directory, read from its ``genai_config.json`` and decoder graph."""
    import onnx

    directory = Path(directory)
    config_path = directory / GENAI_CONFIG
    if not config_path.is_file():
        raise CapacityError(f"{directory} has no {GENAI_CONFIG}: export with --flavor ort-gqa or use the builder")
    config = json.loads(config_path.read_text())
    decoder = config["model"]["decoder"]
    graph = onnx.load(str(directory / decoder["filename"]), load_external_data=False).graph
    inputs = {value.name: value.type.tensor_type for value in graph.input}
    per_token = 0
    for layer in range(int(decoder["num_hidden_layers"])):
        for template in (decoder["inputs"]["past_key_names"], decoder["inputs"]["past_value_names"]):
            tensor = inputs.get(template % layer)
            if tensor is None:
                raise CapacityError(f"{directory}: the decoder graph has no cache input {template % layer}")
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
            # the builder leaves a quantized cache's dims symbolic: og allocates the config's heads and head size
            # then (a 4-bit cache packed two to a byte would be half that, so it is refused rather than guessed)
            if dims[1:2] == [None] or dims[3:4] == [None]:
                packed = tensor.elem_type == 2  # uint8: 4-bit codes
                dims = [None, int(decoder["num_key_value_heads"]), None, None if packed else int(decoder["head_size"])]
            if len(dims) != 4 or dims[1] is None or dims[3] is None or tensor.elem_type not in _ITEMSIZE:
                raise CapacityError(f"{directory}: cache input {template % layer} is not [batch, kv_heads, tokens, "
                                    f"head_dim] of a float or 8-bit type whose widths the graph or config give: {dims}")
            per_token += dims[1] * dims[3] * _ITEMSIZE[tensor.elem_type]
    shared = config.get("search", {}).get("past_present_share_buffer", False)
    return Footprint(name or directory.name, str(directory), _weight_bytes(directory, graph), per_token,
                     1 if shared else 2)


def _weight_bytes(directory: Path, graph) -> int:
    """Initializer bytes the decoder holds (kvq's entry graph reads model.onnx's, which :func:`weight_bytes` reads)."""
    from kvq_export.weight_bytes import weight_bytes  # lazy: imports onnx

    if (directory / MODEL_NAME).is_file():
        return weight_bytes(directory).total
    return sum(math.prod(t.dims) * _ITEMSIZE.get(t.data_type, 1) for t in graph.initializer)


@dataclass
class CapacityRow:
    """One export at one context: prediction and measurement side by side."""

    name: str
    directory: str
    context: int
    concurrent: int
    budget_bytes: int
    weight_bytes: int
    cache_bytes_per_sequence: int
    #: sequences that fit the budget beside the weights (and the measured runtime overhead, when measured)
    predicted_sequences: int
    backend: str = ""
    status: str = "ok"
    rss_loaded_bytes: int | None = None  # resident set after loading the export
    rss_bytes: int | None = None  # ... after ``concurrent`` sequences decoded at ``context``
    predicted_rss_bytes: int | None = None  # rss_loaded + concurrent * cache_bytes_per_sequence
    measured_cache_bytes_per_sequence: int | None = None  # (rss - rss_loaded) / concurrent
    measured_sequences: int | None = None  # the budget divided by what the resident set says
    tokens_per_s: float | None = None  # aggregate decode tokens/s of the concurrent sequences
    decode_step_ms: float | None = None  # median step of the whole batch
    prefill_tokens_per_s: float | None = None  # og backend: the batch's prefill
    extra: dict[str, Any] = field(default_factory=dict)


# -- measuring (in a child process) -------------------------------------------------------------------------------
def _runner(backend: Backend, directory: str, threads: int | None, providers: Sequence[str] | None) -> Runner:
    """The runner of ``backend`` on ``directory`` (not yet entered)."""
    if backend == Backend.OG:
        return GenaiRunner(directory, threads=threads, providers=providers)
    if backend == Backend.SESSION:
        return KvqRunner(directory, threads=threads, verify_weights=False, providers=providers)
    return OrtGraphRunner(directory, threads=threads, providers=providers)


def _hold(runner: Any, backend: Backend, directory: str, context: int, concurrent: int, steps: int,
          seed: int) -> tuple[Any, dict[str, Any]]:
    """A state of ``concurrent`` sequences holding ``context - steps`` tokens, with room for ``steps`` more.

    ``og``: synthetic prompts prefilled together in one call; the others: a synthetic cache (no prefill).
    """
    rng = np.random.default_rng(seed)
    if backend != Backend.OG:
        return runner.synthetic(concurrent, context - steps, context, rng), {}
    vocab = json.loads((Path(directory) / GENAI_CONFIG).read_text())["model"]["vocab_size"]
    prompt = rng.integers(1, vocab, (concurrent, context - steps), dtype=np.int32)
    state, seconds = runner.prefill(prompt, context)
    return state, {"prefill_tokens_per_s": prompt.size / seconds}


def _serve(conn, backend: Backend, directory: str, context: int, concurrent: int, steps: int, threads: int | None,
           seed: int, providers: list[str] | None) -> None:
    """Child process: set one export up, then time one decode step per ``STEP`` message until ``DONE``."""
    try:
        with _runner(backend, directory, threads, providers) as runner:
            loaded = resident_bytes() or 0
            state, info = _hold(runner, backend, directory, context, concurrent, steps, seed)
            conn.send((_Message.READY, {"rss_loaded": loaded, **info}))
            while conn.recv() == _Message.STEP:
                start = time.perf_counter()
                runner.step(state)
                conn.send((_Message.STEP, time.perf_counter() - start))
            conn.send((_Message.DONE, {"rss": resident_bytes() or 0}))
    except Exception as err:  # noqa: BLE001 - reported as the row's status, the other exports go on
        conn.send((_Message.FAILED, f"{type(err).__name__}: {err}"))


def _receive(conn, process) -> tuple[_Message, Any]:
    try:
        return conn.recv()
    except EOFError:  # killed (out of memory) or crashed in native code
        process.join(5)
        return _Message.FAILED, f"the measuring process died (exit code {process.exitcode})"


def _remote_step(conn, process, where: str):
    """A stepper for :func:`~kvq_export.measure.timing.interleaved`: one step in the child, timed there."""

    def step(_: int) -> float:
        conn.send(_Message.STEP)
        status, value = _receive(conn, process)
        if status != _Message.STEP:
            raise CapacityError(f"{where}: {value}")
        return value

    return step


def measure(jobs: Mapping[str, tuple[Backend, str]], context: int, concurrent: int, new_tokens: int,
            threads: int | None = None, seed: int = 0, warmup: int = WARMUP,
            providers: Sequence[str] | None = None) -> dict[str, dict[str, Any] | str]:
    """Measure every ``name -> (backend, directory)`` at ``context``, decode steps interleaved across them.

    Each export lives in a process of its own (so its resident memory is its own), set up one after another (a
    prefill never competes with another); then :func:`~kvq_export.measure.timing.interleaved` runs one step of
    each export per round in a fresh random order while the others wait, so load on a shared machine hits them all
    alike. ``warmup`` rounds are not timed. Returns per name ``rss_loaded``, ``rss``, per-step ``steps`` seconds
    (, ``prefill_tokens_per_s``), or the reason it failed.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results: dict[str, dict[str, Any] | str] = {}
    live: dict[str, tuple[Any, Any]] = {}
    try:
        for name, (backend, directory) in jobs.items():
            conn, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child, backend, directory, context, concurrent,
                                                       warmup + new_tokens, threads, seed,
                                                       None if providers is None else list(providers)), daemon=True)
            process.start()
            child.close()
            status, value = _receive(conn, process)
            if status == _Message.READY:
                live[name] = process, conn
                results[name] = value
            else:
                results[name] = f"{directory} at {context} tokens x {concurrent}: {value}"
        failures: dict[str, str] = {}
        steppers = {name: _remote_step(conn, process, f"{jobs[name][1]} at {context} tokens x {concurrent}")
                    for name, (process, conn) in live.items()}
        timings = (interleaved(steppers, new_tokens, warmup=warmup, seed=seed, self_timed=True, failures=failures)
                   if live else {})
        results.update(failures)
        for name, timing in timings.items():
            process, conn = live[name]
            conn.send(_Message.DONE)
            status, value = _receive(conn, process)
            results[name] = ({**results[name], "steps": list(timing.seconds), **value} if status == _Message.DONE
                             else f"{jobs[name][1]}: {value}")
    finally:
        for process, conn in live.values():
            conn.close()
            process.join(10)
            if process.is_alive():
                process.terminate()
    return results


# -- the run -----------------------------------------------------------------------------------------------------
def choose_backend(directory: str | os.PathLike[str], backend: Backend | str) -> Backend:
    """One of :data:`BACKENDS` for ``directory``.

    ``auto``: ``session`` for a kvq export (no prefill), else ``og``; ``synthetic``: every export on a cache
    already holding the context, ``session`` for a kvq export, else ``ort``.
    """
    try:
        backend = Backend(backend)
    except ValueError:
        raise CapacityError(f"unknown backend {backend!r}; allowed: {', '.join(Backend)}") from None
    is_kvq = (Path(directory) / MANIFEST_NAME).is_file()
    if backend is Backend.SESSION and not is_kvq:
        raise CapacityError(f"{directory} is not a kvq export: the session backend needs one (use og or ort)")
    if backend is Backend.AUTO:
        return Backend.SESSION if is_kvq else Backend.OG
    if backend is Backend.SYNTHETIC:
        return Backend.SESSION if is_kvq else Backend.ORT
    return backend


def capacity_row(print_: Footprint, context: int, concurrent: int, budget_bytes: int, backend: Backend,
                 measured: Mapping[str, Any] | None) -> CapacityRow:
    """A row from a footprint and (optionally) a measurement: the arithmetic, in one place."""
    per_seq = print_.cache_bytes(context)
    row = CapacityRow(print_.name, print_.directory, context, concurrent, budget_bytes, print_.weight_bytes, per_seq,
                      print_.sequences(budget_bytes, context), backend)
    if measured is None:
        return row
    steps = sorted(measured["steps"])
    median = steps[len(steps) // 2]
    loaded, rss = int(measured["rss_loaded"]), int(measured["rss"])
    overhead = max(0, loaded - print_.weight_bytes)  # the runtime's own memory beside the weights
    row.predicted_sequences = print_.sequences(budget_bytes, context, overhead)
    row.rss_loaded_bytes, row.rss_bytes = loaded, rss
    row.predicted_rss_bytes = loaded + concurrent * per_seq
    row.measured_cache_bytes_per_sequence = max(0, rss - loaded) // concurrent
    grown = max(row.measured_cache_bytes_per_sequence, 1)
    row.measured_sequences = max(0, (budget_bytes - loaded) // grown)
    row.decode_step_ms = 1e3 * median
    row.tokens_per_s = concurrent / median
    if "prefill_tokens_per_s" in measured:
        row.prefill_tokens_per_s = float(measured["prefill_tokens_per_s"])
    return row


def run_capacity(directories: Mapping[str, str | os.PathLike[str]], *, contexts: Sequence[int] = CONTEXTS,
                 concurrent: int = 4, budget_bytes: int = 8 << 30, new_tokens: int = 8,
                 backend: Backend | str = Backend.AUTO, threads: int | None = None,
                 out: str | os.PathLike[str] | None = None,
                 measure_fn: Callable[..., Mapping[str, dict[str, Any] | str]] | None = None,
                 predict_only: bool = False, providers: Sequence[str] | None = None) -> list[CapacityRow]:
    """Predict and measure every directory at every context; each context's rows are appended to ``out`` once measured.

    ``measure_fn`` (default :func:`measure` on ``providers``, every export of a context interleaved) takes
    ``(jobs, context, concurrent, new_tokens, threads)`` with ``jobs`` ``name -> (backend, directory)`` and returns
    per name the measurement or why it failed; a failed measurement leaves a row with its prediction and the failure as
    ``status``; ``predict_only`` measures nothing (rows with status ``predicted``).
    """
    if concurrent < 1 or new_tokens < 1 or budget_bytes < 1:
        raise CapacityError(f"invalid concurrent={concurrent}/new_tokens={new_tokens}/budget_bytes={budget_bytes}: "
                            "each must be >= 1")
    bad = [c for c in contexts if c <= new_tokens + WARMUP]
    if bad:
        raise CapacityError(f"context {bad[0]} leaves no prompt before {WARMUP} warm-up and {new_tokens} new tokens: "
                            "allowed: > new_tokens + 2")
    prints = {name: footprint(path, name) for name, path in directories.items()}
    jobs = {name: (choose_backend(path, backend), prints[name].directory) for name, path in directories.items()}
    if measure_fn is None:
        import functools

        measure_fn = functools.partial(measure, providers=providers)
    rows = []
    for context in contexts:
        measured: Mapping[str, dict[str, Any] | str] = {}
        failure = None
        if not predict_only:
            try:
                measured = measure_fn(jobs, context, concurrent, new_tokens, threads)
            except CapacityError as err:
                failure = str(err)
        for name, print_ in prints.items():
            result = measured.get(name, failure)
            row = capacity_row(print_, context, concurrent, budget_bytes, jobs[name][0],
                               result if isinstance(result, Mapping) else None)
            row.status = ("predicted" if predict_only else "ok" if isinstance(result, Mapping) else
                          f"failed: {result or 'not measured'}")
            if isinstance(result, Mapping):
                row.extra["interleaved_with"] = sorted(n for n, r in measured.items()
                                                       if n != name and isinstance(r, Mapping))
            logger.info("%s @%d x%d: %s", name, context, concurrent, json.dumps(asdict(row)))
            rows.append(row)
        if out is not None:
            with open(out, "a") as f:
                f.writelines(json.dumps(asdict(row)) + "\n" for row in rows[-len(prints):])
    return rows


def read_rows(path: str | os.PathLike[str]) -> list[CapacityRow]:
    """The rows a run wrote (one JSON object a line)."""
    return [CapacityRow(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_capacity(rows: Sequence[CapacityRow], path: str | os.PathLike[str]) -> Path:
    """A PNG, one bar per export and context: cache MiB per sequence, sequences within the budget, tokens/s.

    Predicted values are the bars (labelled); what resident memory says is a black tick over each bar.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.name for r in rows))
    contexts = sorted({r.context for r in rows})
    by = {(r.name, r.context): r for r in rows}
    mib = 2.0**-20
    panels = (  # (title, predicted, measured by resident memory, label format)
        ("cache MiB per sequence", lambda r: r.cache_bytes_per_sequence * mib,
         lambda r: None if r.measured_cache_bytes_per_sequence is None else r.measured_cache_bytes_per_sequence * mib,
         "{:.0f}"),
        ("sequences within the budget", lambda r: r.predicted_sequences, lambda r: r.measured_sequences, "{:d}"),
        ("aggregate decode tokens/s", lambda r: r.tokens_per_s, lambda r: None, "{:.0f}"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.8))
    width = 0.8 / max(1, len(contexts))
    x = np.arange(len(names))
    for ax, (title, predicted, measured, label) in zip(axes, panels):
        for i, context in enumerate(contexts):
            cells = [by.get((n, context)) for n in names]
            values = [None if r is None else predicted(r) for r in cells]
            bars = ax.bar(x + i * width, [v or 0 for v in values], width, label=f"{context} tokens")
            ax.bar_label(bars, ["" if v is None else label.format(v) for v in values], fontsize=8)
            ticks = [(x[j] + i * width, measured(r)) for j, r in enumerate(cells) if r and measured(r) is not None]
            if ticks:
                ax.scatter(*zip(*ticks), marker="_", s=300, color="black", zorder=3,
                           label="from resident memory" if i == 0 else None)
        ax.set_xticks(x + width * (len(contexts) - 1) / 2, names, rotation=20, ha="right")
        ax.set_title(title)
        ax.margins(y=0.12)
        ax.legend(fontsize=8)
    budget = rows[0].budget_bytes / 2**30 if rows else 0
    concurrent = rows[0].concurrent if rows else 0
    fig.suptitle(f"budget {budget:g} GiB (weights included); tokens/s of {concurrent} sequences decoded together, "
                 "steps interleaved across exports")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
