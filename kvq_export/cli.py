"""The ``kvq`` command line: a thin click layer over library functions.

Every command parses options and calls one library function; heavy imports (torch, transformers,
onnxruntime) happen inside the command body so ``kvq --help`` stays fast and works without them.
A :class:`~kvq_export.errors.KVQError` becomes a one-line message and exit code 1.
"""

from __future__ import annotations

import functools
import json
import logging
import sys

import click

from kvq_export.cli_types import FRACTION, NON_NEGATIVE, POSITIVE, FiniteFloat, outside_exports
from kvq_export.errors import KVQError
from kvq_export.export.flavors import FLAVORS, flavor_names
from kvq_export.request import (
    DEFAULT_OPSET,
    MIN_OPSET,
    WEIGHT_BLOCK_SIZES,
    CalibrationMethod,
    CalibrationSpec,
    WeightFormat,
)

DEFAULT_CURVE = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _Group(click.Group):
    """Click group that turns KVQError into ``error: <message>`` and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KVQError as err:
            click.echo(f"error: {err.for_cli()}", err=True)
            ctx.exit(1)


def _windows(scheme) -> list[tuple[str, int]]:
    """The scheme's high-precision windows as (label, tokens): ``R`` (``R_K``/``R_V`` when they differ), ``S``."""
    key, value = (scheme.residual_for(tq) for tq in (scheme.key, scheme.value))
    recent = [("R", key)] if key == value else [("R_K", key), ("R_V", value)]
    return [(label, count) for label, count in (*recent, ("S", scheme.sink_tokens)) if count]


def _console():
    from rich.console import Console

    # Wide enough for the breakdown columns when output is piped (rich assumes 80 columns then).
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=140)


