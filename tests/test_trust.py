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


# -- the automatic baseline is the export's own model, by content, in the export's flavour ------------------
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


# -- the graph is the source of truth for everything it fixes ----------------------------------------------
def _edit(directory: Path, change) -> None:
    path = directory / "kvq.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _rechecksum(directory: Path) -> None:
    """Record the current sha256 of every checksummed file: what someone editing an export by hand would do."""
    import hashlib

    def change(data):
        for name in data["weights"]:
            blob = (directory / name).read_bytes()
            data["weights"][name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}

    _edit(directory, change)


FACT_EDITS = {
    "scaling": lambda v: v * 2,
    "max_position_embeddings": lambda v: v * 4,
    "vocab_size": lambda v: v + 64,
    "num_heads": lambda v: v * 2,
    "hidden_size": lambda v: v * 2,
    "tie_word_embeddings": lambda v: not v,
    "sliding_windows": lambda v: [8] * len(v),
    "model_type": lambda v: "mistral",
    "rope": lambda v: {**v, "parameters": {**v["parameters"], "rope_theta": 5e5}},
}
TOP_EDITS = {"flavor": lambda v: "ort-gqa" if v == "reference" else "reference", "dtype": lambda v: "fp16"}


@pytest.mark.parametrize("which", ["kivi", "gqa"])
@pytest.mark.parametrize("field", [*FACT_EDITS, *TOP_EDITS])
def test_an_edited_model_fact_or_flavour_is_refused_on_load(request, which, field, tmp_path):
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.session import KVQSession

    directory = shutil.copytree(request.getfixturevalue(which), tmp_path / "e")
    if field in FACT_EDITS:
        _edit(directory, lambda m: m["model"].update({field: FACT_EDITS[field](m["model"][field])}))
    else:
        _edit(directory, lambda m: m.update({field: TOP_EDITS[field](m[field])}))
    with pytest.raises(RuntimeInputError) as err:
        KVQSession(directory)
    assert "\n" not in str(err.value)
    if field in ("scaling", "max_position_embeddings", "vocab_size", "flavor", "dtype", "rope", "tie_word_embeddings"):
        assert "the manifest was edited" in str(err.value), str(err.value)


