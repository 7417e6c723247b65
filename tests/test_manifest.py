"""kvq.json's sections are typed records that write back exactly what they read."""

from __future__ import annotations

import json

import pytest
from gqa_harness import SCHEMES, calibration
from tiny_models import save_tiny_model_dir, tiny_model

from kvq_export.errors import RuntimeInputError
from kvq_export.export.exporter import export, export_model
from kvq_export.flavors.ort_gqa.genai import RUNTIME
from kvq_export.manifest import MANIFEST_NAME, Manifest
from kvq_export.manifest_sections import CalibrationRecord, GraphValue, RuntimeSupport, TokenizerFacts
from kvq_export.request import CalibrationSpec, ExportRequest


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Exports that fill every section differently: calibrated from a spec, given scales, none, not servable."""
    root = tmp_path_factory.mktemp("manifest")
    source = save_tiny_model_dir(root / "source")
    calibrated = ExportRequest(model=str(source), scheme="ort-int8", flavor="ort-gqa",
                               calibration=CalibrationSpec(tokens=128, method="percentile", percentile=99.5))
    export(calibrated, root / "calibrated")
    scheme = SCHEMES["ort-int8"]
    export_model(tiny_model("llama"), scheme, root / "given", flavor="ort-gqa", static=calibration("llama", scheme))
    export_model(tiny_model("llama"), "kivi-4", root / "reference")
    return {name: root / name for name in ("calibrated", "given", "reference")}


@pytest.mark.parametrize("name", ["calibrated", "given", "reference"])
def test_manifest_json_round_trips_byte_for_byte(exports, name, tmp_path):
    written = (exports[name] / MANIFEST_NAME).read_text()
    manifest = Manifest.load(exports[name])
    assert json.dumps(manifest.to_dict(), indent=2) == written
    assert Manifest.from_dict(json.loads(written)) == manifest
    assert manifest.save(tmp_path).read_text() == written


def test_sections_read_as_typed_records(exports):
    calibrated = Manifest.load(exports["calibrated"])
    cal = calibrated.calibration
    assert isinstance(cal, CalibrationRecord) and cal.calibrated
    assert (cal.file, cal.tokens, cal.method, cal.percentile) == ("calibration.npz", 128, "percentile", 99.5)
    assert calibrated.build.request["model"] == str(exports["calibrated"].parent / "source")
    assert len(calibrated.build.kvq_code) == 16 and calibrated.build.static is None
    assert calibrated.source_digest == calibrated.build.source_digest is not None
    assert calibrated.tokenizer == TokenizerFacts(eos_token_id=None, bos_token_id=None, pad_token_id=None, files=True)
    assert calibrated.inputs[0] == GraphValue("input_ids", "int64", ("batch", "seq"))
    assert calibrated.outputs[0].shape == ("batch", "seq", calibrated.model.vocab_size)
    assert all(c.bytes > 0 and len(c.sha256) == 64 for c in calibrated.weights.values())
    assert calibrated.runtimes[RUNTIME].supported and calibrated.runtimes[RUNTIME].engine_batches
    given = Manifest.load(exports["given"])
    assert given.calibration.source == "given" and not given.calibration.calibrated
    assert given.calibration.to_dict() == {"file": "calibration.npz", "digest": given.calibration.digest,
                                           "source": "given"}
    assert given.build.source_digest is None and given.tokenizer.files is False
    reference = Manifest.load(exports["reference"])
    entry = reference.runtimes[RUNTIME]
    assert entry == RuntimeSupport(supported=False, reason=entry.reason) and "kivi-4" in entry.reason
    assert reference.calibration is None


def test_tokenizer_facts_take_one_or_several_eos_ids():
    several = TokenizerFacts.from_dict({"eos_token_id": [2, 7], "bos_token_id": 1, "pad_token_id": None,
                                        "files": True})
    assert several.eos_ids == (2, 7) and several.to_dict()["eos_token_id"] == [2, 7]
    assert TokenizerFacts.from_dict({"eos_token_id": 3}).eos_ids == (3,) and TokenizerFacts().eos_ids == ()
    assert TokenizerFacts.from_dict({}).files is True  # an export without the section had its tokenizer written


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["calibration"].pop("digest"), "missing the field 'calibration.digest'"),
    (lambda m: m["calibration"].update(tokens="128"), "field 'calibration.tokens' must be an integer"),
    (lambda m: m["build"].update(kvq="x"), "unknown field\\(s\\) build.kvq; allowed: kvq_code, request, "),
    (lambda m: m["runtimes"][RUNTIME].update(supported="yes"), f"field 'runtimes.{RUNTIME}.supported' must be"),
    (lambda m: m["inputs"][0].update(shape=["batch", None]), "field 'inputs\\[0\\].shape' must list dimension"),
    (lambda m: m["tokenizer"].update(eos_token_id=[1, "2"]), "field 'tokenizer.eos_token_id' must be an integer"),
    (lambda m: m["weights"].update({"model.onnx": {"sha256": "0" * 64}}),
     "missing the field 'weights.model.onnx.bytes'"),
])
def test_a_malformed_section_is_refused_naming_its_field(exports, edit, message):
    data = json.loads((exports["calibrated"] / MANIFEST_NAME).read_text())
    edit(data)
    with pytest.raises(RuntimeInputError, match=f"^invalid manifest: {message}"):
        Manifest.from_dict(data)
