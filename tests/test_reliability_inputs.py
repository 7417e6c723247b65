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
from kvq_export.errors import KVQError, ModelError
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
    from gguf_harness import LOADS, source_model, write_gguf

    root = tmp_path_factory.mktemp("two")
    models = {}
    for folder, shift in (("a", 0.0), ("b", 1.0)):
        model = source_model("llama")
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
    assert gguf_cache_dir(a) != gguf_cache_dir(b)  # same name and size: the digest tells them apart
    for folder in ("a", "b"):
        loaded, _ = load_model(models[folder][1])
        assert torch.equal(loaded.model.embed_tokens.weight, models[folder][0].model.embed_tokens.weight)
    from kvq_export.model_digest import model_identity

    ident_a, ident_b = model_identity(a), model_identity(b)
    assert ident_a != ident_b and ident_a["spec"] == str(a.resolve())
    monkeypatch.chdir(root)
    assert model_identity("a/m.gguf") == ident_a  # a relative spec names the same content


def test_export_reuse_is_keyed_by_the_models_content(tmp_path, monkeypatch):
    """ensure_export never reuses the export of another model that had the same path."""
    from kvq_export.export.exporter import ensure_export
    from kvq_export.manifest import Manifest
    from kvq_export.request import ExportRequest

    monkeypatch.chdir(tmp_path)
    save_tiny_model_dir(tmp_path / "m")
    first = ensure_export(ExportRequest(model="m", scheme="fp16"), tmp_path / "out")
    digest = Manifest.load(first).weights
    assert Manifest.load(first).model.source == str(tmp_path / "m")  # absolute in the manifest
    import shutil

    shutil.rmtree(tmp_path / "m")
    save_tiny_model_dir(tmp_path / "m", kind="llama-tied")  # another model, same path
    again = ensure_export(ExportRequest(model="m", scheme="fp16"), tmp_path / "out")
    assert Manifest.load(again).weights != digest



def test_export_reuse_of_a_loaded_model_is_keyed_by_its_weights(tmp_path):
    """Bench hands ensure_export loaded models: the same one changed in place is exported again, not reused."""
    import copy

    from tiny_models import tiny_model

    from kvq_export.export.exporter import ensure_export
    from kvq_export.manifest import Manifest
    from kvq_export.request import ExportRequest

    model = copy.deepcopy(tiny_model("llama"))  # tiny_model is shared: change a copy
    request = ExportRequest(model=None, scheme="fp16")
    first = Manifest.load(ensure_export(request, tmp_path / "out", model=model)).weights
    assert Manifest.load(ensure_export(request, tmp_path / "out", model=model)).weights == first  # reused
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.0)
    assert Manifest.load(ensure_export(request, tmp_path / "out", model=model)).weights != first



