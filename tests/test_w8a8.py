"""w8a8 weights (int8 per channel, int8 activations per row, QGEMM), their smoothing, the GEMM forms, the table."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from cli_harness import kvq
from tiny_models import VOCAB, WORDS, loud_model, save_tiny_model_dir, tiny_model, tiny_tokenizer

from kvq_export.calibration.smoothing import smoothed_model, smoothing_record, w8a8_emulated
from kvq_export.errors import ExportError
from kvq_export.export.exporter import export_model
from kvq_export.graph.gemm_forms import FORM_OF_WEIGHTS, GEMM_FORMS, fastest_forms, get_form, single_linear
from kvq_export.graph.qgemm import QGEMM_ROWS
from kvq_export.manifest import MODEL_NAME
from kvq_export.measure.cpu import CpuInfo, cpu_peaks
from kvq_export.measure.kernels import LinearShape, kernel_rows, model_shapes, run_kernel_table
from kvq_export.memory import predict_weights
from kvq_export.presets import PRESETS
from kvq_export.request import CalibrationSpec, WeightSpec
from kvq_export.runtime.session import KVQSession
from kvq_export.vocab import WeightFormat
from kvq_export.weight_blocks import channel_codes, dequantized_channels
from kvq_export.weight_bytes import weight_bytes

PROMPT = np.array([[5, 17, 99, 3, 42, 8, 77, 1, 64, 120, 33, 2, 90, 11]], np.int64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Calibration text the tiny tokenizer reads: random words, one id each."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 2000)))
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory, corpus):
    made = {}

    def get(flavor: str, arch: str, fmt: str = "w8a8"):
        if (flavor, arch, fmt) not in made:
            scheme = PRESETS["ort-int8" if flavor == "ort-gqa" else "int4-sym-g32"][0]
            out = tmp_path_factory.mktemp("w8a8") / f"{flavor}-{arch}-{fmt}"
            made[flavor, arch, fmt] = export_model(  # static scales calibrated by the export, on its weights
                loud_model(arch), scheme, out, flavor=flavor, tokenizer=tiny_tokenizer(),
                weights=WeightSpec(format=fmt), calibration=CalibrationSpec(corpus=str(corpus), tokens=256, offset=0))
        return made[flavor, arch, fmt]

    return get


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))


@pytest.mark.parametrize("flavor", ["reference", "ort-gqa"])
@pytest.mark.parametrize("arch", ["llama-tied", "llama"])
def test_w8a8_export_runs_close_to_fp32_and_weighs_what_was_predicted(exports, flavor, arch):
    out, base = exports(flavor, arch), exports(flavor, arch, "fp32")
    assert rel_error(KVSession(out), KVSession(base)) < 0.1
    proto = onnx.load(str(out / MODEL_NAME), load_external_data=False)
    rows = [n for n in proto.graph.node if n.op_type == QGEMM_ROWS]
    per_layer = 4 if flavor == "ort-gqa" else 7  # the fused body: qkv, o, gate-up, down; else each projection
    assert len(rows) == per_layer * 2 + (arch == "llama")  # and an untied head
    assert {n.op_type for n in proto.graph.node} >= {"GatherBlockQuantized"} and not [
        n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1].endswith(".weight")]
    held = weight_bytes(out)
    assert held.format == "w8a8" and held.settings["smoothing"]["alpha"] in (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    assert held.settings["smoothing"]["offset"] == 0 and held.settings["smoothing"]["tokens"] == 256
    model = tiny_model(arch)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    predicted = predict_weights(shapes, WeightSpec(format="w8a8"), embedding="model.embed_tokens.weight")
    assert predicted.total_bytes == held.parameters


def KVSession(directory):
    return KVQSession(directory).step(PROMPT)[0][0]


def test_a_row_of_a_w8a8_batch_computes_what_it_computes_alone(exports):
    session = KVQSession(exports("ort-gqa", "llama-tied"))
    loud = PROMPT.copy()
    loud[0, 3] = 7  # another prompt beside it
    batch = np.concatenate([PROMPT, loud[:, ::-1].copy()], axis=0)
    assert np.array_equal(session.step(batch)[0][0], session.step(PROMPT)[0][0])


def test_smoothing_keeps_the_float_model_and_chooses_by_the_emulated_logits():
    model = loud_model("llama")
    rng = np.random.default_rng(1)
    windows = [list(rng.integers(0, VOCAB, 32)) for _ in range(3)]
    with torch.no_grad():  # a channel of the inputs tens of times larger than the rest: the case smoothing is for
        model.model.layers[0].input_layernorm.weight[5] = 40.0
    smooth = smoothed_model(model, windows)
    record = smoothing_record(smooth)
    assert record["logit_kl"][str(record["alpha"])] == min(record["logit_kl"].values())
    assert float(record["alpha"]) > 0 and record["logit_kl"][str(record["alpha"])] < record["logit_kl"]["0.0"]
    ids = torch.tensor([windows[0]])
    with torch.no_grad():
        assert torch.allclose(smooth(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)  # the same function
        with w8a8_emulated(model):  # and the emulation rounds (it changes the logits)
            assert not torch.allclose(model(ids).logits, smooth(ids).logits, atol=1e-4)
    assert smoothing_record(model) is None


def test_channel_codes_are_symmetric_int8_per_output_column():
    weight = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    weight[:, 3] = 0
    codes, scales = channel_codes(weight)
    assert codes.dtype == np.int8 and np.abs(codes).max() == 127 and scales[3] == 1 and not codes[:, 3].any()
    np.testing.assert_allclose(dequantized_channels(weight), weight, atol=float(scales.max()) / 2 + 1e-7)
    with pytest.raises(ExportError, match="must be 2-D"):
        channel_codes(weight[0])


@pytest.mark.parametrize("name", list(GEMM_FORMS))
def test_every_gemm_form_computes_the_linear(name):
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((96, 40)) * 0.05).astype(np.float32)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    session = ort.InferenceSession(single_linear(get_form(name), weight).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    assert rel_error(got, x @ weight) < (1e-6 if name == "fp32" else 0.12)


def test_fastest_forms_picks_the_fastest_that_keeps_rows_alone_within_the_bound():
    gflops = {"a": {1: 10, 160: 100}, "b": {1: 20, 160: 300}, "c": {1: 5, 160: 900}, "d": {1: 50, 160: 50}}
    alone = {"a": True, "b": True, "c": False, "d": True}
    errors = {"a": 0.0, "b": 0.01, "c": 0.01, "d": 0.5}
    assert fastest_forms(gflops, alone, errors, max_error=0.1) == {1: "b", 160: "b"}
    assert FORM_OF_WEIGHTS[WeightFormat.W8A8] == "qgemm-rows" and set(FORM_OF_WEIGHTS) == set(WeightFormat)
    with pytest.raises(Exception, match="unknown GEMM form 'x'; allowed: fp32"):
        get_form("x")


def test_the_kernel_table_checks_rows_and_reports_each_cell():
    shapes = [LinearShape("a", 64, 48, 2), LinearShape("head", 64, 128, 1)]
    table = run_kernel_table(shapes, ["fp32", "dynamic-quantize", "qgemm-rows"], rows=(1, 8), rounds=2, warmup=0)
    # integer sums computed alone, against one scale shared by the call (float kernels vary by CPU: not asserted)
    assert table.rows_alone["qgemm-rows"] and not table.rows_alone["dynamic-quantize"]
    assert len(table.cells) == 2 * 2 * 3 and all(c.gflops > 0 for c in table.cells)
    assert set(table.chosen().values()) <= {"fp32", "qgemm-rows"}
    data = json.loads(json.dumps(table.to_dict()))
    assert data["cpu"] and data["layer_gflops"]["fp32"]["8"] > 0
    assert [r[:2] for r in kernel_rows(table, "fp32")][-1] == ["qgemm-rows", "layer"]


def test_model_shapes_are_the_fused_body_s_linears():
    shapes = {s.name: (s.k, s.n, s.count) for s in model_shapes(tiny_model("llama").config)}
    assert shapes == {"qkv": (128, 4 * 32 + 2 * 2 * 32, 2), "o": (128, 128, 2), "gate_up": (128, 512, 2),
                      "down": (256, 128, 2), "head": (128, VOCAB, 1)}


ZEN4 = "vendor_id : AuthenticAMD\ncpu family : 25\nmodel : 17\nmodel name : AMD EPYC\ncpu MHz : 2600.0\n" \
       "flags : fpu avx2 fma avx512f avx512_vnni\n"
SPR = "vendor_id : GenuineIntel\ncpu family : 6\nmodel : 143\nmodel name : Xeon\ncpu MHz : 2000.0\n" \
      "flags : avx2 fma avx512f avx512_vnni amx_tile amx_int8\n"


def test_cpu_peaks_follow_the_flags_and_the_clock():
    zen4, xeon = CpuInfo.read(ZEN4), CpuInfo.read(SPR)
    assert cpu_peaks(zen4, 2).fp32 == pytest.approx(2 * 2 * 8 * 2 * 2.6)  # 512-bit ops on 256-bit pipes
    assert cpu_peaks(zen4, 2).int8 == pytest.approx(2 * 2 * 8 * 4 * 2 * 2.6)
    assert cpu_peaks(xeon, 1).fp32 == pytest.approx(2 * 16 * 2 * 2.0)
    assert cpu_peaks(xeon, 1).int8 == pytest.approx(1024 * 2 * 2.0)  # AMX
    assert "family 25 model 17" in zen4.describe() and "avx512_vnni" in zen4.describe()
    assert cpu_peaks(CpuInfo.read("model name : x\n"), 1).fp32 is None


def test_w8a8_refuses_what_it_cannot_be_in_one_line(tmp_path):
    with pytest.raises(ExportError, match="apply to int8/int4 blocks only"):
        WeightSpec(format="w8a8", block_size=64)
    model = tiny_model("llama")
    with pytest.raises(ExportError, match=r"w8a8 weights need --dtype fp32 .* got dtype fp16"):
        export_model(model, "fp16", tmp_path / "x", flavor="reference", dtype="fp16", weights=WeightSpec("w8a8"))
    with pytest.raises(ExportError, match=r"stores ONNX Runtime's MatMulIntegerToFloat, which the trt flavor"):
        export_model(model, "fp16", tmp_path / "y", flavor="trt", weights=WeightSpec("w8a8"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    result = kvq("memory", "--model", save_tiny_model_dir(tmp_path / "m"), "--scheme", "fp16", "--seq-len", "8",
                 "--weights", "w8a8", "--json", "-")
    assert result.returncode == 0 and json.loads(result.stdout)["weights"]["format"] == "w8a8"
    refused = kvq("export", "--model", tmp_path / "m", "--scheme", "fp16", "--out", tmp_path / "z", "--weights",
                  "w8a8", "--weight-block-size", "64")
    assert refused.returncode != 0 and "apply to int8/int4 weights only" in refused.stderr


def test_calibration_on_w8a8_weights_smooths_first_and_records_them():
    from kvq_export.calibration import calibrate_static_scales

    rng = np.random.default_rng(4)
    windows = [list(rng.integers(0, VOCAB, 32)) for _ in range(2)]
    model = loud_model("llama")
    static = calibrate_static_scales(model, PRESETS["ort-int8"][0], windows, weights=WeightSpec(format="w8a8"))
    assert static.weights == {"format": "w8a8"} and smoothing_record(model) is None  # the caller's model untouched
    with pytest.raises(Exception, match=r"measured on w8a8 weights \(int8 per output channel\), but the export runs "
                                        r"the model's own weights"):
        static.check_weights(None)


def test_bench_kernels_cli_prints_the_table_and_writes_json(tmp_path):
    model = save_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "k.json"
    result = kvq("bench-kernels", "--model", model, "--rounds", "2", "--rows", "1,4", "--forms",
                 "nbits4,qgemm-rows,dynamic-quantize", "--json", out)
    assert result.returncode == 0 and "qgemm-rows yes, dynamic-quantize NO" in result.stdout
    data = json.loads(out.read_text())
    assert {c["shape"] for c in data["cells"]} == {"qkv", "o", "gate_up", "down", "head"} and data["peaks"]["how"]
    bad = kvq("bench-kernels", "--model", model, "--forms", "nbits4,x")
    assert bad.returncode == 2 and "unknown GEMM form 'x'; allowed: fp32" in bad.stderr
    bad = kvq("bench-kernels", "--model", model, "--forms", "qgemm-rows")
    assert bad.returncode == 2 and "'nbits4' is not among --forms (qgemm-rows)" in bad.stderr


def test_the_dequantized_w8a8_model_run_emulated_computes_what_the_graph_computes(tmp_path):
    """Calibration's model (weights per channel, the embedding int8 blocks) with rows rounded as the graph rounds them.

    An untied head is a QGemmRows too, so the whole model is emulated: the logits agree to float rounding, while the
    model's own weights are far off. (A tied head runs MatMulNBits' own run-time rounding, which no copy holds.)
    """
    import onnx_ir as ir

    from kvq_export.calibration.weights import dequantized_model
    from kvq_export.graph.builder import save
    from kvq_export.graph.weights import quantize_weights
    from kvq_export.manifest import Manifest, weight_checksums

    model = loud_model("llama")
    cache = PRESETS["fp16"][0]
    out = export_model(model, cache, tmp_path / "x", flavor="ort-gqa")  # no smoothing: the graph's weights as built
    save(quantize_weights(ir.load(out / MODEL_NAME), format="w8a8"), out / MODEL_NAME)
    dataclasses.replace(Manifest.load(out), weights=weight_checksums(out)).save(out)
    got = KVQSession(out).step(PROMPT)[0][0]
    run = dequantized_model(model, WeightSpec("w8a8"))
    with torch.no_grad():
        own = model(torch.tensor(PROMPT)).logits[0].numpy()
        with w8a8_emulated(run):
            want = run(torch.tensor(PROMPT)).logits[0].numpy()
    assert np.abs(got - want).max() < 1e-4 < 0.01 < np.abs(own - want).max()
