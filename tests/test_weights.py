"""Weight formats: fp16 storage and ONNX Runtime's block-quantized int8 / int4 weights on kvq exports."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from tiny_models import VOCAB, tiny_model

from kvq_export.calibration import calibrate_static_scales
from kvq_export.errors import ExportError
from kvq_export.export.exporter import export_model
from kvq_export.flavors.ort_gqa.genai import GENAI_MODEL
from kvq_export.flavors.ort_gqa.genai_graph import adapt_graph
from kvq_export.graph.builder import save
from kvq_export.graph.weights import WEIGHTS_KEY, quantize_weights
from kvq_export.manifest import MODEL_NAME, Manifest, weight_checksums
from kvq_export.presets import PRESETS
from kvq_export.runtime.session import KVQSession
from kvq_export.weight_bytes import weight_bytes

#: (flavour, preset): the portable graph (tied head: Gemm(transB=1)) and ONNX Runtime's GroupQueryAttention
#: (tied head: MatMul on the embedding's Transpose); the rotated preset keeps float32 rotation MatMuls in the body
CASES = {"reference": "int4-sym-g32", "ort-gqa": "ort-int8", "reference-rot": "k-q8_0-v-q4_0-rot"}
PROMPT = np.array([[5, 17, 99, 3, 42, 8, 77, 1, 64, 120, 33, 2, 90, 11]], np.int64)
H, V = 128, VOCAB


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    made = {}

    def get(case: str, arch: str = "llama-tied") -> Path:
        if (case, arch) not in made:
            model, scheme = tiny_model(arch), PRESETS[CASES[case]][0]
            static = None
            if scheme.needs_calibration:
                rng = np.random.default_rng(3)
                static = calibrate_static_scales(model, scheme, [list(rng.integers(0, VOCAB, 64)) for _ in range(4)])
            out = tmp_path_factory.mktemp("weights") / f"{case}-{arch}"
            made[case, arch] = export_model(model, scheme, out, flavor=case.removesuffix("-rot"), static=static)
        return made[case, arch]

    return get


def converted(src: Path, dst: Path, **options) -> Path:
    """A copy of export ``src`` whose graph went through :func:`quantize_weights` (as ir.Model, like the export)."""
    shutil.copytree(src, dst)
    graph = quantize_weights(ir.load(dst / MODEL_NAME), **options)
    save(graph, dst / MODEL_NAME)
    if (dst / GENAI_MODEL).is_file():
        adapt_graph(dst / MODEL_NAME, dst / GENAI_MODEL)
    manifest = Manifest.load(dst)
    dataclasses.replace(manifest, weights=weight_checksums(dst)).save(dst)
    return dst


def logits(directory: Path) -> np.ndarray:
    return KVQSession(directory).step(PROMPT)[0][0]


def initializers(directory: Path) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in onnx.load(str(directory / MODEL_NAME), load_external_data=False).graph.initializer}


def nodes(directory: Path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(directory / MODEL_NAME), load_external_data=False).graph.node)


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))


#: relative RMS error of the logits against the fp32-weight export (measured on these tiny random models: fp16
#: <= 0.015, int8 <= 0.06, int4 <= 0.23 with blocks of 32); a payload read with its nibbles swapped gives ~1
TOLERANCE = {"fp16": 0.03, "int8": 0.1, "int4": 0.35}


def weight_shapes(directory: Path) -> list[tuple[int, int]]:
    """(K, N) of every weight in the fp32 graph: MatMul weights are [K, N], the embedding [V, H] is N=V, K=H."""
    graph = onnx.load(str(directory / MODEL_NAME), load_external_data=False).graph
    embedding = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"}
    shapes = []
    for t in graph.initializer:
        if t.name.endswith(".weight") and len(t.dims) == 2:
            shapes.append((t.dims[1], t.dims[0]) if t.name in embedding else (t.dims[0], t.dims[1]))
    return shapes


@pytest.mark.parametrize("case", ["reference", "ort-gqa"])
@pytest.mark.parametrize("arch", ["llama-tied", "llama"])
@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
def test_format_runs_close_to_fp32_and_shrinks(exports, tmp_path, case, arch, fmt):
    src = exports(case, arch)
    out = converted(src, tmp_path / "q", format=fmt)
    assert rel_error(logits(out), logits(src)) < TOLERANCE[fmt]
    before, after = weight_bytes(src), weight_bytes(out)
    assert before.format == "fp32" and after.format == fmt
    # the files shrink as the stored bits say (the graph itself, norms and small constants stay)
    assert after.files < {"fp16": 0.57, "int8": 0.38, "int4": 0.27}[fmt] * before.files
    shapes = weight_shapes(src)
    stored = sum(k * n for k, n in shapes)
    assert after.unquantized["fp32"] == before.unquantized["fp32"] - 4 * stored  # no weight left in fp32
    if fmt == "fp16":
        assert after.quantized == after.scales == 0
        assert after.unquantized["fp16"] == before.unquantized.get("fp16", 0) + 2 * stored
        return
    # every weight quantized exactly once: K padded to whole blocks, bits/8 bytes each, one fp32 scale per block
    bits = {"int8": 8, "int4": 4}[fmt]
    assert after.quantized == sum(n * -(-k // 32) * 32 * bits // 8 for k, n in shapes)
    assert after.scales == sum(n * -(-k // 32) * 4 for k, n in shapes)
    assert after.settings == {"format": fmt, "block_size": 32, "symmetric": True, "accuracy_level": 4}


@pytest.mark.parametrize("case", ["reference", "ort-gqa", "reference-rot"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_weight_matmuls_and_embedding_are_replaced(exports, tmp_path, case, fmt):
    src = exports(case)
    out = converted(src, tmp_path / "q", format=fmt)
    old, new = nodes(src), nodes(out)
    inits = initializers(src)
    weight_matmuls = [n for n in old if n.op_type == "MatMul" and n.input[1].endswith(".weight")]
    constant_matmuls = [n for n in old if n.op_type == "MatMul" and n.input[1] in inits]
    assert weight_matmuls and len(constant_matmuls) == len(weight_matmuls) + 2 * (case == "reference-rot") * 2
    nbits = [n for n in new if n.op_type == "MatMulNBits"]
    assert len(nbits) == len(weight_matmuls) + 1  # + the tied lm_head
    assert {onnx.helper.get_attribute_value(a) for n in nbits for a in n.attribute if a.name == "bits"} == {
        {"int8": 8, "int4": 4}[fmt]}
    assert all(any(a.name == "accuracy_level" and a.i == 4 for a in n.attribute) for n in nbits)
    # no float weight is read any more, neither by a MatMul, a Gemm nor a Gather; the rotations stay float32
    new_inits = initializers(out)
    assert not [n.name for n in new if n.op_type in ("MatMul", "Gemm", "Gather") and any(
        x in new_inits and x.endswith(".weight") for x in n.input)]
    assert [n.input[1] for n in new if n.op_type == "MatMul" and n.input[1] in new_inits] == [
        n.input[1] for n in constant_matmuls if not n.input[1].endswith(".weight")]
    gathers = [n for n in new if n.op_type == "GatherBlockQuantized"]
    assert len(gathers) == 1 and gathers[0].input[1] == "input_ids"
    # the tied lm_head and the embedding read one quantized table (through a Reshape) and one set of scales
    reshape = next(n for n in new if n.output[0] == gathers[0].input[0])
    heads = [n for n in nbits if n.input[1] == reshape.input[0]]
    assert reshape.op_type == "Reshape" and len(heads) == 1 and heads[0].name.startswith("head/")
    assert gathers[0].input[2] == heads[0].input[2]


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8", "int4"])
def test_tied_embedding_is_stored_once_at_most_in_full_precision(exports, tmp_path, fmt):
    src = exports("ort-gqa")
    out = src if fmt == "fp32" else converted(src, tmp_path / "q", format=fmt)
    full = [t.data_type for t in initializers(out).values() if "embed" in t.name
            and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and int(np.prod(t.dims)) >= V * H]
    assert full == {"fp32": [onnx.TensorProto.FLOAT], "fp16": [onnx.TensorProto.FLOAT16]}.get(fmt, [])
    if fmt in ("int8", "int4"):  # and the quantized table is there once, not once per reader
        payload = [t for t in initializers(out).values() if "embed" in t.name and t.data_type == onnx.TensorProto.UINT8]
        assert [int(np.prod(t.dims)) for t in payload] == [V * H * {"int8": 8, "int4": 4}[fmt] // 8]


def test_fp32_is_unchanged_and_proto_input_matches_ir_input(exports, tmp_path):
    proto = onnx.load(str(exports("reference") / MODEL_NAME))
    assert quantize_weights(proto, format="fp32") is proto
    from_proto = quantize_weights(onnx.load(str(exports("reference") / MODEL_NAME)), format="int4")
    from_ir = ir.to_proto(quantize_weights(ir.load(exports("reference") / MODEL_NAME), format="int4"))
    for a, b in zip(from_proto.graph.initializer, from_ir.graph.initializer, strict=True):
        assert a.name == b.name and onnx.numpy_helper.to_array(a).tobytes() == onnx.numpy_helper.to_array(b).tobytes()
    assert {p.key: p.value for p in from_proto.metadata_props}[WEIGHTS_KEY] == (
        '{"accuracy_level": 4, "block_size": 32, "format": "int4", "symmetric": true}')


def test_options_reach_the_graph(exports, tmp_path):
    out = converted(exports("ort-gqa"), tmp_path / "q", format="int4", block_size=64, symmetric=False,
                    accuracy_level=4)
    nbits = [n for n in nodes(out) if n.domain == "com.microsoft" and n.op_type in ("MatMulNBits",
                                                                                    "GatherBlockQuantized")]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert {a["block_size"] for a in attrs} == {64}
    assert {a.get("accuracy_level") for a, n in zip(attrs, nbits) if n.op_type == "MatMulNBits"} == {4}
    assert all(len(n.input) == 4 for n in nbits)  # zero points
    assert weight_bytes(out).settings["symmetric"] is False
    assert rel_error(logits(out), logits(exports("ort-gqa"))) < TOLERANCE["int4"]
    plain = quantize_weights(onnx.load(str(exports("ort-gqa") / MODEL_NAME)), format="int8", accuracy_level=None)
    assert not [a for n in plain.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                if a.name == "accuracy_level"]


def test_tolerance_catches_a_misread_payload(exports, tmp_path):
    """The logit tolerance is tight enough to fail a quantizer whose nibbles are in the wrong order."""
    src = exports("ort-gqa")
    out = converted(src, tmp_path / "q", format="int4")
    graph = ir.load(out / MODEL_NAME)
    ir.external_data.load_to_model(graph)
    for value in graph.graph.initializers.values():
        if value.const_value.dtype == ir.DataType.UINT8 and value.name.endswith("_Q4"):
            codes = value.const_value.numpy()
            value.const_value = ir.Tensor((codes >> 4) | (codes << 4), name=value.name)
    save(graph, out / MODEL_NAME)
    got = KVQSession(out, verify_weights=False).step(PROMPT)[0][0]
    assert rel_error(got, logits(src)) > 3 * TOLERANCE["int4"]


def test_fp16_compute_graph_takes_int4_weights(tmp_path):
    model = tiny_model("llama-tied")
    src = export_model(model, "int4-sym-g32", tmp_path / "fp16", dtype="fp16")
    out = converted(src, tmp_path / "q", format="int4")
    assert rel_error(logits(out), logits(src)) < TOLERANCE["int4"]
    # its weights are fp16 already: fp16 storage adds no Cast
    before = onnx.load(str(src / MODEL_NAME))
    count = len(before.graph.node)
    assert len(quantize_weights(before, format="fp16").graph.node) == count


@pytest.mark.parametrize("case", ["reference", "ort-gqa"])
def test_greedy_in_a_batch_equals_greedy_alone(exports, tmp_path, case):
    """The default accuracy level keeps every sequence's greedy tokens independent of the rest of the batch."""
    session = KVQSession(converted(exports(case), tmp_path / "q", format="int4"))
    prompts = [[5, 17, 99], [60, 61, 2, 9, 100, 4, 4, 7, 1], [11, 12, 13, 14, 15, 16, 120, 3, 8, 90, 91, 92, 7, 6]]
    together = [g.tokens for g in session.generate(prompts, 16)]
    alone = [session.generate([p], 16)[0].tokens for p in prompts]
    assert together == alone


