"""Progress of long library steps, reported to whoever is listening (library code never prints).

A step reports through :func:`task`; nothing is shown unless a caller installed a sink with
:func:`reporting` (the CLI does, with tqdm bars on stderr)::

    with task("calibration: forward passes", total=len(windows)) as advance:
        for window in windows:
            ...
            advance()

A sink is any callable taking a :class:`Step`; tests pass a list's ``append``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One report of a task: ``done`` of ``total`` units (``total`` None: unknown); ``finished`` at its end."""

    desc: str
    done: int
    total: int | None
    finished: bool = False


Sink = Callable[[Step], None]

_SINK: contextvars.ContextVar[Sink | None] = contextvars.ContextVar("kvq_progress_sink", default=None)


@contextlib.contextmanager
def reporting(sink: Sink | None) -> Iterator[None]:
    """Send every :func:`task` report inside the block to ``sink`` (None: report nothing)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


@contextlib.contextmanager
def task(desc: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """A step of ``total`` units; the yielded ``advance(n=1)`` reports ``n`` more done.

    The sink hears the start (0 done), every advance and the end (``finished``, also when the block raises).
    """
    sink = _SINK.get()
    done = 0

    def advance(n: int = 1) -> None:
        nonlocal done
        done += n
        if sink is not None:
            sink(Step(desc, done, total))

    if sink is not None:
        sink(Step(desc, 0, total))
    try:
        yield advance
    finally:
        if sink is not None:
            sink(Step(desc, done, total, finished=True))


@contextlib.contextmanager
def tqdm_bars(enabled: bool = True) -> Iterator[None]:
    """Show every task as a tqdm bar on stderr while the block runs (none when not ``enabled``).

    Bars are also left out when stderr is not a terminal (tqdm's own rule), so logs and pipes stay clean.
    """
    if not enabled:
        with reporting(None):
            yield
        return
    from tqdm.auto import tqdm

    bars: dict[str, tqdm] = {}

    def sink(step: Step) -> None:
        bar = bars.get(step.desc)
        if bar is None:
            if step.finished:
                return
            bar = bars[step.desc] = tqdm(desc=step.desc, total=step.total, disable=None, leave=False,
                                         dynamic_ncols=True)
        bar.update(step.done - bar.n)
        if step.finished:
            bar.close()
            del bars[step.desc]

    try:
        with reporting(sink):
            yield
    finally:
        for bar in bars.values():
            bar.close()