def calibration_options(*, optional: bool = False, short_names: bool = False):
    """The calibration options every calibrating command shares, given to it as one ``calibration`` argument.

    ``--calib-corpus``, ``--calib-tokens``, ``--calib-offset``, ``--calib-method`` and ``--percentile`` take the
    defaults of :class:`~kvq_export.request.CalibrationSpec`. ``optional``: no corpus unless one is given
    (``calibration`` is then None: ``kvq export`` calibrates only when asked). ``short_names``: also accept
    ``--corpus``, ``--tokens`` and ``--offset`` (``kvq plan``'s spellings).
    """
    default = CalibrationSpec()

    def names(name: str) -> tuple[str, ...]:
        return (f"--calib-{name}", f"--{name}") if short_names else (f"--calib-{name}",)

    options = [
        click.option(*names("corpus"), "calib_corpus", default=None if optional else default.corpus,
                     show_default=not optional, help="Calibration text: corpus name (britannica) or text file."),
        click.option(*names("tokens"), "calib_tokens", type=click.IntRange(1), default=default.tokens,
                     show_default=True, help="Calibration tokens."),
        click.option(*names("offset"), "calib_offset", type=click.IntRange(0), default=default.offset,
                     show_default=True, help="Corpus tokens skipped before the calibration text (kvq validate scores "
                     "from token 0: keep the calibration text apart from it)."),
        click.option("--calib-method", "calib_method", type=click.Choice([str(m) for m in CalibrationMethod]),
                     default=str(default.method), show_default=True,
                     help="absmax, a percentile, or per-channel clipping chosen by its effect on attention."),
        click.option("--percentile", "percentile", type=FiniteFloat(50, 100, min_open=True),
                     default=default.percentile, show_default=True, help="For --calib-method percentile."),
    ]

    def apply(func):
        @functools.wraps(func)
        def command(*args, calib_corpus, calib_tokens, calib_offset, calib_method, percentile, **kwargs):
            calibration = None if calib_corpus is None else CalibrationSpec(
                corpus=calib_corpus, tokens=calib_tokens, offset=calib_offset, method=calib_method,
                percentile=percentile)
            return func(*args, calibration=calibration, **kwargs)

        for option in reversed(options):
            command = option(command)
        return command

    return apply


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="kvq")
def cli(verbose: int) -> None:
    """kvq: deploy LLMs with a quantized KV cache through ONNX and TensorRT."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@cli.command()
@click.option("--head-dim", type=click.IntRange(1), default=64, show_default=True,
              help="head_dim of the bits/element columns (SmolLM2's: 64).")
@click.option("--json", "as_json", is_flag=True, help="Print every preset as scheme JSON.")
def schemes(head_dim: int, as_json: bool) -> None:
    """List the named scheme presets with their bits per element.

    ``bits/elem`` ignores windows; the ``@512`` / ``@4096`` columns are the memory model's bits per cached
    element for a SmolLM2-shaped cache (30 layers, 3 kv heads) holding that many tokens, metadata, sinks,
    recent windows and partial channel groups included.
    """
    from kvq_export.memory import Geometry, predict
    from kvq_export.presets import PRESETS, presets_json
    from kvq_export.scheme import bits_label

    if as_json:
        click.echo(presets_json())
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
    _console().print(table)


_SHORT = {"payload": "payload", "scales": "scales", "zero_points": "zeros", "high_precision": "hp window",
          "padding": "padding"}


def _memory_table(title: str, reports, *, show_breakdown: bool):
    """One row per report; with ``show_breakdown`` also a column per breakdown key."""
    from rich.table import Table

    from kvq_export.memory import BREAKDOWN_KEYS

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


def _breakdown_table(title: str, report):
    """One report, one row per breakdown key with exact bytes and share."""
    from rich.table import Table

    from kvq_export.memory import BREAKDOWN_KEYS

    table = Table(title=title)
    for col in ("part", "bytes", "", "share"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for key in BREAKDOWN_KEYS:
        n = report.breakdown[key]
        share = f"{100 * n / report.total_bytes:.1f}%" if report.total_bytes else "-"
        table.add_row(key, str(n), _fmt_bytes(n), share)
    table.add_row("total", str(report.total_bytes), _fmt_bytes(report.total_bytes), "100%", end_section=True)
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


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@click.option("--scheme", "scheme_spec", required=True, help="Preset name or scheme .json file.")
@click.option("--seq-len", type=click.IntRange(0), required=True, help="Tokens in the cache.")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (exact byte counts).")
def memory(model_spec: str, scheme_spec: str, seq_len: int, batch: int, as_json: bool) -> None:
    """Predict the cache's bytes: payload, scales, zero points, high precision, padding."""
    from kvq_export import memory as mem
    from kvq_export.model_source import load_config, model_facts
    from kvq_export.presets import resolve_scheme

    scheme = resolve_scheme(scheme_spec)
    facts = model_facts(load_config(model_spec))
    report = mem.predict(scheme, facts, seq_len, batch)
    if as_json:
        click.echo(json.dumps({"model": model_spec, **report.to_dict()}, indent=2))
        return
    console = _console()
    console.print(_breakdown_table(
        f"{report.scheme} on {model_spec} ({facts.num_layers} layers x {facts.num_kv_heads} kv heads x "
        f"head_dim {facts.head_dim}), {seq_len} tokens, batch {batch}", report))
    lengths = sorted({n for n in DEFAULT_CURVE if n <= max(seq_len, 1) * 4} | {seq_len})
    console.print(_memory_table("over sequence length", mem.curve(scheme, facts, lengths, batch),
                                show_breakdown=False))


@cli.command("export")
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@click.option("--scheme", "scheme_spec", required=True, help="Preset name or scheme .json file.")
@click.option("--out", "out_dir", required=True, callback=outside_exports, help="Export directory.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Compute dtype of the graph.")
@click.option("--opset", type=click.IntRange(MIN_OPSET), default=DEFAULT_OPSET, show_default=True)
@click.option("--flavor", type=click.Choice(flavor_names()), default=flavor_names()[0], show_default=True,
              help="Graph flavor: " + "; ".join(f"{f.name} ({f.about})" for f in FLAVORS.values()) + ".")
@click.option("--force", is_flag=True, help="Replace an existing export directory (only a kvq export is replaced).")
@click.option("--weights", "weight_format", type=click.Choice([str(f) for f in WeightFormat]),
              default=str(WeightFormat.FP32), show_default=True,
              help="How the linear weights and the embedding are stored: as computed, fp16, or int8/int4 blocks "
                   "(ONNX Runtime's MatMulNBits and GatherBlockQuantized; a tied embedding is stored once).")
@click.option("--weight-block-size", type=click.Choice([str(b) for b in WEIGHT_BLOCK_SIZES]), default="32",
              show_default=True, help="int8/int4 weights: input channels per scale.")
@click.option("--weight-asymmetric", is_flag=True, help="int8/int4 weights: a zero point per block as well.")
@click.option("--weight-accuracy-level", type=click.IntRange(1, 4), default=1, show_default=True,
              help="int8/int4 weights: MatMulNBits' activation type (1 fp32 .. 4 int8). 4 is faster on CPU, but "
                   "greedy tokens may then depend on what else is in the batch.")
