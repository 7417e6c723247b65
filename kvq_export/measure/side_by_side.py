"""Several servers on the same prompts (or workload) and load, one after another: never two loaded at once."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvq_export.errors import KVQError
from kvq_export.measure.load import LoadConfig, LoadResult, measure_endpoint
from kvq_export.measure.peers import ServerProcess, ServerSpec
from kvq_export.measure.prefix_load import measure_workload
from kvq_export.measure.workloads import Workload

logger = logging.getLogger(__name__)


def bench_servers(specs: Sequence[ServerSpec], prompts: list[str] | Workload, config: LoadConfig,
                  log_dir: str | os.PathLike[str],
                  on_result: Callable[[list[LoadResult]], None] | None = None) -> list[LoadResult]:
    """Start each server in turn, load it (:func:`~kvq_export.measure.load.measure_endpoint`), stop it.

    With a :class:`~kvq_export.measure.workloads.Workload` instead of prompts, the load is
    :func:`~kvq_export.measure.prefix_load.measure_workload`.

    Each server's output goes to ``log_dir/NAME.log``; its context bounds the hostile client's long prompt.
    ``on_result`` sees the results so far after each server (to write them as they come). A server that fails to
    start is reported as a result with no points and the reason, and the next one runs.
    """
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise KVQError(f"server names must differ; given: {', '.join(names)}")
    results = []
    for spec in specs:
        server = ServerProcess(spec, Path(log_dir) / f"{spec.name}.log")
        try:
            server.start()
        except KVQError as err:
            logger.error("%s", err)
            results.append(LoadResult(name=spec.name, model=spec.model, incomplete=str(err)))
        else:
            try:
                own = dataclasses.replace(config, context_tokens=spec.context_tokens)
                if isinstance(prompts, Workload):
                    results.append(measure_workload(server.endpoint(), prompts, own, name=spec.name))
                else:
                    results.append(measure_endpoint(server.endpoint(), prompts, own, name=spec.name))
            finally:
                server.stop()
        if on_result is not None:
            on_result(results)
    return results
