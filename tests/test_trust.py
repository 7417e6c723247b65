"""Results a user can trust: no silently wrong answer with exit code 0.

One section per way a run could have answered wrongly and still succeeded: the wrong baseline, an edited
manifest, an export replaced under a live session, meaningless tolerances, outputs written into an export,
files an export does not own, a comparison that never leaves the fp16 window, ranks of tied heads.
Property tests run with a fixed seed (``KVQ_TEST_SEED`` overrides it).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import WORDS, save_tiny_model_dir

from kvq_export.cli import cli
from kvq_export.export.exporter import export
from kvq_export.manifest import Manifest

SEED = int(os.environ.get("KVQ_TEST_SEED", "0"))


def kvq(*args, cwd: Path | None = None):
    """``kvq ARGS`` in this process; (exit code, stdout, stderr)."""
    old = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    finally:
        os.chdir(old)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("trust")
    random.seed(SEED)
    (path / "words.txt").write_text(" ".join(random.choice(WORDS) for _ in range(3000)))
    return path


@pytest.fixture(scope="module")
def model_dir(root):
    return save_tiny_model_dir(root / "a" / "tiny")


@pytest.fixture(scope="module")
def kivi(root, model_dir):
    return export(str(model_dir), "kivi-2", root / "kivi")


@pytest.fixture(scope="module")
def gqa(root, model_dir):
    return export(str(model_dir), "ort-int8", root / "gqa", flavor="ort-gqa", calib_corpus=str(root / "words.txt"),
                  calib_tokens=256)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _validate(export_dir, root, *extra, cwd=None):
    return kvq("validate", export_dir, "--corpus", root / "words.txt", "--windows", "1", "--window-len", "16",
               "--gen-tokens", "0", "--quiet", *extra, cwd=cwd)


# -- 1. the automatic baseline is the export's own model, by content, in the export's flavour ------------------
def test_two_models_of_one_name_get_their_own_baselines(root, model_dir, kivi, cache_dir, tmp_path):
    other_dir = save_tiny_model_dir(tmp_path / "b" / "tiny", "llama-tied")  # another model, also named "tiny"
    other = export(str(other_dir), "kivi-2", tmp_path / "other")
    for directory in (kivi, other):
        code, _, err = _validate(directory, root, "--json", tmp_path / f"{directory.name}.json")
        assert code == 0, err
    mine, theirs = (json.loads((tmp_path / f"{d.name}.json").read_text()) for d in (kivi, other))
    assert mine["baseline"] != theirs["baseline"]
    for result, directory in ((mine, kivi), (theirs, other)):
        assert Manifest.load(result["baseline"]).source_digest == Manifest.load(directory).source_digest
        assert Path(result["baseline"]).parent == cache_dir / "exports"


def test_a_source_edited_in_place_or_gone_is_refused(root, cache_dir, tmp_path):
    source = save_tiny_model_dir(tmp_path / "tiny")
    directory = export(str(source), "kivi-2", tmp_path / "e")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))  # edited: another model
    code, _, err = _validate(directory, root)
    assert code == 1 and "changed since this export was made" in err and len(err.strip().splitlines()) == 1
    shutil.rmtree(source)
    code, _, err = _validate(directory, root)
    assert code == 1 and "model source of this export is gone" in err
    assert not (cache_dir / "exports").exists() or not any((cache_dir / "exports").iterdir())  # nothing guessed


def test_a_relative_source_is_recorded_absolutely(root, model_dir, cache_dir, tmp_path):
    out = tmp_path / "rel"
    code, _, err = kvq("export", "--model", "tiny", "--scheme", "kivi-2", "--out", out, cwd=model_dir.parent)
    assert code == 0, err
    assert Manifest.load(out).model.source == str(model_dir.resolve())
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "tiny").mkdir(parents=True)  # a "tiny" that is not a model, where validation runs
    code, _, err = _validate(out, root, "--json", tmp_path / "r.json", cwd=elsewhere)
    assert code == 0, err
    assert Manifest.load(json.loads((tmp_path / "r.json").read_text())["baseline"]).model.source == \
        str(model_dir.resolve())


def test_the_automatic_baseline_has_the_exports_flavour_and_dtype(root, gqa, cache_dir, tmp_path):
    code, _, err = _validate(gqa, root, "--json", tmp_path / "r.json")
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    base = Manifest.load(result["baseline"])
    assert (result["baseline_flavor"], base.flavor, base.dtype) == ("ort-gqa", "ort-gqa", "fp32")
    assert not base.scheme.quantized and base.source_digest == Manifest.load(gqa).source_digest


def test_an_explicit_baseline_of_other_weights_is_refused(root, kivi, tmp_path):
    other_dir = save_tiny_model_dir(tmp_path / "tiny", "llama-tied")
    base = export(str(other_dir), "fp16", tmp_path / "base")
    code, _, err = _validate(kivi, root, "--baseline", base)
    assert code == 1 and "not the same model" in err or "other weights" in err

