"""The kernel table: every GEMM form on a model's linear shapes, at several row counts, interleaved in one run.

For each shape ``[K, N]`` of the model's linears (as kvq's fused ``ort-gqa`` body has them: q/k/v as one, gate/up
as one, o, down, and the head) and each form of :data:`~kvq_export.graph.gemm_forms.GEMM_FORMS`, one single-linear
ONNX Runtime session is timed at ``M`` rows (1, 32, 160 and 512 by default: a decode step, a batch of decode rows,
a served prompt, a prefill chunk). Every call of one ``(shape, M)`` runs in the same rounds, in a fresh random order
(:func:`~kvq_export.measure.timing.interleaved`), so load drift hits the forms alike. Each cell reports GFLOP/s
(``2 M K N`` / median seconds) and its share of the cores' fp32 and int8 peaks (:mod:`~kvq_export.measure.cpu`).

Beside the speed, per form and shape: the largest error relative to float32 on the same random data (weights
``N(0, 0.02)``, activations ``N(0, 1)`` with a few channels 20x larger, as LLM activations have), and whether a
row computes alone: row 0 of a call of ``M`` rows, its other rows scaled up 100x, must equal row 0 run alone bit
for bit. :func:`~kvq_export.graph.gemm_forms.fastest_forms` then names the fastest form per ``M`` among those
that compute rows alone and err no more than the int4 form kvq ships.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.measure.cpu import CpuInfo, cpu_peaks
from kvq_export.measure.timing import interleaved

logger = logging.getLogger(__name__)

DEFAULT_ROWS = (1, 32, 160, 512)
#: the error bound for being chosen when the table has no int4 form to compare with
CHOSEN_MAX_ERROR = 0.1


@dataclass(frozen=True)
class LinearShape:
    """One linear of the model: ``[K, N]`` and how many of it one forward pass runs."""

    name: str
    k: int
    n: int
    count: int


def model_shapes(config: Any) -> list[LinearShape]:
    """The linears of one forward pass of ``config``'s model as the fused ``ort-gqa`` body runs them."""
    from kvq_export.arch import get_arch

    arch = get_arch(config)
    h, layers, d = arch.hidden_size, arch.num_layers, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    return [LinearShape("qkv", h, q + 2 * kv, layers), LinearShape("o", q, h, layers),
            LinearShape("gate_up", h, 2 * arch.intermediate_size, layers),
            LinearShape("down", arch.intermediate_size, h, layers), LinearShape("head", h, arch.vocab_size, 1)]


@dataclass
class KernelCell:
    """One form on one shape at one row count."""

    form: str
    shape: str
    rows: int
    median_s: float
    gflops: float
    fp32_peak_share: float | None
    int8_peak_share: float | None


@dataclass
class KernelTable:
    """The whole table, the machine it ran on, and per form its error and row check."""

    cpu: str
    peaks: dict[str, Any]
    threads: int | None
    shapes: list[LinearShape]
    rows: list[int]
    cells: list[KernelCell] = field(default_factory=list)
    max_error: dict[str, float] = field(default_factory=dict)
    rows_alone: dict[str, bool] = field(default_factory=dict)

    def layer_gflops(self, form: str, rows: int) -> float | None:
        """GFLOP/s over one layer's linears (the head left out): their FLOPs over their summed median times."""
        cells = [c for c in self.cells if c.form == form and c.rows == rows and c.shape != "head"]
        if not cells:
            return None
        shapes = {s.name: s for s in self.shapes}
        flops = sum(2 * rows * shapes[c.shape].k * shapes[c.shape].n for c in cells)
        return flops / sum(c.median_s for c in cells) / 1e9

    def chosen(self, base: str = "nbits4") -> dict[int, str]:
        """Per row count, the fastest form (over a layer) that computes rows alone and errs no more than ``base``.

        ``base`` is the form kvq's int4 exports run (or, when the table has no such form, an error of at most
        :data:`CHOSEN_MAX_ERROR`).
        """
        from kvq_export.graph.gemm_forms import fastest_forms

        per_layer = {f: {m: g for m in self.rows if (g := self.layer_gflops(f, m))} for f in self.max_error}
        bound = self.max_error.get(base, CHOSEN_MAX_ERROR)
        return fastest_forms(per_layer, self.rows_alone, self.max_error, max_error=bound)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"cpu": self.cpu, "peaks": self.peaks, "threads": self.threads,
                "shapes": [asdict(s) for s in self.shapes], "rows": self.rows,
                "cells": [asdict(c) for c in self.cells], "max_error": self.max_error,
                "rows_alone": self.rows_alone, "chosen": {str(m): f for m, f in self.chosen().items()},
                "layer_gflops": {f: {str(m): self.layer_gflops(f, m) for m in self.rows} for f in self.max_error}}