def test_a_file_rewritten_with_its_old_size_and_mtime_is_hashed_again(tiny_export, tmp_path):
    """Digest memos are keyed by the file's version (inode, size, mtime, ctime), not by its name and mtime."""
    import shutil

    from kvq_export.errors import RuntimeInputError
    from kvq_export.manifest import Manifest, verify_weights

    out = shutil.copytree(tiny_export, tmp_path / "e")
    manifest = Manifest.load(out)
    verify_weights(out, manifest)  # hashed and remembered
    data = out / "model.onnx.data"
    stamp = data.stat()
    with open(data, "r+b") as handle:  # same size, another byte
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 1]))
    os.utime(data, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert data.stat().st_size == stamp.st_size and data.stat().st_mtime_ns == stamp.st_mtime_ns
    with pytest.raises(RuntimeInputError, match="does not match its sha256"):
        verify_weights(out, manifest)


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


@pytest.mark.parametrize("name, content, needle", [
    ("config.json", b"null", "holds NoneType, not a JSON object"), ("config.json", b"[1]", "holds list"),
    ("config.json", b"7", "holds int"), ("model.safetensors", b"", "header too small"),
    ("model.safetensors", b"\xff" * 8 + b"{}", "header too large"), ("model.safetensors", "half", "incomplete"),
])
def test_an_unreadable_config_or_weights_file_is_one_model_error(tiny_dir, tmp_path, name, content, needle):
    broken = _copy_model(tiny_dir, tmp_path / "m")
    if content == "half":
        content = (broken / name).read_bytes()[: (broken / name).stat().st_size // 2]
    (broken / name).write_bytes(content)
    with pytest.raises(ModelError) as err:
        load_model(broken)
    assert "\n" not in str(err.value) and needle in str(err.value) and str(broken) in str(err.value)
    line = _one_line(CliRunner().invoke(cli, ["export", "--model", str(broken), "--scheme", "fp16", "--out",
                                              str(tmp_path / "out")]))
    assert needle in line and not (tmp_path / "out").exists()


def _one_line(result) -> str:
    """:func:`_one_line_error`, ignoring warnings torch or transformers print while loading a broken model."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and len(lines) == 1, (result.exit_code, result.output, result.exception)
    return lines[0]


@seed(SEED)
@FUZZ
@given(data=st.data(), value=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_a_weight_holding_nan_or_inf_is_refused_naming_it(tiny_dir, tmp_path_factory, data, value):
    from safetensors.torch import load_file, save_file

    broken = _copy_model(tiny_dir, tmp_path_factory.mktemp("nonfinite") / "m")
    tensors = load_file(broken / "model.safetensors")
    name = data.draw(st.sampled_from(sorted(tensors)))
    flat = tensors[name].view(-1)
    flat[data.draw(st.integers(0, flat.numel() - 1))] = value
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=f"weights hold NaN or Inf \\({name}\\)"):
        load_model(broken)


@pytest.mark.parametrize("field, value, needle", [
    ("rope_theta", float("nan"), "non-finite or non-positive rotary"), ("rope_theta", 0, "non-positive rotary"),
    ("rope_theta", -10000.0, "rotary frequencies"), ("rope_theta", float("inf"), "rotary frequencies"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps -1e-06; allowed: a finite number > 0"), ("rms_norm_eps", 0.0, "> 0"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps nan"), ("vocab_size", 0, "vocab_size 0; allowed: an integer >= 1"),
])
def test_config_values_that_make_the_graph_non_finite_are_refused(tiny_dir, tmp_path, field, value, needle):
    """Before, each of these exported with exit 0 and a graph whose every logit was NaN (or empty)."""
    from transformers import AutoConfig

    from kvq_export.arch import get_arch

    config = AutoConfig.from_pretrained(tiny_dir)
    if field == "rope_theta":
        config.rope_parameters = {**config.rope_parameters, "rope_theta": value}
    else:
        setattr(config, field, value)
    with pytest.raises(ModelError) as err:
        get_arch(config).rope()
    assert needle in str(err.value) and "\n" not in str(err.value)


# -- 3. malformed input files, bounded -------------------------------------------------------------------------
def _gguf(metadata: list[tuple[str, int, bytes]], tensors: list[tuple[str, list[int], int]] = (),
          data: bytes = b"") -> bytes:
    """A little-endian GGUF v3: ``metadata`` as (key, value type, encoded value), ``tensors`` as (name, dims, type)."""
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    out = struct.pack("<IIQQ", 0x46554747, 3, len(tensors), len(metadata))
    for key, kind, value in metadata:
        out += string(key) + struct.pack("<I", kind) + value
    offset = 0
    for name, dims, kind in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", kind, offset)
        offset += 4 * int(np_prod(dims))
    return out + b"\0" * (-len(out) % 32) + data


def np_prod(dims) -> int:
    import math

    return math.prod(dims)


def _gstr(text: str) -> bytes:
    import struct

    return struct.pack("<Q", len(text.encode())) + text.encode()


STRING, ARRAY, UINT32, F32 = 8, 9, 4, 0


def _valid_gguf() -> bytes:
    """A header-complete llama GGUF with strings, arrays and one f32 tensor of 8 values."""
    import struct

    return _gguf([("general.architecture", STRING, _gstr("llama")),
                  ("llama.block_count", UINT32, struct.pack("<I", 1)),
                  ("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 3) + b"".join(map(_gstr, "abc"))),
                  ("tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", UINT32, 3) + struct.pack("<3I", 1, 1, 1))],
                 [("token_embd.weight", [4, 2], F32)], data=b"\0" * 32)


@pytest.mark.parametrize("case", ["string 2^62", "array of 2^62 strings", "nested arrays", "2^40 dimension",
                                  "tensor past the end"])
def test_a_hostile_gguf_header_is_one_model_error_before_any_allocation(case, tmp_path, monkeypatch):
    import struct

    from kvq_export.model_source import load_config, read_gguf_header

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    arch = ("general.architecture", STRING, _gstr("llama"))
    if case == "string 2^62":
        data = _gguf([arch, ("general.name", STRING, struct.pack("<Q", 1 << 62) + b"x")])
    elif case == "array of 2^62 strings":
        data = _gguf([arch, ("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 1 << 62))])
    elif case == "nested arrays":
        data = _gguf([arch, ("x", ARRAY, struct.pack("<IQ", ARRAY, 1) * 100_000 + struct.pack("<IQ", UINT32, 0))])
    elif case == "2^40 dimension":
        data = _gguf([arch], [("token_embd.weight", [1 << 40, 2], F32)], data=b"\0" * 64)
    else:
        data = _gguf([arch], [("token_embd.weight", [64, 2], F32)], data=b"\0" * 64)
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises((ValueError, EOFError)):
        read_gguf_header(path)
    with pytest.raises(ModelError) as err:
        load_config(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> Path:
    from kvq_export.model_source import read_gguf_header

    path = tmp_path_factory.mktemp("gguf") / "ok.gguf"
    path.write_bytes(_valid_gguf())
    header = read_gguf_header(path)
    assert header.architecture == "llama" and header.tensor_names == ("token_embd.weight",)
    return path


@seed(SEED)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(0, 400), width=st.sampled_from([4, 8]),
       value=st.sampled_from([1 << 62, 1 << 40, (1 << 64) - 1, (1 << 32) - 1, 1 << 31, 9, 8, 0]) |
       st.integers(0, (1 << 64) - 1))
def test_any_overwritten_gguf_header_field_is_read_within_the_file(valid_gguf, tmp_path_factory, at, width, value):
    """Every length, count, type or dimension the header states, overwritten, is refused or read within bounds."""
    import struct

    from kvq_export.model_source import load_config, read_gguf_header

    data = bytearray(valid_gguf.read_bytes())
    at = min(at, len(data) - 8)
    data[at:at + width] = struct.pack("<Q" if width == 8 else "<I", value % (1 << (8 * width)))
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    path.write_bytes(bytes(data))
    try:
        read_gguf_header(path)
    except (ValueError, EOFError):  # UnicodeDecodeError and unknown type codes are ValueErrors
        pass
    try:  # what passes the header check, transformers' reader then reads within the file too
        load_config(path)
    except ModelError as err:
        assert "\n" not in str(err)


@pytest.mark.parametrize("text,needle", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                         ('{"residual_length": ' + "9" * 5000 + "}", "5000 digits"),
                                         ('{"key": {"bits": ' + "1" * 21 + "}}", "21 digits")])
def test_a_hostile_scheme_json_is_one_scheme_error(text, needle, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(text)
    result = CliRunner().invoke(cli, ["memory", "--scheme", str(path), "--seq-len", "8", "--model",
                                      str(save_tiny_model_dir(tmp_path / "m"))])
    line = _one_line_error(result)
    assert needle in line



@seed(SEED)
@settings(max_examples=80, deadline=None)
@given(depth=st.integers(0, 200_000), digits=st.integers(1, 6000), sign=st.sampled_from(["", "-"]))
def test_scheme_json_of_any_depth_or_integer_length_parses_or_is_one_scheme_error(depth, digits, sign):
    from kvq_export.errors import SchemeError
    from kvq_export.scheme import KVQuantScheme

    text = '{"residual_length": ' + "[" * depth + sign + "7" * digits + "]" * depth + "}"
    try:
        KVQuantScheme.from_json(text)
    except SchemeError as err:
        assert "\n" not in str(err)
        if digits > 20:
            assert f"{digits} digits" in str(err) or "nested too deeply" in str(err)


# -- 4. unbounded reads ------------------------------------------------------------------------------------------
@seed(SEED)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 300), limit=st.integers(1, 200))
def test_the_capped_reader_returns_a_file_within_its_limit_and_names_the_limit_otherwise(tmp_path_factory, size,
                                                                                        limit):
    from kvq_export._read import read_bytes

    path = tmp_path_factory.mktemp("cap") / "f.txt"
    path.write_bytes(b"a" * size)
    if size <= limit:
        assert read_bytes(path, "text file", limit=limit) == b"a" * size
    else:
        with pytest.raises(KVQError, match=f"at most {limit} bytes"):
            read_bytes(path, "text file", limit=limit)


def test_prompts_from_an_endless_device_are_refused_with_the_limit(tmp_path):
    result = CliRunner().invoke(cli, ["validate", str(tmp_path), "--prompts", "/dev/zero"])
    line = _one_line_error(result)
    assert "prompts file /dev/zero" in line and "64 MiB" in line


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, tiny_dir):
    from kvq_export.export.exporter import export_model

    return export_model(tiny_dir, "fp16", tmp_path_factory.mktemp("exp") / "fp16")


@pytest.mark.parametrize("name, size", [("kvq.json", 3 << 30), ("tokenizer.json", 20 << 30)])
def test_a_sparse_export_file_is_refused_without_reading_it(tiny_export, tmp_path, name, size):
    import shutil

    export_dir = tmp_path / "e"
    shutil.copytree(tiny_export, export_dir)
    with open(export_dir / name, "r+b") as handle:
        handle.truncate(size)  # sparse: no disk used, GiBs to a reader
    # --no-verify: past the checksums (which refuse the size first), the capped reader must still refuse it
    result = CliRunner().invoke(cli, ["generate", str(export_dir), "--prompt", "w1 w2", "--max-new-tokens", "2",
                                      "--no-verify"])
    line = _one_line_error(result)
    assert name in line and f"{size} bytes" in line and "MiB" in line
    if name == "kvq.json":  # the identity a session pins on open is capped too (it read the GiBs to hash them)
        from kvq_export.errors import RuntimeInputError
        from kvq_export.manifest import export_identity

        with pytest.raises(RuntimeInputError, match="kvq reads at most"):
            export_identity(export_dir)


def test_a_sparse_tokenizer_file_of_a_model_directory_is_refused(tiny_dir, tmp_path):
    model = _copy_model(tiny_dir, tmp_path / "m")
    with open(model / "tokenizer.json", "r+b") as handle:
        handle.truncate(4 << 30)
    with pytest.raises(ModelError, match="256 MiB"):
        load_model(model)


# -- 5. output targets -----------------------------------------------------------------------------------------------
def _export_args(model: Path, out: str) -> list[str]:
    return ["export", "--model", str(model), "--scheme", "fp16", "--out", out]


@pytest.mark.parametrize("out", [".", "..", "./", "sub/.."])
def test_the_current_directory_or_a_parent_is_never_an_export_target(tiny_dir, tmp_path, monkeypatch, out):
    here = tmp_path / "work"
    (here / "sub").mkdir(parents=True)
    monkeypatch.chdir(here)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    line = _one_line_error(CliRunner().invoke(cli, _export_args(tiny_dir, out)))
    assert "current directory" in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before and Path.cwd() == here


def test_an_output_the_file_system_refuses_is_one_line(tiny_dir):
    line = _one_line_error(CliRunner().invoke(cli, _export_args(tiny_dir, "/proc/kvq-export")))
    assert "cannot create the lock file /proc/.kvq-export.lock" in line
    assert not os.path.lexists("/proc/kvq-export")


@pytest.mark.parametrize("length", [246, 250, 255])
def test_a_legal_long_output_name_exports_and_leaves_nothing_beside_it(tiny_dir, tmp_path, length):
    out = tmp_path / ("e" * length)
    result = CliRunner().invoke(cli, _export_args(tiny_dir, str(out)))
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == [out.name] and (out / "kvq.json").is_file()
    result = CliRunner().invoke(cli, [*_export_args(tiny_dir, str(out)), "--force"])
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


@pytest.mark.parametrize("stage", ["graph", "tokenizer", "manifest"])
def test_a_disk_that_fills_during_the_export_is_one_line_and_keeps_the_old_export(tiny_dir, tiny_export, tmp_path,
                                                                                  monkeypatch, stage):
    import errno
    import shutil

    from kvq_export.export import exporter
    from kvq_export.graph import builder

    out = tmp_path / "e"
    shutil.copytree(tiny_export, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fill(directory) -> None:  # writes part of a file, then the disk is full
        (Path(directory) / "partial.bin").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(directory) / "partial.bin"))

    if stage == "graph":
        monkeypatch.setattr(builder, "save", lambda graph, path, *args, **kwargs: fill(Path(path).parent))
    elif stage == "tokenizer":
        from transformers import PreTrainedTokenizerBase

        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", lambda self, d, *args, **kwargs: fill(d))
    else:
        monkeypatch.setattr(exporter.Manifest, "save", lambda self, d: fill(d))
    line = _one_line_error(CliRunner().invoke(cli, [*_export_args(tiny_dir, str(out)), "--force"]))
    assert "no space left on device" in line and str(out) in line
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no temporary directory, no lock
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("cache", ["a file", "/proc/kvq-cache"])
def test_a_cache_directory_that_cannot_be_used_is_one_line(two_ggufs, tmp_path, monkeypatch, cache):
    if cache == "a file":
        cache = tmp_path / "cache-file"
        cache.write_text("")
    monkeypatch.setenv("KVQ_CACHE_DIR", str(cache))
    _, models = two_ggufs
    line = _one_line_error(CliRunner().invoke(cli, _export_args(models["a"][1], str(tmp_path / "out"))))
    assert f"cache directory {cache}" in line and "KVQ_CACHE_DIR" in line
    assert not (tmp_path / "out").exists()


SPECIAL_OUTPUTS = [  # (command line with {out} for the output path)
    ["validate", "{e}", "--baseline", "{e}", "--json", "{out}"], ["validate", "{e}", "--report", "{out}"],
    ["generate", "{e}", "--prompt", "w1", "--json", "{out}"], ["compare", "{e}", "{e}", "--json", "{out}"],
    ["plan", "--model", "{m}", "--budget", "4", "--out", "{out}"], ["calibrate", "--model", "{m}", "--out", "{out}"],
    ["bench", "--model", "{m}", "--json", "{out}"],
]


@pytest.mark.parametrize("args", SPECIAL_OUTPUTS, ids=lambda a: f"{a[0]}-{a[-2]}")
def test_an_output_that_is_a_device_or_fifo_is_refused_before_any_work_and_left_alone(tiny_dir, tiny_export, tmp_path,
                                                                                     args):
    """A written file is renamed into place: over /dev/null (as root) that replaced the device for everyone."""
    import stat

    kinds = ["fifo"] + (["character device"] if os.geteuid() == 0 else [])
    for kind in kinds:
        node = tmp_path / f"{kind.replace(' ', '-')}.html"
        if kind == "fifo":
            os.mkfifo(node)
        else:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers, in a private place
        before = os.lstat(node).st_mode
        line = _one_line_error(CliRunner().invoke(cli, [a.format(e=tiny_export, m=tiny_dir, out=node) for a in args]))
        assert f"is a {'FIFO' if kind == 'fifo' else kind}, not a regular file" in line and str(node) in line
        assert os.lstat(node).st_mode == before and sorted(p.name for p in tmp_path.iterdir()) == \
            sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".html"))


def test_an_output_below_a_file_is_one_line(tiny_export, tmp_path):
    (tmp_path / "file").write_text("x")
    line = _one_line_error(CliRunner().invoke(cli, ["generate", str(tiny_export), "--prompt", "w1", "--json",
                                                    str(tmp_path / "file" / "r.json")]))
    assert line == f"error: cannot write {tmp_path / 'file' / 'r.json'}: Not a directory"


# -- 6. lock files ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["symlink to nothing", "symlink to a file", "fifo", "directory", "hard link"])
def test_a_lock_that_is_not_a_plain_file_is_refused_and_nothing_it_points_at_changes(tiny_dir, tmp_path, kind):
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    lock = tmp_path / ".e.lock"
    if kind == "symlink to nothing":
        lock.symlink_to(victim)
    elif kind == "symlink to a file":
        victim.write_text("keep")
        lock.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
    else:
        victim.write_text("keep")
        os.link(victim, lock)
    line = _one_line_error(CliRunner().invoke(cli, _export_args(tiny_dir, str(tmp_path / "e"))))
    assert str(lock) in line and "remove it" in line
    kept = kind in ("symlink to a file", "hard link")
    assert [p.name for p in victim.parent.iterdir()] == (["victim"] if kept else [])  # nothing created there
    assert not kept or victim.read_text() == "keep"
    assert not (tmp_path / "e").exists() and os.path.lexists(lock)


def test_a_lock_in_a_directory_that_cannot_be_written_is_one_line(tiny_dir, tmp_path, monkeypatch):
    import errno

    real = os.open

    def unwritable(path, flags, *args, **kwargs):  # as a user without write permission there (root has it)
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", unwritable)
    line = _one_line_error(CliRunner().invoke(cli, _export_args(tiny_dir, str(tmp_path / "e"))))
    assert "cannot create the lock file" in line and "Permission denied" in line


# -- 7. wrong settings -----------------------------------------------------------------------------------------------
@seed(SEED)
@settings(max_examples=60, deadline=None)
@given(opset=st.integers(-5, 300) | st.sampled_from([99999, 2**63]))
def test_an_opset_is_accepted_exactly_when_onnx_and_onnx_runtime_load_it(opset):
    from kvq_export.errors import ExportError
    from kvq_export.export.stages import check_opset, supported_opsets

    low, high = supported_opsets()
    if low <= opset <= high:
        check_opset(opset)
    else:
        with pytest.raises(ExportError, match=f"allowed {low}..{high}"):
            check_opset(opset)


def test_export_refuses_an_opset_it_could_only_write_broken(tiny_dir, tmp_path):
    from kvq_export.export.stages import supported_opsets

    line = _one_line_error(CliRunner().invoke(cli, [*_export_args(tiny_dir, str(tmp_path / "e")), "--opset", "99999"]))
    low, high = supported_opsets()
    assert f"opset 99999 is not supported: allowed {low}..{high}" in line and high >= 23
    assert not (tmp_path / "e").exists()


@seed(SEED)
@settings(max_examples=200, deadline=None)
@given(penalty=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, 1e-308, 5e-324, 0.01, 100.0]))
def test_a_repetition_penalty_is_bounded_so_penalized_logits_stay_finite(penalty):
    import numpy as np

    from kvq_export.runtime.sampling import REPETITION_PENALTY_RANGE, Sampler, SamplingConfig

    low, high = REPETITION_PENALTY_RANGE
    if not low <= penalty <= high:
        with pytest.raises(KVQError, match=f"repetition_penalty=.*allowed: a number from {low:g} to {high:g}"):
            SamplingConfig(repetition_penalty=penalty)
        return
    sampler = Sampler(SamplingConfig(repetition_penalty=penalty))
    sampler.prime([[0, 1, 2, 3]])
    logits = np.array([[3e4, -3e4, 1e-3, -1e-3, 5.0]], np.float32)
    assert np.isfinite(sampler.penalized(logits)).all()


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_the_cli_blames_repetition_penalty_with_the_librarys_range(tiny_export, command):
    from kvq_export.runtime.sampling import REPETITION_PENALTY_RANGE

    option = next(p for p in cli.commands[command].params if p.name == "repetition_penalty")
    assert (option.type.min, option.type.max) == REPETITION_PENALTY_RANGE
    args = [str(tiny_export), "--prompt", "w1"] if command == "generate" else []
    result = CliRunner().invoke(cli, [command, *args, "--repetition-penalty", "1e308"])
    assert result.exit_code == 2 and "Invalid value for '--repetition-penalty'" in result.output
    assert "a finite number >= 0.01 and <= 100" in result.output


@pytest.fixture
def little_memory(monkeypatch):
    """8 GiB available, whatever this machine has: the refusals below do not depend on the machine."""
    from kvq_export import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 8 << 30)


@pytest.mark.parametrize("args, needle", [
    (["--contexts", "1000000000"], "context 1000000000 is beyond the model's 1024 positions"),
    (["--contexts", "512", "--batch", "1000000"], "bench at context 512 and batch 1000000 needs at least"),
])
def test_bench_refuses_what_the_model_or_the_memory_cannot_hold_before_exporting(tiny_dir, tmp_path, little_memory,
                                                                                 args, needle):
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_dir), "--schemes", "q4_0", "--flavors",
                                      "reference", "--work-dir", str(tmp_path / "w"), *args])
    line = _one_line_error(result)
    assert needle in line and ("8.0 GiB" in line or "positions" in line)
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args, needle", [
    (["--batch", "100000"], "compare at batch 100000 needs at least"),
    (["--prompt-len", "2000"], "prompt length + steps 2004 is beyond the model's 1024 positions"),
])
def test_compare_refuses_runs_beyond_positions_or_memory_up_front(tiny_export, little_memory, args, needle):
    line = _one_line_error(CliRunner().invoke(cli, ["compare", str(tiny_export), str(tiny_export), *args]))
    assert needle in line


def test_compare_says_why_its_automatic_prompt_length_is_beyond_the_positions(tiny_dir, tiny_export, tmp_path,
                                                                               little_memory):
    """Neither --prompt-len nor --steps given: the refusal names the window the automatic length was sized past."""
    import dataclasses
    import json

    from kvq_export.export.exporter import export_model
    from kvq_export.presets import resolve_scheme

    scheme = dataclasses.replace(resolve_scheme("q4_0"), residual_length=1010, name="q4_0-recent1010")
    (tmp_path / "s.json").write_text(json.dumps(scheme.to_dict()))
    windowed = export_model(tiny_dir, str(tmp_path / "s.json"), tmp_path / "windowed")
    line = _one_line_error(CliRunner().invoke(cli, ["compare", str(tiny_export), str(windowed)]))
    assert "sized past the exports' 1010-token high-precision window" in line, line
    assert "beyond the model's 1024 positions" in line and "--prompt-len" in line


# -- 8. misleading errors --------------------------------------------------------------------------------------------
def test_an_fp16_cache_that_overflows_names_the_tensor_and_the_range(tiny_dir, tmp_path):
    """Keys of about 1e5 cannot be stored in float16: the error says so instead of blaming the weights."""
    from transformers import AutoModelForCausalLM

    from kvq_export.export.exporter import export_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(1e6)
    model.save_pretrained(_copy_model(tiny_dir, tmp_path / "loud"))
    out = export_model(tmp_path / "loud", "fp16", tmp_path / "e")
    line = _one_line_error(CliRunner().invoke(cli, ["generate", str(out), "--prompt", "w1 w2 w3",
                                                    "--max-new-tokens", "3", "--json"]))
    assert "layer 1 key" in line and "beyond float16's range (±65504)" in line
    assert "weights" not in line


def test_a_repeated_export_names_force_in_the_callers_words(tiny_export, tiny_dir):
    from kvq_export.errors import ExportError
    from kvq_export.export.exporter import export_model

    line = _one_line_error(CliRunner().invoke(cli, _export_args(tiny_dir, str(tiny_export))))
    assert line.endswith("already exists; pass --force to replace it") and "force=True" not in line
    with pytest.raises(ExportError) as err:
        export_model(tiny_dir, "fp16", tiny_export)
    assert str(err.value).endswith("already exists; pass force=True to replace it") and "--force" not in str(err.value)