@calibration_options(optional=True)
def export_cmd(model_spec, scheme_spec, out_dir, dtype, opset, flavor, force, weight_format, weight_block_size,
               weight_asymmetric, weight_accuracy_level, calibration) -> None:
    """Export MODEL with a quantized KV cache to an ONNX directory (model.onnx + kvq.json)."""
    from kvq_export.export.exporter import export
    from kvq_export.request import ExportRequest, WeightSpec
    from kvq_export.runtime.genai import RUNTIME

    weights = WeightSpec(format=weight_format, block_size=int(weight_block_size), symmetric=not weight_asymmetric,
                         accuracy_level=weight_accuracy_level)
    request = ExportRequest(model=model_spec, scheme=scheme_spec, flavor=flavor, weights=weights, dtype=dtype,
                            opset=opset, calibration=calibration)
    manifest = export(request, out_dir, force=force)
    click.echo(f"exported to {out_dir}")
    genai = manifest.runtimes.get(RUNTIME) or {}
    click.echo(f"{RUNTIME}: " + (f"serve with og.Model({str(out_dir)!r}) ({genai['config']})" if genai.get("supported")
                                 else f"not servable: {genai.get('reason', 'no entry')}"))


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@calibration_options(short_names=True)
@click.option("--budget", type=POSITIVE, required=True,
              help="Most bits per cached element at --context (memory model: metadata and windows count).")
@click.option("--context", type=click.IntRange(1), default=4096, show_default=True,
              help="Cache length the budget is stated at.")
@click.option("--candidates", default="ort-gqa", show_default=True,
              help="Built-in set (ort-gqa, kivi, accuracy, accuracy-recent) or comma-separated presets / scheme files "
                   "(one layer option each).")
@click.option("--metric", type=click.Choice(["attention", "kl"]), default="attention", show_default=True,
              help="attention: output error through o_proj relative to the residual stream (one model pass); "
                   "kl: logit KL with one layer's stream quantized (a forward per layer and candidate).")
@click.option("--sink-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="First tokens kept in high precision in every layer (measured, and counted in the budget).")
@click.option("--value-window", type=click.IntRange(0), default=None,
              help="Every value candidate keeps its N newest tokens exact (measured, and counted in the budget).")
@click.option("--name", default=None, help="Name of the planned scheme (default plan-<budget>b).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), callback=outside_exports,
              help="Scheme JSON to write.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None, callback=outside_exports,
              help="Also write the measured damage per layer and candidate, and the uniform choices, as JSON.")
@click.option("--quiet", is_flag=True, help="No progress bars (they are also left out when stderr is not a terminal).")
def plan(model_spec, calibration, budget, context, candidates, metric, sink_tokens, value_window, name, out_path,
         report_path, quiet) -> None:
    """Choose per-layer key/value formats under a bit budget by measured attention damage; write a scheme."""
    from pathlib import Path

    from kvq_export._atomic import atomic_write
    from kvq_export.calibrate import calibration_windows
    from kvq_export.model_source import load_model
    from kvq_export.plan import plan_scheme
    from kvq_export.progress import tqdm_bars

    for path in (out_path, report_path):  # a plan takes minutes: refuse a file it could not write before planning
        if path and not Path(path).resolve().parent.is_dir():
            raise KVQError(f"cannot write {path}: its directory does not exist")
    model, tokenizer = load_model(model_spec)
    if tokenizer is None:
        raise KVQError(f"model {model_spec} has no tokenizer: kvq plan reads calibration text")
    windows = calibration_windows(tokenizer, calibration.corpus, calibration.tokens, offset=calibration.offset)
    with tqdm_bars(not quiet):
        result = plan_scheme(model, windows, budget=budget, context=context, candidates=candidates, metric=metric,
                             calibration=calibration, sink_tokens=sink_tokens, value_window=value_window,
                             name=name or Path(out_path).stem)
    result.settings.update(model=model_spec, corpus=calibration.corpus, offset=calibration.offset)
    atomic_write(out_path, result.scheme.to_json() + "\n")
    if report_path:
        from kvq_export.validate.report import write_json

        write_json(result.to_dict(), report_path)
    click.echo(f"{out_path}: {result.bits_per_element:.3f} bits/element at {context} tokens (budget {budget:g}), "
               f"predicted damage {result.damage:.4g} ({metric}); {result.scheme.describe()}")
    for row in result.uniform:
        click.echo(f"  uniform K {row['key']} / V {row['value']}: {row['bits_per_element']:.3f} bits/element, "
                   f"damage {row['damage']:.4g}")


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeat for a batch).")
@click.option("--max-new-tokens", type=click.IntRange(0), default=64, show_default=True)
@click.option("--temperature", type=NON_NEGATIVE, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(1), default=None)
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=None)
@click.option("--seed", type=click.IntRange(0), default=None)
@click.option("--repetition-penalty", type=FiniteFloat(0.01, 100), default=1.0, show_default=True,
              help="> 1 discourages tokens the row already holds (prompt included); 1 = off.")
