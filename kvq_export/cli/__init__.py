"""The ``kvq`` command line: a thin click layer over library functions.

Every command parses options and calls one library function; heavy imports (torch, transformers,
onnxruntime) happen inside the command body so ``kvq --help`` stays fast and works without them.
A :class:`~kvq_export.errors.KVQError` becomes a one-line message and exit code 1.

One module per family of commands registers them on the shared group:
``describe`` (schemes, memory), ``export`` (export, plan, calibrate, build), ``run`` (generate, serve, demo),
``check`` (validate, compare) and ``bench`` (bench, bench-serve).
"""

from __future__ import annotations

from kvq_export.cli import bench, check, describe, export, run  # noqa: F401  (registers the commands)
from kvq_export.cli._base import cli, main

__all__ = ["cli", "main"]
