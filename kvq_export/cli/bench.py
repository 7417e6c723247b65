"""``kvq bench`` and ``kvq bench-serve``: latency, throughput, bytes and capacity, as ratios measured in one run."""

from __future__ import annotations

import click

from kvq_export import bench as kvq_bench
from kvq_export.bench_config import FILLS, BenchConfig
from kvq_export.capacity import Backend, plot_capacity, run_capacity
from kvq_export.cli._base import (
    STDOUT,
    calibration_options,
    cli,
    device_option,
    distinct_outputs,
    int_list,
    json_option,
    make_console,
    weight_options,
    write_json_output,
)
from kvq_export.cli_types import outside_exports
from kvq_export.dtypes import COMPUTE_DTYPES
from kvq_export.errors import KVQError
from kvq_export.flavors import flavor_names, get_flavor
from kvq_export.progress import tqdm_bars


def _flavor_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """``--flavors a,b``: each a known flavor (an unknown one is a one-line error naming the allowed ones)."""
    names = [f.strip() for f in value.split(",") if f.strip()]
    if not names:
        raise click.BadParameter(f"give at least one flavor ({', '.join(flavor_names())})")
    return [str(get_flavor(name).name) for name in names]


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@click.option("--schemes", required=True, help="Comma-separated presets or scheme files (the baseline is added).")
@click.option("--flavors", default="ort-gqa", show_default=True, callback=_flavor_list,
              help=f"Comma-separated flavors, each one of: {', '.join(flavor_names())}.")
@click.option("--contexts", default="512,2048,8192", show_default=True,
              help="Comma-separated cache lengths (tokens per row) decoding is timed at.")
@click.option("--batch", "batches", default="1,4", show_default=True, help="Comma-separated batch sizes.")
@click.option("--baseline", default="fp16", show_default=True, help="Scheme every result is a ratio to.")
@click.option("--steps", type=click.IntRange(1), default=32, show_default=True, help="Timed decode steps.")
@click.option("--warmup", type=click.IntRange(0), default=4, show_default=True, help="Untimed decode steps first.")
@click.option("--prefill-tokens", type=click.IntRange(1), default=512, show_default=True,
              help="Prefill length cap (and chunk size of --fill prefill).")
@click.option("--fill", type=click.Choice(FILLS), default="synthetic", show_default=True,
              help="How the cache reaches the context: random data in the stored layout, or a real prefill.")
@click.option("--dtype", type=click.Choice(COMPUTE_DTYPES), default="fp32", show_default=True,
              help="Compute dtype of the exports.")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="ONNX Runtime intra-op threads [default: OMP_NUM_THREADS when set, else ONNX Runtime's choice].")
@click.option("--ppl-windows", type=click.IntRange(0), default=0, show_default=True,
              help="Also report strict-decode perplexity on this many windows of the calibration corpus.")
@click.option("--ppl-tokens", type=click.IntRange(2), default=512, show_default=True, help="Tokens per window.")
@calibration_options()
@weight_options()
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, callback=outside_exports,
              help="Where the exports are kept and reused (default: the kvq cache directory).")
@json_option("every result (a file is rewritten after each one)")
@device_option()
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None, callback=outside_exports,
              help="PNG of decode latency and cache bytes against context length.")
