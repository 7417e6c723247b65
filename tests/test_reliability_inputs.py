"""What a file, a path or a setting can do to kvq: every bad one is a one-line error, none is used silently.

Where the inputs form a space the cases come from hypothesis with a fixed seed (``KVQ_TEST_SEED`` overrides it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tiny_models import save_tiny_model_dir

from kvq_export.cli import cli
from kvq_export.errors import ModelError
from kvq_export.model_source import gguf_cache_dir, load_model

SEED = int(os.environ.get("KVQ_TEST_SEED", "20261203"))
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _one_line_error(result) -> str:
    """The CLI failed with exit 1 and one ``error:`` line, no traceback."""
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# -- 1. which model gets loaded ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ggufs(tmp_path_factory):
    """Two different tiny Llama GGUFs of one name, size and mtime, in two folders."""
    from test_gguf import LOADS, _source_model, write_gguf

    root = tmp_path_factory.mktemp("two")
    models = {}
    for folder, shift in (("a", 0.0), ("b", 1.0)):
        model = _source_model("llama")
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(shift)
        (root / folder).mkdir()
        models[folder] = (model, write_gguf(model, root / folder / "m.gguf", LOADS["llama"]))
    stamp = models["a"][1].stat().st_mtime_ns
    for _, path in models.values():
        os.utime(path, ns=(stamp, stamp))
    assert models["a"][1].stat().st_size == models["b"][1].stat().st_size
    return root, models


def test_a_gguf_path_loads_that_file_not_a_namesake_in_the_current_directory(two_ggufs, tmp_path, monkeypatch):
    root, models = two_ggufs
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(root / "b")  # holds another m.gguf
    loaded, _ = load_model(Path("..") / "a" / "m.gguf")
    want = models["a"][0].model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, want)


def test_gguf_caches_are_keyed_by_content_not_by_name(two_ggufs, tmp_path, monkeypatch):
    root, models = two_ggufs
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    a, b = models["a"][1], models["b"][1]
    assert gguf_cache_dir(a) != gguf_cache_dir(b)  # same name, size and mtime: the digest tells them apart
    for folder in ("a", "b"):
        loaded, _ = load_model(models[folder][1])
        assert torch.equal(loaded.model.embed_tokens.weight, models[folder][0].model.embed_tokens.weight)
    from kvq_export.model_source import model_identity

    ident_a, ident_b = model_identity(a), model_identity(b)
    assert ident_a != ident_b and ident_a["spec"] == str(a.resolve())
    monkeypatch.chdir(root)
    assert model_identity("a/m.gguf") == ident_a  # a relative spec names the same content


def test_export_reuse_is_keyed_by_the_models_content(tmp_path, monkeypatch):
    """ensure_export never reuses the export of another model that had the same path."""
    from kvq_export.export.exporter import ensure_export
    from kvq_export.manifest import Manifest

    monkeypatch.chdir(tmp_path)
    save_tiny_model_dir(tmp_path / "m")
    first = ensure_export("m", "fp16", tmp_path / "out")
    digest = Manifest.load(first).weights
    assert Manifest.load(first).model.source == str(tmp_path / "m")  # absolute in the manifest
    import shutil

    shutil.rmtree(tmp_path / "m")
    save_tiny_model_dir(tmp_path / "m", kind="llama-tied")  # another model, same path
    again = ensure_export("m", "fp16", tmp_path / "out")
    assert Manifest.load(again).weights != digest


# -- 2. incomplete checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def _copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = _copy_model(tiny_dir, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(3)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(cli, ["export", "--model", str(broken), "--scheme", "fp16",
                                      "--out", str(tmp_path / "out")])
    line = _one_line_error(result)
    assert "missing model.layers.1.self_attn.k_proj.weight" in line
    assert "unexpected model.layers.9.extra.weight" in line
    assert not (tmp_path / "out").exists()


SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size")


@seed(SEED)
@FUZZ
@given(field=st.sampled_from(SIZE_FIELDS), value=st.integers(1, 300))
def test_a_config_whose_sizes_do_not_match_the_weights_is_one_model_error(tiny_dir, tmp_path_factory, field, value):
    config = json.loads((tiny_dir / "config.json").read_text())
    if config[field] == value:
        return
    broken = _copy_model(tiny_dir, tmp_path_factory.mktemp("sizes") / "m")
    (broken / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelError) as err:
        load_model(broken)
    message = str(err.value)
    assert "\n" not in message and str(broken) in message


def test_a_pickle_that_runs_code_is_refused_in_one_line(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tiny_dir / "config.json").read_text())
    torch.save({**load_file(tiny_dir / "model.safetensors"), "payload": Payload()}, pickled / "pytorch_model.bin")
    result = CliRunner().invoke(cli, ["export", "--model", str(pickled), "--scheme", "fp16",
                                      "--out", str(tmp_path / "out")])
    line = _one_line_error(result)
    assert "need code to load" in line and "safetensors" in line and "ran" not in result.output
