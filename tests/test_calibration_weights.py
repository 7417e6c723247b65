"""Calibration on the weights that run: int4 / int8 exports are calibrated (and planned) on the dequantized blocks.

The model calibration runs for an export with int blocks is :func:`kvq_export.calibration.weights.dequantized_model`:
its logits equal the int4 export's (MatMulNBits with float activations), and a calibration records the weights it
was measured on, so one measured on other weights than an export runs is refused.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from tiny_models import VOCAB, save_tiny_model_dir, tiny_model, tiny_tokenizer

from kvq_export.calibration import Calibration, calibrate_static_scales, calibration_windows
from kvq_export.calibration.artifact import WEIGHTS_MEMBER
from kvq_export.calibration.weights import dequantized_model
from kvq_export.cli import cli
from kvq_export.errors import CalibrationWeightsError, KVQError
from kvq_export.export.exporter import export, export_model
from kvq_export.manifest import CALIBRATION_NAME, Manifest
from kvq_export.presets import get_preset
from kvq_export.request import CalibrationSpec, ExportRequest, WeightSpec
from kvq_export.runtime.session import KVQSession
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.weight_blocks import BITS, block_quantizer, dequantized_blocks

PROMPT = np.array([[5, 17, 99, 3, 42, 8, 77, 1, 64, 120, 33, 2, 90, 11]], np.int64)
#: an unquantized cache (the ort-gqa flavour's fp32 buffer), so only the weights differ
FLOAT_CACHE = KVQuantScheme(key=TensorQuant(format="fp16", bits=16), value=TensorQuant(format="fp16", bits=16),
                            hp_dtype="fp32")
INT4 = WeightSpec("int4")


def windows(count: int = 4, length: int = 64) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [list(map(int, rng.integers(0, VOCAB, length))) for _ in range(count)]


# -- the dequantized blocks ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "symmetric", "rows"), [("int4", True, 128), ("int4", False, 80), ("int8", True, 80),
                                                        ("int8", False, 128)])
def test_dequantized_blocks_are_what_matmulnbits_computes_with(fmt, symmetric, rows):
    """ONNX Runtime's own MatMulNBits on the quantizer's codes equals a float MatMul on dequantized_blocks."""
    bits, cols, block = BITS[fmt], 24, 32
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((rows, cols)).astype(np.float32)
    packed, scales, zero_points = block_quantizer(bits, block, symmetric).qbits_block_quant(weight)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")]
    inits += [] if symmetric else [numpy_helper.from_array(zero_points, "Z")]
    node = helper.make_node("MatMulNBits", ["A", "B", "S", *([] if symmetric else ["Z"])], ["Y"],
                            domain="com.microsoft", K=rows, N=cols, bits=bits, block_size=block, accuracy_level=1)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, rows])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, cols])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft",
                                                                                                     1)])
    x = rng.standard_normal((3, rows)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": x})[0]
    run = dequantized_blocks(weight, bits=bits, block_size=block, symmetric=symmetric)
    assert run.shape == weight.shape and run.dtype == np.float32
    np.testing.assert_allclose(got, x @ run, atol=2e-5, rtol=0)
    step = np.abs(weight).max() / ((1 << (bits - 1)) - 1)
    assert 0 < np.abs(run - weight).max() <= step  # quantized: off the weights, by at most a step


@pytest.mark.parametrize(("arch", "flavor"), [("llama-tied", "ort-gqa"), ("llama", "reference"), ("phi3", "ort-gqa")])
def test_dequantized_model_computes_what_the_int4_export_computes(tmp_path, arch, flavor):
    """Logits of the dequantized torch model equal the int4 export's (float activations).

    The tied and the untied lm_head, the embedding's GatherBlockQuantized and a fused q|k|v projection (Phi3) included.
    """
    model = tiny_model(arch)
    spec = WeightSpec("int4", accuracy_level=1)  # float activations: no run-time rounding beside the weights'
    directory = export_model(model, FLOAT_CACHE, tmp_path / arch, flavor=flavor, weights=spec)
    got = KVQSession(directory).step(PROMPT)[0][0]
    run = dequantized_model(model, spec)
    with torch.no_grad():
        want = run(torch.tensor(PROMPT)).logits[0].numpy()
        own = model(torch.tensor(PROMPT)).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
    assert np.abs(own - want).max() > 100 * np.abs(got - want).max()  # the int4 blocks move the logits far more
    assert run is not model and all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                                        tiny_model(arch).parameters()))
    assert dequantized_model(model, WeightSpec("fp16")) is model  # fp16 storage: the model's own weights


# -- the calibration records its weights --------------------------------------------------------------------------
def test_a_calibration_records_the_weights_it_was_measured_on(tmp_path):
    model, scheme = tiny_model("llama-tied"), get_preset("ort-int8")
    own = calibrate_static_scales(model, scheme, windows())
    int4 = calibrate_static_scales(model, scheme, windows(), weights=INT4)
    assert own.weights is None and dict(int4.weights) == {"format": "int4", "block_size": 32, "symmetric": True}
    on_blocks = calibrate_static_scales(dequantized_model(model, INT4), scheme, windows())
    assert int4 == Calibration(on_blocks.arrays, weights=INT4.calibration_weights)  # the same passes, recorded
    assert not np.array_equal(own[0]["key"]["scales"], int4[0]["key"]["scales"])
    assert own.digest() != int4.digest() and own != int4
    assert calibrate_static_scales(model, scheme, windows(), weights=WeightSpec("fp16")) == own
    path = int4.save(tmp_path / "int4.npz")
    loaded = Calibration.load(path)
    assert loaded == int4 and loaded.digest() == int4.digest() and loaded.weights == int4.weights
    assert Calibration.load(own.save(tmp_path / "own.npz")).weights is None
    assert "measured on int4 weights (blocks of 32, symmetric)" in repr(int4)


def test_a_calibration_file_with_a_bad_weights_record_is_refused(tmp_path):
    calibration = calibrate_static_scales(tiny_model("llama"), get_preset("ort-int8"), windows(), weights=INT4)
    path = tmp_path / "bad.npz"
    for record in (b"{not json", json.dumps({"format": "int3", "block_size": 32, "symmetric": True}).encode(),
                   json.dumps({"format": "int4"}).encode()):
        with zipfile.ZipFile(path, "w") as archive:
            for name, array in calibration.arrays.items():
                with archive.open(f"{name}.npy", "w") as handle:
                    np.lib.format.write_array(handle, array)
            with archive.open(f"{WEIGHTS_MEMBER}.npy", "w") as handle:
                np.lib.format.write_array(handle, np.frombuffer(record, np.uint8))
        with pytest.raises(KVQError, match=f"member '{WEIGHTS_MEMBER}' does not name the weights it was measured"):
            Calibration.load(path)


# -- an export takes only a calibration of its own weights --------------------------------------------------------
def test_an_export_refuses_a_calibration_of_other_weights(tmp_path):
    model, scheme = tiny_model("llama-tied"), get_preset("ort-int8")
    own = calibrate_static_scales(model, scheme, windows())
    int4 = calibrate_static_scales(model, scheme, windows(), weights=INT4)
    refusals = [(own, INT4, "measured on the model's own weights, but the export runs int4 weights \\(blocks of 32"),
                (int4, WeightSpec(), "measured on int4 weights \\(blocks of 32, symmetric\\), but the export runs the "
                                     "model's own weights"),
                (int4, WeightSpec("int4", block_size=64), "but the export runs int4 weights \\(blocks of 64"),
                (int4, WeightSpec("int8"), "but the export runs int8 weights")]
    for static, weights, message in refusals:
        with pytest.raises(CalibrationWeightsError, match=message):
            export_model(model, scheme, tmp_path / "refused", flavor="ort-gqa", weights=weights, static=static)
        assert not (tmp_path / "refused").exists()
    # the accuracy level rounds activations only: a calibration of the int4 blocks fits every level
    directory = export_model(model, scheme, tmp_path / "int4", flavor="ort-gqa", weights=WeightSpec("int4",
                                                                                                    accuracy_level=1),
                             static=int4)
    record = Manifest.load(directory).calibration
    assert record.weights == dict(int4.weights) and record.measured_on == "int4 weights (blocks of 32, symmetric)"
    assert Calibration.load(directory / CALIBRATION_NAME) == int4


def test_an_int4_export_calibrates_on_its_int4_weights(tmp_path):
    """Without given scales the export measures them on the dequantized blocks, and its manifest says so."""
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{i % (VOCAB - 1)}" for i in range(0, 3000, 7)))
    spec = CalibrationSpec(corpus=str(text), tokens=256, offset=0)
    model, scheme = tiny_model("llama"), get_preset("ort-int8")
    manifest = export(ExportRequest(model=None, scheme=scheme, flavor="ort-gqa", weights=INT4, calibration=spec),
                      tmp_path / "x", model=model, tokenizer=tiny_tokenizer())
    measured = calibrate_static_scales(model, scheme, calibration_windows(tiny_tokenizer(), str(text), 256),
                                       weights=INT4)
    assert manifest.calibration.digest == measured.digest() and manifest.calibration.source == "calibrated"
    assert manifest.calibration.weights == {"format": "int4", "block_size": 32, "symmetric": True}
    fp32 = export(ExportRequest(model=None, scheme=scheme, flavor="ort-gqa", calibration=spec), tmp_path / "y",
                  model=model, tokenizer=tiny_tokenizer())
    assert fp32.calibration.weights is None and fp32.calibration.measured_on is None  # the model's own, as before
    assert fp32.calibration.digest != measured.digest()


# -- kvq calibrate --weights ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def kvq(*args) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_kvq_calibrate_measures_on_the_weights_it_is_given(model_dir, tmp_path):
    calib = ("--calib-tokens", "128")
    kvq("calibrate", "--model", model_dir, "--format", "npz", "--weights", "int4", *calib, "--out", tmp_path / "a.npz")
    kvq("calibrate", "--model", model_dir, "--format", "npz", *calib, "--out", tmp_path / "b.npz")
    int4, own = Calibration.load(tmp_path / "a.npz"), Calibration.load(tmp_path / "b.npz")
    assert dict(int4.weights) == INT4.calibration_weights and own.weights is None and int4 != own
    output = kvq("calibrate", "--model", model_dir, "--weights", "int4", *calib, "--out", tmp_path / "s.json")
    assert "-p int4 -e cpu" in output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["kvq"]["measured_on"] == "int4 weights (blocks of 32, symmetric)"
    assert data["kvq"]["weights"] == INT4.calibration_weights
    assert np.array_equal(np.asarray(data["scales"]["k_scales"][1], np.float32),
                          int4[1]["key"]["scales"].reshape(-1))
    own_file = kvq("calibrate", "--model", model_dir, *calib, "--out", tmp_path / "own.json")
    assert "-p fp32 -e cpu" in own_file
    assert json.loads((tmp_path / "own.json").read_text())["kvq"]["measured_on"] == "the model's own weights"
