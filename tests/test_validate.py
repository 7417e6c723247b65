"""Validation: analytic attention cases, end-to-end on tiny exports, kvq compare, Polygraphy commands."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_harness import kvq
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import WORDS, save_tiny_model_dir, tiny_model, tiny_tokenizer

from kvq_export.errors import KVQError
from kvq_export.export.exporter import export_model
from kvq_export.manifest import Manifest
from kvq_export.request import CalibrationSpec
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.validate.attention import METRICS, AttentionSample, attention_metrics, rank_agreement
from kvq_export.validate.result import ValidationResult
from kvq_export.validate.runner import ValidateConfig, validate

ROOT = Path(__file__).resolve().parents[1]


# -- analytic cases on the metric definitions -------------------------------------------------------------
def _sample(seed, hq=6, hkv=2, n=40, d=16, key_noise=0.0, value_noise=0.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((hq, d))
    k, v = rng.standard_normal((hkv, n, d)), rng.standard_normal((hkv, n, d))
    return AttentionSample(q, k, v, k + key_noise * rng.standard_normal(k.shape),
                           v + value_noise * rng.standard_normal(v.shape), d**-0.5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), noise=st.floats(1e-3, 0.5))
def test_values_only_leaves_attention_probabilities_unchanged(seed, noise):
    m = attention_metrics(_sample(seed, value_noise=noise))
    for name in ("score_shift_max", "kl_keys", "tv_keys", "key_induced", "out_rel_keys", "cross_term"):
        assert np.all(m[name] == 0), name
    assert np.all(m["top1_keys"] == 1) and np.all(m["top2_flip"] == 0)
    assert np.all(m["value_induced"] > 0)
    assert np.allclose(m["out_rel_values"], m["out_rel_both"])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), noise=st.floats(1e-3, 0.5))
def test_keys_only_has_no_value_induced_term(seed, noise):
    m = attention_metrics(_sample(seed, key_noise=noise))
    assert np.all(m["value_induced"] == 0) and np.all(m["cross_term"] == 0) and np.all(m["value_mse"] == 0)
    assert np.all(m["key_induced"] > 0)
    assert np.allclose(m["out_rel_keys"], m["key_induced"]) and np.allclose(m["out_rel_keys"], m["out_rel_both"])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), kn=st.floats(1e-3, 1.0), vn=st.floats(1e-3, 1.0))
def test_key_value_and_cross_terms_reconstruct_the_total(seed, kn, vn):
    m = attention_metrics(_sample(seed, key_noise=kn, value_noise=vn))
    assert np.all(m["decomposition_residual"] < 1e-12)
    # triangle inequality on the relative norms
    assert np.all(m["out_rel_both"] <= m["key_induced"] + m["value_induced"] + m["cross_term"] + 1e-12)


def test_no_quantization_is_zero_everywhere():
    m = attention_metrics(_sample(3))
    for name in METRICS:
        if name in ("top1_keys", "topk_keys"):
            assert np.all(m[name] == 1)
        elif name == "margin":
            assert np.all(m[name] >= 0)
        else:
            assert np.all(m[name] == 0), name


def test_top2_flip_detects_a_swapped_order():
    s = _sample(5, n=3)
    scores = np.einsum("hd,hnd->hn", s.q[:2], s.keys[:1].repeat(2, 0))
    assert scores.shape == (2, 3)
    k_hat = s.keys.copy()
    k_hat[:, [0, 1, 2]] = k_hat[:, [2, 1, 0]]  # permuting keys changes which key scores highest
    m = attention_metrics(AttentionSample(s.q, s.keys, s.values, k_hat, s.values, s.scaling))
    assert m["top1_keys"].mean() < 1 or m["top2_flip"].mean() > 0


def test_rank_agreement():
    assert rank_agreement(np.array([1, 2, 3.0]), np.array([10, 20, 30.0])) == pytest.approx(1.0)
    assert rank_agreement(np.array([1, 2, 3.0]), np.array([3, 2, 1.0])) == pytest.approx(-1.0)


# -- end to end on tiny exports -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    model_dir = save_tiny_model_dir(root / "tiny-llama")
    random.seed(0)
    corpus = root / "words.txt"
    corpus.write_text(" ".join(random.choice(WORDS) for _ in range(4000)))
    fp16 = TensorQuant.fp16()
    schemes = {
        "fp16": "fp16",
        "kivi-2": "kivi-2",
        "int4-sym-g32": "int4-sym-g32",
        "values-only": KVQuantScheme(key=fp16, value=TensorQuant(format="int", bits=2, group_size=32), name="vo"),
        "keys-only": KVQuantScheme(key=TensorQuant(format="int", bits=2, group_size=32), value=fp16, name="ko"),
    }
    dirs = {name: export_model(str(model_dir), scheme, root / name) for name, scheme in schemes.items()}
    return {"root": root, "model_dir": model_dir, "corpus": corpus, **dirs}


def _config(tiny, **kw):
    base = dict(corpus=str(tiny["corpus"]), windows=3, window_len=96, prompts=("w1 w2 w3", "w7"), gen_tokens=12,
                attention_samples=3)
    return ValidateConfig(**{**base, **kw})


def test_values_only_scheme_leaves_attention_unchanged_on_the_real_graph(tiny):
    r = validate(tiny["values-only"], tiny["fp16"], _config(tiny), progress=False)
    s = r.attention.summary
    assert r.attention.samples == 3 * 3 * 2  # positions x windows x layers
    assert s.kl_keys == 0 and s.score_shift_max == 0 and s.key_induced == 0 and s.top1_keys == 1
    assert s.value_induced > 0


def test_keys_only_scheme_has_no_value_induced_term_on_the_real_graph(tiny):
    r = validate(tiny["keys-only"], tiny["fp16"], _config(tiny), progress=False)
    s = r.attention.summary
    assert s.value_induced == 0 and s.cross_term == 0 and s.key_induced > 0 and s.score_shift_max > 0
    assert s.decomposition_residual < 1e-12


def test_no_quantization_gives_zero_everywhere(tiny):
    r = validate(tiny["fp16"], tiny["fp16"], _config(tiny), progress=False)
    tok, s = r.token.scores, r.attention.summary
    assert tok.perplexity == tok.reference_perplexity and tok.kl.max == 0 and tok.top1_agreement == 1
    assert r.token.greedy.identical_fraction == 1
    for name in ("key_mse", "value_mse", "score_shift_max", "kl_keys", "out_rel_both", "key_induced",
                 "value_induced"):
        assert getattr(s, name) == 0, name
    assert r.memory.prediction_matches and r.memory.ratio == 1


def test_rotated_streams_are_analysed_in_one_basis(tiny):
    """Probes, exact and decoded K/V of a rotated export share the stored basis.

    No error without quantization, and a values-only rotated scheme still leaves attention probabilities unchanged.
    """
    fp16 = TensorQuant.fp16()
    rot = TensorQuant(format="fp16", bits=16, rotation="hadamard")
    plain = KVQuantScheme(key=rot, value=rot, name="fp16-rot")
    values = KVQuantScheme(key=fp16, value=TensorQuant(format="int", bits=2, group_size=32, rotation="hadamard"),
                           name="vo-rot")
    dirs = {s.name: export_model(str(tiny["model_dir"]), s, tiny["root"] / s.name) for s in (plain, values)}
    s = validate(dirs["fp16-rot"], tiny["fp16"], _config(tiny, gen_tokens=0), progress=False).attention.summary
    for name in ("key_mse", "value_mse", "score_shift_max", "key_induced", "value_induced", "out_rel_both"):
        assert getattr(s, name) < 1e-9, name
    r = validate(dirs["vo-rot"], tiny["fp16"], _config(tiny, gen_tokens=0), progress=False)
    s, plain_values = r.attention.summary, validate(tiny["values-only"], tiny["fp16"], _config(
        tiny, gen_tokens=0), progress=False).attention.summary
    assert s.kl_keys == 0 and s.key_induced == 0 and s.value_induced > 0
    assert 0.3 < s.value_mse / plain_values.value_mse < 3  # same 2-bit error size, not a basis mismatch


def test_strict_decode_perplexity_equals_pytorch_full_forward(tiny):
    import dataclasses

    from kvq_export.corpus import load_corpus, token_windows
    from kvq_export.presets import get_preset
    from kvq_export.runtime.session import KVQSession

    fp32 = export_model(str(tiny["model_dir"]), dataclasses.replace(get_preset("fp16"), hp_dtype="fp32", name="fp32"),
                        tiny["root"] / "fp32")
    r = validate(tiny["kivi-2"], fp32, _config(tiny, attention_samples=0), progress=False)
    windows = token_windows(KVQSession(fp32).tokenizer, load_corpus(str(tiny["corpus"])), 3, 96)
    model = tiny_model("llama")
    with torch.no_grad():
        logits = model(torch.tensor(windows)).logits.double()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(windows)[:, 1:, None]).mean()
    assert r.token.scores.reference_perplexity == pytest.approx(float(torch.exp(nll)), rel=1e-4)


def test_a_window_longer_than_the_positions_is_refused_before_anything_runs(tiny):
    top = Manifest.load(tiny["kivi-2"]).model.max_position_embeddings
    with pytest.raises(KVQError, match=rf"window length {top + 1} \(--window-len\) exceeds the {top} positions"):
        validate(tiny["kivi-2"], tiny["fp16"], _config(tiny, window_len=top + 1), progress=False)


def test_quantized_validation_reports_every_section(tiny, tmp_path):
    from kvq_export.validate.report import summary_rows, write_html, write_json

    r = validate(tiny["kivi-2"], tiny["fp16"], _config(tiny, window_len=200), progress=False)
    assert r.attention.summary.key_mse > 0  # keys past the 128-token window got quantized
    assert r.memory.prediction_matches and r.memory.measured_bytes < r.memory.fp16_bytes
    assert len(r.latency.buckets) == 4 and r.latency.ratio > 0
    assert len(r.attention.key_error_hurts_most) == 8  # 2 layers x 4 heads, top 10 capped
    json.loads(write_json(r, tmp_path / "r.json").read_text())
    page = write_html(r, tmp_path / "r.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "key error hurts most" in page.lower()
    assert len(summary_rows(r)) >= 10
    assert dict(summary_rows(r))["scheme"].endswith(" vs fp16 (reference) baseline")  # the baseline it ran against


def test_baseline_is_exported_on_the_fly(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path))
    r = validate(tiny["int4-sym-g32"], None, _config(tiny, attention_samples=0, gen_tokens=0), progress=False)
    assert Path(r.baseline).parent == tmp_path / "exports" and r.token.scores.reference_perplexity > 0


def test_ort_gqa_export_validates_like_the_reference_flavour(tiny):
    """Fused RoPE leaves no post-RoPE q/k in the graph; the probed session rotates the projections itself.

    Same scheme, same static scales, two flavours: the analyses must agree (GQA quantizes fp32 K/V where the
    reference rounds them to fp16 first, so a few codes differ by one: close, not identical).
    """
    calib = dict(calibration=CalibrationSpec(corpus=str(tiny["corpus"]), tokens=512, offset=0))
    dirs = {flavor: export_model(str(tiny["model_dir"]), "ort-int8", tiny["root"] / f"ort-int8-{flavor}", flavor=flavor,
                                 **calib) for flavor in ("ort-gqa", "reference")}
    config = _config(tiny, gen_tokens=4)
    got, want = (validate(dirs[f], tiny["fp16"], config, progress=False) for f in ("ort-gqa", "reference"))
    assert got.flavor == "ort-gqa" and got.attention.samples == want.attention.samples == 18
    assert got.memory.prediction_matches
    s, w = got.attention.summary, want.attention.summary
    for name in ("key_mse", "value_mse", "out_rel_both", "key_induced", "value_induced"):
        assert getattr(s, name) > 0 and getattr(s, name) == pytest.approx(getattr(w, name), rel=0.1), name
    assert got.token.scores.perplexity == pytest.approx(want.token.scores.perplexity, rel=1e-3)
    _assert_json_form(got, "calibrated")


# -- the result's JSON form ---------------------------------------------------------------------------------
#: ``kvq validate --json`` files of tiny exports, as written: scored attention, greedy and calibration with the
#: weight-only line skipped; a scored weight-only line with attention and greedy skipped; constant rankings (NaN).
PINS = json.loads((ROOT / "tests" / "data" / "validate_pins.json").read_text())
#: Forms that are another object's own ``to_dict()``: the scheme's and the weights' keys are not validate's.
OWN_FORMS = {"baseline_scheme", "scheme", "weights", "memory.weights", "memory.baseline_weights"}


def _layout(value, path=""):
    """Every key path of a JSON form in order, with its value's type: a list by its first item, a position as <n>."""
    if isinstance(value, dict) and path not in OWN_FORMS:
        paths = [_layout(v, f"{path}.{'<n>' if k.isdigit() else k}".lstrip(".")) for k, v in value.items()]
        return list(dict.fromkeys(p for item in paths for p in item)) or [f"{path}: dict"]
    if isinstance(value, list):
        return _layout(value[0], f"{path}[]") if value else [f"{path}: list"]
    return [f"{path}: {type(value).__name__}"]