def _test_input(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, rng.choice(k, size=max(1, k // 100), replace=False)] *= 20  # a few outlier channels
    return x


def _check(session, weight: np.ndarray, rows: int, rng) -> tuple[float, bool]:
    """(largest error relative to float32, whether row 0 computes alone) of one form's session."""
    x = _test_input(max(rows, 2), weight.shape[0], rng)
    want = x.astype(np.float64) @ weight.astype(np.float64)
    got = session.run(None, {"x": x})[0]
    error = float(np.abs(got - want).max() / np.abs(want).max())
    crowded = x.copy()
    crowded[1:] *= 100  # the other rows dominate any scale shared across the call
    alone = session.run(None, {"x": x[:1]})[0][0]
    return error, bool(np.array_equal(session.run(None, {"x": crowded})[0][0], alone))


def run_kernel_table(shapes: Sequence[LinearShape], forms: Sequence[str], rows: Sequence[int] = DEFAULT_ROWS, *,
                     rounds: int = 30, warmup: int = 3, threads: int | None = None, seed: int = 0,
                     progress=None) -> KernelTable:
    """Time every form on every shape at every row count (see the module); ``progress(shape, rows)`` per cell."""
    import onnxruntime as ort

    from kvq_export.graph.gemm_forms import get_form, single_linear
    from kvq_export.runtime.ort_setup import session_options

    if not shapes or not forms or not rows or min(rows) < 1:
        raise KVQError(f"the kernel table needs shapes, forms and row counts >= 1; got rows {list(rows)}")
    cpu = CpuInfo.read()
    peaks = cpu_peaks(cpu, threads)
    table = KernelTable(cpu.describe(), asdict(peaks), threads, list(shapes), list(rows))
    rng = np.random.default_rng(seed)
    for shape in shapes:
        weight = (rng.standard_normal((shape.k, shape.n)) * 0.02).astype(np.float32)
        sessions = {name: ort.InferenceSession(single_linear(get_form(name), weight).SerializeToString(),
                                               session_options(threads),
                                               providers=["CPUExecutionProvider"]) for name in forms}
        for name, session in sessions.items():
            error, alone = _check(session, weight, max(rows), rng)
            table.max_error[name] = max(table.max_error.get(name, 0.0), error)
            table.rows_alone[name] = table.rows_alone.get(name, True) and alone
        for m in rows:
            x = _test_input(m, shape.k, rng)
            timings = interleaved({name: (lambda i, s=s, x=x: s.run(None, {"x": x})) for name, s in sessions.items()},
                                  rounds=rounds, warmup=warmup, seed=seed)
            for name, timing in timings.items():
                gflops = 2 * m * shape.k * shape.n / timing.median / 1e9
                table.cells.append(KernelCell(name, shape.name, m, timing.median, gflops,
                                              gflops / peaks.fp32 if peaks.fp32 else None,
                                              gflops / peaks.int8 if peaks.int8 else None))
            if progress is not None:
                progress(shape, m)
    return table


def kernel_rows(table: KernelTable, base: str) -> list[list[str]]:
    """Printable rows: form, shape, then per row count GFLOP/s, x ``base``, % of the fp32 / int8 peak."""
    out = []
    cells = {(c.form, c.shape, c.rows): c for c in table.cells}
    forms = list(dict.fromkeys(c.form for c in table.cells))
    for shape in [s.name for s in table.shapes] + ["layer"]:
        for form in forms:
            row = [form, shape]
            for m in table.rows:
                if shape == "layer":
                    got, ref = table.layer_gflops(form, m), table.layer_gflops(base, m)
                    row.append(f"{got:.0f} ({got / ref:.2f}x)" if got and ref else "-")
                    continue
                cell, ref = cells.get((form, shape, m)), cells.get((base, shape, m))
                if cell is None:
                    row.append("-")
                    continue
                share = "/".join(f"{100 * s:.0f}" for s in (cell.fp32_peak_share, cell.int8_peak_share) if s)
                ratio = f" {cell.gflops / ref.gflops:.2f}x" if ref else ""
                row.append(f"{cell.gflops:.0f}{ratio} ({share}%)" if share else f"{cell.gflops:.0f}{ratio}")
            out.append(row)
    return out
