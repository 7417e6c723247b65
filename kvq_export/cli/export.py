"""``kvq export``, ``kvq plan``, ``kvq calibrate`` and ``kvq build``: from a model to a deployable artifact."""

from __future__ import annotations

import functools
import json

import click

from kvq_export._atomic import atomic_write
from kvq_export.calibration import calibration_windows
from kvq_export.cli._base import (
    STDOUT,
    calibration_options,
    cli,
    deprecated_alias,
    distinct_outputs,
    json_option,
    out_option,
    scheme_options,
    weight_options,
    write_json_output,
)
from kvq_export.cli_types import POSITIVE, outside_exports
from kvq_export.errors import KVQError
from kvq_export.export.exporter import export
from kvq_export.flavors import FLAVORS, flavor_names
from kvq_export.model_source import load_model
from kvq_export.plan import plan_scheme
from kvq_export.progress import tqdm_bars
from kvq_export.request import (
    DEFAULT_OPSET,
    DEFAULT_PLAN_CANDIDATES,
    DEFAULT_PLAN_CONTEXT,
    MIN_OPSET,
    ExportRequest,
    PlanMetric,
    PlanSpec,
)
from kvq_export.runtime.genai import RUNTIME, calibrate_to_file
from kvq_export.trt import build_engine


def plan_options(*, for_export: bool = False):
    """``kvq plan``'s planning options, given to the command as one ``plan`` argument (a :class:`PlanSpec`).

    ``for_export``: ``kvq export``'s spelling: ``--budget`` is optional (``plan`` is None without it, and the other
    planning options are then refused), and ``--candidates`` defaults to the flavor's (see
    :func:`kvq_export.export.budget.plan_candidates`).
    """
    names = ("budget", "context", "candidates", "metric", "sink_tokens", "value_window", "name")
    candidates_help = ("Built-in set (ort-gqa, ort-gqa-int4, ort-gqa-int8, kivi, accuracy, accuracy-recent) or "
                       "comma-separated presets / scheme files (one layer option each)")
    options = [
        click.option("--budget", type=POSITIVE, required=not for_export,
                     help="Most bits per cached element at --context (memory model: metadata and windows count)" +
                     (": plan the scheme (kvq plan's planner) instead of giving --scheme." if for_export else ".")),
        click.option("--context", type=click.IntRange(1), default=DEFAULT_PLAN_CONTEXT, show_default=True,
                     help="Cache length the budget is stated at."),
        click.option("--candidates", default=None if for_export else DEFAULT_PLAN_CANDIDATES,
                     show_default=not for_export, help=candidates_help + (
                         f" [default: {DEFAULT_PLAN_CANDIDATES}; with --flavor ort-gqa the best plan of it that "
                         "onnxruntime-genai serves (ort-gqa-int4 or ort-gqa-int8)]" if for_export else ".")),
        click.option("--metric", type=click.Choice([str(m) for m in PlanMetric]), default=str(PlanMetric.ATTENTION),
                     show_default=True, help="attention: output error through o_proj relative to the residual stream "
                     "(one model pass); kl: logit KL with one layer's stream quantized (a forward per layer and "
                     "candidate)."),
        click.option("--sink-tokens", type=click.IntRange(0), default=0, show_default=True,
                     help="First tokens kept in high precision in every layer (measured, and counted in the budget)."),
        click.option("--value-window", type=click.IntRange(0), default=None,
                     help="Every value candidate keeps its N newest tokens exact (measured, and counted in the "
                     "budget)."),
        click.option("--name", default=None, help="Name of the planned scheme (default " +
                     ("plan-<budget>b)." if for_export else "the --out file's stem).")),
    ]

    def apply(func):
        @functools.wraps(func)
        def command(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in names}
            if values["budget"] is None:
                ctx = click.get_current_context()
                given = [f"--{name.replace('_', '-')}" for name in names
                         if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
                if given:
                    raise KVQError(f"{', '.join(given)} plan a scheme: give them with --budget, not with --scheme")
            plan = None if values["budget"] is None else PlanSpec(**values)
            return func(*args, plan=plan, **kwargs)

        for option in reversed(options):
            command = option(command)
        return command

    return apply


@cli.command("export")
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@scheme_options(required=False)  # or --budget: plan one
@click.option("--out", "out_dir", required=True, callback=outside_exports, help="Export directory.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Compute dtype of the graph.")
@click.option("--opset", type=click.IntRange(MIN_OPSET), default=DEFAULT_OPSET, show_default=True,
              help="ONNX opset of the graph.")
@click.option("--flavor", type=click.Choice(flavor_names()), default=flavor_names()[0], show_default=True,
              help="Graph flavor: " + "; ".join(f"{f.name} ({f.about})" for f in FLAVORS.values()) + ".")
@click.option("--force", is_flag=True, help="Replace an existing export directory (only a kvq export is replaced).")
@weight_options(accuracy_level=True)
@calibration_options(optional=True)
@plan_options(for_export=True)
@click.option("--quiet", is_flag=True, help="--budget: no progress bars (they are also left out when stderr is not a "
              "terminal).")
def export_cmd(model_spec, scheme_spec, out_dir, dtype, opset, flavor, force, weights, calibration, plan,
               quiet) -> None:
    """Export MODEL with a quantized KV cache to an ONNX directory (model.onnx + kvq.json).

    With --budget instead of --scheme, plan the scheme first as kvq plan does (on held-out calibration text by
    default) and export it: the same as kvq plan then kvq export --scheme with the plan. Static scales (and a plan)
    are measured on the weights the export computes with: with --weights int4, on the int4 blocks dequantized.
    """
    request = ExportRequest(model=model_spec, scheme=scheme_spec, flavor=flavor, weights=weights, dtype=dtype,
                            opset=opset, calibration=calibration, plan=plan)
    if calibration is not None and request.scheme is not None and not request.scheme.needs_calibration:
        raise KVQError(f"scheme {request.scheme.name or 'given'} has no static scales or calibrated channels: the "
                       "--calib-* / --percentile options would change nothing; drop them (allowed with static "
                       "schemes such as ort-int8, and with --budget)")
    with tqdm_bars(not quiet):
        manifest = export(request, out_dir, force=force)
    click.echo(f"exported to {out_dir}")
    if manifest.plan is not None:
        click.echo(f"planned {manifest.scheme.name}: {manifest.plan['bits_per_element']:.3f} bits/element at "
                   f"{manifest.plan['context']} tokens (budget {manifest.plan['budget']:g}), predicted damage "
                   f"{manifest.plan['predicted_damage']:.4g} ({manifest.plan['metric']}); {manifest.scheme.describe()}")
    genai = manifest.runtimes.get(RUNTIME)
    click.echo(f"{RUNTIME}: " + (f"serve with og.Model({str(out_dir)!r}) ({genai.config})" if genai and genai.supported
                                 else f"not servable: {genai.reason if genai else 'no entry'}"))


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@calibration_options(short_names=True)
@weight_options(measured=True)
@plan_options()
@out_option("Scheme JSON to write.", required=True, param="out_path")
@json_option("the measured damage per layer and candidate, and the uniform choices,")
@deprecated_alias("--report", "--json", "json_out", type=click.Path(dir_okay=False))
@click.option("--quiet", is_flag=True, help="No progress bars (they are also left out when stderr is not a terminal).")
def plan(model_spec, calibration, weights, plan, out_path, json_out, quiet) -> None:
    """Choose per-layer key/value formats under a bit budget by measured attention damage; write a scheme.

    With --weights int4 (or int8) the damage is measured on the model with the weights such an export computes with.
    """
    from pathlib import Path

    distinct_outputs({"--out": out_path, "--json": json_out},
                     {"--calib-corpus": calibration.corpus, **{f"--candidates {c}": c for c in
                                                             (plan.candidates or "").split(",")}})
    for path in (out_path, json_out):  # a plan takes minutes: refuse a file it could not write before planning
        if path and path != STDOUT and not Path(path).resolve().parent.is_dir():
            raise KVQError(f"cannot write {path}: its directory does not exist")
    model, tokenizer = load_model(model_spec)
    if tokenizer is None:
        raise KVQError(f"model {model_spec} has no tokenizer: kvq plan reads calibration text")
    windows = calibration_windows(tokenizer, calibration.corpus, calibration.tokens, offset=calibration.offset)
    with tqdm_bars(not quiet):
        result = plan_scheme(model, windows, budget=plan.budget, context=plan.context, candidates=plan.candidates,
                             metric=str(plan.metric), calibration=calibration, sink_tokens=plan.sink_tokens,
                             value_window=plan.value_window, name=plan.name or Path(out_path).stem,
                             weights=weights)
    result.settings.update(model=model_spec, corpus=calibration.corpus, offset=calibration.offset)
    atomic_write(out_path, result.scheme.to_json() + "\n")
    if json_out:
        write_json_output(json_out, result.to_dict())
    to_stderr = json_out == STDOUT  # stdout then holds the JSON alone
    click.echo(f"{out_path}: {result.bits_per_element:.3f} bits/element at {plan.context} tokens (budget "
               f"{plan.budget:g}), predicted damage {result.damage:.4g} ({plan.metric}); {result.scheme.describe()}",
               err=to_stderr)
    for row in result.uniform:
        click.echo(f"  uniform K {row['key']} / V {row['value']}: {row['bits_per_element']:.3f} bits/element, "
                   f"damage {row['damage']:.4g}", err=to_stderr)


@cli.command()
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="Built-in name (smollm2), a Hugging Face model directory, or a .gguf file.")
@scheme_options(default="ort-int8")
@calibration_options()
@weight_options(measured=True)
@click.option("--format", "file_format", type=click.Choice(["genai-scales", "npz"]), default="genai-scales",
              show_default=True, help="genai-scales: onnxruntime-genai builder's kv_cache_scale_file; npz: kvq's.")
