"""Long-context output: the summary rows, the tables by distance and by task, a heat map and the HTML report."""

from __future__ import annotations

import html
import os
from pathlib import Path

from kvq_export._atomic import atomic_write
from kvq_export.manifest import check_output_path
from kvq_export.validate.long_context.result import LongContextResult
from kvq_export.validate.report import html_head, html_table, png_base64, png_bytes


def _rate(hits: int, total: int) -> str:
    return f"{hits}/{total}" + (f" ({hits / total:.0%})" if total else "")


def summary_rows(result: LongContextResult) -> list[tuple[str, str]]:
    """(label, value) pairs of the one-screen summary."""
    r, config = result.retrieval, result.config
    s = r.summary()
    both = f", both with {result.weights} weights" if result.weights != "fp32" else ""
    rows = [
        ("scheme", f"{result.scheme.name or 'custom'} ({result.flavor}) vs "
                   f"{result.baseline_scheme.name or 'custom'} baseline{both}"),
        ("grid", f"{', '.join(config.tasks) or 'no task'} x lengths {', '.join(map(str, config.lengths))} x "
                 f"{config.depths} depths x {config.trials} trial(s), seed {config.seed}, "
                 f"prefill chunk {config.chunk}"),
        ("windows", f"{config.corpus} windows of {', '.join(map(str, config.ppl_windows))} tokens from token "
                    f"{config.offset}, {config.ppl_chunk} per step (a step's tokens see each other as the flavour's "
                    "prefill has them; 1 is strict decode)"),
    ]
    if r.trials:
        rate = "-" if s["pass_rate"] is None else f"{s['pass_rate']:.1%}"
        rows += [
            ("retrieval", f"{rate} of {s['scored_trials']} trials in cells the baseline passes (baseline "
                          f"{_rate(s['baseline_hits'], s['trials'])}, export {_rate(s['export_hits'], s['trials'])} "
                          "of all trials)"),
            ("flips", f"{s['lost']} lost, {s['gained']} gained (McNemar p = {s['mcnemar_p']:.3g}); worst cell "
                      f"{r.worst_cell_deficit()} trial(s) below the baseline; answer log-prob "
                      f"{s['logprob_delta']:+.3f} nats vs the baseline"),
        ]
    for g in result.distance:
        rows.append((f"positions {g.label}", f"perplexity {g.perplexity:.4f} vs {g.baseline_perplexity:.4f} "
                                             f"({g.perplexity_delta_rel:+.3%}), KL {g.kl_mean:.3g}, top-1 "
                                             f"{g.top1_agreement:.2%} ({g.predictions} predictions)"))
    rows.append(("machine", f"{result.cpu}; {result.seconds} s"))
    return rows


def task_rows(result: LongContextResult) -> list[list[str]]:
    """One row per task and length: baseline and export hits, the pass rate, flips and the log-prob change."""
    out = []
    r = result.retrieval
    for task in r.tasks:
        for length in result.config.lengths:
            cells = [c for c in r.cells(task) if c.length == length]
            if not cells:
                continue
            passed = [c for c in cells if c.baseline_passes]
            hits, total = sum(c.export_hits for c in passed), sum(c.trials for c in passed)
            trials = sum(c.trials for c in cells)
            out.append([task, str(length), _rate(sum(c.baseline_hits for c in cells), trials),
                        _rate(sum(c.export_hits for c in cells), trials), _rate(hits, total),
                        f"{sum(c.logprob_delta * c.trials for c in cells) / trials:+.3f}"])
    return out


TASK_HEADERS = ["task", "length", "baseline", "export", "export where baseline passes", "log-prob delta"]


def heatmap(result: LongContextResult, path: str | os.PathLike[str] | None = None):
    """Length x depth per task: the baseline's and the export's exact-match rate, and their difference.

    Cells the baseline does not pass are hatched in the difference panel (kept out of the pass rate). Returns the
    figure; with ``path``, also writes it as a PNG (atomically; never inside an export directory).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    r, config = result.retrieval, result.config
    tasks, lengths, depths = r.tasks, list(config.lengths), list(config.depth_values)
    fig, axes = plt.subplots(len(tasks), 3, figsize=(12, 2.8 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        grids = {key: np.full((len(lengths), len(depths)), np.nan) for key in ("baseline", "export", "passes")}
        for c in r.cells(task):
            i, j = lengths.index(c.length), depths.index(c.depth)
            grids["baseline"][i, j] = c.baseline_hits / c.trials
            grids["export"][i, j] = c.export_hits / c.trials
            grids["passes"][i, j] = c.baseline_passes
        panels = (("baseline", grids["baseline"], "Greens", 0), ("export", grids["export"], "Greens", 0),
                  ("export - baseline", grids["export"] - grids["baseline"], "RdBu", -1))
        for ax, (title, grid, cmap, low) in zip(axes[row], panels):
            im = ax.imshow(grid, cmap=cmap, vmin=low, vmax=1, aspect="auto", origin="lower")
            ax.set(title=f"{task}: {title}", xlabel="depth", ylabel="length", xticks=range(len(depths)),
                   yticks=range(len(lengths)), xticklabels=[f"{d:g}" for d in depths], yticklabels=lengths)
            fig.colorbar(im, ax=ax)
        for i, j in zip(*np.nonzero(grids["passes"] == 0)):
            axes[row][2].add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="xx", color="grey"))
    fig.suptitle(f"{result.scheme.name or 'custom'} ({result.flavor}, {result.weights} weights): exact match; "
                 "hatched: the baseline misses")
    fig.tight_layout()
    if path is not None:
        check_output_path(path, "the heat map")
        atomic_write(path, png_bytes(fig))
    return fig


def write_html(result: LongContextResult, path: str | os.PathLike[str]) -> Path:
    """One self-contained HTML file: the summary, both tables and the heat map (never inside an export)."""
    import matplotlib.pyplot as plt

    check_output_path(path, "the HTML report")
    parts = [html_head("kvq long-context validation"),
             f"<h1>kvq long-context validation: {html.escape(str(result.scheme.name or 'custom'))}</h1>",
             f"<p>export <code>{html.escape(result.export)}</code> vs baseline "
             f"<code>{html.escape(result.baseline)}</code></p>",
             "<h2>Summary</h2>", html_table(["", ""], [list(r) for r in summary_rows(result)]),
             "<h2>Perplexity by distance</h2>",
             html_table(["positions", "perplexity", "baseline", "delta", "KL", "top-1", "predictions"],
                        [[g.label, g.perplexity, g.baseline_perplexity, f"{g.perplexity_delta_rel:+.3%}", g.kl_mean,
                          f"{g.top1_agreement:.2%}", g.predictions] for g in result.distance])]
    if result.retrieval.trials:
        fig = heatmap(result)
        parts += ["<h2>Retrieval</h2>", html_table(TASK_HEADERS, task_rows(result)),
                  f"<img src='data:image/png;base64,{png_base64(fig)}'>",
                  "<h2>Trials</h2>",
                  html_table(["task", "length", "depth", "trial", "answer", "baseline said", "export said",
                              "baseline log-prob", "export log-prob"],
                             [[t.task, t.length, t.depth, t.trial, t.answer, t.baseline_said, t.export_said,
                               t.baseline_logprob, t.export_logprob] for t in result.retrieval.trials])]
        plt.close(fig)
    return atomic_write(path, "\n".join(parts))
