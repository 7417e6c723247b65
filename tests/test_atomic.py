"""Every file kvq writes goes through one atomic writer: all or nothing, and readable like a plain open()."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvq_export._atomic import atomic_write, atomic_writer


def test_finished_file_has_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "sub" / "a.json", "{}")
    finally:
        os.umask(old)
    assert path.read_text() == "{}" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "cal.npz"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_writer(target, "wb") as handle:
        np.save(handle, np.arange(3))
        raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["cal.npz"]


def test_manifest_and_calibration_are_world_readable(tmp_path):
    from kvq_export.calibration import Calibration

    old = os.umask(0o022)
    try:
        path = Calibration.of({0: {"key": {"scales": np.ones((2, 4), np.float32)}}}).save(tmp_path / "c.npz")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"), atomic_writer(tmp_path / "x", "a"):
        pass