@click.option("--granularity", type=click.Choice(["per_channel", "per_tensor"]), default="per_channel",
              show_default=True, help="genai-scales: the builder's kv_cache_quant_scheme granularity.")
@out_option("Scale file to write.", required=True)
@click.option("--quiet", is_flag=True, help="No progress bars (they are also left out when stderr is not a terminal).")
def calibrate(model_spec, scheme_spec, calibration, weights, file_format, granularity, out, quiet) -> None:
    """Calibrate static K/V scales and write them for kvq or for onnxruntime-genai's model builder.

    With --weights int4 (or int8) they are measured on the model with the weights such an export computes with (for
    the builder's -p int4: its MatMuls come from the same ONNX Runtime quantizer); the file records it.
    """
    distinct_outputs({"--out": out}, {"--calib-corpus": calibration.corpus})
    with tqdm_bars(not quiet):
        path = calibrate_to_file(model_spec, scheme_spec, out, corpus=calibration.corpus, tokens=calibration.tokens,
                                 method=str(calibration.method), percentile=calibration.percentile,
                                 offset=calibration.offset, file_format=file_format, granularity=granularity,
                                 weights=weights)
    click.echo(f"wrote {path}")
    if file_format == "genai-scales":
        data = json.loads(path.read_text())
        precision = weights.format if weights.quantized else "fp32"
        click.echo(f"build: python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p {precision} -e cpu "
                   "--extra_options "
                   f"{data['kvq']['builder_option']} kv_cache_scale_file={path}")


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--fp16", is_flag=True, help="Allow fp16 kernels.")
@click.option("--max-batch", type=click.IntRange(1), default=8, show_default=True,
              help="Largest batch of the engine's profiles.")
@click.option("--max-context", type=click.IntRange(1), default=4096, show_default=True,
              help="Longest cache (tokens) of the engine's profiles.")
@click.option("--max-prefill", type=click.IntRange(1), default=None, help="Longest prefill (default: max context).")
@out_option("Engine path (default: DIR.engine beside the export; never inside it).")
@deprecated_alias("--output", "--out", "out", type=click.Path(dir_okay=False))
def build(export_dir, fp16, max_batch, max_context, max_prefill, out) -> None:
    """Build a TensorRT engine from a --flavor trt export (plugin loaded; prefill and decode profiles).

    EXPORT_DIR: a kvq export directory made with --flavor trt.
    """
    path = build_engine(export_dir, fp16=fp16, max_batch=max_batch, max_context=max_context,
                        max_prefill=max_prefill, output=out)
    click.echo(f"engine written to {path}")
