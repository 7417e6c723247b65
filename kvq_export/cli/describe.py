"""``kvq schemes`` and ``kvq memory``: what a scheme costs, before anything is exported."""

from __future__ import annotations

import click

from kvq_export import memory as mem
from kvq_export.arch import get_arch
from kvq_export.cli._base import STDOUT, cli, json_option, make_console, scheme_options, write_json_output
from kvq_export.memory import BREAKDOWN_KEYS, WEIGHT_BREAKDOWN_KEYS, predict
from kvq_export.model_facts import Geometry
from kvq_export.model_source import load_config, model_facts, parameter_shapes
from kvq_export.presets import PRESETS, presets_json, resolve_scheme
from kvq_export.request import WeightFormat, WeightSpec
from kvq_export.scheme import bits_label
from kvq_export.weight_blocks import BLOCK_SIZES

DEFAULT_CURVE = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _windows(scheme) -> list[tuple[str, int]]:
    """The scheme's high-precision windows as (label, tokens): ``R`` (``R_K``/``R_V`` when they differ), ``S``."""
    key, value = (scheme.residual_for(tq) for tq in (scheme.key, scheme.value))
    recent = [("R", key)] if key == value else [("R_K", key), ("R_V", value)]
    return [(label, count) for label, count in (*recent, ("S", scheme.sink_tokens)) if count]


@cli.command()
@click.option("--head-dim", type=click.IntRange(1), default=64, show_default=True,
              help="head_dim of the bits/element columns (SmolLM2's: 64).")
@json_option("every preset's scheme")
def schemes(head_dim: int, json_out: str | None) -> None:
    """List the named scheme presets with their bits per element.

    ``bits/elem`` ignores windows; the ``@512`` / ``@4096`` columns are the memory model's bits per cached
    element for a SmolLM2-shaped cache (30 layers, 3 kv heads) holding that many tokens, metadata, sinks,
    recent windows and partial channel groups included.
    """
    if json_out:
        write_json_output(json_out, presets_json())
        if json_out == STDOUT:
            return
    from rich.table import Table

    geometry = Geometry(num_layers=30, num_kv_heads=3, head_dim=head_dim)
    lengths = (512, 4096)
    table = Table(title=f"kvq scheme presets (bits/element at head_dim={head_dim}; @N: SmolLM2-shaped cache "
                        "of N tokens, everything stored included)")
    for col in ("preset", "bits/elem", *(f"@{n}" for n in lengths), "keys", "values", "window", "about"):
        table.add_column(col)
    for name, (scheme, about) in PRESETS.items():
        window = " ".join(f"{label}={count}" for label, count in _windows(scheme)) or "-"
        at = [f"{predict(scheme, geometry, n).bits_per_element:.3f}" for n in lengths]
        table.add_row(name, bits_label(scheme.effective_bits(head_dim)), *at, scheme.key.describe(),
                      scheme.value.describe(), window, about)
    make_console().print(table)


_SHORT = {"payload": "payload", "scales": "scales", "zero_points": "zeros", "high_precision": "hp window",
          "padding": "padding"}


