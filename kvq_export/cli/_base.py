"""The ``kvq`` click group and what its commands share: error handling, console, option decorators, parsers."""

from __future__ import annotations

import functools
import logging

import click

from kvq_export.cli_types import FiniteFloat
from kvq_export.errors import KVQError
from kvq_export.request import CalibrationMethod, CalibrationSpec


class KVQGroup(click.Group):
    """Click group that turns KVQError into ``error: <message>`` and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KVQError as err:
            click.echo(f"error: {err.for_cli()}", err=True)
            ctx.exit(1)


def make_console():
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


@click.group(cls=KVQGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="kvq")
def cli(verbose: int) -> None:
    """kvq: deploy LLMs with a quantized KV cache through ONNX and TensorRT."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def utf8_text(path: str, what: str) -> str:
    """A text file's content, capped (``/dev/zero`` is refused); bytes that are not UTF-8 are a one-line error."""
    from kvq_export._read import read_text

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
