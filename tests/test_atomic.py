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


def _special(path, kind: str) -> None:
    """Make ``kind`` at ``path``: a FIFO, a socket, a character device like /dev/null (root only), a directory."""
    import socket

    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "character device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        os.mkdir(path)


SPECIAL_KINDS = ["fifo", "socket", "directory"] + (["character device"] if os.geteuid() == 0 else [])


def test_a_device_fifo_socket_or_directory_is_never_replaced_by_a_written_file(tmp_path_factory):
    """``--json /dev/null`` once renamed a plain file over the device: every such target is refused, untouched."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvq_export.errors import OutputWriteError

    @settings(max_examples=40, deadline=None, database=None)
    @given(kind=st.sampled_from(SPECIAL_KINDS), via_link=st.booleans(), data=st.sampled_from(["{}", b"\0\1"]),
           streaming=st.booleans())
    def check(kind, via_link, data, streaming):
        root = tmp_path_factory.mktemp("special")
        _special(root / "target", kind)
        path = root / "target"
        if via_link:  # a link to it is the same target
            (root / "link").symlink_to(path)
            path = root / "link"
        before = {p.name: os.lstat(p).st_mode for p in root.iterdir()}
        with pytest.raises(OutputWriteError) as err:
            if streaming:
                with atomic_writer(path, "wb" if isinstance(data, bytes) else "w") as handle:
                    handle.write(data)
            else:
                atomic_write(path, data)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
        assert f"is a {'FIFO' if kind == 'fifo' else kind}" in str(err.value)
        assert {p.name: os.lstat(p).st_mode for p in root.iterdir()} == before  # nothing replaced, nothing beside

    check()


def test_a_file_system_refusal_is_one_line_and_still_an_os_error(tmp_path):
    import errno

    from kvq_export.errors import KVQError, OutputWriteError

    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputWriteError) as err:
        atomic_write(tmp_path / "file" / "sub" / "r.json", "{}")  # a parent that is a file
    assert isinstance(err.value, KVQError) and isinstance(err.value, OSError) and err.value.errno == errno.ENOTDIR
    assert str(err.value) == f"cannot write {tmp_path / 'file' / 'sub' / 'r.json'}: Not a directory"


def test_a_full_disk_at_the_rename_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    import errno

    from kvq_export.errors import OutputWriteError

    target = tmp_path / "r.json"
    target.write_text("old")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OutputWriteError, match=f"^cannot write {target}: No space left on device$") as err:
        atomic_write(target, "{}")
    assert err.value.errno == errno.ENOSPC
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