@click.option("--runtime", type=click.Choice(["kvq", "genai"]), default="kvq", show_default=True,
              help="kvq: kvq's loop on ONNX Runtime; genai: onnxruntime-genai's C++ loop (ort-gqa exports).")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and cache bytes as JSON.")
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
def generate(export_dir, prompts, max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty, runtime,
             as_json, no_verify) -> None:
    """Generate text from an export directory on ONNX Runtime (quantized cache between steps)."""
    from kvq_export.runtime.sampling import SamplingConfig

    for prompt in prompts:  # bytes that are not UTF-8 arrive as lone surrogates: refuse them before any work
        _utf8_arg(prompt, "--prompt")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              repetition_penalty=repetition_penalty)
    if runtime == "genai":
        from kvq_export.runtime.genai import GenaiSession

        session = GenaiSession(export_dir, verify_weights=not no_verify)
        results = session.generate(list(prompts), max_new_tokens, sampling)
        scheme = session.manifest.scheme.name
    else:
        from kvq_export.runtime.session import KVQSession

        session = KVQSession(export_dir, verify_weights=not no_verify)
        scheme = session.manifest.scheme.name
        results = None
    stream = None
    if results is None and len(prompts) == 1 and not as_json:
        stream = _TextStream(session.tokenizer, prompts[0])
    if results is None:
        results = session.generate(list(prompts), max_new_tokens, sampling, on_token=stream)
    if as_json:
        click.echo(json.dumps({"export": str(export_dir), "scheme": scheme, "runtime": runtime,
                               "results": [r.to_dict() for r in results]}, indent=2))
        return
    if stream is not None:
        click.echo("")
    else:
        for r in results:
            click.echo(f"{r.prompt}{r.text}")
    click.echo(f"[cache: {results[0].cache_bytes} bytes]", err=True)


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@click.option("--scheme", "scheme_spec", default="ort-int8", show_default=True,
              help="Preset or scheme .json file with static scales (what is calibrated).")
@calibration_options()
@click.option("--format", "file_format", type=click.Choice(["genai-scales", "npz"]), default="genai-scales",
              show_default=True, help="genai-scales: onnxruntime-genai builder's kv_cache_scale_file; npz: kvq's.")
@click.option("--granularity", type=click.Choice(["per_channel", "per_tensor"]), default="per_channel",
              show_default=True, help="genai-scales: the builder's kv_cache_quant_scheme granularity.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), callback=outside_exports,
              help="File to write.")
@click.option("--quiet", is_flag=True, help="No progress bars (they are also left out when stderr is not a terminal).")
def calibrate(model_spec, scheme_spec, calibration, file_format, granularity, out, quiet) -> None:
    """Calibrate static K/V scales and write them for kvq or for onnxruntime-genai's model builder."""
    from kvq_export.progress import tqdm_bars
    from kvq_export.runtime.genai import calibrate_to_file

    with tqdm_bars(not quiet):
        path = calibrate_to_file(model_spec, scheme_spec, out, corpus=calibration.corpus, tokens=calibration.tokens,
                                 method=str(calibration.method), percentile=calibration.percentile,
                                 offset=calibration.offset, file_format=file_format, granularity=granularity)
    click.echo(f"wrote {path}")
    if file_format == "genai-scales":
        data = json.loads(path.read_text())
        click.echo("build: python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32 -e cpu --extra_options "
                   f"{data['kvq']['builder_option']} kv_cache_scale_file={path}")