def _assert_json_form(result: ValidationResult, pin: str) -> None:
    """``result``'s JSON form has the layout of the written file ``pin`` and reads back to the same text."""
    text = result.to_json()
    assert ValidationResult.from_dict(json.loads(text)).to_json() == text
    assert _layout(json.loads(text)) == _layout(PINS[pin])


@pytest.mark.parametrize("name", sorted(PINS))
def test_a_written_result_reads_back_byte_for_byte(name):
    result = ValidationResult.from_dict(PINS[name])
    assert result.to_json() == json.dumps(PINS[name], indent=2)  # every key, in order, every value


def test_the_pins_hold_every_optional_section():
    layouts = {name: "\n".join(_layout(pin)) for name, pin in PINS.items()}
    assert "calibration.windows_overlap_calibration: bool" in layouts["calibrated"]
    assert "calibration: NoneType" in layouts["weight_only"]
    for name, sections in (("calibrated", ("attention.summary.key_induced", "token.greedy.tokens_to_divergence[]",
                                           "weight_only.skipped")),
                           ("weight_only", ("attention.samples", "token.greedy.prompts", "weight_only.reference"))):
        assert all(f"\n{section}: " in "\n" + layouts[name] for section in sections), name
    assert "attention.summary" not in layouts["weight_only"] and "weight_only.reference" not in layouts["calibrated"]