def test_int8_activations_give_each_row_its_logits_alone(exports, tmp_path):
    """accuracy_level 4 (int8 activations): a row's logits in a left-padded batch are bit for bit its logits alone.

    ONNX Runtime's CPU MatMulNBits at level 4 computes each row alike whatever else the batch holds (level 1 takes
    another kernel for one row than for several), and so does the rest of the ort-gqa graph.
    """
    session = KVQSession(converted(exports("ort-gqa"), tmp_path / "q", format="int4", accuracy_level=4))
    prompts = [[5, 17, 99], [60, 61, 2, 9, 100, 4, 4, 7, 1], [11, 12, 13, 14, 15, 16, 120, 3, 8, 90, 91, 92, 7, 6]]
    width = max(map(len, prompts))
    ids = np.array([[0] * (width - len(p)) + p for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    together, cache = session.step(ids, mask)
    step, cache = session.step(np.array([[7], [8], [9]]), None, cache)
    for row, prompt in enumerate(prompts):
        alone, own = session.step(np.array([prompt]))
        assert np.array_equal(together[row, width - len(prompt):], alone[0]), row
        assert np.array_equal(step[row], session.step(np.array([[7 + row]]), None, own)[0][0]), row


@pytest.mark.parametrize(("options", "message"), [
    ({"format": "int3"}, "unknown weight format 'int3'; allowed: fp32, fp16, int8, int4"),
    ({"format": "int4", "block_size": 24}, "invalid weight block size 24; allowed: 16, 32, 64, 128, 256"),
    ({"format": "int4", "block_size": 8}, "invalid weight block size 8; allowed"),
    ({"format": "int8", "block_size": True}, "invalid weight block size True"),
    ({"format": "int4", "accuracy_level": 5}, "invalid accuracy_level 5; allowed: 1 (float32 activations)"),
    ({"format": "int4", "symmetric": "yes"}, "invalid symmetric='yes'; allowed: True, False"),
])
def test_bad_options_are_one_line_errors(exports, options, message):
    proto = onnx.load(str(exports("reference") / MODEL_NAME), load_external_data=False)
    with pytest.raises(ExportError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        quantize_weights(proto, **options)
    assert "\n" not in str(err.value)


def test_weights_left_in_external_data_are_refused(exports):
    proto = onnx.load(str(exports("reference") / MODEL_NAME), load_external_data=False)
    with pytest.raises(ExportError, match=r"still in external data: load the model with its weights") as err:
        quantize_weights(proto, format="int4")
    assert "\n" not in str(err.value)


def test_a_graph_without_weights_is_refused():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])])
    for fmt in ("fp16", "int4"):
        with pytest.raises(ExportError, match=r"found no .* \(is this a kvq decoder graph\?\)"):
            quantize_weights(onnx.helper.make_model(graph), format=fmt)


