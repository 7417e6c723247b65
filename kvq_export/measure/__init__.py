"""kvq's measuring code: serving load on OpenAI-compatible endpoints, and the one in-process timing harness.

Three lines of Python load a running server::

    from kvq_export.measure import Endpoint, LoadConfig, measure_endpoint
    result = measure_endpoint(Endpoint("http://127.0.0.1:8000", "smollm2"), prompts, LoadConfig(clients=(1, 4)))
    print(result.points[-1].tokens_per_s)

:mod:`~kvq_export.measure.load` is the closed-loop driver (the official ``openai`` client), with
:mod:`~kvq_export.measure.hostile` (bad requests beside it) and :mod:`~kvq_export.measure.watch` (RSS, a metrics
gauge); :mod:`~kvq_export.measure.prompts` cuts prompts from the offline corpus;
:mod:`~kvq_export.measure.workloads` builds the closed-loop workloads (shared prefix, multi-turn chat, mixed
lengths), which :mod:`~kvq_export.measure.prefix_load` runs, :mod:`~kvq_export.measure.reuse` scores (hit rate
against what the workload allowed) and :mod:`~kvq_export.measure.cache_use` weighs (cache occupancy against the
memory model); :mod:`~kvq_export.measure.peers`
starts and stops servers (``kvq serve``, :mod:`~kvq_export.measure.og_server`, llama-server) and
:mod:`~kvq_export.measure.side_by_side` runs them one after another; :mod:`~kvq_export.measure.builder` makes
onnxruntime-genai's builder export; :mod:`~kvq_export.measure.report` writes the table, the plot and JSON.
``tools/serve_bench.py`` is the command line. ``openai`` and ``httpx`` are imported only when a load runs.

In-process timing has one harness, after Polygraphy's runners and comparator: :mod:`~kvq_export.measure.runners`
(``prefill`` / ``step`` / ``cache_bytes`` for kvq sessions, the builder's graphs in ONNX Runtime and
onnxruntime-genai; :mod:`~kvq_export.peer_compare.llama` for llama.cpp), :mod:`~kvq_export.measure.timing` (the one
interleaved loop, a fresh seeded random order every round), :mod:`~kvq_export.measure.synthetic` (the one
synthetic cache) and :mod:`~kvq_export.measure.scoring` (strict-decode perplexity). ``kvq bench``, ``kvq
bench-serve``, ``tools/long_context.py`` and the peer comparison (:mod:`~kvq_export.peer_compare.compare`,
command line ``tools/peer_compare.py``) time through them.
"""

from __future__ import annotations

from kvq_export.measure.load import Endpoint, LoadConfig, LoadResult, PointResult, measure_endpoint, run_load

__all__ = ["Endpoint", "LoadConfig", "LoadResult", "PointResult", "measure_endpoint", "run_load"]
