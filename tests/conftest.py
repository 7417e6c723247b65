"""Suite-wide setup: under pytest-xdist (``make test``), the workers share the cores instead of each taking all.

torch and ONNX Runtime each start one thread per core in every process; two workers on two cores would run
four busy threads and spend the difference switching. Each worker gets ``cores // workers`` threads through
``OMP_NUM_THREADS``, which torch, the BLAS libraries and kvq's sessions honour, and which the CLI subprocesses
the tests start inherit. A value the caller set is kept.
"""

from __future__ import annotations

import os
import sys


def _share_cores() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # already imported by a plugin: its pool size was read at import
        sys.modules["torch"].set_num_threads(threads)


_share_cores()