class _TextStream:
    """Prints a single prompt's continuation as tokens arrive (re-decoding the tail keeps spacing right)."""

    def __init__(self, tokenizer, prompt: str) -> None:
        self.tokenizer, self.prompt_tokens = tokenizer, tokenizer(prompt)["input_ids"]
        self.tokens: list[int] = []
        self.shown = ""
        click.echo(prompt, nl=False)

    def __call__(self, row: int, token: int) -> None:
        from kvq_export.runtime.session import continuation_text

        self.tokens.append(token)
        text = continuation_text(self.tokenizer, self.prompt_tokens, self.tokens)
        click.echo(text[len(self.shown):], nl=False)
        self.shown = text


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--baseline", type=click.Path(exists=True, file_okay=False), default=None,
              help="fp16 export of the same model (default: exported on the fly from the manifest's source).")
@click.option("--corpus", default="britannica", show_default=True, help="Corpus name or text file.")
@click.option("--windows", type=click.IntRange(1), default=8, show_default=True)
@click.option("--window-len", type=click.IntRange(2), default=512, show_default=True)
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True,
              help="Corpus tokens skipped before the first window (e.g. past a static scheme's calibration text).")
@click.option("--chunk", type=click.IntRange(1), default=None,
              help="Feed C tokens per step instead of strict one-token decode (faster, less strict).")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Greedy-agreement prompts, one per line (default: a built-in set of 8).")
@click.option("--gen-tokens", type=click.IntRange(0), default=64, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=outside_exports,
              help="Write every number here.")
