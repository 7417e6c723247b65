"""The ``kvq`` click group and what its commands share: error handling, console, option decorators, parsers."""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

import click

from kvq_export._atomic import atomic_write
from kvq_export._read import read_text
from kvq_export.cli_types import FiniteFloat, outside_exports
from kvq_export.errors import KVQError, OutputPathError, SchemeError
from kvq_export.manifest import check_output_path
from kvq_export.presets import scheme_from_formats, tensor_format_names
from kvq_export.request import CalibrationMethod, CalibrationSpec, WeightFormat, WeightSpec
from kvq_export.runtime.device import DEVICES, providers_for
from kvq_export.weight_blocks import BLOCK_SIZES, BLOCKED_FORMATS


class KVQGroup(click.Group):
    """Click group that turns KVQError into ``error: <message>`` and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KVQError as err:
            click.echo(f"error: {err.for_cli()}", err=True)
            ctx.exit(1)


def make_console(*, json_out: str | None = None):
    """The console tables go to: stdout, or stderr when ``--json -`` keeps stdout for the JSON alone."""
    from rich.console import Console

    stderr = json_out == STDOUT
    # Wide enough for the breakdown columns when output is piped (rich assumes 80 columns then).
    console = Console(highlight=False, stderr=stderr)
    return console if console.is_terminal else Console(highlight=False, width=140, stderr=stderr)


# -- the options every command spells the same way ----------------------------------------------------------
#: ``--json -``: the JSON goes to stdout (and nothing else does).
STDOUT = "-"


def _json_target(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return value if value == STDOUT else outside_exports(ctx, param, value)


def json_option(what: str):
    """``--json FILE``: write ``what`` as JSON to FILE (atomically; never inside an export), ``-`` to stdout.

    A bare ``--json`` means ``-``. The command receives ``json_out`` and writes with :func:`write_json_output`.
    """
    return click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                        is_flag=False, flag_value=STDOUT, callback=_json_target, metavar="FILE",
                        help=f"Write {what} as JSON to FILE ('-' or a bare --json: stdout, and only the JSON).")


def write_json_output(target: str, payload: Any) -> None:
    """``payload`` (a JSON-able object, or JSON text) to stdout for ``-``, else atomically to the file ``target``."""
    text = payload if isinstance(payload, str) else json.dumps(payload, indent=2)
    if target == STDOUT:
        click.echo(text)
        return

    atomic_write(check_output_path(target, "--json"), text.rstrip("\n") + "\n")


def distinct_outputs(outputs: dict[str, str | None], inputs: dict[str, str | None] | None = None) -> None:
    """Refuse two outputs of one command naming one file, or an output naming a file the command reads.

    The second write would replace the first (``kvq plan --out p.json --json p.json`` kept the report, not the
    scheme), and an output over an input destroys it (``--json`` over the ``--corpus`` file). Keys are the option
    names; None and ``-`` (stdout) are skipped. Raises :class:`OutputPathError` before any work.
    """
    seen: dict[str, str] = {}
    for option, path in (inputs or {}).items():
        if path is not None and path != STDOUT and os.path.isfile(path):
            seen.setdefault(os.path.realpath(path), option)
    read = set(seen.values())
    for option, path in outputs.items():
        if path is None or path == STDOUT:
            continue
        key = os.path.realpath(path)
        if key in seen:
            other = seen[key]
            why = "which it reads: writing would destroy it" if other in read else "the second would replace the first"
            raise OutputPathError(f"{option} {path} names the same file as {other} ({why}); give each its own path")
        seen[key] = option


def _html_target(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.lower().endswith((".html", ".htm")):
        raise OutputPathError(f"--report {value}: the report is HTML; give a .html path (numbers as JSON: --json)")
    return outside_exports(ctx, param, value)


def report_option(what: str):
    """``--report FILE.html``: a self-contained HTML report (any other suffix is a one-line error)."""
    return click.option("--report", "report_out", type=click.Path(dir_okay=False), default=None,
                        callback=_html_target, metavar="FILE.html", help=f"Write {what} as one self-contained "
                        "HTML file here (a .html path).")


def out_option(help: str, *, required: bool = False, param: str = "out"):
    """``--out FILE``: the file the command writes (never inside an export directory)."""
    return click.option("--out", param, required=required, callback=outside_exports, type=click.Path(dir_okay=False),
                        help=help)


def deprecated_alias(old: str, new: str, param: str, **kwargs):
    """A hidden ``old`` spelling of option ``new`` (the command's parameter ``param``): it still works, and warns."""
    def apply(func):
        @functools.wraps(func)
        def command(*args, **params):
            value = params.pop(f"deprecated_{param}")
            if value is not None:
                if params[param] not in (None, value):
                    raise KVQError(f"give {new} only, not both {new} and {old}")
                click.echo(f"warning: {old} is deprecated; use {new}", err=True)
                params[param] = value
            return func(*args, **params)

        return click.option(old, f"deprecated_{param}", hidden=True, default=None, callback=outside_exports,
                            help=f"Deprecated spelling of {new}.", **kwargs)(command)

    return apply


def device_option():
    """``--device auto|cpu|cuda``, given to the command as ``providers`` (ONNX Runtime execution providers)."""
    def to_providers(ctx: click.Context, param: click.Parameter, value: str) -> list[str] | None:
        return providers_for(value)

    return click.option("--device", "providers", type=click.Choice(DEVICES), default="auto", show_default=True,
                        callback=to_providers, help="Where ONNX Runtime runs the graphs: cpu, cuda "
                        "(CUDAExecutionProvider: onnxruntime-gpu), or auto (cuda when ONNX Runtime has it, else cpu).")


def scheme_options(*, default: str | None = None, required: bool = True):
    """``--scheme PRESET|FILE`` or ``--key FORMAT --value FORMAT`` (llama.cpp's ``-ctk`` / ``-ctv``).

    The command receives one ``scheme_spec``: the preset name / file, or the scheme built from the two formats
    (None when neither is given and the scheme is not ``required``: ``kvq export --budget`` plans one).
    """
    formats = ", ".join(tensor_format_names())

    def apply(func):
        @functools.wraps(func)
        def command(*args, scheme_spec, key_format, value_format, **kwargs):
            if scheme_spec is not None and (key_format or value_format):
                raise SchemeError("give either --scheme or --key/--value, not both")
            if (key_format is None) != (value_format is None):
                raise SchemeError("give both --key and --value (a format each; allowed: " + formats + ")")
            if key_format is not None:
                scheme_spec = scheme_from_formats(key_format, value_format)
            elif scheme_spec is None:
                if default is None and required:
                    raise SchemeError("give a cache scheme: --scheme PRESET|FILE, or --key FORMAT --value FORMAT")
                scheme_spec = default
            return func(*args, scheme_spec=scheme_spec, **kwargs)

        about = f" [default: {default}]" if default else ""
        for option in reversed([
            click.option("--scheme", "scheme_spec", default=None, metavar="PRESET|FILE",
                         help=f"Preset name (kvq schemes) or scheme .json file{about}; or give --key and --value."),
            click.option("--key", "key_format", default=None, metavar="FORMAT",
                         help=f"Keys' format, with --value instead of --scheme: {formats}."),
            click.option("--value", "value_format", default=None, metavar="FORMAT",
                         help="Values' format, with --key instead of --scheme (the same formats)."),
        ]):
            command = option(command)
        return command

    return apply


def calibration_options(*, optional: bool = False, short_names: bool = False):
    """The calibration options every calibrating command shares, given to it as one ``calibration`` argument.

    ``--calib-corpus``, ``--calib-tokens``, ``--calib-offset``, ``--calib-method`` and ``--percentile`` take the
    defaults of :class:`~kvq_export.request.CalibrationSpec`. ``optional``: no calibration unless a calibration
    option is given (``calibration`` is then None: ``kvq export`` calibrates only when asked; any of them asks, on
    the default corpus unless ``--calib-corpus`` names another). ``short_names``: also accept ``--corpus``,
    ``--tokens`` and ``--offset`` (``kvq plan``'s spellings).
    """
    default = CalibrationSpec()

    def names(name: str) -> tuple[str, ...]:
        return (f"--calib-{name}", f"--{name}") if short_names else (f"--calib-{name}",)

    options = [
        click.option(*names("corpus"), "calib_corpus", default=None if optional else default.corpus,
                     show_default=not optional, help="Calibration text: corpus name (britannica) or text file."),
        click.option(*names("tokens"), "calib_tokens", type=click.IntRange(1), default=default.tokens,
                     show_default=True, help="Calibration tokens, read in windows of at most 1024 (keys at later "
                     "positions are reached by shifting each window's RoPE angles)."),
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
            ctx = click.get_current_context()
            asked = calib_corpus is not None or any(
                ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
                for name in ("calib_tokens", "calib_offset", "calib_method", "percentile"))
            calibration = CalibrationSpec(
                corpus=calib_corpus or default.corpus, tokens=calib_tokens, offset=calib_offset, method=calib_method,
                percentile=percentile) if asked else None
            return func(*args, calibration=calibration, **kwargs)

        for option in reversed(options):
            command = option(command)
        return command

    return apply


def weight_options(*, accuracy_level: bool = False, measured: bool = False):
    """The weight options, given to the command as one ``weights`` argument (a :class:`~kvq_export.request.WeightSpec`).

    ``--weights``, ``--weight-block-size``, ``--weight-asymmetric`` and, with ``accuracy_level``,
    ``--weight-accuracy-level``.

    ``measured``: the command runs the model (calibration, planning) on the weights an export storing them so
    computes with, and says so in the help.
    """
    default = WeightSpec()
    about = ("How the export stores the linear weights and the embedding: int8/int4 blocks (ONNX Runtime's "
             "MatMulNBits and GatherBlockQuantized) or w8a8 are what the model is measured on here, as kvq export "
             "does" if measured else "How the linear weights and the embedding are stored: as computed, fp16, "
             "int8/int4 blocks (ONNX Runtime's MatMulNBits and GatherBlockQuantized), or w8a8 (int8 per output "
             "channel and int8 activations per token, on ONNX Runtime's QGEMM kernels); a tied embedding is stored "
             "once")
    options = [
        click.option("--weights", "weight_format", type=click.Choice([str(f) for f in WeightFormat]),
                     default=str(default.format), show_default=True, help=about + "."),
        click.option("--weight-block-size", type=click.Choice([str(b) for b in BLOCK_SIZES]),
                     default=str(default.block_size), show_default=True, help="int8/int4 weights: input channels per "
                     "scale."),
        click.option("--weight-asymmetric", is_flag=True, help="int8/int4 weights: a zero point per block as well."),
    ]
    if accuracy_level:
        options.append(click.option(
            "--weight-accuracy-level", type=click.IntRange(1, 4), default=default.accuracy_level, show_default=True,
            help="int8/int4 weights: MatMulNBits' activation type (1 fp32 .. 4 int8). 4 is the fast CPU kernel and "
            "computes each row of a batch as it would be alone."))

    def apply(func):
        @functools.wraps(func)
        def command(*args, weight_format, weight_block_size, weight_asymmetric, **kwargs):
            level = kwargs.pop("weight_accuracy_level") if accuracy_level else default.accuracy_level
            ctx = click.get_current_context()  # an option that changes nothing is refused: no one thinks it applied
            given = [f"--{name.replace('_', '-')}" for name in ("weight_block_size", "weight_asymmetric",
                                                                "weight_accuracy_level")
                     if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
            if given and weight_format not in BLOCKED_FORMATS:
                raise KVQError(f"{', '.join(given)} apply to int8/int4 weights only; with --weights {weight_format} "
                               "drop them (allowed: --weights int8 or int4)")
            weights = WeightSpec(format=weight_format, block_size=int(weight_block_size),
                                 symmetric=not weight_asymmetric, accuracy_level=level)
            return func(*args, weights=weights, **kwargs)

        for option in reversed(options):
            command = option(command)
        return command

    return apply


@click.group(cls=KVQGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="kvq")
def cli(verbose: int) -> None:
    """kvq: deploy LLMs with a quantized KV cache through ONNX and TensorRT."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def utf8_text(path: str, what: str) -> str:
    """A text file's content, capped (``/dev/zero`` is refused); bytes that are not UTF-8 are a one-line error."""
    return read_text(path, what)


def utf8_arg(text: str, option: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise KVQError(f"{option} {text[:40]!r} is not UTF-8 text") from None
    return text


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="kvq", standalone_mode=True)