def _memory_table(title: str, reports, *, show_breakdown: bool):
    """One row per report; with ``show_breakdown`` also a column per breakdown key."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("scheme")
    for col in ("seq_len", "total", *(_SHORT[k] for k in BREAKDOWN_KEYS if show_breakdown), "fp16", "ratio",
                "bits/elem"):
        table.add_column(col, justify="right")
    for r in reports:
        parts = [_fmt_bytes(r.breakdown[k]) for k in BREAKDOWN_KEYS] if show_breakdown else []
        table.add_row(r.scheme, str(r.seq_len), _fmt_bytes(r.total_bytes), *parts, _fmt_bytes(r.fp16_bytes),
                      f"{r.ratio:.2f}x", f"{r.bits_per_element:.3f}")
    return table


def _parts_table(title: str, parts: dict[str, int], total_label: str, total: int):
    """One row per part with exact bytes and share, then the total (further rows go below it)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("part", "bytes", "", "share"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for key, n in parts.items():
        table.add_row(key, str(n), _fmt_bytes(n), f"{100 * n / total:.1f}%" if total else "-")
    table.add_row(total_label, str(total), _fmt_bytes(total), "100%", end_section=True)
    return table


def _breakdown_table(title: str, report):
    """One report, one row per breakdown key with exact bytes and share."""
    table = _parts_table(title, {key: report.breakdown[key] for key in BREAKDOWN_KEYS}, "total", report.total_bytes)
    table.add_row("fp16 cache", str(report.fp16_bytes), _fmt_bytes(report.fp16_bytes), "")
    table.add_row("ratio", f"{report.ratio:.3f}x", "", "")
    table.add_row("bits/element", f"{report.bits_per_element:.4g}", "", "")
    return table


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _weights_table(title: str, weights, cache):
    """The predicted weight bytes by part, and the cache's bytes beside them."""
    table = _parts_table(title, {key: weights.breakdown[key] for key in WEIGHT_BREAKDOWN_KEYS},
                         f"{weights.format} weights", weights.total_bytes)
    smaller = weights.as_built_bytes / weights.total_bytes if weights.total_bytes else 1.0
    table.add_row(f"as built ({weights.dtype})", str(weights.as_built_bytes), _fmt_bytes(weights.as_built_bytes),
                  f"{smaller:.2f}x")
    table.add_row(f"cache ({cache.scheme}, {cache.seq_len} tokens x {cache.batch})", str(cache.total_bytes),
                  _fmt_bytes(cache.total_bytes), "")
    both = weights.total_bytes + cache.total_bytes
    table.add_row("weights + cache", str(both), _fmt_bytes(both), "")
    return table


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@scheme_options()
@click.option("--seq-len", type=click.IntRange(0), required=True, help="Tokens in the cache.")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True, help="Sequences in the cache.")
@click.option("--weights", "weight_format", type=click.Choice([str(f) for f in WeightFormat]), default=None,
              help="Also predict the weights' bytes, stored as ``kvq export --weights`` would store them.")
@click.option("--weight-block-size", type=click.Choice([str(b) for b in BLOCK_SIZES]), default="32",
              show_default=True, help="int8/int4 weights: input channels per scale.")
@click.option("--weight-asymmetric", is_flag=True, help="int8/int4 weights: a zero point per block as well.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Compute dtype of the graph (what unquantized weights and scales are stored in).")
@json_option("the report (exact byte counts)")
def memory(model_spec: str, scheme_spec, seq_len: int, batch: int, weight_format: str | None,
           weight_block_size: str, weight_asymmetric: bool, dtype: str, json_out: str | None) -> None:
    """Predict the cache's bytes: payload, scales, zero points, high precision, padding.

    With --weights, also the weights' bytes (codes, scales, zero points, unquantized) beside the cache's.
    """
    scheme = resolve_scheme(scheme_spec)
    config = load_config(model_spec)
    facts = model_facts(config)
    report = mem.predict(scheme, facts, seq_len, batch)
    weights = None
    if weight_format is not None:
        spec = WeightSpec(format=weight_format, block_size=int(weight_block_size), symmetric=not weight_asymmetric)
        weights = mem.predict_weights(parameter_shapes(config), spec, dtype, embedding=get_arch(config).embed_name())
    if json_out:
        extra = {} if weights is None else {"weights": weights.to_dict(),
                                            "weights_and_cache_bytes": weights.total_bytes + report.total_bytes}
        write_json_output(json_out, {"model": model_spec, **report.to_dict(), **extra})
        if json_out == STDOUT:
            return
    console = make_console()
    console.print(_breakdown_table(
        f"{report.scheme} on {model_spec} ({facts.num_layers} layers x {facts.num_kv_heads} kv heads x "
        f"head_dim {facts.head_dim}), {seq_len} tokens, batch {batch}", report))
    if weights is not None:
        console.print(_weights_table(f"{weights.format} weights of {model_spec} ({weights.parameters} parameters, "
                                     f"{dtype} compute)", weights, report))
    lengths = sorted({n for n in DEFAULT_CURVE if n <= max(seq_len, 1) * 4} | {seq_len})
    console.print(_memory_table("over sequence length", mem.curve(scheme, facts, lengths, batch),
                                show_breakdown=False))
