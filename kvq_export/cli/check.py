"""``kvq validate`` and ``kvq compare``: an export against its baseline."""

from __future__ import annotations

import click

from kvq_export.cli._base import (
    STDOUT,
    cli,
    device_option,
    distinct_outputs,
    json_option,
    make_console,
    report_option,
    utf8_text,
    write_json_output,
)
from kvq_export.cli.long_context import check_mode, long_context_options, run_long_context
from kvq_export.cli_types import FRACTION, NON_NEGATIVE
from kvq_export.errors import KVQError
from kvq_export.manifest import Manifest
from kvq_export.trt import compare_with_onnxruntime
from kvq_export.validate import report
from kvq_export.validate.compare import Tolerances, compare_exports, comparison_prompt_len, warn_unexercised
from kvq_export.validate.config import DEFAULT_PROMPTS, ValidateConfig
from kvq_export.validate.gates import Gates
from kvq_export.validate.runner import validate as run_validation


@cli.command()
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--baseline", type=click.Path(exists=True, file_okay=False), default=None,
              help="fp16 export of the same model (default: exported on the fly from the manifest's source).")
@click.option("--corpus", default="britannica", show_default=True, help="Corpus name or text file.")
@click.option("--windows", type=click.IntRange(1), default=8, show_default=True,
              help="Corpus windows scored (each from an empty cache).")
@click.option("--window-len", type=click.IntRange(2), default=512, show_default=True, help="Tokens per window.")
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True,
              help="Corpus tokens skipped before the first window (e.g. past a static scheme's calibration text).")
@click.option("--chunk", type=click.IntRange(1), default=None,
              help="Feed C tokens per step instead of strict one-token decode (faster, less strict: on ort-gqa "
                   "exports a chunk's tokens attend over each other's exact K/V). With --long-context: the "
                   "perplexity windows' tokens per step [default: 64].")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Greedy-agreement prompts, one per line (default: a built-in set of 8).")
@click.option("--gen-tokens", type=click.IntRange(0), default=64, show_default=True,
              help="Greedy tokens per prompt compared with the baseline's (0: no greedy agreement).")
@json_option("every number")
@report_option("the tables and plots")
@device_option()
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
@click.option("--max-ppl-delta", type=NON_NEGATIVE, default=None,
              help="Exit 1 when perplexity exceeds the baseline's by more than this fraction (0.02 = +2%).")
@click.option("--min-top1", type=FRACTION, default=None,
              help="Exit 1 when top-1 agreement with the baseline is below this (0..1).")
@click.option("--max-kl", type=NON_NEGATIVE, default=None,
              help="Exit 1 when the mean per-token KL(baseline || export) exceeds this (nats).")
