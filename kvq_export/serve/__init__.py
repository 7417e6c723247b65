"""``kvq serve``: an export behind an OpenAI-compatible HTTP endpoint.

Three lines of Python do what the command does::

    from kvq_export.serve import serve
    serve("exports/smollm2-ort-int8", host="127.0.0.1", port=8000)

:mod:`~kvq_export.serve.protocol` checks requests and shapes replies, :mod:`~kvq_export.serve.backends` runs them
(onnxruntime-genai's continuous-batching engine for ort-gqa exports, one ``KVQSession`` request at a time for
the other flavors), :mod:`~kvq_export.serve.text` turns tokens into streamed text and :mod:`~kvq_export.serve.app`
is the FastAPI app and its uvicorn runner. Nothing else in kvq imports this package (fastapi loads with it).
"""

from __future__ import annotations

from kvq_export.serve.app import create_app, serve
from kvq_export.serve.backends import Backend, EngineBackend, Job, SessionBackend, open_backend

__all__ = ["Backend", "EngineBackend", "Job", "SessionBackend", "create_app", "open_backend", "serve"]
