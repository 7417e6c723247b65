"""Which backend serves an export: :func:`open_backend` (``kvq serve --backend``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvq_export.errors import KVQError
from kvq_export.manifest import Manifest
from kvq_export.serve.backends import Backend, ServeLimits, SessionBackend
from kvq_export.serve.metrics import ServeMetrics
from kvq_export.serve.scheduler import BatchBackend
from kvq_export.vocab import LayoutName

#: ``--backend`` values: ``batch`` (continuous batching, buffer-layout exports), ``session`` (one at a time)
BACKENDS = ("auto", "batch", "session")


def open_backend(directory: str | Path, *, kind: str = "auto", verify_weights: bool = True,
                 threads: int | None = None, providers: Sequence[str] | None = None,
                 limits: ServeLimits | None = None, metrics: ServeMetrics | None = None,
                 **batch_options: Any) -> Backend:
    """The backend for an export: ``batch`` for a buffer-layout export (``auto``), else ``session``.

    ``batch_options`` (``max_seqs``, ``cache_budget``, ``prefill_chunk``, ``allow_batch_variance``,
    ``prefix_cache``) go to :class:`~kvq_export.serve.scheduler.BatchBackend`.
    """
    if kind not in BACKENDS:
        raise KVQError(f"unknown backend {kind!r}; allowed: {', '.join(BACKENDS)}")
    directory = Path(directory)
    layout = Manifest.load(directory).cache_layout.name
    batchable = layout == LayoutName.BUFFER
    if kind == "batch" and not batchable:
        raise KVQError(f"continuous batching needs an export whose cache rows are independent (--flavor ort-gqa, "
                       f"the buffer layout); {directory} has the {layout} layout: serve it with --backend session")
    common = dict(verify_weights=verify_weights, threads=threads, providers=providers, limits=limits, metrics=metrics)
    if kind in ("batch", "auto") and batchable:
        return BatchBackend(directory, **common, **batch_options)
    reason = ("chosen with --backend session" if kind == "session" else
              f"its {layout} cache layout keeps every row's regions aligned to the longest: one request at a time")
    return SessionBackend(directory, reason=reason, **common)
