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
from kvq_export.export.exporter import export_model
from kvq_export.manifest import Manifest
from kvq_export.model_source import resolve_spec
from kvq_export.presets import resolve_scheme
from kvq_export.request import CalibrationSpec

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


def words_calibration(root: Path) -> CalibrationSpec:
    """Calibration on the tiny word corpus from its first token (it is far shorter than the held-out offset)."""
    return CalibrationSpec(corpus=str(root / "words.txt"), tokens=256, offset=0)


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
    return export_model(str(model_dir), "kivi-2", root / "kivi")


@pytest.fixture(scope="module")
def gqa(root, model_dir):
    return export_model(str(model_dir), "ort-int8", root / "gqa", flavor="ort-gqa", calibration=words_calibration(root))


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
    other = export_model(str(other_dir), "kivi-2", tmp_path / "other")
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
    directory = export_model(str(source), "kivi-2", tmp_path / "e")
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
    base = export_model(str(other_dir), "fp16", tmp_path / "base")
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
TOP_EDITS = {"flavor": lambda v: "ort-gqa" if v == "reference" else "reference", "dtype": lambda v: "fp16",
             "opset": lambda v: v - 1}


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
    if field in ("scaling", "max_position_embeddings", "vocab_size", "flavor", "dtype", "opset", "rope",
                 "tie_word_embeddings"):
        assert "the manifest was edited" in str(err.value), str(err.value)


def test_an_edited_eos_bos_or_pad_id_is_refused_on_load(kivi, gqa, tmp_path):
    """An EOS id edited into kvq.json cut every answer at the first such token, with exit code 0."""
    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.session import KVQSession

    counter = iter(range(10**6))

    @seed(SEED)
    @settings(max_examples=12, deadline=None, database=None)
    @given(which=st.sampled_from(["kivi", "gqa"]), field=st.sampled_from(["eos_token_id", "bos_token_id",
                                                                          "pad_token_id"]),
           value=st.integers(0, 127) | st.lists(st.integers(0, 127), min_size=1, max_size=3))
    def check(which, field, value):
        directory = shutil.copytree(kivi if which == "kivi" else gqa, tmp_path / f"e{next(counter)}")
        _edit(directory, lambda m: m["tokenizer"].update({field: value}))
        with pytest.raises(RuntimeInputError, match=f"tokenizer.{field}") as err:
            KVQSession(directory)
        assert "\n" not in str(err.value)
        shutil.rmtree(directory)

    check()


@pytest.mark.parametrize("which", ["kivi", "gqa"])
@pytest.mark.parametrize("edit", ["rename input", "input dtype", "rename output", "output dtype", "drop input",
                                  "add input", "unknown dtype"])
def test_edited_inputs_or_outputs_are_refused_on_load(request, which, edit, tmp_path):
    """The declared inputs/outputs (the TensorRT builder's profiles read them) were never compared with the graph."""
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.session import KVQSession

    directory = shutil.copytree(request.getfixturevalue(which), tmp_path / "e")
    change = {
        "rename input": lambda m: m["inputs"][1].update(name="attention_mask_"),
        "input dtype": lambda m: m["inputs"][0].update(dtype="int32"),
        "rename output": lambda m: m["outputs"][0].update(name="logits_"),
        "output dtype": lambda m: m["outputs"][0].update(dtype="float16"),
        "drop input": lambda m: m["inputs"].pop(1),
        "add input": lambda m: m["inputs"].append({"name": "position_ids", "dtype": "int64", "shape": ["batch"]}),
        "unknown dtype": lambda m: m["inputs"][0].update(dtype="int7"),
    }[edit]
    _edit(directory, change)
    with pytest.raises(RuntimeInputError, match="manifest|graph") as err:
        KVQSession(directory)
    assert "\n" not in str(err.value)


