"""Read-only exports work: validation and comparison never write into an export directory."""

from __future__ import annotations

import os
import shutil

import pytest
from tiny_models import save_tiny_model_dir

from kvq_export.export.exporter import export_model


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("ro")
    model = save_tiny_model_dir(root / "tiny")
    (root / "corpus.txt").write_text(" ".join(f"w{i % 100}" for i in range(400)))
    return {"q4_0": export_model(model, "q4_0", root / "q4_0"), "fp16": export_model(model, "fp16", root / "fp16"),
            "corpus": root / "corpus.txt"}


def _snapshot(directory):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}, \
        directory.stat().st_mtime_ns


@pytest.fixture
def readonly(exports, tmp_path):
    directory = shutil.copytree(exports["q4_0"], tmp_path / "ro")
    for path in directory.iterdir():
        path.chmod(0o444)
    directory.chmod(0o555)
    before = _snapshot(directory)
    yield directory
    assert _snapshot(directory) == before  # not a file created, removed or touched (holds even for root)
    directory.chmod(0o755)


def test_validate_writes_nothing_into_the_export(exports, readonly):
    from kvq_export.validate.runner import ValidateConfig, validate

    config = ValidateConfig(corpus=str(exports["corpus"]), windows=1, window_len=16, prompts=("w1 w2",),
                            gen_tokens=2, attention_samples=1)
    result = validate(readonly, exports["fp16"], config, progress=False)
    assert result.memory.prediction_matches


def test_compare_writes_nothing_into_the_export(exports, readonly):
    from kvq_export.validate.compare import compare_exports

    assert compare_exports(readonly, exports["q4_0"], prompt_len=6, batch=1, steps=1)


def test_probed_session_creates_no_file_anywhere_in_the_export(readonly, monkeypatch):
    from kvq_export.validate.probe import probed_session

    real = os.open
    written = []

    def watch(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and str(os.path.abspath(path)).startswith(str(readonly)):
            written.append(path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", watch)
    session = probed_session(readonly)
    assert session.extra_outputs and written == []

