"""Suite-wide setup: under pytest-xdist (``make test``), the workers share the cores instead of each taking all.

torch and ONNX Runtime each start one thread per core in every process; two workers on two cores would run
four busy threads and spend the difference switching. ``-n auto`` starts one worker per usable core (at most
4: each holds a model and its exports in memory), and each worker gets ``cores // workers`` threads through
``OMP_NUM_THREADS``, which torch, the BLAS libraries and kvq's sessions honour, and which the CLI subprocesses
the tests start inherit. A value the caller set is kept.

Modules run slowest first, by their measured durations: every run records each test's seconds (setup, call and
teardown) in pytest's cache (``.pytest_cache``, key :data:`DURATIONS_KEY`, merged with earlier runs), and the next
run orders the modules by them. A fresh clone has no cache: :data:`SLOWEST_FIRST` orders it until one run has
measured the suite (``make test`` measures as it runs; ``pytest --cache-clear`` starts over).

Randomised tests draw from one seed (:mod:`seeds`: 0 unless ``KVQ_TEST_SEED`` is set): Python's, NumPy's and
torch's global generators are seeded with it before each test, and Hypothesis replays the same examples every
run (``derandomize``), or the seed's under ``KVQ_TEST_SEED``.
"""

from __future__ import annotations

import os
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from seeds import ENV, base_seed

MAX_WORKERS = 4

#: Where each test's measured seconds are kept, in pytest's cache (``config.cache``).
DURATIONS_KEY = "kvq/test-seconds"
#: The measured order is used once the measurements cover this share of the collected tests.
MEASURED_ENOUGH = 0.9
#: The slowest modules, slowest first: the order before any run has measured the suite. ``make test`` hands whole
#: modules to its workers in collection order (``--dist loadfile --no-loadscope-reorder``); started first, the long
#: ones run beside the many short ones instead of one of them running alone at the end while the other worker idles.
SLOWEST_FIRST = (
    "test_export_runtime.py",
    "test_triton_kernels.py",
    "test_smollm2_integration.py",
    "test_serve_batch.py",
    "test_gqa_flavor.py",
    "test_triton_compile.py",
    "test_validate.py",
    "test_kv_graph.py",
    "test_genai.py",
    "test_bench.py",
    "test_serve_bench.py",
)


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


def pytest_collection_modifyitems(config, items) -> None:
    """Whole modules, slowest first: by their measured seconds, or :data:`SLOWEST_FIRST` before they are measured.

    The sort is stable: tests keep their order within a module, unranked modules theirs after the ranked ones.
    """
    seconds = module_seconds(config, items)
    if seconds is not None:
        items.sort(key=lambda item: -seconds[item.path.name])
        return
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def module_seconds(config, items) -> dict[str, float] | None:
    """Each collected module's measured seconds (the sum of its tests'), or None while too few are measured."""
    cache = getattr(config, "cache", None)
    measured = cache.get(DURATIONS_KEY, {}) if cache is not None else {}
    totals: dict[str, float] = defaultdict(float)
    known = 0
    for item in items:
        if item.nodeid in measured:
            known += 1
            totals[item.path.name] += measured[item.nodeid]
    return totals if items and known >= MEASURED_ENOUGH * len(items) else None


_SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    """Add up each test's setup, call and teardown (under xdist the controller sees every worker's reports)."""
    _SECONDS[report.nodeid] += report.duration


def pytest_sessionfinish(session) -> None:
    """Merge this run's seconds into the cache (once, from the controller; entries of deleted files dropped)."""
    config = session.config
    cache = getattr(config, "cache", None)
    if cache is None or hasattr(config, "workerinput") or not _SECONDS:
        return
    root = Path(str(config.rootpath))
    stored = {nodeid: s for nodeid, s in cache.get(DURATIONS_KEY, {}).items()
              if (root / nodeid.split("::")[0]).is_file()}
    cache.set(DURATIONS_KEY, {**stored, **{nodeid: round(s, 3) for nodeid, s in _SECONDS.items()}})


@pytest.hookimpl(tryfirst=True)  # before Hypothesis's own plugin reads --hypothesis-seed
def pytest_configure(config) -> None:
    from hypothesis import settings

    if ENV in os.environ:
        if config.getoption("hypothesis_seed", None) is None:
            config.option.hypothesis_seed = base_seed()
    else:
        settings.register_profile("kvq-fixed-seed", derandomize=True)
        settings.load_profile("kvq-fixed-seed")


@pytest.fixture(autouse=True)
def _seeded_generators() -> None:
    """Every test starts from the suite's seed, whatever ran before it on this worker."""
    seed = base_seed()
    random.seed(seed)
    np.random.seed(seed)
    if "torch" in sys.modules:  # imported by the test's module: seed it without importing it for everyone
        sys.modules["torch"].manual_seed(seed)