def test_the_reports_and_gates_read_the_typed_result():
    from kvq_export.validate.gates import Gates
    from kvq_export.validate.report import summary_rows

    result = ValidationResult.from_dict(PINS["calibrated"])
    tok = result.token.scores
    assert Gates(max_ppl_delta=tok.perplexity_delta_rel, min_top1=tok.top1_agreement, max_kl=tok.kl.mean).misses(
        result) == []
    missed = Gates(max_ppl_delta=0, min_top1=1, max_kl=0).misses(result)
    assert [m.split()[0] for m in missed] == ["perplexity", "top-1", "mean"]
    rows = dict(summary_rows(result))
    assert rows["calibration"].startswith("absmax on 512 tokens of ") and "IS calibration text" in rows["calibration"]
    assert rows["weight-only error"] == "skipped: the export's weights are fp32 (as built): there is no weight error " \
                                       "to separate"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.token.scores.perplexity = 0.0


# -- kvq compare and the plain Polygraphy commands ----------------------------------------------------------
def test_kvq_compare_passes_on_itself_and_fails_on_a_perturbed_export(tiny, tmp_path):
    import onnx
    from onnx import numpy_helper

    assert kvq("compare", str(tiny["int4-sym-g32"]), str(tiny["int4-sym-g32"])).returncode == 0
    perturbed = tmp_path / "perturbed"
    shutil.copytree(tiny["int4-sym-g32"], perturbed)
    model = onnx.load(str(perturbed / "model.onnx"))
    weight = next(t for t in model.graph.initializer if "layers.1.self_attn.k_proj" in t.name)
    array = numpy_helper.to_array(weight).copy()
    array[:, :3] *= 1.05  # a 5% error in three output channels of one projection
    weight.CopyFrom(numpy_helper.from_array(array, weight.name))
    onnx.save(model, str(perturbed / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    proc = kvq("compare", str(tiny["int4-sym-g32"]), str(perturbed))
    assert proc.returncode == 1 and "export again (or skip the check" in proc.stderr  # edited weights: refused ...
    proc = kvq("compare", str(tiny["int4-sym-g32"]), str(perturbed), "--no-verify")  # ... unless the check is skipped
    assert proc.returncode == 1 and "differ beyond tolerance" in proc.stderr


def test_readme_polygraphy_commands(tiny, tmp_path, monkeypatch, capsys):
    """The README's ``polygraphy run`` lines, through Polygraphy's own command-line entry point in this process."""
    from polygraphy.tools import main as polygraphy

    loader = str(ROOT / "tools" / "polygraphy_data_loader.py")
    monkeypatch.chdir(tmp_path)

    def run(directory, *extra) -> int:
        monkeypatch.setenv("KVQ_EXPORT", str(directory))
        return polygraphy(["run", str(Path(directory) / "model.onnx"), "--onnxrt", "--onnx-outputs", "logits",
                           "--data-loader-script", loader, *extra])

    assert run(tiny["fp16"], "--save-outputs", "fp16.json") == 0, capsys.readouterr()
    loose = run(tiny["int4-sym-g32"], "--load-outputs", "fp16.json", "--atol", "0.5", "--rtol", "0",
                "--check-error-stat", "max")
    assert loose == 0, capsys.readouterr()
    tight = run(tiny["int4-sym-g32"], "--load-outputs", "fp16.json", "--atol", "1e-4", "--rtol", "0",
                "--check-error-stat", "max")
    assert tight == 1


# -- weights beside the cache ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int4_weights(tiny):
    from kvq_export.request import WeightSpec

    return export_model(str(tiny["model_dir"]), "kivi-2", tiny["root"] / "kivi-2-int4-weights",
                        weights=WeightSpec(format="int4"))


def test_automatic_baseline_carries_the_exports_weights_and_the_weight_error_is_its_own_line(
        tiny, int4_weights, monkeypatch, tmp_path):
    """int4 weights: the cache is compared with an fp16 cache on int4 weights; int4 vs fp32 weights is apart."""
    from kvq_export.weight_bytes import weight_bytes

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path))
    config = _config(tiny, window_len=200, attention_samples=0, gen_tokens=0)
    r = validate(int4_weights, None, config, progress=False)
    baseline = weight_bytes(r.baseline)
    assert baseline.format == "int4" and baseline.settings == weight_bytes(int4_weights).settings
    assert r.weights.format == "int4" and r.baseline_scheme.name == "fp16"
    mem = r.memory
    assert mem.weights.format == mem.baseline_weights.format == "int4"
    assert mem.weights.parameters == mem.baseline_weights.parameters == baseline.parameters
    assert mem.weights.total == weight_bytes(int4_weights).total and mem.prediction_matches
    only, scores = r.weight_only, r.weight_only.scores
    assert only.skipped is None and only.weights.startswith("int4 (blocks of 32")
    assert only.reference_weights == "fp32"
    # the weight-only line scores the very baseline the cache was compared with, on the same windows ...
    assert scores.perplexity == r.token.scores.reference_perplexity
    assert scores.predictions == r.token.scores.predictions
    assert scores.kl.mean > 0 and scores.reference_perplexity != scores.perplexity
    assert only.reference_weight_bytes > 3 * mem.baseline_weights.total
    _assert_json_form(r, "weight_only")
    # ... against the fp32-weight baseline an fp32-weight export of the same cache is validated against
    fp32 = validate(tiny["kivi-2"], None, config, progress=False)
    assert Path(only.reference) == Path(fp32.baseline) != Path(r.baseline)
    assert scores.reference_perplexity == pytest.approx(fp32.token.scores.reference_perplexity, rel=1e-12)
    assert fp32.weight_only.skipped.startswith("the export's weights are fp32")
    assert fp32.memory.weights.format == fp32.memory.baseline_weights.format == "fp32"


