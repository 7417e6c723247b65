"""kvq export --budget: plan, calibrate and export in one step, the same as kvq plan then kvq export --scheme."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tiny_models import VOCAB, WORDS, save_tiny_model_dir, tiny_model, tiny_tokenizer

from kvq_export.calibration import calibrate_static_scales, calibration_windows
from kvq_export.cli import cli
from kvq_export.errors import ExportError, KVQError
from kvq_export.export import stages
from kvq_export.export.exporter import export
from kvq_export.export.stages import load_source, plan_export
from kvq_export.manifest import Manifest
from kvq_export.plan import CandidateSet, plan_scheme
from kvq_export.presets import get_preset
from kvq_export.request import DEFAULT_CALIBRATION, CalibrationSpec, ExportRequest, PlanSpec
from kvq_export.scheme import KVQuantScheme

#: A budget the tiny llama's ort-gqa plan spends on one int8 and one int4 layer (which onnxruntime-genai cannot
#: serve: the ort-gqa flavor's default is then the best plan of one cache type, of the ort-gqa-int4 set).
BUDGET = "6.5"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def kvq(*args: str) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def refused(*args: str, code: int = 1) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def initializers(directory: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(directory / "model.onnx").graph
    return {init.name: numpy_helper.to_array(init) for init in graph.initializer}


def assert_same_export(one: Path, two: Path) -> None:
    """The same scheme (its name aside), calibration and graph weights, initializer by initializer."""
    a, b = Manifest.load(one), Manifest.load(two)
    assert dataclasses.replace(a.scheme, name=None) == dataclasses.replace(b.scheme, name=None)
    assert a.calibration == b.calibration and a.flavor == b.flavor and a.runtimes.keys() == b.runtimes.keys()
    left, right = initializers(one), initializers(two)
    assert left.keys() == right.keys()
    for name, array in left.items():
        assert array.dtype == right[name].dtype and np.array_equal(array, right[name]), name


def test_budget_export_equals_plan_then_export(model_dir, tmp_path):
    """Both with defaults (held-out britannica text, ort-gqa candidates, the reference flavor)."""
    plan_file = tmp_path / "plan.json"
    kvq("plan", "--model", model_dir, "--budget", BUDGET, "--out", plan_file)
    kvq("export", "--model", model_dir, "--scheme", plan_file, "--calib-corpus", "britannica",
        "--out", tmp_path / "two")
    output = kvq("export", "--model", model_dir, "--budget", BUDGET, "--out", tmp_path / "one")
    assert "planned plan-6.5b:" in output and "bits/element at 4096 tokens (budget 6.5)" in output
    assert_same_export(tmp_path / "one", tmp_path / "two")

    manifest = Manifest.load(tmp_path / "one")
    planned = KVQuantScheme.from_json(plan_file.read_text())
    assert manifest.scheme == dataclasses.replace(planned, name="plan-6.5b")
    streams = {(key.bits, value.bits) for key, value in planned.streams(2)}
    assert streams == {(8, 8), (4, 4)}  # a mixed plan: the reference flavor holds it as kvq plan wrote it
    record = manifest.plan
    assert record["budget"] == 6.5 and record["bits_per_element"] <= 6.5 and record["candidates"] == "ort-gqa"
    assert record["layers"] == [{"layer": i, "key": k.describe(), "value": v.describe()}
                                for i, (k, v) in enumerate(planned.streams(2))]
    assert manifest.calibration.offset == DEFAULT_CALIBRATION.offset  # held out from what kvq validate scores
    request = ExportRequest.from_dict(manifest.build.request)  # what was asked: the budget, not the scheme
    assert request.scheme is None and request.plan == PlanSpec(budget=6.5)
    assert request.calibration == DEFAULT_CALIBRATION


def test_ort_gqa_budget_export_is_the_plan_onnxruntime_genai_serves(model_dir, tmp_path):
    """--flavor ort-gqa keeps to one cache type; the manifest's kvq plan command writes the same scheme again."""
    output = kvq("export", "--model", model_dir, "--budget", BUDGET, "--flavor", "ort-gqa", "--out", tmp_path / "one")
    assert "onnxruntime-genai: serve with og.Model(" in output
    manifest = Manifest.load(tmp_path / "one")
    assert {key.bits for key, _ in manifest.scheme.streams(2)} == {4}
    assert manifest.plan["candidates"] == "ort-gqa-int4"
    assert manifest.plan["onnxruntime_genai"] == {"servable": True, "candidates": "ort-gqa-int4"}

    command = shlex.split(manifest.plan["command"])
    assert command[:2] == ["kvq", "plan"] and command[-2:] == ["--out", "plan-6.5b.json"]
    plan_file = tmp_path / "plan-6.5b.json"
    kvq(*command[1:-1], plan_file)
    assert KVQuantScheme.from_json(plan_file.read_text()) == manifest.scheme  # as kvq plan writes it, name included
    kvq("export", "--model", model_dir, "--scheme", plan_file, "--flavor", "ort-gqa", "--calib-corpus", "britannica",
        "--out", tmp_path / "two")
    assert_same_export(tmp_path / "one", tmp_path / "two")


