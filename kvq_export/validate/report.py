"""Validation output: the one-screen summary, the JSON file and a self-contained HTML report."""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq_export._atomic import atomic_write
from kvq_export.manifest import check_output_path
from kvq_export.validate.attention import AttentionMetric
from kvq_export.validate.result import ValidationResult

if TYPE_CHECKING:
    from kvq_export.scheme import KVQuantScheme
    from kvq_export.validate.result import MemoryResult, WeightOnlyResult
    from kvq_export.weight_bytes import WeightBytes


def write_json(result: ValidationResult | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Every number, as JSON (written atomically; never inside an export directory).

    A :class:`ValidationResult` is written in its JSON form (:meth:`ValidationResult.as_dict`).
    """
    check_output_path(path, "the JSON report")
    if isinstance(result, ValidationResult):
        return atomic_write(path, result.to_json())
    return atomic_write(path, json.dumps(result, indent=2))


def _label(scheme: KVQuantScheme, flavor: str) -> str:
    """``name (flavor)`` of a scheme."""
    return f"{scheme.name or 'custom'} ({flavor})"


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g} MB"


def _weight_bytes_row(mem: MemoryResult) -> str:
    """The export's and the baseline's weight bytes (what the graphs' initializers hold), beside the cache's."""
    def one(weights: WeightBytes) -> str:
        rest = sum(weights.unquantized.values())
        parts = f"{_mb(weights.quantized)} codes + {_mb(weights.scales)} scales + {_mb(rest)} unquantized"
        return f"{weights.format} {_mb(weights.total)} ({parts})" if weights.quantized else (
            f"{weights.format} {_mb(weights.total)}")

    return (f"export {one(mem.weights)}, baseline {one(mem.baseline_weights)}; cache "
            f"{_mb(mem.measured_bytes)} held at {mem.seq_len} tokens x {mem.batch}")


def _weight_only_row(section: WeightOnlyResult) -> str:
    """The weights' own error: the baseline against the same cache with fp32 weights, or why it was skipped."""
    scores = section.scores
    if scores is None:
        return f"skipped: {section.skipped}"
    return (f"{section.weights} vs {section.reference_weights} weights, same cache: perplexity "
            f"{scores.perplexity:.4f} vs {scores.reference_perplexity:.4f} "
            f"({100 * scores.perplexity_delta_rel:+.3f}%), KL mean {scores.kl.mean:.3g} / p99 "
            f"{scores.kl.p99:.3g}, top-1 {100 * scores.top1_agreement:.2f}% "
            f"({scores.predictions} predictions)")


def summary_rows(result: ValidationResult) -> list[tuple[str, str]]:
    """(label, value) pairs of the one-screen summary."""
    tok, greedy, mem, lat = result.token.scores, result.token.greedy, result.memory, result.latency
    label = result.weights_label
    both = f", both with {label} weights" if label != "fp32" else ""
    rows = [
        ("scheme", f"{_label(result.scheme, result.flavor)} vs "
                   f"{_label(result.baseline_scheme, result.baseline_flavor)} baseline{both}"),
        ("perplexity", f"{tok.perplexity:.4f} vs {tok.reference_perplexity:.4f} "
                       f"({100 * tok.perplexity_delta_rel:+.3f}%, {tok.predictions} predictions)"),
        ("logit KL", f"mean {tok.kl.mean:.3g}, p99 {tok.kl.p99:.3g}, max {tok.kl.max:.3g}"),
        ("top-1 agreement", f"{100 * tok.top1_agreement:.2f}%"),
    ]
    cal = result.calibration
    if cal and cal.record.calibrated:
        where = {True: "the scored text IS calibration text (in-sample: use --offset past it for held-out text)",
                 False: "scored text is held out", None: "overlap unknown"}[cal.windows_overlap_calibration]
        start = f" from token {cal.record.offset}" if cal.record.offset else ""
        rows.append(("calibration", f"{cal.record.method} on {cal.record.tokens} tokens of {cal.record.corpus}"
                                      f"{start}; {where}"))
    if greedy.prompts:
        rows.append(("greedy", f"{greedy.mean_tokens_to_divergence:.1f} tokens to divergence (mean), "
                               f"{100 * greedy.identical_fraction:.0f}% of {greedy.prompts} prompts "
                               f"identical over {greedy.tokens}{_greedy_window_note(result)}"))
    window = result.window
    if window.tokens and not window.windows_exceed:
        rows.append(("WARNING", f"the scored windows never leave the {window.tokens}-token high-precision "
                                "window: the token numbers above never read a quantized token"))
    rows += _attention_rows(result)
    rows.append(("memory", f"{mem.measured_bytes} B held (predicted {mem.predicted_cache_state_bytes}: "
                           f"{'match' if mem.prediction_matches else 'MISMATCH'}), fp16 {mem.fp16_bytes} B, "
                           f"{mem.ratio:.2f}x smaller, {mem.bits_per_element:.3f} bits/element"))
    rows.append(("weight bytes", _weight_bytes_row(mem)))
    rows.append(("weight-only error", _weight_only_row(result.weight_only)))
    rows.append(("decode latency", f"{lat.quantized.median_ms:.2f} ms vs {lat.baseline.median_ms:.2f} "
                                   f"ms median per step (batch {lat.batch}), ratio {lat.ratio:.2f}"))
    return rows


def _attention_rows(result: ValidationResult) -> list[tuple[str, str]]:
    """The attention rows of the summary: key error before softmax, value error after it (none if not sampled)."""
    att = result.attention
    s = att.summary
    if not att.samples or s is None:
        return []
    return [
        ("attention (keys)", f"score shift mean {s.score_shift_mean:.3g} / max {s.score_shift_max:.3g}, "
                             f"KL {s.kl_keys:.3g}, TV {s.tv_keys:.3g}, top-1 {100 * s.top1_keys:.1f}%, "
                             f"top-2 flips {100 * s.top2_flip:.1f}%"),
        ("output error", f"keys only {s.out_rel_keys:.3g}, values only {s.out_rel_values:.3g}, "
                         f"both {s.out_rel_both:.3g}"),
        ("error split", f"key-induced {s.key_induced:.3g}, value-induced {s.value_induced:.3g}, "
                        f"cross {s.cross_term:.3g}"),
        ("key error hurts most", ", ".join(f"L{t.layer}H{t.head} ({t.key_induced:.3g}, MSE rank "
                                           f"{t.mse_rank})" for t in att.key_error_hurts_most[:3])),
        ("MSE vs attention rank", f"Spearman {att.rank_agreement_mse_vs_key_induced:.2f} (key-induced), "
                                  f"{att.rank_agreement_mse_vs_kl:.2f} (KL)"),
    ]


def _greedy_window_note(result: ValidationResult) -> str:
    """Why a perfect greedy match may mean nothing: how many prompts reached past the high-precision window."""
    window, greedy = result.window, result.token.greedy
    exceeding = greedy.prompts_exceeding_window
    if not window.tokens or exceeding is None:
        return ""
    if exceeding == 0:
        return f" (WARNING: no prompt leaves the {window.tokens}-token high-precision window: not tested)"
    return f" ({exceeding} of {greedy.prompts} prompts leave the {window.tokens}-token high-precision window)"


def _mark_window(ax, result: ValidationResult, last: float) -> None:
    """A dashed line where the high-precision window ends (tokens after it are read quantized)."""
    tokens = result.window.tokens
    if tokens and tokens < last:
        ax.axvline(tokens + 0.5, color="grey", linestyle="--", linewidth=1,
                   label=f"high-precision window ends ({tokens} tokens)")
        ax.legend()


def png_bytes(fig) -> bytes:
    """A matplotlib figure as the PNG every kvq report draws (90 dpi, tight bounds)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()


def png_base64(fig) -> str:
    """:func:`png_bytes` in base64, for an ``<img src='data:...'>`` in a report."""
    return base64.b64encode(png_bytes(fig)).decode()


def _plots(result: ValidationResult) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = []
    att = result.attention
    if att.samples and att.per_layer_head is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        grids = {m: np.asarray(att.per_layer_head[m])
                 for m in (AttentionMetric.KEY_INDUCED, AttentionMetric.VALUE_INDUCED)}
        top = max(float(g.max()) for g in grids.values()) or 1.0  # one colour scale: the two are comparable
        for ax, metric, title in zip(axes, grids,
                                     ("key-induced output error (a'-a)V", "value-induced output error a(V'-V)")):
            im = ax.imshow(grids[metric], aspect="auto", cmap="viridis", vmin=0, vmax=top)
            ax.set(title=title, xlabel="query head", ylabel="layer")
            fig.colorbar(im, ax=ax)
        out.append(("Per layer and head: key vs value error (relative to |o|)", png_base64(fig)))
        plt.close(fig)
        by_position = sorted(att.by_position, key=lambda p: p.position)
        positions = [p.position for p in by_position]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for metric, label in ((AttentionMetric.OUT_REL_KEYS, "keys only"),
                              (AttentionMetric.OUT_REL_VALUES, "values only"), (AttentionMetric.OUT_REL_BOTH, "both")):
            ax.plot(positions, [getattr(p, metric) for p in by_position], marker="o", label=label)
        ax.set(xlabel="decode position", ylabel="attention output rel. error", title="Error vs position")
        ax.legend()
        _mark_window(ax, result, positions[-1] if positions else 0)
        out.append(("Attention output error vs position", png_base64(fig)))
        plt.close(fig)
    kl = result.token.scores.kl_by_position
    if kl:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(kl) + 1), kl)
        ax.set(xlabel="position in window", ylabel="mean KL(baseline || quantized)", title="Logit KL vs position")
        _mark_window(ax, result, len(kl))
        out.append(("Logit KL vs position", png_base64(fig)))
        plt.close(fig)
    curve = result.memory.curve
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([c.seq_len for c in curve], [c.bytes / 2**20 for c in curve], marker="o", label="quantized")
    ax.plot([c.seq_len for c in curve], [c.fp16_bytes / 2**20 for c in curve], marker="o", label="fp16")
    ax.set(xscale="log", xlabel="sequence length", ylabel="cache MiB (batch 1)", title="Memory vs sequence length")
    ax.legend()
    out.append(("Cache memory vs sequence length", png_base64(fig)))
    plt.close(fig)
    return out


def html_table(headers: list[str], rows: list[list[Any]]) -> str:
    """An HTML table of ``rows`` under ``headers`` (floats to 4 significant digits, everything escaped)."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def html_head(title: str) -> str:
    """The start of a self-contained report page: its title and the tables' style."""
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
            "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}</style>")


def write_html(result: ValidationResult, path: str | os.PathLike[str]) -> Path:
    """One self-contained HTML file (plots embedded as PNG data URIs; never inside an export directory)."""
    check_output_path(path, "the HTML report")
    att, lat, mem = result.attention, result.latency, result.memory
    parts = [
        html_head("kvq validation"),
        f"<h1>kvq validation: {html.escape(str(result.scheme.name or 'custom'))}</h1>",
        f"<p>export <code>{html.escape(result.export)}</code> vs baseline "
        f"<code>{html.escape(result.baseline)}</code>, {result.seconds} s</p>",
        "<h2>Summary</h2>", html_table(["", ""], [list(r) for r in summary_rows(result)]),
    ]
    if att.samples:
        parts += ["<h2>Layers/heads where key error hurts most</h2>",
                  html_table(["layer", "head", "key-induced", "out err (keys only)", "attention KL", "key MSE",
                              "MSE rank"],
                             [[t.layer, t.head, t.key_induced, t.out_rel_keys, t.kl_keys, t.key_mse, t.mse_rank]
                              for t in att.key_error_hurts_most])]
    parts += ["<h2>Latency</h2>",
              html_table(["context", "quantized median ms", "p10", "p90", "baseline median ms", "ratio"],
                         [[f"{b.context_from}-{b.context_to}", b.quantized.median_ms, b.quantized.p10_ms,
                           b.quantized.p90_ms, b.baseline.median_ms, b.ratio] for b in lat.buckets]),
              "<h2>Memory</h2>",
              html_table(["part", "bytes"], [[k, v] for k, v in mem.breakdown.items()]
                         + [["total (predicted)", mem.predicted_bytes], ["measured cache state", mem.measured_bytes],
                            ["fp16", mem.fp16_bytes],
                            [f"weights: export ({mem.weights.format})", mem.weights.total],
                            [f"weights: baseline ({mem.baseline_weights.format})", mem.baseline_weights.total]])]
    parts += _weight_only_html(result.weight_only)
    for title, png in _plots(result):
        parts.append(f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,{png}'>")
    return atomic_write(path, "\n".join(parts))


def _weight_only_html(section: WeightOnlyResult) -> list[str]:
    """The weight-only section of the HTML report: its table, or why it was skipped."""
    head = "<h2>Weight-only error (the baseline's cache, the export's weights vs fp32 weights)</h2>"
    scores = section.scores
    if scores is None:
        return [head, f"<p>Skipped: {html.escape(str(section.skipped))}</p>"]
    return [head, html_table(
        ["weights", "perplexity", "reference weights", "perplexity", "delta", "KL mean", "KL p99", "top-1",
         "predictions"],
        [[section.weights, scores.perplexity, section.reference_weights, scores.reference_perplexity,
          f"{100 * scores.perplexity_delta_rel:+.3f}%", scores.kl.mean, scores.kl.p99,
          f"{100 * scores.top1_agreement:.2f}%", scores.predictions]])]