def test_int8_weights_without_int8_activations_warn(exports, caplog):
    """ONNX Runtime's CPU kernel for 8-bit weights is fast only with int8 activations: say so."""
    proto = onnx.load(str(exports("reference") / MODEL_NAME))
    quantize_weights(proto, format="int8")  # the default: level 4
    assert "accuracy_level=4" not in caplog.text
    quantize_weights(onnx.load(str(exports("reference") / MODEL_NAME)), format="int8", accuracy_level=1)
    assert "int8 weights with accuracy_level 1" in caplog.text and "accuracy_level=4" in caplog.text


def test_blocks_wider_than_the_hidden_size_pad_and_slice(exports, tmp_path):
    """Hidden size 128 in blocks of 256: ONNX Runtime pads the last block; the gathered rows are sliced back."""
    src = exports("ort-gqa")
    out = converted(src, tmp_path / "q", format="int4", block_size=256)
    gather = next(n for n in nodes(out) if n.op_type == "GatherBlockQuantized")
    assert next(n for n in nodes(out) if gather.output[0] in n.input).op_type == "Slice"
    assert rel_error(logits(out), logits(src)) < TOLERANCE["int4"]


@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma2"])
def test_other_architectures(tmp_path, arch):
    """Biases (qwen2), row slices of fused projections (phi3), soft-capping and a scaled tied embedding (gemma2)."""
    model = tiny_model(arch)
    src = export_model(model, "int4-sym-g32", tmp_path / "fp32")
    out = converted(src, tmp_path / "q", format="int8")
    assert rel_error(logits(out), logits(src)) < TOLERANCE["int8"]
    assert not [n for n in nodes(out) if n.op_type in ("MatMul", "Gemm", "Gather") and n.input[int(
        n.op_type != "Gather")].endswith((".weight", "]"))]


