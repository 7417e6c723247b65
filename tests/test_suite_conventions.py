"""The suite's own rules: test modules share code only through harness modules, and randomness has one seed."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import numpy as np
import pytest
from seeds import ENV, base_seed

TESTS = Path(__file__).parent


def test_test_modules_import_only_harness_modules_not_each_other():
    test_modules = {p.stem for p in TESTS.glob("test_*.py")}
    offenders = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name} imports {n}" for n in names if n.split(".")[0] in test_modules
                          or n.startswith("tests.test_")]
    assert not offenders, offenders


def test_every_test_starts_from_the_suite_seed():
    seed = base_seed()
    assert random.random() == random.Random(seed).random()
    assert np.random.random() == np.random.RandomState(seed).random()


def test_the_seed_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "1234")
    assert base_seed() == 1234
    monkeypatch.delenv(ENV)
    assert base_seed() == 0
    for bad in ("x", "-1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            base_seed()
