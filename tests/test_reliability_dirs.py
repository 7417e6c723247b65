"""An export never destroys or clobbers a directory.

Only a kvq export is replaced, one writer at a time, and a crash at any point leaves the old export or the
new one under the user's name.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_model_dir

from kvq_export import _atomic
from kvq_export.errors import ExportError
from kvq_export.export.exporter import export_model
from kvq_export.manifest import MANIFEST_NAME


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _is_export(directory: Path) -> bool:
    """What an export replaces: a directory with a manifest."""
    return (directory / MANIFEST_NAME).is_file()


def _move_into_place(new: Path, target: Path) -> None:
    """The export's last stage: the finished directory swapped in, replacing only an export."""
    _atomic.move_dir_into_place(new, target, replaceable=_is_export)


def _fake_export(path: Path, label: str) -> Path:
    """A directory that looks like a finished export (its manifest is what marks it)."""
    path.mkdir(parents=True)
    (path / "kvq.json").write_text(label)
    (path / "model.onnx").write_text(label)
    return path


@pytest.mark.parametrize("contents", [{"thesis.tex": "years of work"},
                                      {".bashrc": "x", "Documents/cv.pdf": "y"}])
def test_force_refuses_a_directory_that_is_not_an_export(tmp_path, contents):
    out = tmp_path / "user"
    for name, text in contents.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    with pytest.raises(ExportError, match="not a kvq export directory.*force=True replaces only a kvq export"):
        export_model("/nonexistent-model", "fp16", out, force=True)  # refused before the model is even looked at
    assert all((out / name).read_text() == text for name, text in contents.items())


def test_force_refuses_a_file_and_a_symlink(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("notes")
    with pytest.raises(ExportError, match="is not a directory"):
        export_model("/nonexistent-model", "fp16", notes, force=True)
    assert notes.read_text() == "notes"
    real = _fake_export(tmp_path / "real", "old")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ExportError, match="symbolic link"):
        export_model("/nonexistent-model", "fp16", link, force=True)
    assert (real / "kvq.json").read_text() == "old" and link.is_symlink()


def test_an_existing_export_needs_force(tmp_path):
    out = _fake_export(tmp_path / "exp", "old")
    with pytest.raises(ExportError, match="already exists; pass force=True to replace it"):
        export_model("/nonexistent-model", "fp16", out)


def test_a_second_export_of_the_same_directory_fails_at_once(tmp_path):
    out = tmp_path / "exp"
    with _atomic.target_lock(out):  # another process is exporting here
        with pytest.raises(ExportError, match="another kvq export is writing"):
            export_model("/nonexistent-model", "fp16", out)
    assert not out.exists() and not list(tmp_path.iterdir())  # the lock file goes with its holder


def test_the_swap_is_atomic_and_leaves_nothing_behind(tmp_path):
    out = _fake_export(tmp_path / "exp", "old")
    new = _fake_export(tmp_path / ".exp.tmp-1", "new")
    _move_into_place(new, out)
    assert (out / "kvq.json").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["exp"]


def test_a_crash_between_the_fallback_renames_is_repaired_by_the_next_export(tmp_path, monkeypatch):
    out = _fake_export(tmp_path / "exp", "old")
    new = _fake_export(tmp_path / ".exp.tmp-1", "new")
    monkeypatch.setattr(_atomic, "exchange", lambda a, b: False)  # a platform without renameat2
    real = os.replace

    def killed(src, dst):
        if Path(dst) == out:
            raise KeyboardInterrupt  # the process dies between moving the old export aside and the new one in
        return real(src, dst)

    monkeypatch.setattr(_atomic.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _move_into_place(new, out)
    monkeypatch.setattr(_atomic.os, "replace", real)
    assert not out.exists()
    _atomic.clean_leftovers(out, complete=_is_export)  # what the next export does first, holding the lock
    assert (out / "kvq.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["exp"]


def test_a_directory_created_meanwhile_is_never_replaced(tmp_path):
    out = tmp_path / "exp"
    new = _fake_export(tmp_path / ".exp.tmp-1", "new")
    (out / "x").mkdir(parents=True)  # someone else's files appeared at the target while exporting
    (out / "x" / "f").write_text("theirs")
    with pytest.raises(FileExistsError, match="filled by someone else"):
        _move_into_place(new, out)
    assert (out / "x" / "f").read_text() == "theirs"
    other = tmp_path / "other"
    monkey = _atomic.rename_noreplace
    try:  # appears between the last check and the rename: the no-replace rename refuses it
        _atomic.rename_noreplace = lambda a, b: (other.mkdir(), monkey(a, b))
        with pytest.raises(FileExistsError):
            _move_into_place(new, other)
    finally:
        _atomic.rename_noreplace = monkey
    assert other.is_dir() and not any(other.iterdir()) and (new / "kvq.json").read_text() == "new"


_KILLED = """
import os, sys
from kvq_export.export import exporter
exporter.Manifest.save = lambda self, directory: os._exit(9)  # killed with the temporary half written
exporter.export_model(sys.argv[1], "fp16", sys.argv[2])
"""


def test_killed_export_leftovers_are_cleaned_and_umask_is_honoured(model_dir, tmp_path):
    out = tmp_path / "exp"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(model_dir), str(out)], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert not out.exists() and any(p.name.startswith(".exp.tmp-") for p in tmp_path.iterdir())
    old = os.umask(0o027)
    try:
        export_model(model_dir, "fp16", out)
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]  # temporaries and the lock are gone
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o640}
    with pytest.raises(ExportError, match="already exists"):
        export_model(model_dir, "fp16", out)
    export_model(model_dir, "fp16", out, force=True)  # an export directory is replaced with force
    assert (out / "kvq.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["exp"]


def test_an_empty_directory_is_filled(model_dir, tmp_path):
    out = tmp_path / "made-by-mkdir"
    out.mkdir()
    export_model(model_dir, "fp16", out)
    assert (out / "kvq.json").is_file()


def test_gguf_cache_directory_honours_the_umask(tmp_path):
    from kvq_export.model_source import write_dir_atomically

    old = os.umask(0o077)
    try:
        write_dir_atomically(tmp_path / "m", lambda d: (d / "config.json").write_text("{}"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "m" / "config.json").stat().st_mode) == 0o600