def test_converting_twice_is_refused(exports):
    path = exports("reference") / MODEL_NAME
    for once in (quantize_weights(onnx.load(str(path)), format="fp16"), quantize_weights(ir.load(path), format="int4")):
        with pytest.raises(ExportError, match=r"weights are stored as (fp16|int4) already; convert the graph as built"):
            quantize_weights(once, format="int8")


@pytest.mark.parametrize("flavor", ["reference", "ort-gqa"])
def test_export_writes_the_weight_format_it_is_asked_for(tmp_path, flavor):
    """``export(weights=...)`` runs the quantizer between building and saving, and records the format."""
    from kvq_export.request import WeightSpec

    fp32 = export_model(tiny_model("llama-tied"), "fp16", tmp_path / "fp32", flavor=flavor)
    int4 = export_model(tiny_model("llama-tied"), "fp16", tmp_path / "int4", flavor=flavor,
                        weights=WeightSpec(format="int4"))
    assert weight_bytes(int4).format == "int4" and weight_bytes(fp32).format == "fp32"
    assert Manifest.load(int4).build.request["weights"]["format"] == "int4"
    assert {"MatMulNBits", "GatherBlockQuantized"} <= {n.op_type for n in nodes(int4)}
    assert rel_error(logits(int4), logits(fp32)) < 0.35  # the tolerance test_format_runs_close_to_fp32 uses
    assert sum(f.stat().st_size for f in int4.iterdir()) < 0.5 * sum(f.stat().st_size for f in fp32.iterdir())


