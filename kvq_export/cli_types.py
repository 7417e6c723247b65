"""Click parameter types shared by every ``kvq`` command.

``float("nan")`` and ``float("inf")`` parse as floats, and every comparison with NaN is false, so a plain
``type=float`` (or ``click.FloatRange``) lets ``--logits-atol nan`` pass any two models. :class:`FiniteFloat`
accepts finite numbers inside declared bounds only, and says which in one line.
"""

from __future__ import annotations

import math

import click

from kvq_export._atomic import refuse_special_target
from kvq_export.manifest import check_output_path


class FiniteFloat(click.ParamType):
    """A finite float within ``[min, max]`` (either end open with ``min_open`` / ``max_open``; None: unbounded)."""

    name = "float"

    def __init__(self, min: float | None = 0.0, max: float | None = None, *, min_open: bool = False,
                 max_open: bool = False) -> None:
        self.min, self.max, self.min_open, self.max_open = min, max, min_open, max_open

    def allowed(self) -> str:
        """The accepted values in words, e.g. ``a finite number >= 0``."""
        low = None if self.min is None else f"{'>' if self.min_open else '>='} {self.min:g}"
        high = None if self.max is None else f"{'<' if self.max_open else '<='} {self.max:g}"
        return "a finite number" + (f" {' and '.join(b for b in (low, high) if b)}" if low or high else "")

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, float) and math.isfinite(value) and self._inside(value):
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number; allowed: {self.allowed()}", param, ctx)
        if not math.isfinite(number) or not self._inside(number):
            self.fail(f"{value!r} is not allowed; allowed: {self.allowed()}", param, ctx)
        return number

    def _inside(self, number: float) -> bool:
        if self.min is not None and (number < self.min or self.min_open and number == self.min):
            return False
        return self.max is None or not (number > self.max or self.max_open and number == self.max)

    def __repr__(self) -> str:
        return f"FiniteFloat({self.allowed()})"


class ByteSize(click.ParamType):
    """A size in bytes: an integer, or a number with a unit (``2GiB``, ``512MiB``, ``1.5GB``, ``64KiB``)."""

    name = "size"
    UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        text = str(value).strip()
        digits = text.rstrip("KMGTBIkmgtbi ")
        unit = text[len(digits):].strip().upper()
        try:
            number = float(digits)
        except ValueError:
            number = math.nan
        if unit not in self.UNITS or not math.isfinite(number) or int(number * self.UNITS[unit]) < 1:
            self.fail(f"{value!r} is not a size; allowed: a positive number of bytes, optionally with a unit "
                      "(KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 2GiB", param, ctx)
        return int(number * self.UNITS[unit])


#: ``>= 0``: tolerances, thresholds, temperatures.
NON_NEGATIVE = FiniteFloat(0.0)
#: ``> 0``: budgets, penalties.
POSITIVE = FiniteFloat(0.0, min_open=True)
#: ``[0, 1]``: fractions.
FRACTION = FiniteFloat(0.0, 1.0)


def outside_exports(ctx: click.Context, param: click.Parameter, value):
    """Click callback of every output path option: refuse one inside an export, or a device a file would replace.

    One line, exit 1; a FIFO or socket is refused like a device.
    """
    if value is not None:
        option = param.opts[0] if param.opts else "output"
        check_output_path(value, option)
        refuse_special_target(value, option, directory_ok=True)  # before the work, not after it
    return value
