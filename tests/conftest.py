"""Suite-wide setup: under pytest-xdist (``make test``), the workers share the cores instead of each taking all.

torch and ONNX Runtime each start one thread per core in every process; two workers on two cores would run
four busy threads and spend the difference switching. ``-n auto`` starts one worker per usable core (at most
4: each holds a model and its exports in memory), and each worker gets ``cores // workers`` threads through
``OMP_NUM_THREADS``, which torch, the BLAS libraries and kvq's sessions honour, and which the CLI subprocesses
the tests start inherit. A value the caller set is kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MAX_WORKERS = 4


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (containers, CI)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here: the affinity is the limit
    return cores


def pytest_xdist_auto_num_workers(config) -> int:
    return min(MAX_WORKERS, usable_cores())


def _share_cores() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, usable_cores() // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # already imported by a plugin: its pool size was read at import
        sys.modules["torch"].set_num_threads(threads)


_share_cores()