def test_int4_budget_export_equals_plan_then_export_on_the_int4_weights(model_dir, tmp_path):
    """--weights int4: the plan is measured on the int4 blocks, and its kvq plan command says --weights int4 too."""
    calib = ("--calib-tokens", "256")
    output = kvq("export", "--model", model_dir, "--budget", BUDGET, "--flavor", "ort-gqa", "--weights", "int4",
                 *calib, "--out", tmp_path / "one")
    assert "planned plan-6.5b:" in output
    manifest = Manifest.load(tmp_path / "one")
    assert manifest.plan["settings"]["weights"] == {"format": "int4", "block_size": 32, "symmetric": True}
    assert manifest.calibration.weights == manifest.plan["settings"]["weights"]
    command = shlex.split(manifest.plan["command"])
    assert command[command.index("--weights") + 1] == "int4" and "--weight-asymmetric" not in command
    plan_file = tmp_path / "plan-6.5b.json"
    kvq(*command[1:-1], plan_file)
    assert KVQuantScheme.from_json(plan_file.read_text()) == manifest.scheme
    kvq("export", "--model", model_dir, "--scheme", plan_file, "--flavor", "ort-gqa", "--weights", "int4", *calib,
        "--out", tmp_path / "two")
    assert_same_export(tmp_path / "one", tmp_path / "two")
    # the same budget on the model's own weights measures other keys and values: other scales
    kvq("export", "--model", model_dir, "--scheme", plan_file, "--flavor", "ort-gqa", *calib, "--out",
        tmp_path / "fp32")
    own = Manifest.load(tmp_path / "fp32").calibration
    assert own.weights is None and own.digest != manifest.calibration.digest


def test_a_budget_export_calibrates_once(tmp_path, monkeypatch):
    """The plan's calibration of the chosen candidates is the export's: the model runs over the text once."""
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(np.random.default_rng(3).choice(WORDS, 600)))
    calibration = CalibrationSpec(corpus=str(text), tokens=256, offset=0)

    def calibrates(*args, **kwargs):
        raise AssertionError("a planned export calibrated a second time")

    monkeypatch.setattr(stages, "calibrate_static_scales", calibrates)
    request = ExportRequest(model=None, plan=PlanSpec(budget=5.0, context=1024, name="small"), flavor="ort-gqa",
                            calibration=calibration)
    manifest = export(request, tmp_path / "x", model=tiny_model("llama"), tokenizer=tiny_tokenizer())
    assert manifest.scheme.name == "small" and manifest.calibration.tokens == 256
    assert manifest.build.request == request.to_dict() and manifest.plan["request"]["context"] == 1024
    monkeypatch.undo()
    windows = calibration_windows(tiny_tokenizer(), str(text), 256)
    fresh = calibrate_static_scales(tiny_model("llama"), manifest.scheme, windows)
    assert manifest.calibration.digest == fresh.digest()


@pytest.mark.parametrize("method", ["absmax", "percentile", "attention"])
def test_plan_metadata_is_what_export_calibrates(method):
    """Plan.static_for gives calibrate_static_scales' arrays, rotated static candidates too (their own basis)."""
    int4, int8 = get_preset("ort-int4").key, get_preset("ort-int8").key
    rotated = dataclasses.replace(int4, rotation="hadamard")
    high = dataclasses.replace(get_preset("ort-int4").key, format="int", high_channels=8)
    cset = CandidateSet("test", pairs=((rotated, rotated), (int8, int8), (high, dataclasses.replace(int4,
                                                                                                   high_channels=8))))
    windows = np.random.default_rng(5).integers(0, VOCAB, (2, 48)).tolist()
    model = tiny_model("llama")
    calibration = CalibrationSpec(method=method)
    plan = plan_scheme(model, windows, budget=6.5, context=256, candidates=cset, calibration=calibration)
    for scheme in [plan.scheme] + [KVQuantScheme(key=k, value=v) for k, v in cset.pairs]:
        got = plan.static_for(scheme, 2)
        want = calibrate_static_scales(model, scheme, windows, method=method)
        assert got.keys() == want.keys()
        for layer, parts in want.items():
            assert got[layer].keys() == parts.keys()
            for part, meta in parts.items():
                assert got[layer][part].keys() == meta.keys()
                for role, array in meta.items():
                    np.testing.assert_array_equal(got[layer][part][role], array,
                                                  err_msg=f"{scheme.describe()} {layer}.{part}.{role}")
    with pytest.raises(KVQError, match="layer 0 value: .* is not a calibrated value candidate"):
        plan.static_for(KVQuantScheme(key=high, value=high), 2)


def test_a_calibration_option_without_a_corpus_uses_the_default_corpus(model_dir, tmp_path):
    kvq("export", "--model", model_dir, "--budget", "6", "--context", "1024", "--calib-tokens", "128",
        "--calib-method", "percentile", "--out", tmp_path / "x")
    manifest = Manifest.load(tmp_path / "x")
    assert manifest.calibration.corpus == DEFAULT_CALIBRATION.corpus and manifest.calibration.tokens == 128
    assert manifest.calibration.method == "percentile" and manifest.plan["settings"]["calib_method"] == "percentile"


