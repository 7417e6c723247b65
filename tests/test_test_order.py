"""The suite runs its modules slowest first, by the seconds earlier runs measured (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest


def _item(module: str, test: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=f"tests/{module}::{test}", path=Path("tests") / module)


def _config(seconds: dict[str, float]) -> SimpleNamespace:
    """A pytest config whose cache holds ``seconds`` per test."""
    return SimpleNamespace(cache=SimpleNamespace(get=lambda key, default: seconds))


ITEMS = [_item("test_a.py", "t1"), _item("test_a.py", "t2"), _item("test_b.py", "t1"), _item("test_bench.py", "t")]


def test_modules_run_slowest_first_by_their_measured_seconds():
    measured = {"tests/test_a.py::t1": 1.0, "tests/test_a.py::t2": 1.5, "tests/test_b.py::t1": 9.0,
                "tests/test_bench.py::t": 0.5}
    ordered = list(ITEMS)
    conftest.pytest_collection_modifyitems(_config(measured), ordered)
    assert [i.nodeid for i in ordered] == ["tests/test_b.py::t1", "tests/test_a.py::t1", "tests/test_a.py::t2",
                                          "tests/test_bench.py::t"]  # a module's tests keep their order


def test_before_the_suite_is_measured_the_hand_kept_list_orders_it():
    ordered = list(ITEMS)  # a fresh clone, or one module run alone: too little measured
    conftest.pytest_collection_modifyitems(_config({"tests/test_b.py::t1": 9.0}), ordered)
    assert [i.nodeid for i in ordered] == ["tests/test_bench.py::t", *(i.nodeid for i in ITEMS[:3])]
