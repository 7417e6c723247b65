"""The suite's one random seed: 0 by default, ``KVQ_TEST_SEED=N`` to run every randomised test on other data.

conftest seeds Python's, NumPy's and torch's global generators with it before each test and gives it to
Hypothesis; tests that build their own generators take it from :func:`base_seed`, and name it when they fail.
"""

from __future__ import annotations

import os

ENV = "KVQ_TEST_SEED"


def base_seed() -> int:
    """``KVQ_TEST_SEED`` (a non-negative integer), else 0."""
    text = os.environ.get(ENV, "0")
    try:
        seed = int(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r} is not an integer seed") from None
    if seed < 0:
        raise ValueError(f"{ENV}={seed} must be >= 0")
    return seed