def test_a_field_kvq_does_not_read_is_refused_on_load(kivi):
    """An added key (``model.num_experts``, a top-level ``sliding_window``) was silently ignored."""
    import copy

    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    from kvq_export.errors import RuntimeInputError

    data = json.loads((kivi / "kvq.json").read_text())

    @seed(SEED)
    @settings(max_examples=40, deadline=None, database=None)
    @given(where=st.sampled_from(["", "model.", "model.rope."]),
           key=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12),
           value=st.sampled_from([1, "x", None, [], {}]))
    def check(where, key, value):
        edited = copy.deepcopy(data)
        section = edited if not where else edited["model"] if where == "model." else edited["model"]["rope"]
        if key in section:
            return
        section[key] = value
        with pytest.raises(RuntimeInputError, match="unknown field") as err:
            Manifest.from_dict(edited)
        assert f"{where}{key}" in str(err.value) or "\n" in key or "\r" in key

    check()
    assert Manifest.from_dict(copy.deepcopy(data)).to_dict() == data  # what kvq writes, it reads


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

    from kvq_export.calibration import Calibration
    from kvq_export.errors import RuntimeInputError
    from kvq_export.manifest import load_static
    from kvq_export.runtime.session import KVQSession

    directory = shutil.copytree(gqa, tmp_path / "e")
    scales = load_static(directory, Manifest.load(directory))
    doctored = {layer: {part: {role: a * 2 for role, a in roles.items()} for part, roles in parts.items()}
                for layer, parts in scales.items()}
    np.savez(directory / "calibration.npz", **{f"{layer}.{part}.{role}": a for layer, parts in doctored.items()
                                               for part, roles in parts.items() for role, a in roles.items()})
    _edit(directory, lambda m: m["calibration"].update(digest=Calibration.of(doctored).digest()))
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

    directory = export_model(str(model_dir), "kivi-2", tmp_path / "e")
    before = KVQSession(directory).generate(["w1 w2 w3"], 3)[0]  # what this export answers
    session = KVQSession(directory)  # opened; nothing generated yet
    export_model(str(_reversed_tokenizer_model(tmp_path / "rev")), "kivi-2", directory, force=True)
    assert KVQSession(directory).generate(["w1 w2 w3"], 1)[0].prompt_tokens != before.prompt_tokens  # new export
    after = session.generate(["w1 w2 w3"], 3)[0]  # the open session: its own graph and its own tokenizer
    assert (after.prompt_tokens, after.tokens, after.text) == (before.prompt_tokens, before.tokens, before.text)


def test_an_export_replaced_while_a_session_opens_is_refused(model_dir, tmp_path, monkeypatch):
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime import session as session_module
    from kvq_export.runtime.session import KVQSession

    directory = export_model(str(model_dir), "kivi-2", tmp_path / "e")
    load = session_module.load_tokenizer

    def replace_then_load(*args):  # the session reads its tokenizer last, after the graph and the scales
        export_model(str(model_dir), "int4-sym-g32", directory, force=True)
        return load(*args)

    monkeypatch.setattr(session_module, "load_tokenizer", replace_then_load)
    with pytest.raises(RuntimeInputError, match="was replaced or changed while this session opened it"):
        KVQSession(directory)


def test_a_tokenizer_onnxruntime_genai_cannot_read_is_never_handed_to_it(gqa, monkeypatch):
    """onnxruntime-genai parses a WordLevel tokenizer as BPE merges and fails; that failure has crashed a process."""
    og = pytest.importorskip("onnxruntime_genai")
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.genai import GenaiSession

    monkeypatch.setattr(og, "Tokenizer", lambda model: pytest.fail("og.Tokenizer was given a WordLevel tokenizer"))
    session = GenaiSession(gqa)
    with pytest.raises(RuntimeInputError, match="tokenizer.json model is WordLevel; onnxruntime-genai reads BPE"):
        session.encode("w1 w2")
    assert len(session.generate([[1, 2, 3]], 2)[0].tokens) == 2  # token ids still run


