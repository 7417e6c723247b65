"""``kvq validate --long-context``: its options, the check that each belongs to the mode given, and the run."""

from __future__ import annotations

import click

from kvq_export.cli._base import distinct_outputs, int_list, make_console, write_json_output
from kvq_export.cli_types import FRACTION, NON_NEGATIVE, outside_exports
from kvq_export.errors import KVQError, OutputPathError
from kvq_export.progress import tqdm_bars
from kvq_export.validate.long_context.tasks import TASKS

#: options that only the ordinary validation reads, and only the long-context one
SHORT_ONLY = ("windows", "window_len", "prompts_file", "gen_tokens", "max_ppl_delta", "min_top1", "max_kl")
LONG_ONLY = ("tasks", "lengths", "depths", "trials", "seed", "ppl_windows", "prefill_chunk", "heatmap_out",
             "min_retrieval", "max_group_ppl_delta", "max_logprob_drop", "baseline_trials")


def _names(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise click.BadParameter(f"unknown task {unknown[0]!r}; allowed: {', '.join(TASKS)} (comma-separated)")
    return names


def _ints(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...]:
    return tuple(int_list(value)) if value else ()


def _png_target(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.lower().endswith(".png"):
        raise OutputPathError(f"--heatmap {value}: the heat map is a PNG; give a .png path")
    return outside_exports(ctx, param, value)


def long_context_options(command):
    """The ``--long-context`` flag and the options of that mode, added to ``kvq validate``."""
    options = [
        click.option("--long-context", "long_context", is_flag=True,
                     help="Validate at long range: perplexity by distance and the retrieval grid (options below)."),
        click.option("--tasks", default=",".join(TASKS), show_default=True, callback=_names,
                     help=f"--long-context: retrieval tasks, comma-separated, of: {', '.join(TASKS)} (empty: "
                          "perplexity by distance only)."),
        click.option("--lengths", default=None, callback=_ints,
                     help="--long-context: tokens per trial, comma-separated [default: 1024,2048,4096 and the "
                          "export's positions]."),
        click.option("--depths", type=click.IntRange(1), default=5, show_default=True,
                     help="--long-context: key-needle depths per length, evenly spaced from 0 to 1."),
        click.option("--trials", type=click.IntRange(1), default=1, show_default=True,
                     help="--long-context: trials per length and depth (each its own keys and values)."),
        click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
                     help="--long-context: seed of every generated case (the same seed, the same prompts)."),
        click.option("--ppl-windows", default=None, callback=_ints,
                     help="--long-context: corpus windows scored by distance, comma-separated lengths [default: "
                          "2048,4096 and the export's positions]."),
        click.option("--prefill-chunk", type=click.IntRange(1), default=512, show_default=True,
                     help="--long-context: context tokens per prefill step (the question is a step of its own)."),
        click.option("--heatmap", "heatmap_out", type=click.Path(dir_okay=False), default=None,
                     callback=_png_target, metavar="FILE.png",
                     help="--long-context: write the length x depth heat map (baseline, export, difference) here."),
        click.option("--baseline-trials", type=click.Path(exists=True, dir_okay=False), default=None,
                     metavar="RESULT.json",
                     help="--long-context: take the baseline's retrieval trials from an earlier --json run against "
                          "the same --baseline with the same grid instead of running them again (several exports, "
                          "one baseline)."),
        click.option("--min-retrieval", type=FRACTION, default=None,
                     help="--long-context: exit 1 when the export answers fewer than this fraction of the trials in "
                          "cells the baseline passes (0..1)."),
        click.option("--max-group-ppl-delta", multiple=True,
                     help="--long-context: exit 1 when a distance group's perplexity exceeds the baseline's by more "
                          "than VALUE: START-END=VALUE for one group, VALUE for every group; repeatable."),
        click.option("--max-logprob-drop", type=NON_NEGATIVE, default=None,
                     help="--long-context: exit 1 when the gold answers' mean teacher-forced log-probability falls "
                          "below the baseline's by more than this many nats (over every trial; steadier than exact "
                          "matches, which flip on near ties)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def check_mode(long_context: bool) -> None:
    """Refuse, in one line, an option given on the command line that the chosen mode does not read."""
    ctx = click.get_current_context()
    wrong = LONG_ONLY if not long_context else SHORT_ONLY
    given = [p for p in ctx.command.params if p.name in wrong
             and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        mode = "--long-context" if not long_context else "validation without --long-context"
        raise click.UsageError(f"{given[0].opts[0]} applies only to {mode}")


def run_long_context(export_dir, baseline, *, corpus, offset, chunk, json_out, report_out, providers, quiet,
                     no_verify, tasks, lengths, depths, trials, seed, ppl_windows, prefill_chunk, heatmap_out,
                     baseline_trials, min_retrieval, max_group_ppl_delta, max_logprob_drop) -> None:
    """The long-context mode of ``kvq validate``: run, write what was asked for, print the tables, then gate."""
    from rich.table import Table

    from kvq_export.validate.long_context import report
    from kvq_export.validate.long_context.config import LongContextConfig
    from kvq_export.validate.long_context.gates import LongContextGates, parse_group_limit
    from kvq_export.validate.long_context.result import LongContextResult
    from kvq_export.validate.long_context.runner import validate_long_context

    distinct_outputs({"--json": json_out, "--report": report_out, "--heatmap": heatmap_out}, {"--corpus": corpus})
    if heatmap_out and not tasks:
        raise KVQError("--heatmap needs a retrieval task to map; allowed: --tasks with at least one of "
                       f"{', '.join(TASKS)}")
    gates = LongContextGates(min_retrieval, tuple(parse_group_limit(v) for v in max_group_ppl_delta),
                             max_logprob_drop)
    config = LongContextConfig(tasks=tasks, lengths=lengths, depths=depths, trials=trials, seed=seed,
                               chunk=prefill_chunk, corpus=corpus, offset=offset, ppl_windows=ppl_windows,
                               ppl_chunk=chunk or 64)
    earlier = LongContextResult.load(baseline_trials) if baseline_trials else None
    with tqdm_bars(not quiet):
        result = validate_long_context(export_dir, baseline, config, verify_weights=not no_verify,
                                       providers=providers, baseline_from=earlier)
    if json_out:
        write_json_output(json_out, result.to_json())
    if report_out:
        report.write_html(result, report_out)
    if heatmap_out:
        report.heatmap(result, heatmap_out)
    console = make_console(json_out=json_out)
    table = Table(title=f"kvq validate --long-context {export_dir} ({result.seconds} s)", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in report.summary_rows(result):
        table.add_row(label, value)
    console.print(table)
    if result.retrieval.trials:
        tasks_table = Table(title="retrieval by task and length (exact match)")
        for header in report.TASK_HEADERS:
            tasks_table.add_column(header, justify="left" if header == "task" else "right")
        for row in report.task_rows(result):
            tasks_table.add_row(*row)
        console.print(tasks_table)
    gates.check(result)  # a missed threshold: one line and exit 1, after every number was shown and written