def test_the_trt_flavor_refuses_int_weights_in_one_line(tmp_path):
    from kvq_export.request import WeightSpec

    with pytest.raises(ExportError, match="trt flavor's runtimes cannot run; allowed there: fp32, fp16"):
        export_model(tiny_model("llama"), "fp16", tmp_path / "trt", flavor="trt", weights=WeightSpec(format="int4"))
    assert not (tmp_path / "trt").exists()


def test_cli_export_takes_weights(tmp_path):
    from click.testing import CliRunner
    from tiny_models import save_tiny_model_dir

    from kvq_export.cli import cli

    model_dir = save_tiny_model_dir(tmp_path / "m")
    result = CliRunner().invoke(cli, ["export", "--model", str(model_dir), "--scheme", "fp16", "--out",
                                      str(tmp_path / "e"), "--weights", "int8", "--weight-accuracy-level", "4"])
    assert result.exit_code == 0, result.output
    assert weight_bytes(tmp_path / "e").format == "int8"
    assert Manifest.load(tmp_path / "e").build.request["weights"]["accuracy_level"] == 4


# -- predicted weight bytes (kvq memory --weights) --------------------------------------------------------------
@pytest.mark.parametrize(("arch", "flavor", "dtype", "spec"), [
    ("llama-tied", "ort-gqa", "fp32", {"format": "int4"}),  # tied embedding: one table for both readers
    ("llama", "reference", "fp32", {"format": "int8", "block_size": 64, "symmetric": False}),  # untied head, zeros
    ("qwen2", "ort-gqa", "fp32", {"format": "int4", "block_size": 256, "symmetric": False}),  # biases, padded blocks
    ("phi3", "reference", "fp32", {"format": "fp16"}),  # fused projections read as row slices
    ("gemma2", "reference", "fp32", {"format": "fp32"}),
    ("llama-tied", "reference", "fp16", {"format": "int4"}),  # fp16 compute: fp16 scales and norms
])
def test_predicted_weight_bytes_equal_the_exported_ones(tmp_path, arch, flavor, dtype, spec):
    """The prediction from parameter shapes alone equals the initializer bytes an export with those weights holds."""
    from kvq_export.memory import predict_weights
    from kvq_export.model_source import parameter_shapes
    from kvq_export.request import WeightSpec

    weights = WeightSpec(**spec)
    model = tiny_model(arch)
    predicted = predict_weights(parameter_shapes(model.config), weights, dtype)
    measured = weight_bytes(export_model(model, "fp16", tmp_path / "e", flavor=flavor, dtype=dtype, weights=weights))
    assert measured.format == spec["format"] or (spec["format"] == "fp32" and measured.format == dtype)
    assert predicted.breakdown["quantized"] == measured.quantized
    assert predicted.breakdown["scales"] + predicted.breakdown["zero_points"] == measured.scales
    assert predicted.total_bytes == measured.parameters == measured.total - measured.constants
    assert (predicted.breakdown["zero_points"] > 0) == (weights.quantized and not weights.symmetric)
    # the shapes are the model's own, a tied embedding once
    assert predicted.parameters == sum(p.numel() for p in model.parameters())
    assert predicted.as_built_bytes == predicted.parameters * {"fp32": 4, "fp16": 2}[dtype]


