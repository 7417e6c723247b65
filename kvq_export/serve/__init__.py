"""``kvq serve``: an export behind an OpenAI-compatible HTTP endpoint.

Three lines of Python do what the command does::

    from kvq_export.serve import serve
    serve("exports/smollm2-ort-int8", host="127.0.0.1", port=8000, cache_budget=2 << 30)

:mod:`~kvq_export.serve.protocol` checks requests and shapes replies; :mod:`~kvq_export.serve.scheduler` batches
requests continuously over the rows of an ort-gqa export's cache (:mod:`~kvq_export.serve.batch_loop` is its loop,
:mod:`~kvq_export.serve.cache_pool` the one owner of rows sized by tokens (:mod:`~kvq_export.serve.segments`) and
of cached prefixes, and :mod:`~kvq_export.serve.selfcheck` checks at start that a row's answer depends neither on
its batch nor on a reused prefix), and :mod:`~kvq_export.serve.backends` runs other flavors one request at a time;
:mod:`~kvq_export.serve.text` turns tokens into streamed text, :mod:`~kvq_export.serve.metrics` holds the Prometheus
metrics and :mod:`~kvq_export.serve.app` is the FastAPI app and its uvicorn runner. Nothing else in kvq imports
this package (fastapi loads with it). Which runtime serves what, and why: docs/design/serving.md.
"""

from __future__ import annotations

from kvq_export.serve.app import create_app, serve
from kvq_export.serve.backends import Backend, Job, ServeLimits, SessionBackend
from kvq_export.serve.factory import open_backend

__all__ = ["Backend", "Job", "ServeLimits", "SessionBackend", "create_app", "open_backend", "serve"]