@click.option("--report", "report_out", type=click.Path(dir_okay=False), default=None, callback=outside_exports,
              help="Write a self-contained HTML report here.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
@click.option("--max-ppl-delta", type=NON_NEGATIVE, default=None,
              help="Exit 1 when perplexity exceeds the baseline's by more than this fraction (0.02 = +2%).")
@click.option("--min-top1", type=FRACTION, default=None,
              help="Exit 1 when top-1 agreement with the baseline is below this (0..1).")
@click.option("--max-kl", type=NON_NEGATIVE, default=None,
              help="Exit 1 when the mean per-token KL(baseline || export) exceeds this (nats).")
def validate(export_dir, baseline, corpus, windows, window_len, offset, chunk, prompts_file, gen_tokens, json_out,
             report_out, quiet, no_verify, max_ppl_delta, min_top1, max_kl) -> None:
    """Compare an export with its fp16 baseline: tokens, attention (key vs value error), memory, latency.

    With --max-ppl-delta / --min-top1 / --max-kl the command is a gate: every number is still reported and
    written, then it exits 1 with one line naming each threshold missed.
    """
    from rich.table import Table

    from kvq_export.validate import report
    from kvq_export.validate.gates import Gates
    from kvq_export.validate.runner import DEFAULT_PROMPTS, ValidateConfig
    from kvq_export.validate.runner import validate as run_validation

    prompts = DEFAULT_PROMPTS
    if prompts_file:
        prompts = tuple(line for line in _utf8_text(prompts_file, "prompts file").splitlines() if line.strip())
    config = ValidateConfig(corpus=corpus, windows=windows, window_len=window_len, offset=offset, chunk=chunk,
                            prompts=prompts, gen_tokens=gen_tokens)
    gates = Gates(max_ppl_delta=max_ppl_delta, min_top1=min_top1, max_kl=max_kl)
    result = run_validation(export_dir, baseline, config, progress=not quiet, verify_weights=not no_verify)
    if json_out:
        report.write_json(result, json_out)
    if report_out:
        report.write_html(result, report_out)
    table = Table(title=f"kvq validate {export_dir} ({result['seconds']} s)", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in report.summary_rows(result):
        table.add_row(label, value)
    _console().print(table)
    gates.check(result)  # a missed threshold: one line and exit 1, after every number was shown and written


@cli.command()
@click.argument("dir_a", type=click.Path(exists=True, file_okay=False))
@click.argument("dir_b", type=click.Path(exists=True, file_okay=False), required=False)
@click.option("--backend", type=click.Choice(["onnxrt", "trt"]), default="onnxrt", show_default=True,
              help="onnxrt: DIR_A vs DIR_B on ONNX Runtime. trt: the TensorRT engine of DIR_A (a --flavor trt "
                   "export) vs its reference flavor on ONNX Runtime (DIR_B, or re-exported from the model source).")
@click.option("--engine", type=click.Path(dir_okay=False), default=None, help="--backend trt: engine file.")
@click.option("--logits-atol", type=NON_NEGATIVE, default=1e-3, show_default=True)
@click.option("--logits-rtol", type=NON_NEGATIVE, default=1e-3, show_default=True)
@click.option("--cache-atol", type=NON_NEGATIVE, default=1e-3, show_default=True,
              help="For the cache each export holds, decoded with its manifest.")
@click.option("--cache-rtol", type=NON_NEGATIVE, default=1e-3, show_default=True)
@click.option("--steps", type=click.IntRange(0), default=4, show_default=True, help="Decode steps after prefill.")
@click.option("--prompt-len", type=click.IntRange(1), default=None,
              help="Prompt tokens [default: past both exports' high-precision windows, at least 48; a shorter "
                   "one that never leaves a window is compared with a warning].")
@click.option("--batch", type=click.IntRange(1), default=2, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
def compare(dir_a, dir_b, backend, engine, logits_atol, logits_rtol, cache_atol, cache_rtol, steps, prompt_len, batch,
            seed, no_verify) -> None:
    """Run two exports (or an engine and its ONNX reference) through Polygraphy's Comparator; exit 1 on mismatch."""
    from kvq_export.validate.compare import Tolerances, compare_exports

    tol = Tolerances(logits_atol, logits_rtol, cache_atol, cache_rtol)
    run = dict(prompt_len=prompt_len, batch=batch, steps=steps, seed=seed)
    if backend == "trt":
        from kvq_export.manifest import Manifest
        from kvq_export.trt import compare_with_onnxruntime
        from kvq_export.validate.compare import comparison_prompt_len, warn_unexercised

        manifests = [Manifest.load(dir_a)]
        run["prompt_len"] = prompt_len or comparison_prompt_len(manifests, batch=batch)
        warn_unexercised(manifests, [dir_a], prompt_len=run["prompt_len"], steps=steps)

        ok = compare_with_onnxruntime(dir_a, reference_dir=dir_b, engine=engine, tolerances=tol, **run)
        other = dir_b or "its reference flavor"
    else:
        if dir_b is None:
            raise click.UsageError("--backend onnxrt compares two export directories: give DIR_B")
        ok = compare_exports(dir_a, dir_b, tol, verify_weights=not no_verify, **run)
        other = dir_b
    if not ok:
        click.echo(f"error: {dir_a} and {other} differ beyond tolerance", err=True)
        raise SystemExit(1)
    click.echo(f"{dir_a} and {other} match within tolerance")


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--fp16", is_flag=True, help="Allow fp16 kernels.")
@click.option("--max-batch", type=click.IntRange(1), default=8, show_default=True)
@click.option("--max-context", type=click.IntRange(1), default=4096, show_default=True)
@click.option("--max-prefill", type=click.IntRange(1), default=None, help="Longest prefill (default: max context).")
@click.option("--output", type=click.Path(dir_okay=False), default=None, callback=outside_exports,
              help="Engine path (default: DIR.engine beside the export; never inside it).")
def build(export_dir, fp16, max_batch, max_context, max_prefill, output) -> None:
    """Build a TensorRT engine from a --flavor trt export (plugin loaded; prefill and decode profiles)."""
    from kvq_export.trt import build_engine

    path = build_engine(export_dir, fp16=fp16, max_batch=max_batch, max_context=max_context,
                        max_prefill=max_prefill, output=output)
    click.echo(f"engine written to {path}")


def _utf8_text(path: str, what: str) -> str:
    """A text file's content, capped (``/dev/zero`` is refused); bytes that are not UTF-8 are a one-line error."""
    from kvq_export._read import read_text

    return read_text(path, what)


def _utf8_arg(text: str, option: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise KVQError(f"{option} {text[:40]!r} is not UTF-8 text") from None
    return text


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True)
@click.option("--schemes", required=True, help="Comma-separated presets or scheme files (the baseline is added).")
@click.option("--flavors", default="ort-gqa", show_default=True,
              help=f"Comma-separated flavors ({', '.join(flavor_names())}).")
@click.option("--contexts", default="512,2048,8192", show_default=True)
@click.option("--batch", "batches", default="1,4", show_default=True)
@click.option("--baseline", default="fp16", show_default=True, help="Scheme every result is a ratio to.")
@click.option("--steps", type=click.IntRange(1), default=32, show_default=True, help="Timed decode steps.")
@click.option("--warmup", type=click.IntRange(0), default=4, show_default=True, help="Untimed decode steps first.")
@click.option("--prefill-tokens", type=click.IntRange(1), default=512, show_default=True,
              help="Prefill length cap (and chunk size of --fill prefill).")
@click.option("--fill", type=click.Choice(["synthetic", "prefill"]), default="synthetic", show_default=True,
              help="How the cache reaches the context: random data in the stored layout, or a real prefill.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Compute dtype of the exports.")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="ONNX Runtime intra-op threads [default: OMP_NUM_THREADS when set, else ONNX Runtime's choice].")
@click.option("--ppl-windows", type=click.IntRange(0), default=0, show_default=True,
              help="Also report strict-decode perplexity on this many windows of the calibration corpus.")
@click.option("--ppl-tokens", type=click.IntRange(2), default=512, show_default=True, help="Tokens per window.")
@calibration_options()
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, callback=outside_exports,
              help="Where the exports are kept and reused (default: the kvq cache directory).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=outside_exports)
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None, callback=outside_exports,
              help="PNG of decode latency and cache bytes against context length.")
@click.option("--quiet", is_flag=True, help="No progress bars (they are also left out when stderr is not a terminal).")
def bench(model_spec, schemes, flavors, contexts, batches, baseline, steps, warmup, prefill_tokens, fill, dtype,
          threads, ppl_windows, ppl_tokens, calibration, work_dir, json_out, plot_out, quiet) -> None:
    """Decode latency, prefill throughput, cache bytes and RSS per scheme, as ratios to the baseline."""
    from rich.console import Console

    from kvq_export import bench as kvq_bench
    from kvq_export.progress import tqdm_bars

    progress = Console(stderr=True, highlight=False, soft_wrap=True)

    def show(r) -> None:  # a long run reports each result as it is measured
        progress.print(f"{r.flavor} {r.scheme} ctx {r.context} batch {r.batch}: decode {r.decode_ms_median:.2f} ms "
                       f"(x{r.ratio['decode_ms_paired']:.2f}, 90% {r.ratio['decode_ms_paired_low']:.2f}-"
                       f"{r.ratio['decode_ms_paired_high']:.2f}), cache {r.ratio['cache_reduction']:.2f}x smaller")

    try:
        with tqdm_bars(not quiet):
            report = kvq_bench.run_bench(
                model_spec, [s for s in schemes.split(",") if s], flavors=[f for f in flavors.split(",") if f],
                contexts=_ints(contexts), batches=_ints(batches), baseline=baseline, steps=steps, warmup=warmup,
                prefill_tokens=prefill_tokens, fill=fill, dtype=dtype, threads=threads, ppl_windows=ppl_windows,
                ppl_tokens=ppl_tokens, calibration=calibration, work_dir=work_dir, on_result=show, json_out=json_out)
    except KeyboardInterrupt:
        if json_out:
            click.echo(f"interrupted: {json_out} keeps every result measured so far", err=True)
        raise
    console = _console()
    console.print(kvq_bench.report_table(report))
    if ppl_windows:
        console.print(kvq_bench.perplexity_table(report))
    if plot_out:
        kvq_bench.plot(report, plot_out)


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True)
@click.option("--prompt", default=None, help="Prompt text (default: a built-in ~130-token story opening).")
@click.option("--max-new-tokens", type=click.IntRange(2), default=64, show_default=True)
@click.option("--repetition-penalty", type=FiniteFloat(0.01, 100), default=None,
              help="Greedy decoding's repetition penalty (default: the demo's, 1.3).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, callback=outside_exports,
              help="Where the exports live (default: the kvq cache directory).")