def test_a_genai_session_reads_nothing_from_a_replaced_export(root, model_dir, gqa, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.genai import GenaiSession

    directory = shutil.copytree(gqa, tmp_path / "e")
    session = GenaiSession(directory)
    before = session.generate([[1, 2, 3]], 3)[0].tokens
    export_model(str(model_dir), "ort-int4", directory, flavor="ort-gqa", force=True,
           calibration=words_calibration(root))
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

    other_dir = save_tiny_model_dir(tmp_path / "other-model", "llama-tied")
    other = export_model(str(other_dir), "ort-int8", tmp_path / "other", flavor="ort-gqa",
                         calibration=words_calibration(root))
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


# -- a comparison that never leaves the fp16 window says so (and the defaults leave it) ----------------------
@pytest.fixture(scope="module")
def pair(root, model_dir):
    return (export_model(str(model_dir), "fp16", root / "pair-fp16"),
            export_model(str(model_dir), "kivi-2", root / "pair-kivi2"))


def test_kvq_compare_defaults_reach_past_the_window(pair, caplog):
    fp16, kivi2 = pair
    code, out, err = kvq("compare", fp16, kivi2)  # before: a 48-token prompt, all in fp16, "match"
    assert code == 1 and "differ beyond tolerance" in err, out + err
    with caplog.at_level("WARNING"):
        code, out, err = kvq("compare", fp16, kivi2, "--prompt-len", "48")
    assert code == 0 and "match within tolerance" in out
    assert "keeps its first 128 tokens in high precision" in caplog.text and "not compared" in caplog.text


def test_the_sized_prompt_puts_quantized_tokens_in_the_longest_rows():
    import dataclasses

    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    from kvq_export.errors import KVQError
    from kvq_export.presets import PRESETS
    from kvq_export.validate.compare import comparison_prompt_len, high_precision_window

    class _Manifest:  # what the two functions read
        def __init__(self, scheme):
            self.scheme = scheme
            self.model = type("M", (), {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
                                        "max_position_embeddings": 4096})()

    names = sorted(n for n, (s, _) in PRESETS.items() if s.quantized)

    @seed(SEED)
    @settings(max_examples=80, deadline=None, database=None)
    @given(name=st.sampled_from(names), residual=st.sampled_from([None, 0, 16, 64, 128, 300]), batch=st.integers(1, 8))
    def check(name, residual, batch):
        scheme = PRESETS[name][0]
        try:
            if residual is not None and not scheme.needs_calibration:
                scheme = dataclasses.replace(scheme, residual_length=residual)
            manifest = _Manifest(scheme)
            window = high_precision_window(manifest)
        except KVQError:  # a window this scheme's groups cannot have, or a preset this geometry cannot hold
            return
        length = comparison_prompt_len([manifest], batch=batch)
        rows = [length - min(r * (length // 4), length - 1) for r in range(min(batch, 2))]  # as prompt_batch pads
        assert min(rows) > window and length >= 48

    check()


def test_validate_says_when_nothing_left_the_window(root, pair, tmp_path, monkeypatch):
    import matplotlib.axes

    fp16, kivi2 = pair
    code, out, err = _validate(kivi2, root, "--baseline", fp16, "--gen-tokens", "4", "--json", tmp_path / "r.json",
                               "--report", tmp_path / "r.html")
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["window"] == {"tokens": 128, "windows_exceed": False, "greedy_prompts_exceeding": 0}
    assert "WARNING" in out and "never leave the 128-token high-precision window" in " ".join(out.split())
    lines = []
    draw = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline",
                        lambda self, x, **kw: (lines.append((x, kw["label"])), draw(self, x, **kw))[1])
    from dataclasses import replace

    from kvq_export.validate.report import write_html
    from kvq_export.validate.result import ValidationResult

    typed = ValidationResult.from_dict(result)
    longer = replace(typed.token, scores=replace(typed.token.scores, kl_by_position=(0.0,) * 200))
    write_html(replace(typed, token=longer), tmp_path / "long.html")
    assert lines == [(128.5, "high-precision window ends (128 tokens)")]


# -- ranks with ties --------------------------------------------------------------------------------------
def test_rank_agreement_is_spearman_with_average_ranks_for_ties():
    import numpy as np
    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    from kvq_export.validate.attention import average_ranks, rank_agreement

    def reference(a, b):  # the definition: Pearson correlation of average ranks, ranks by counting
        def ranks(x):
            return np.array([(x < v).sum() + ((x == v).sum() + 1) / 2 for v in x])

        ra, rb = ranks(a) - ranks(a).mean(), ranks(b) - ranks(b).mean()
        denom = np.sqrt((ra**2).sum() * (rb**2).sum())
        return (ra * rb).sum() / denom if denom else float("nan")

    values = st.lists(st.integers(0, 4), min_size=2, max_size=30)  # few distinct values: ties everywhere

    @seed(SEED)
    @settings(max_examples=300, deadline=None, database=None)
    @given(pair=values.flatmap(lambda a: st.tuples(st.just(a), st.lists(st.integers(0, 4), min_size=len(a),
                                                                        max_size=len(a)))),
           perm_seed=st.integers(0, 2**32 - 1))
    def check(pair, perm_seed):
        a, b = (np.array(x, dtype=float) for x in pair)
        want = reference(a, b)
        got = rank_agreement(a, b)
        assert (np.isnan(got) and np.isnan(want)) or got == pytest.approx(want, abs=1e-12)
        perm = np.random.default_rng(perm_seed).permutation(a.size)  # the heads' order does not matter
        again = rank_agreement(a[perm], b[perm])
        assert (np.isnan(got) and np.isnan(again)) or again == pytest.approx(got, abs=1e-12)
        assert sorted(average_ranks(a)) == pytest.approx(sorted(reference_ranks(a)))

    def reference_ranks(x):
        return [(x < v).sum() + ((x == v).sum() + 1) / 2 for v in x]

    check()
    # heads sharing a KV head: equal key error; the order inside each pair says nothing
    mse = np.array([1, 1, 2, 2, 3, 3.0])
    up, swapped = np.array([5, 6, 7, 8, 9, 10.0]), np.array([6, 5, 8, 7, 10, 9.0])
    assert rank_agreement(mse, up) == rank_agreement(mse, swapped) == pytest.approx(16 / np.sqrt(16 * 17.5))
    assert rank_agreement(mse, mse * 10) == pytest.approx(1.0)
    assert np.isnan(rank_agreement(np.zeros(4), np.arange(4.0)))  # no order: no agreement claimed


# -- tolerances and thresholds are finite and non-negative; validate can be a gate -------------------------
FLOAT_OPTIONS = [  # (command line before the option, option)
    (["compare", "{e}", "{e}"], "--logits-atol"), (["compare", "{e}", "{e}"], "--logits-rtol"),
    (["compare", "{e}", "{e}"], "--cache-atol"), (["compare", "{e}", "{e}"], "--cache-rtol"),
    (["validate", "{e}"], "--max-ppl-delta"), (["validate", "{e}"], "--min-top1"), (["validate", "{e}"], "--max-kl"),
    (["generate", "{e}", "--prompt", "w1"], "--temperature"), (["generate", "{e}", "--prompt", "w1"], "--top-p"),
    (["generate", "{e}", "--prompt", "w1"], "--repetition-penalty"), (["demo"], "--repetition-penalty"),
    (["export", "--scheme", "fp16", "--out", "{e}/x"], "--percentile"),
    (["calibrate", "--out", "{e}/x.json"], "--percentile"),
    (["plan", "--out", "{e}/x.json"], "--budget"), (["plan", "--out", "{e}/x.json", "--budget", "4"], "--percentile"),
    (["serve", "{e}"], "--shutdown-timeout"),
]
INT_OPTIONS = [(["compare", "{e}", "{e}"], "--seed"), (["generate", "{e}", "--prompt", "w1"], "--seed")]


def _bad_floats():
    from hypothesis import strategies as st

    return st.one_of(st.sampled_from(["nan", "NaN", "inf", "-inf", "+inf", "1e999", "-1e-300", "abc", ""]),
                     st.floats(max_value=-1e-12, allow_nan=False, allow_infinity=False).map(repr))


def test_every_float_option_refuses_non_finite_and_negative_values(tmp_path):
    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    @seed(SEED)
    @settings(max_examples=120, deadline=None, database=None)
    @given(case=st.sampled_from(FLOAT_OPTIONS), value=_bad_floats())
    def check(case, value):
        args, option = case
        code, out, err = kvq(*[a.format(e=tmp_path) for a in args], f"{option}={value}")
        assert code == 2, (args, option, value, out)
        assert "allowed: a finite number" in err and option in err, err

    check()


@pytest.mark.parametrize(("args", "option"), INT_OPTIONS)
def test_seeds_are_non_negative(tmp_path, args, option):
    code, _, err = kvq(*[a.format(e=tmp_path) for a in args], option, "-1")
    assert code == 2 and "-1 is not in the range x>=0" in err


def test_finite_float_accepts_its_range_and_nothing_else():
    import math

    import click
    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    from kvq_export.cli_types import FiniteFloat

    @seed(SEED)
    @settings(max_examples=300, deadline=None, database=None)
    @given(low=st.floats(-10, 10), span=st.floats(0, 10), min_open=st.booleans(), max_open=st.booleans(),
           value=st.one_of(st.floats(), st.floats(-30, 30)))
    def check(low, span, min_open, max_open, value):
        kind = FiniteFloat(low, low + span, min_open=min_open, max_open=max_open)
        inside = math.isfinite(value) and (low < value if min_open else low <= value) and (
            value < low + span if max_open else value <= low + span)
        try:
            assert kind.convert(repr(value), None, None) == value and inside
        except click.BadParameter:
            assert not inside

    check()


def test_validate_gates_exit_1_with_one_line_after_writing_every_number(root, model_dir, tmp_path):
    directory = export_model(str(model_dir), "int4-sym-g32", tmp_path / "int4")
    base = export_model(str(model_dir), "fp16", tmp_path / "fp16")
    common = ["--baseline", base, "--window-len", "48", "--json", tmp_path / "r.json"]
    code, _, err = _validate(directory, root, *common, "--max-ppl-delta", "0", "--min-top1", "1", "--max-kl", "0")
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["token"]["kl"]["mean"] > 0  # the run itself completed and was written
    assert code == 1 and len(err.strip().splitlines()) == 1 and "validation gate missed" in err
    assert "--max-kl 0" in err and "--min-top1 1" in err
    code, _, err = _validate(directory, root, *common, "--max-ppl-delta", "10", "--min-top1", "0", "--max-kl", "100")
    assert code == 0, err


# -- no command writes inside an export directory -----------------------------------------------------------
OUTPUTS = [  # (command line with {out} for the path, whether the path is a directory)
    (["validate", "{e}", "--json", "{out}"], False), (["validate", "{e}", "--report", "{out}.html"], False),
    (["plan", "--out", "{out}", "--budget", "4"], False), (["plan", "--json", "{out}", "--out", "x.json",
                                                            "--budget", "4"], False),
    (["calibrate", "--out", "{out}"], False), (["bench", "--json", "{out}", "--schemes", "fp16"], False),
    (["bench", "--plot", "{out}", "--schemes", "fp16"], False), (["bench", "--work-dir", "{out}", "--schemes", "fp16"],
                                                                 True),
    (["demo", "--work-dir", "{out}"], True), (["build", "{e}", "--out", "{out}"], False),
    (["export", "--out", "{out}", "--scheme", "fp16"], True),
]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_no_command_writes_inside_an_export(kivi, tmp_path):
    from hypothesis import given, seed, settings
    from hypothesis import strategies as st

    before = _snapshot(kivi)
    targets = st.sampled_from(["kvq.json", "model.onnx", "model.onnx.data", "tokenizer.json", "new.json", "sub/x.json",
                               "sub/deeper/x"])

    @seed(SEED)
    @settings(max_examples=60, deadline=None, database=None)
    @given(case=st.sampled_from(OUTPUTS), name=targets, via_link=st.booleans())
    def check(case, name, via_link):
        args, is_dir = case
        base = kivi
        if via_link:  # a symlink outside the export that leads into it: resolved, still inside
            link = tmp_path / "link"
            if not link.exists():
                link.symlink_to(kivi)
            base = link
        out = base / name
        code, _, err = kvq(*[a.format(e=kivi, out=out) for a in args])
        if code == 2:  # click's own path check refuses a file given for a directory first
            assert is_dir and (kivi / name).is_file() and "is a file" in err, err
            return
        assert code == 1, (args, name, err)
        assert len(err.strip().splitlines()) == 1 and "lies inside the kvq export" in err, err

    check()
    assert _snapshot(kivi) == before


@pytest.mark.parametrize("where", ["the export", "a folder inside it", "deeper inside it"])
def test_a_cache_directory_inside_an_export_is_refused(root, kivi, tmp_path, monkeypatch, where):
    """The automatic baseline is written under the cache: with KVQ_CACHE_DIR in an export, it went into the export."""
    directory = shutil.copytree(kivi, tmp_path / "e")
    before = _snapshot(directory)
    cache = {"the export": directory, "a folder inside it": directory / "cache",
             "deeper inside it": directory / "a" / "b"}[where]
    monkeypatch.setenv("KVQ_CACHE_DIR", str(cache))
    code, _, err = _validate(directory, root)
    assert code == 1 and len(err.strip().splitlines()) == 1 and f"lies inside the kvq export {directory}" in err, err
    assert "KVQ_CACHE_DIR" in err and _snapshot(directory) == before
    assert sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")) == sorted(before)


def test_library_report_writers_refuse_an_export_path(kivi):
    from kvq_export.errors import OutputPathError
    from kvq_export.validate.report import write_html, write_json

    for write in (write_json, write_html):
        with pytest.raises(OutputPathError, match="lies inside the kvq export"):
            write({}, kivi / "kvq.json")


def test_the_default_engine_path_lies_beside_the_export(kivi):
    from kvq_export.manifest import export_containing
    from kvq_export.trt.engine import default_engine_path

    assert export_containing(default_engine_path(kivi)) is None
    assert default_engine_path(kivi).parent == kivi.resolve().parent


@pytest.mark.parametrize("name, make, resolve", [
    ("fp16", lambda p: p.write_text("{}"), resolve_scheme),
    ("smollm2", lambda p: p.mkdir(), resolve_spec),
])
def test_a_name_that_is_also_a_path_here_says_which_one_is_used(tmp_path, monkeypatch, caplog, name, make, resolve):
    """A preset or built-in name always wins over a same-named path in the current directory, and says so once."""
    monkeypatch.chdir(tmp_path)
    make(tmp_path / name)
    with caplog.at_level("WARNING"):
        resolve(name)
        resolve(name)
    said = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(said) == 1 and f"give ./{name} to use it" in said[0], said
