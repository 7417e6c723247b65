"""The typed export request: defaults, JSON round trips, one-line refusals, and the CLI's shared options."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvq_export.errors import ExportError, KVQError
from kvq_export.presets import get_preset
from kvq_export.request import (
    DEFAULT_CALIB_OFFSET,
    DEFAULT_CALIB_TOKENS,
    DEFAULT_CALIBRATION,
    DEFAULT_OPSET,
    DEFAULT_PERCENTILE,
    CalibrationMethod,
    CalibrationSpec,
    ExportRequest,
    WeightFormat,
    WeightSpec,
)


def test_calibration_defaults_are_held_out_text():
    spec = CalibrationSpec()
    assert (spec.corpus, spec.tokens, spec.offset, spec.method, spec.percentile) == (
        "britannica", DEFAULT_CALIB_TOKENS, DEFAULT_CALIB_OFFSET, CalibrationMethod.ABSMAX, DEFAULT_PERCENTILE)
    assert spec == DEFAULT_CALIBRATION
    # kvq validate scores 8 x 512 tokens from token 0: the default calibration text lies past them
    from kvq_export.validate.runner import ValidateConfig

    scored = ValidateConfig()
    assert spec.offset >= scored.offset + scored.windows * scored.window_len


def test_requests_round_trip_through_json_with_plain_strings():
    calibration = CalibrationSpec(corpus="notes.txt", tokens=512, offset=0, method="percentile", percentile=99.5)
    weights = WeightSpec(format="int4", block_size=64, symmetric=False, accuracy_level=4)
    request = ExportRequest(model="smollm2", scheme="ort-int4", flavor="ort-gqa", weights=weights, dtype="fp16",
                            opset=24, calibration=calibration)
    data = json.loads(json.dumps(request.to_dict()))
    assert data["flavor"] == "ort-gqa" and data["weights"]["format"] == "int4"
    assert data["calibration"] == {"corpus": "notes.txt", "tokens": 512, "offset": 0, "method": "percentile",
                                   "percentile": 99.5}
    again = ExportRequest.from_dict(data)
    assert again.to_dict() == request.to_dict()
    assert again.calibration == calibration and again.weights == weights and again.flavor == "ort-gqa"
    assert CalibrationSpec.from_dict(calibration.to_dict()) == calibration
    assert WeightSpec.from_dict(weights.to_dict()) == weights
    assert isinstance(again.weights.format, WeightFormat) and isinstance(again.calibration.method, CalibrationMethod)


def test_request_defaults_and_normalization(tmp_path):
    request = ExportRequest(model=tmp_path, scheme="kivi-4")
    assert request.model == str(tmp_path) and request.scheme == get_preset("kivi-4")
    assert (request.flavor, request.dtype, request.opset, request.calibration) == ("reference", "fp32", DEFAULT_OPSET,
                                                                                   None)
    assert request.weights == WeightSpec() and request.weights.format == WeightFormat.FP32
    assert not request.weights.quantized
    assert ExportRequest(model=None, scheme=get_preset("kivi-4").to_dict()).scheme == get_preset("kivi-4")


def test_what_does_not_shape_an_export_is_left_out_of_its_json():
    plain = ExportRequest(model="m", scheme="fp16")
    assert plain.to_dict()["calibration"] is None
    # a scheme that needs no calibration: the calibration cannot change the export
    assert ExportRequest(model="m", scheme="fp16", calibration=CalibrationSpec()).to_dict() == plain.to_dict()
    renamed = dataclasses.replace(get_preset("kivi-4"), name="mine")
    assert ExportRequest(model="m", scheme=renamed).to_dict() == ExportRequest(model="m", scheme="kivi-4").to_dict()
    static = ExportRequest(model="m", scheme="ort-int8", calibration=CalibrationSpec())
    assert static.to_dict()["calibration"] == CalibrationSpec().to_dict()


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: CalibrationSpec(tokens=0), KVQError, r"calibration\.tokens=0: allowed: an integer >= 1"),
    (lambda: CalibrationSpec(offset=-1), KVQError, r"calibration\.offset=-1: allowed: an integer >= 0"),
    (lambda: CalibrationSpec(method="mse"), KVQError,
     r"calibration\.method='mse': allowed: absmax, percentile, attention"),
    (lambda: CalibrationSpec(percentile=40), KVQError, r"calibration\.percentile=40: allowed: a number in \(50, 100\]"),
    (lambda: CalibrationSpec(corpus=""), KVQError, r"calibration\.corpus='': allowed"),
    (lambda: CalibrationSpec.from_dict({"tokns": 3}), KVQError,
     r"unknown field\(s\) calibration\.tokns; allowed: corpus"),
    (lambda: WeightSpec(format="int3"), ExportError, r"weights\.format='int3': allowed: fp32, fp16, int8, int4"),
    (lambda: WeightSpec(block_size=24), ExportError, r"weights\.block_size=24: allowed: 16, 32, 64, 128, 256"),
    (lambda: WeightSpec(accuracy_level=0), ExportError, r"weights\.accuracy_level=0: allowed: 1, 2, 3, 4, or null"),
    (lambda: WeightSpec(symmetric="yes"), ExportError, r"weights\.symmetric='yes': allowed: true, false"),
    (lambda: ExportRequest(model="m", scheme="fp16", flavor="nope"), ExportError,
     r"unknown flavor 'nope'; allowed: reference, ort-gqa, trt"),
    (lambda: ExportRequest(model="m", scheme="fp16", dtype="bf16"), ExportError, r"dtype='bf16': allowed: fp32, fp16"),
    (lambda: ExportRequest(model="m", scheme="fp16", opset=17), ExportError, r"opset=17: allowed: an integer >= 18"),
    (lambda: ExportRequest(model=object(), scheme="fp16"), ExportError, r"invalid model=object: allowed: a model spec"),
    (lambda: ExportRequest(model="m", scheme="no-such-preset"), KVQError, r"no-such-preset"),
    (lambda: ExportRequest.from_dict({"model": "m"}), ExportError, r"missing request field 'scheme'"),
])
def test_bad_fields_are_refused_in_one_line_naming_the_field(build, error, message):
    with pytest.raises(error, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def test_every_calibrating_command_shares_the_options_and_their_defaults():
    from kvq_export.cli import cli

    def defaults(command: str) -> dict:
        return {p.name: p.default for p in cli.commands[command].params if p.name.startswith(("calib", "percentile"))}

    spec = CalibrationSpec()
    want = {"calib_corpus": spec.corpus, "calib_tokens": spec.tokens, "calib_offset": spec.offset,
            "calib_method": "absmax", "percentile": spec.percentile}
    for command in ("plan", "bench", "calibrate", "demo"):
        assert defaults(command) == want, command
    assert defaults("export") == {**want, "calib_corpus": None}  # export calibrates only when given a corpus
    flavor = next(p for p in cli.commands["export"].params if p.name == "flavor")
    assert list(flavor.type.choices) == ["reference", "ort-gqa", "trt"]


def test_cached_exports_are_keyed_by_their_weights(tmp_path):
    """Exports of one model and cache scheme with other weights keep separate directories.

    (A validation baseline and its fp32-weight reference would otherwise replace each other on every run.)
    """
    from kvq_export.export.exporter import cached_export_dir

    def where(**weights):
        return cached_export_dir(ExportRequest(model=None, scheme="fp16", weights=WeightSpec(**weights)), tmp_path).name

    assert where() == "model-fp16"  # the default keeps the name it always had
    assert where(format="int4") == "model-fp16-wint4"
    assert where(format="int4", block_size=64, symmetric=False, accuracy_level=1) == "model-fp16-wint4-b64-asym-acc1"
    names = {where(format=f, block_size=b, symmetric=s) for f in ("fp16", "int8", "int4") for b in (32, 128)
             for s in (True, False)}
    assert len(names) == 12 and where() not in names
