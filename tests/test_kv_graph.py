"""The in-graph quantized cache against the reference cache, bit for bit, with left-padded batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kvgraph_harness import SMALL, run_schedule
from schedules import crossing_steps

from kvq_export.presets import PRESETS


@pytest.mark.parametrize("name", sorted(SMALL))
def test_single_row_token_by_token(name):
    run_schedule(SMALL[name], [[5]] + [[1]] * 24)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_left_padded_batch_and_ragged_chunks(name):
    rng = np.random.default_rng(1)
    schedule = [[3, 7, 1]] + [list(rng.integers(0, 4, size=3)) for _ in range(12)] + [[1, 1, 1]] * 16
    run_schedule(SMALL[name], schedule)


def test_sliding_window_mask():
    run_schedule(SMALL["int4-token+int2-channel"], [[9, 4]] + [[1, 1]] * 10, window=5)


def _stored_basis(scheme):
    """The scheme as the cache graph sees it.

    Rotation is applied by the decoder body around the cache graph (its q/k/v arrive already rotated), so a
    rotated preset's cache graph is its unrotated twin's; tests/test_rotation.py covers the rotated body.
    """
    def plain(tq):
        return dataclasses.replace(tq, rotation="none")
    return dataclasses.replace(scheme, key=plain(scheme.key), value=plain(scheme.value))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_cross_every_flush_boundary(preset):
    scheme = _stored_basis(PRESETS[preset][0])
    run_schedule(scheme, [[5, 9]] + [[1, 1]] * crossing_steps(scheme), dim=64)


def test_residual_flush_in_one_big_prefill():
    scheme = dataclasses.replace(SMALL["channel-keys-kivi-like"], sink_tokens=2)
    run_schedule(scheme, [[30, 17], [0, 13], [2, 2]])