def test_validate_and_genai_refuse_an_edited_fact(root, gqa, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.genai import GenaiSession

    directory = shutil.copytree(gqa, tmp_path / "e")
    _edit(directory, lambda m: m["model"].update(max_position_embeddings=m["model"]["max_position_embeddings"] * 8))
    code, _, err = _validate(directory, root, "--baseline", directory)
    assert code == 1 and "model.max_position_embeddings" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(RuntimeInputError, match="model.max_position_embeddings"):
        GenaiSession(directory)


def test_a_doctored_calibration_file_with_a_recomputed_digest_is_refused(gqa, tmp_path):
    import numpy as np

    from kvq_export.calibrate import calibration_digest
    from kvq_export.errors import RuntimeInputError
    from kvq_export.manifest import load_static
    from kvq_export.runtime.session import KVQSession

    directory = shutil.copytree(gqa, tmp_path / "e")
    scales = load_static(directory, Manifest.load(directory))
    doctored = {layer: {part: {role: a * 2 for role, a in roles.items()} for part, roles in parts.items()}
                for layer, parts in scales.items()}
    np.savez(directory / "calibration.npz", **{f"{layer}.{part}.{role}": a for layer, parts in doctored.items()
                                               for part, roles in parts.items() for role, a in roles.items()})
    _edit(directory, lambda m: m["calibration"].update(digest=calibration_digest(doctored)))
    _rechecksum(directory)
    with pytest.raises(RuntimeInputError, match="holds other scales than the graph embeds"):
        KVQSession(directory)


# -- a live session keeps the export it opened -----------------------------------------------------------
def _reversed_tokenizer_model(path: Path) -> Path:
    """The tiny model with a tokenizer that maps every word to another id than the usual one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_tiny_model_dir(path)
    vocab = {"[UNK]": 0, **{w: len(WORDS) - i for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def test_a_session_keeps_its_tokenizer_when_the_export_is_replaced(root, model_dir, tmp_path):
    from kvq_export.runtime.session import KVQSession

    directory = export(str(model_dir), "kivi-2", tmp_path / "e")
    session = KVQSession(directory)
    before = session.generate(["w1 w2 w3"], 3)[0]
    export(str(_reversed_tokenizer_model(tmp_path / "rev")), "kivi-2", directory, force=True)
    assert KVQSession(directory).generate(["w1 w2 w3"], 1)[0].prompt_tokens != before.prompt_tokens  # new export
    after = session.generate(["w1 w2 w3"], 3)[0]  # the open session: its own graph and its own tokenizer
    assert (after.prompt_tokens, after.tokens, after.text) == (before.prompt_tokens, before.tokens, before.text)


def test_an_export_replaced_while_a_session_opens_is_refused(model_dir, tmp_path, monkeypatch):
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.session import KVQSession

    directory = export(str(model_dir), "kivi-2", tmp_path / "e")
    load = KVQSession._load_tokenizer

    def replace_then_load(self):
        export(str(model_dir), "int4-sym-g32", directory, force=True)
        return load(self)

    monkeypatch.setattr(KVQSession, "_load_tokenizer", replace_then_load)
    with pytest.raises(RuntimeInputError, match="was replaced or changed while this session opened it"):
        KVQSession(directory)


def test_a_genai_session_reads_nothing_from_a_replaced_export(root, model_dir, gqa, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.genai import GenaiSession

    directory = shutil.copytree(gqa, tmp_path / "e")
    session = GenaiSession(directory)
    before = session.generate([[1, 2, 3]], 3)[0].tokens
    export(str(model_dir), "ort-int4", directory, flavor="ort-gqa", force=True,
           calib_corpus=str(root / "words.txt"), calib_tokens=256)
    assert session.generate([[1, 2, 3]], 3)[0].tokens == before  # the graph it loaded
    with pytest.raises(RuntimeInputError, match="replaced or changed since this session opened it"):
        session.generate([[1, 2, 3]], 3, stop_at_eos=False)  # would load a graph from the new export


# -- every file of an export is checksummed; links and special files are refused ---------------------------
@pytest.mark.parametrize("which", ["kivi", "gqa"])
def test_every_file_of_an_export_has_a_checksum(request, which):
    directory = request.getfixturevalue(which)
    recorded = set(Manifest.load(directory).weights)
    on_disk = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} - {"kvq.json"}
    assert recorded == on_disk and {"tokenizer.json"} <= recorded
    if which == "gqa":
        assert {"genai_config.json", "calibration.npz", "model.genai.onnx"} <= recorded


MUTATIONS = ("flip", "append", "symlink-inside", "extra-file", "extra-subfolder-file", "linked-subfolder", "fifo")


def _mutate(directory: Path, name: str, how: str) -> None:
    path = directory / name
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "append":
        with open(path, "ab") as handle:
            handle.write(b" ")
    elif how == "symlink-inside":  # the same bytes, through a link to a copy inside the export
        shutil.move(path, directory / f"copy-{path.name}")
        path.symlink_to(directory / f"copy-{path.name}")
    elif how == "extra-file":
        (directory / "added.json").write_text("{}")
    elif how == "extra-subfolder-file":
        (directory / "sub").mkdir(exist_ok=True)
        shutil.copy(path, directory / "sub" / path.name)
    elif how == "linked-subfolder":
        (directory / "sub").symlink_to(directory)
    elif how == "fifo":
        os.mkfifo(directory / "pipe")


def test_any_changed_added_or_linked_file_is_refused(kivi, gqa, tmp_path):
    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.session import KVQSession

    counter = iter(range(10**6))

    @seed(SEED)
    @settings(max_examples=30, deadline=None, database=None)
    @given(which=st.sampled_from(["kivi", "gqa"]), data=st.data(), how=st.sampled_from(MUTATIONS))
    def check(which, data, how):
        source = kivi if which == "kivi" else gqa
        name = data.draw(st.sampled_from(sorted(Manifest.load(source).weights)))
        directory = shutil.copytree(source, tmp_path / f"m{next(counter)}")
        _mutate(directory, name, how)
        with pytest.raises(RuntimeInputError) as err:
            KVQSession(directory)
        assert "\n" not in str(err.value)
        if how in ("symlink-inside", "linked-subfolder"):
            assert "symbolic link" in str(err.value)
        shutil.rmtree(directory)

    check()


def test_genai_config_pointing_into_a_subfolder_of_another_model_is_refused(root, model_dir, gqa, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.genai import GenaiSession

    other = export(str(save_tiny_model_dir(tmp_path / "other-model", "llama-tied")), "ort-int8", tmp_path / "other",
                   flavor="ort-gqa", calib_corpus=str(root / "words.txt"), calib_tokens=256)
    directory = shutil.copytree(gqa, tmp_path / "e")
    (directory / "sub").mkdir()
    for name in ("model.genai.onnx", "model.onnx.data"):  # another model's graph, as links ...
        (directory / "sub" / name).symlink_to(other / name)
    config = json.loads((directory / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "sub/model.genai.onnx"
    (directory / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeInputError, match="outside the export directory"):
        GenaiSession(directory)
    for name in ("model.genai.onnx", "model.onnx.data"):  # ... or copied in, every checksum recomputed
        (directory / "sub" / name).unlink()
        shutil.copy(other / name, directory / "sub" / name)
    _edit(directory, lambda m: m["weights"].update({f"sub/{n}": {} for n in ("model.genai.onnx", "model.onnx.data")}))
    _rechecksum(directory)
    with pytest.raises(RuntimeInputError, match=r"genai_config.json is not the one kvq wrote .*model.decoder.filename"):
        GenaiSession(directory)