# -- refusals ------------------------------------------------------------------------------------------------
def test_cli_refuses_bad_combinations(model_dir, tmp_path):
    out = tmp_path / "x"
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(WORDS * 4))
    calib = ("--calib-corpus", text, "--calib-tokens", "64", "--calib-offset", "0")
    model = ("--model", model_dir, "--out", out)
    assert "error: give --scheme PRESET|FILE (or --key and --value), or --budget BITS to plan a scheme" in refused(
        "export", *model)
    for scheme in (("--scheme", "fp16"), ("--key", "q8_0", "--value", "q8_0")):
        assert "error: give either a scheme (--scheme, or --key/--value) or --budget, not both" in refused(
            "export", *model, *scheme, "--budget", "5")
    assert "error: --context, --candidates plan a scheme: give them with --budget, not with --scheme" in refused(
        "export", *model, "--scheme", "fp16", "--context", "1024", "--candidates", "kivi")
    assert "flavor ort-gqa can hold no candidate of 'per-channel keys" in refused(
        "export", *model, "--budget", "5", "--flavor", "ort-gqa", "--candidates", "kivi", *calib)
    assert "GQA keeps no high-precision window" in refused("export", *model, "--budget", "5", "--flavor", "ort-gqa",
                                                           "--sink-tokens", "4", *calib)
    assert "no allocation fits the budget" in refused("export", *model, "--budget", "1", *calib)
    assert "--metric" in refused("export", *model, "--budget", "5", "--metric", "mse", code=2)
    assert "--budget" in refused("export", *model, "--budget", "0", code=2)
    assert not out.exists()


def test_request_takes_a_scheme_or_a_plan():
    with pytest.raises(ExportError, match="the request has no scheme: give a scheme, or a plan"):
        ExportRequest(model=None)
    with pytest.raises(ExportError, match="give a scheme or a plan \\(a bit budget\\), not both"):
        ExportRequest(model=None, scheme="fp16", plan=PlanSpec(budget=5))
    request = ExportRequest(model="smollm2", plan={"budget": 4.5, "candidates": "kivi", "value_window": 32},
                            flavor="ort-gqa")
    assert request.plan == PlanSpec(budget=4.5, candidates="kivi", value_window=32)
    assert request.calibration == DEFAULT_CALIBRATION  # planning always reads held-out text
    data = json.loads(json.dumps(request.to_dict()))
    assert data["scheme"] is None and data["plan"]["metric"] == "attention" and data["calibration"]["offset"] == 60000
    assert ExportRequest.from_dict(data) == request
    assert "plan" not in ExportRequest(model=None, scheme="fp16").to_dict()  # a scheme request's form is unchanged
    with pytest.raises(ExportError, match="missing request field 'scheme' \\(or 'plan'\\)"):
        ExportRequest.from_dict({"model": None})


@pytest.mark.parametrize(("fields", "message"), [
    ({"budget": 0}, r"invalid plan\.budget=0: allowed: a positive number"),
    ({"budget": float("nan")}, r"invalid plan\.budget=nan"),
    ({"budget": True}, r"invalid plan\.budget=True"),
    ({"budget": 5, "context": 0}, r"invalid plan\.context=0: allowed: an integer >= 1"),
    ({"budget": 5, "metric": "mse"}, r"invalid plan\.metric='mse': allowed: attention, kl"),
    ({"budget": 5, "sink_tokens": -1}, r"invalid plan\.sink_tokens=-1"),
    ({"budget": 5, "value_window": -2}, r"invalid plan\.value_window=-2"),
    ({"budget": 5, "candidates": " "}, r"invalid plan\.candidates=' '"),
    ({"budget": 5, "name": ""}, r"invalid plan\.name=''"),
    ({"context": 5}, r"missing plan field 'budget'"),
    ({"budget": 5, "tokens": 5}, r"unknown field\(s\) plan\.tokens; allowed: budget, context"),
])
def test_plan_spec_refusals(fields, message):
    with pytest.raises(KVQError, match=message):
        PlanSpec.from_dict(fields)


def test_pipeline_refuses_a_plan_it_cannot_carry_out(tmp_path):
    request = ExportRequest(model=None, plan=PlanSpec(budget=5))
    with pytest.raises(ExportError, match="a planned export calibrates its own scales"):
        export(request, tmp_path / "x", model=tiny_model("llama"), tokenizer=tiny_tokenizer(), static={})
    with pytest.raises(ExportError, match="planning a scheme reads calibration text: the model has no tokenizer"):
        export(request, tmp_path / "x", model=tiny_model("llama"))
    source = load_source(request, model=tiny_model("llama"), tokenizer=tiny_tokenizer())
    with pytest.raises(ExportError, match="gives a bit budget, not a scheme: plan it first"):
        plan_export(request, source)
    assert not (tmp_path / "x").exists()