@click.option("--quiet", is_flag=True, help="No progress bars (they are also left out when stderr is not a terminal).")
def bench(model_spec, schemes, flavors, contexts, batches, baseline, steps, warmup, prefill_tokens, fill, dtype,
          threads, ppl_windows, ppl_tokens, calibration, weights, work_dir, json_out, providers, plot_out,
          quiet) -> None:
    """Decode latency, prefill throughput, cache bytes and RSS per scheme, as ratios to the baseline."""
    from rich.console import Console

    distinct_outputs({"--json": json_out, "--plot": plot_out}, {"--calib-corpus": calibration.corpus})
    config = BenchConfig(
        model_spec, [s for s in schemes.split(",") if s], flavors=flavors, contexts=int_list(contexts),
        batches=int_list(batches), baseline=baseline, steps=steps, warmup=warmup, prefill_tokens=prefill_tokens,
        fill=fill, dtype=dtype, threads=threads, ppl_windows=ppl_windows, ppl_tokens=ppl_tokens,
        calibration=calibration, weights=weights, work_dir=work_dir, json_out=None if json_out == STDOUT else json_out,
        providers=providers)
    progress = Console(stderr=True, highlight=False, soft_wrap=True)

    def show(r) -> None:  # a long run reports each result as it is measured
        progress.print(f"{r.flavor} {r.scheme} ctx {r.context} batch {r.batch}: decode {r.decode_ms_median:.2f} ms "
                       f"(x{r.ratio['decode_ms_paired']:.2f}, 90% {r.ratio['decode_ms_paired_low']:.2f}-"
                       f"{r.ratio['decode_ms_paired_high']:.2f}), cache {r.ratio['cache_reduction']:.2f}x smaller")

    try:
        with tqdm_bars(not quiet):
            report = kvq_bench.run_bench(config, on_result=show)
    except KeyboardInterrupt:
        if json_out and json_out != STDOUT:
            click.echo(f"interrupted: {json_out} keeps every result measured so far", err=True)
        raise
    if json_out == STDOUT:
        write_json_output(json_out, report.to_json())
    console = make_console(json_out=json_out)
    console.print(kvq_bench.report_table(report))
    if ppl_windows:
        console.print(kvq_bench.perplexity_table(report))
    if plot_out:
        kvq_bench.plot(report, plot_out)


@cli.command("bench-serve")
@click.argument("export_dirs", nargs=-1, required=True, metavar="[NAME=]DIR...")
@click.option("--context", "contexts", type=click.IntRange(2), multiple=True, default=(2048, 8000), show_default=True,
              help="Cache length measured at (repeat for several).")
@click.option("--concurrent", type=click.IntRange(1), default=4, show_default=True, help="Sequences decoded together.")
@click.option("--budget-gb", type=click.FloatRange(0, min_open=True), default=8.0, show_default=True,
              help="Memory budget (GiB) the sequences must fit beside the weights.")
@click.option("--new-tokens", type=click.IntRange(1), default=8, show_default=True, help="Timed decode steps.")
@click.option("--backend", type=click.Choice([b.value for b in Backend]), default=Backend.AUTO.value,
              show_default=True,
              help="og: og.Model with a batch prefilled for real; session: KVQSession on a synthetic cache (kvq "
                   "exports); ort: ONNX Runtime on the decoder graph og loads, on a synthetic cache (separate past "
                   "and present, as the builder's quantized caches); auto: session for kvq exports, og for others; "
                   "synthetic: session for kvq exports, ort for others.")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="ONNX Runtime intra-op threads [default: OMP_NUM_THREADS when set, else ONNX Runtime's choice].")
@click.option("--out", "out", default="capacity.jsonl", show_default=True, callback=outside_exports,
              help="Rows appended (JSON lines) as measured.")
@click.option("--plot", "plot_out", default=None, callback=outside_exports, help="Write a PNG of the rows here.")
@click.option("--predict-only", is_flag=True, help="Read the graphs only: cache bytes and sequences predicted.")
@device_option()
def bench_serve(export_dirs, contexts, concurrent, budget_gb, new_tokens, backend, threads, out, plot_out,
                predict_only, providers) -> None:
    """Sequences each export serves at once within a memory budget, and their aggregate tokens/s.

    EXPORT_DIRS: export directories (kvq's or onnxruntime-genai's), each optionally named NAME=DIR.
    The memory columns are the host's resident set (with --device cuda the cache lives on the GPU).
    """
    from pathlib import Path

    distinct_outputs({"--out": out, "--plot": plot_out})
    dirs = dict(d.split("=", 1) if "=" in d else (Path(d).name, d) for d in export_dirs)
    rows = run_capacity(dirs, contexts=contexts, concurrent=concurrent, budget_bytes=int(budget_gb * 2**30),
                        new_tokens=new_tokens, backend=backend, threads=threads, out=out, predict_only=predict_only,
                        providers=providers)
    for r in rows:
        speed = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}"
        click.echo(f"{r.name} @{r.context}: {r.cache_bytes_per_sequence / 2**20:.1f} MiB/seq, "
                   f"{r.predicted_sequences} seqs predicted, {r.measured_sequences or '-'} by RSS, "
                   f"{speed} tok/s x{r.concurrent} ({r.status})")
    if plot_out:
        plot_capacity(rows, plot_out)