@calibration_options()
def demo(model_spec, prompt, max_new_tokens, repetition_penalty, workdir, calibration) -> None:
    """fp16 baseline, the most accurate <= 5-bit scheme and the ort-gqa fast path: text, bytes, speed, serving."""
    import dataclasses

    from rich.table import Table

    from kvq_export.demo import DEMO_PROMPT, DEMO_SAMPLING, run_demo

    console = _console()
    prompt = prompt or DEMO_PROMPT
    sampling = DEMO_SAMPLING if repetition_penalty is None else dataclasses.replace(
        DEMO_SAMPLING, repetition_penalty=repetition_penalty)
    rows = run_demo(model_spec, prompt, max_new_tokens, workdir, sampling, calibration=calibration)
    from rich.markup import escape

    console.print(f"[bold]prompt[/bold] ({rows[0].prompt_tokens} tokens): {escape(prompt)}")
    console.print(f"greedy, repetition penalty {sampling.repetition_penalty:g}, {max_new_tokens} new tokens, "
                  "ONNX Runtime on this machine's CPU\n")
    base = rows[0]
    for r in rows:
        console.print(f"[bold]{escape(r.role)}[/bold] — {escape(r.scheme)} ({r.flavor}): {escape(r.text.strip())}\n")
    table = Table(title=f"{model_spec}: one prompt, three caches")
    for col in ("", "scheme (flavor)", "tokens = base", "cache bytes", "vs base", "bits/elem", "ms/token",
                "x base"):
        table.add_column(col, justify="left" if col in ("", "scheme (flavor)") else "right")
    for r in rows:
        table.add_row(escape(r.role), escape(f"{r.scheme} ({r.flavor})"), f"{r.agree_with_baseline}/{len(r.tokens)}",
                      str(r.cache_bytes), f"{base.cache_bytes / r.cache_bytes:.2f}x smaller" if r.cache_bytes else "-",
                      f"{r.bits_per_element:.2f}", f"{r.decode_ms:.1f}", f"{r.decode_ratio:.2f}")
    console.print(table)
    for r in rows:
        console.print(f"[bold]serve {escape(r.scheme)} with onnxruntime-genai[/bold]: {escape(r.serve)}",
                      soft_wrap=True)


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (127.0.0.1: this machine).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
@click.option("--model-name", default=None, help="The `model` clients name (default: the export directory's name).")
@click.option("--backend", type=click.Choice(["auto", "engine", "session"]), default="auto", show_default=True,
              help="engine: onnxruntime-genai's og.Engine, requests batched (ort-gqa exports); session: kvq's loop, "
                   "one request at a time; auto: engine where onnxruntime-genai can serve the export.")