def test_cli_memory_reports_weights_beside_the_cache(tmp_path):
    """``kvq memory --weights int4`` predicts what ``kvq export --weights int4`` writes, next to the cache's bytes."""
    import json

    from click.testing import CliRunner
    from tiny_models import save_tiny_model_dir

    from kvq_export.cli import cli

    model_dir = save_tiny_model_dir(tmp_path / "m", "llama-tied")
    args = ["--model", str(model_dir), "--scheme", "int4-sym-g32"]
    runner = CliRunner()
    result = runner.invoke(cli, ["memory", *args, "--seq-len", "256", "--weights", "int4", "--weight-block-size",
                                 "64", "--weight-asymmetric", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    exported = runner.invoke(cli, ["export", *args, "--out", str(tmp_path / "e"), "--weights", "int4",
                                   "--weight-block-size", "64", "--weight-asymmetric"])
    assert exported.exit_code == 0, exported.output
    measured = weight_bytes(tmp_path / "e")
    assert data["weights"]["total_bytes"] == measured.parameters and data["weights"]["format"] == "int4"
    assert data["weights"]["breakdown"]["zero_points"] > 0
    assert data["weights_and_cache_bytes"] == measured.parameters + data["total_bytes"]
    table = runner.invoke(cli, ["memory", *args, "--seq-len", "256", "--weights", "int4"])
    assert table.exit_code == 0 and "int4 weights" in table.output and "weights + cache" in table.output
    plain = runner.invoke(cli, ["memory", *args, "--seq-len", "256", "--json"])
    assert "weights" not in json.loads(plain.output)  # only when asked: no model is built otherwise