@long_context_options
def validate(export_dir, baseline, corpus, windows, window_len, offset, chunk, prompts_file, gen_tokens, json_out,
             report_out, providers, quiet, no_verify, max_ppl_delta, min_top1, max_kl, **long_context) -> None:
    """Compare EXPORT_DIR with its fp16 baseline: tokens, attention (key vs value error), memory, latency.

    EXPORT_DIR: a kvq export directory.

    With --max-ppl-delta / --min-top1 / --max-kl the command is a gate: every number is still reported and
    written, then it exits 1 with one line naming each threshold missed.

    With --long-context it measures where a quantized cache matters most instead: perplexity by distance over
    corpus windows up to the export's positions, and retrieval (passkey, keyed needles among distractors, variable
    tracking) on a grid of length x depth x trial, the baseline first (--min-retrieval and --max-group-ppl-delta
    are its gates).
    """
    from rich.table import Table

    check_mode(long_context["long_context"])
    if long_context.pop("long_context"):
        run_long_context(export_dir, baseline, corpus=corpus, offset=offset, chunk=chunk, json_out=json_out,
                         report_out=report_out, providers=providers, quiet=quiet, no_verify=no_verify, **long_context)
        return
    distinct_outputs({"--json": json_out, "--report": report_out}, {"--corpus": corpus, "--prompts": prompts_file})
    prompts = DEFAULT_PROMPTS
    if prompts_file:
        prompts = tuple(line for line in utf8_text(prompts_file, "prompts file").splitlines() if line.strip())
        if not prompts and gen_tokens:  # greedy agreement would be skipped without a word
            raise KVQError(f"prompts file {prompts_file} holds no prompt; allowed: one prompt per non-empty line "
                           "(or --gen-tokens 0 to skip greedy agreement)")
    config = ValidateConfig(corpus=corpus, windows=windows, window_len=window_len, offset=offset, chunk=chunk,
                            prompts=prompts, gen_tokens=gen_tokens)
    gates = Gates(max_ppl_delta=max_ppl_delta, min_top1=min_top1, max_kl=max_kl)
    result = run_validation(export_dir, baseline, config, progress=not quiet, verify_weights=not no_verify,
                            providers=providers)
    if json_out:
        write_json_output(json_out, result.to_json())
    if report_out:
        report.write_html(result, report_out)
    table = Table(title=f"kvq validate {export_dir} ({result.seconds} s)", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in report.summary_rows(result):
        table.add_row(label, value)
    make_console(json_out=json_out).print(table)
    gates.check(result)  # a missed threshold: one line and exit 1, after every number was shown and written


@cli.command()
@click.argument("dir_a", type=click.Path(exists=True, file_okay=False))
@click.argument("dir_b", type=click.Path(exists=True, file_okay=False), required=False)
@click.option("--backend", type=click.Choice(["onnxrt", "trt"]), default="onnxrt", show_default=True,
              help="onnxrt: DIR_A vs DIR_B on ONNX Runtime. trt: the TensorRT engine of DIR_A (a --flavor trt "
                   "export) vs its reference flavor on ONNX Runtime (DIR_B, or re-exported from the model source).")
@click.option("--engine", type=click.Path(dir_okay=False), default=None, help="--backend trt: engine file.")
@click.option("--logits-atol", type=NON_NEGATIVE, default=1e-3, show_default=True,
              help="Absolute tolerance of the logits (largest error over every element and step).")
@click.option("--logits-rtol", type=NON_NEGATIVE, default=1e-3, show_default=True,
              help="Relative tolerance of the logits.")
@click.option("--cache-atol", type=NON_NEGATIVE, default=1e-3, show_default=True,
              help="Absolute tolerance of the cache each export holds, decoded with its manifest.")
@click.option("--cache-rtol", type=NON_NEGATIVE, default=1e-3, show_default=True,
              help="Relative tolerance of the decoded cache.")
@click.option("--steps", type=click.IntRange(0), default=4, show_default=True, help="Decode steps after prefill.")
@click.option("--prompt-len", type=click.IntRange(1), default=None,
              help="Prompt tokens [default: past both exports' high-precision windows, at least 48; a shorter "
                   "one that never leaves a window is compared with a warning].")
@click.option("--batch", type=click.IntRange(1), default=2, show_default=True, help="Prompts run together.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Seed of the random prompts.")
@device_option()
@json_option("every output's errors and the verdict")
@click.option("--verbose", is_flag=True, help="Polygraphy's full per-output log, and a row for every output.")
@click.option("--no-verify", "no_verify", is_flag=True,
              help="Skip checking the weight files against the checksums in kvq.json (faster on trusted storage).")
def compare(dir_a, dir_b, backend, engine, logits_atol, logits_rtol, cache_atol, cache_rtol, steps, prompt_len, batch,
            seed, providers, json_out, verbose, no_verify) -> None:
    """Run two exports (or an engine and its ONNX reference) through Polygraphy's Comparator; exit 1 on mismatch.

    DIR_A and DIR_B: export directories (--backend trt: DIR_A's engine against DIR_B, or DIR_A's reference
    flavor re-exported). Prints the largest absolute / relative errors against their tolerances of the logits and
    the worst cache key and value layer, and how many outputs missed (--verbose: every output, and Polygraphy's
    own log).
    """
    tol = Tolerances(logits_atol, logits_rtol, cache_atol, cache_rtol)
    run = dict(prompt_len=prompt_len, batch=batch, steps=steps, seed=seed, providers=providers, verbose=verbose)
    if backend == "trt":
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
    if json_out:
        write_json_output(json_out, {"a": str(dir_a), "b": str(other), **ok.to_dict()})
    make_console(json_out=json_out).print(_comparison_table(ok, full=verbose))
    if not ok:
        click.echo(f"error: {dir_a} and {other} differ beyond tolerance", err=True)
        raise SystemExit(1)
    click.echo(f"{dir_a} and {other} match within tolerance", err=json_out == STDOUT)


def _comparison_table(comparison, *, full: bool):
    """Each output's largest errors against its tolerances (``full``: every output; else the summary rows)."""
    from rich.table import Table

    shown = "every output" if full else "logits and the worst cache layer; --verbose: every output"
    missed = len(comparison.missed)
    table = Table(title=f"largest error over every step ({shown})",
                  caption=f"{missed} of {len(comparison.outputs)} outputs beyond tolerance" if missed else None)
    for col in ("output", "max abs", "atol", "max rel", "rtol", ""):
        table.add_column(col, justify="left" if col == "output" else "right")
    for o in comparison.outputs if full else comparison.summary():
        table.add_row(o.name, f"{o.max_abs:.3g}", f"{o.atol:g}", f"{o.max_rel:.3g}", f"{o.rtol:g}",
                      "pass" if o.passed else "FAIL")
    return table