def _form_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """``--forms a,b``: each a known GEMM form (an unknown one is a one-line error naming the allowed ones)."""
    from kvq_export.graph.gemm_forms import get_form

    names = [f.strip() for f in value.split(",") if f.strip()]
    try:
        return [get_form(name).name for name in names]
    except KVQError as err:
        raise click.BadParameter(str(err)) from None


@cli.command("bench-kernels")
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file: whose linear shapes.")
@click.option("--forms", default="fp32,nbits4,nbits4-fp32,nbits8,dynamic-quantize,qgemm-rows", show_default=True,
              callback=_form_list, help="Comma-separated GEMM forms (kvq_export.graph.gemm_forms).")
@click.option("--rows", default="1,32,160,512", show_default=True,
              help="Comma-separated row counts M (tokens of one call).")
@click.option("--base", default="nbits4", show_default=True, help="The form every ratio is to.")
@click.option("--rounds", type=click.IntRange(1), default=30, show_default=True, help="Timed rounds per cell.")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="ONNX Runtime intra-op threads [default: OMP_NUM_THREADS when set, else ONNX Runtime's choice].")
@json_option("the table (every cell, the CPU, its peaks, the forms chosen)")
def bench_kernels(model_spec, forms, rows, base, rounds, threads, json_out) -> None:
    """GFLOP/s of every GEMM form on the model's linear shapes, interleaved in one run, beside the CPU's peaks.

    Each cell: GFLOP/s, its ratio to --base, and its share of the fp32 / int8 peak. The last lines per form sum
    one layer (the head left out); "rows alone" says whether a row's result is independent of the other rows of
    its call, checked bit for bit; "chosen" is the fastest form per row count that keeps rows alone and errs no
    more than int4.
    """
    from rich.table import Table

    from kvq_export.graph.gemm_forms import GEMM_FORMS
    from kvq_export.measure.kernels import kernel_rows, model_shapes, run_kernel_table
    from kvq_export.model_source import load_config

    row_counts = int_list(rows)
    if base not in forms:
        raise click.BadParameter(f"{base!r} is not among --forms ({', '.join(forms)})", param_hint="--base")
    table = run_kernel_table(model_shapes(load_config(model_spec)), forms, row_counts, rounds=rounds, threads=threads)
    if json_out:
        write_json_output(json_out, table.to_dict())
        if json_out == STDOUT:
            return
    console = make_console()
    view = Table("form", "shape", *[f"M={m}: GFLOP/s, x{base} (% fp32/int8 peak)" for m in row_counts],
                 title=f"GEMM forms on {model_spec}'s linears, {table.cpu}")
    for line in kernel_rows(table, base):
        view.add_row(*line)
    console.print(view)
    for name in forms:
        form = GEMM_FORMS[name]
        console.print(f"{name}: {form.summary}{'' if form.rows_alone else ' (rows depend on the call, by design)'}")
    console.print(f"peaks: fp32 {table.peaks['fp32'] or 0:.0f} GFLOP/s, int8 {table.peaks['int8'] or 0:.0f} GOP/s "
                  f"({table.peaks['how']})")
    console.print("max error vs fp32: " + ", ".join(f"{f} {e:.3f}" for f, e in table.max_error.items()))
    console.print("rows alone: " + ", ".join(f"{f} {'yes' if ok else 'NO'}" for f, ok in table.rows_alone.items()))
    console.print("chosen: " + ", ".join(f"M={m} {f}" for m, f in table.chosen().items()))
