"""The export pipeline: each stage runs alone, and nothing is written when a check fails."""

from __future__ import annotations

import pytest
from tiny_models import WORDS, save_tiny_model_dir, tiny_model

from kvq_export.errors import ExportError
from kvq_export.export.exporter import export
from kvq_export.export.stages import build_graph, calibrate, load_source, package, plan_export, read_facts
from kvq_export.manifest import Manifest
from kvq_export.request import CalibrationSpec, ExportRequest, WeightSpec
from kvq_export.vocab import LayoutName


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.mark.parametrize(("request_", "message"), [
    (ExportRequest(model=None, scheme="ort-int8"), "uses static scales: calibrate first"),
    (ExportRequest(model=None, scheme="kivi-4", flavor="ort-gqa"), "flavor ort-gqa cannot hold scheme kivi-4"),
    (ExportRequest(model=None, scheme="fp16", flavor="trt", weights=WeightSpec(format="int4")),
     r"weights\.format=int4 .* the trt flavor's runtimes cannot run; allowed there: fp32, fp16"),
], ids=["no-calibration", "flavor", "weights"])
def test_a_refused_request_writes_nothing(tmp_path, request_, message):
    out = tmp_path / "exports" / "x"
    with pytest.raises(ExportError, match=message):
        export(request_, out, model=tiny_model("llama"))
    assert not out.exists() and not list(out.parent.iterdir())  # no directory, no temporary, no lock file


def test_plan_checks_before_anything_runs():
    source = load_source(ExportRequest(model=None, scheme="fp16"), model=tiny_model("llama"))
    with pytest.raises(ExportError, match="needs the model's tokenizer"):
        plan_export(ExportRequest(model=None, scheme="ort-int8", calibration=CalibrationSpec()), source)
    with pytest.raises(ExportError, match="pass the loaded model"):
        load_source(ExportRequest(model=None, scheme="fp16"))


def test_stages_run_one_by_one(tmp_path):
    request = ExportRequest(model=None, scheme="kivi-4")
    source = load_source(request, model=tiny_model("llama"))
    arch, facts = read_facts(source)
    assert facts.num_layers == arch.num_layers == 2 and facts.source is None
    plan = plan_export(request, source)
    assert plan.flavor.name == "reference" and not plan.calibrates
    calibrated = calibrate(plan, source)
    assert calibrated.calibration is None and calibrated.provenance == {"source": "given"}
    graph, cache = build_graph(plan, source, calibrated.calibration)
    assert type(cache).__name__ == "QuantizedCacheGraph" and "kvq.scheme" in graph.metadata_props
    manifest = package(tmp_path, plan, source, graph, calibrated)
    assert Manifest.load(tmp_path) == manifest
    assert manifest.build.request == request.to_dict() and manifest.layout == LayoutName.REGIONS


def test_export_returns_the_manifest_it_wrote(model_dir, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(WORDS * 20))
    request = ExportRequest(model=str(model_dir), scheme="ort-int8", flavor="ort-gqa",
                            calibration=CalibrationSpec(corpus=str(text), tokens=128, offset=64))
    out = tmp_path / "gqa"
    manifest = export(request, out)
    assert manifest == Manifest.load(out) and manifest.model.source == str(model_dir)
    assert manifest.calibration.offset == 64 and manifest.calibration.tokens == 128
    assert manifest.build.request["calibration"] == request.calibration.to_dict()
    assert ExportRequest.from_dict(manifest.build.request) == request