@click.option("--shutdown-timeout", type=NON_NEGATIVE, default=10.0, show_default=True,
              help="Seconds in-flight requests may finish after SIGINT/SIGTERM before they are cancelled.")
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
def serve(export_dir, host, port, model_name, backend, shutdown_timeout, no_verify) -> None:
    """Serve an export over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from kvq_export.serve import serve as run_server

    logging.getLogger("kvq_export.serve").setLevel(min(logging.getLogger().getEffectiveLevel(), logging.INFO))
    run_server(export_dir, host=host, port=port, model_name=model_name, backend=backend,
               verify_weights=not no_verify, shutdown_timeout=shutdown_timeout)


@cli.command("bench-serve")
@click.argument("export_dirs", nargs=-1, required=True, metavar="[NAME=]DIR...")
@click.option("--context", "contexts", type=click.IntRange(2), multiple=True, default=(2048, 8000), show_default=True)
@click.option("--concurrent", type=click.IntRange(1), default=4, show_default=True, help="Sequences decoded together.")
@click.option("--budget-gb", type=click.FloatRange(0, min_open=True), default=8.0, show_default=True,
              help="Memory budget (GiB) the sequences must fit beside the weights.")
@click.option("--new-tokens", type=click.IntRange(1), default=8, show_default=True, help="Timed decode steps.")
@click.option("--backend", type=click.Choice(["auto", "og", "session"]), default="auto", show_default=True,
              help="og: og.Model with a batch prefilled for real; session: KVQSession on a synthetic cache (kvq "
                   "exports); auto: session for kvq exports, og for others.")
@click.option("--threads", type=click.IntRange(1), default=None)
@click.option("--out", "out", default="capacity.jsonl", show_default=True, help="Rows appended as measured.")
@click.option("--plot", "plot_out", default=None, help="Write a PNG of the rows here.")
@click.option("--predict-only", is_flag=True, help="Read the graphs only: cache bytes and sequences predicted.")
def bench_serve(export_dirs, contexts, concurrent, budget_gb, new_tokens, backend, threads, out, plot_out,
                predict_only) -> None:
    """Sequences each export serves at once within a memory budget, and their aggregate tokens/s."""
    from pathlib import Path

    from kvq_export.capacity import plot_capacity, run_capacity

    dirs = dict(d.split("=", 1) if "=" in d else (Path(d).name, d) for d in export_dirs)
    rows = run_capacity(dirs, contexts=contexts, concurrent=concurrent, budget_bytes=int(budget_gb * 2**30),
                        new_tokens=new_tokens, backend=backend, threads=threads, out=out, predict_only=predict_only)
    for r in rows:
        speed = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}"
        click.echo(f"{r.name} @{r.context}: {r.cache_bytes_per_sequence / 2**20:.1f} MiB/seq, "
                   f"{r.predicted_sequences} seqs predicted, {r.measured_sequences or '-'} by RSS, "
                   f"{speed} tok/s x{r.concurrent} ({r.status})")
    if plot_out:
        plot_capacity(rows, plot_out)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="kvq", standalone_mode=True)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