def test_a_baseline_with_other_weights_is_refused_in_one_line(tiny, int4_weights):
    from kvq_export.errors import KVQError

    with pytest.raises(KVQError, match=r"baseline .* stores fp32 weights, the export .* int4 \(blocks of 32") as err:
        validate(int4_weights, tiny["fp16"], _config(tiny), progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(KVQError, match=r"stores int4 \(blocks of 32, symmetric, accuracy_level 4\) weights, the "
                                       r"export .* fp32: the cache comparison needs the same weights"):
        validate(tiny["kivi-2"], int4_weights, _config(tiny), progress=False)


def test_cli_validate_reports_weight_bytes_and_the_weight_only_line(tiny, int4_weights, monkeypatch, tmp_path):
    """Table, JSON and HTML all carry the weight bytes beside the cache's and the labelled weight-only line."""
    from click.testing import CliRunner

    from kvq_export.cli import cli
    from kvq_export.validate.report import summary_rows

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    args = ["validate", str(int4_weights), "--corpus", str(tiny["corpus"]), "--windows", "2", "--window-len", "140",
            "--gen-tokens", "0", "--quiet", "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.html")]
    result = CliRunner().invoke(cli, args, terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "weight bytes" in result.output and "weight-only error" in result.output
    data = json.loads((tmp_path / "r.json").read_text())
    rows = dict(summary_rows(ValidationResult.from_dict(data)))
    assert rows["scheme"].endswith("baseline, both with int4 (blocks of 32, symmetric, accuracy_level 4) weights")
    assert rows["weight bytes"].startswith("export int4 ") and ", baseline int4 " in rows["weight bytes"]
    assert rows["weight-only error"].startswith("int4 (blocks of 32, symmetric, accuracy_level 4) vs fp32 weights")
    assert data["weight_only"]["reference_weights"] == "fp32" and data["memory"]["baseline_weight_format"] == "int4"
    page = (tmp_path / "r.html").read_text()
    assert "Weight-only error" in page and "weights: export (int4)" in page and "weights: baseline (int4)" in page
    refused = CliRunner().invoke(cli, ["validate", str(int4_weights), "--baseline", str(tiny["fp16"]), "--quiet"])
    assert refused.exit_code == 1 and "stores fp32 weights, the export" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_a_given_baseline_with_the_same_weights_gets_its_weight_only_line(tiny, int4_weights, monkeypatch, tmp_path):
    """A given int4 baseline: its fp32-weight twin comes from the export's source; without a source, a noted skip."""
    from kvq_export.request import WeightSpec

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    int4 = WeightSpec(format="int4")
    given = export_model(str(tiny["model_dir"]), "fp16", tmp_path / "given", weights=int4)
    config = _config(tiny, attention_samples=0, gen_tokens=0)
    r = validate(int4_weights, given, config, progress=False)
    assert r.baseline == str(given) and r.weight_only.reference_weights == "fp32"
    assert r.weight_only.scores.perplexity == r.token.scores.reference_perplexity
    assert Path(r.weight_only.reference).parent == tmp_path / "cache" / "exports"
    # exports of a loaded model record no source to export the fp32-weight twin from: the cache numbers stand
    loaded = {name: export_model(tiny_model("llama"), scheme, tmp_path / name, weights=int4, tokenizer=tiny_tokenizer())
              for name, scheme in (("quant", "kivi-2"), ("base", "fp16"))}
    r = validate(loaded["quant"], loaded["base"], config, progress=False)
    assert r.weight_only.skipped.startswith("no fp32-weight reference could be exported: ")
    assert r.token.scores.perplexity > 0 and "reference" not in r.weight_only.as_dict()
