"""``kvq export --flavor trt``: one plugin node per layer, checked against the plugin's declared signature.

CPU only (TensorRT is not needed to check the graph): every plugin node's op, domain, inputs (names,
count, order, dtypes) and attributes must be exactly what :func:`kvq_export.flavors.trt.signature.plugin_signature`
declares; the model carries no local function; the cache inputs/outputs equal the reference flavour's,
and the cache update (the subgraph computing layer 0's present state) gives bit-identical results on
ONNX Runtime.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from kvq_plugins.layout import StreamLayout
from onnx import helper
from tiny_models import attention_facts, tiny_model

from kvq_export.dtypes import DType
from kvq_export.errors import ExportError
from kvq_export.export.exporter import export_model
from kvq_export.flavors import flavor_names
from kvq_export.flavors.trt.signature import PLUGIN_NAMESPACE, manifest_signatures, plugin_signature
from kvq_export.manifest import Manifest
from kvq_export.naming import tensor_name
from kvq_export.presets import PRESETS
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant

CASES = {  # (arch, scheme): presets of every stream kind, a mixed-precision override, a sliding window
    "llama-kivi-4": ("llama", PRESETS["kivi-4"][0]),
    "llama-int4-sym-g32": ("llama", PRESETS["int4-sym-g32"][0]),
    "qwen2-fp8": ("qwen2", PRESETS["fp8"][0]),
    "llama-ort-int4": ("llama", PRESETS["ort-int4"][0]),
    "mistral-fp16-window": ("mistral", PRESETS["fp16"][0]),
    "llama-ggml-q5_1-q5_0": ("llama", dataclasses.replace(PRESETS["q5_1"][0], value=PRESETS["q5_0"][0].value)),
    "llama-int4-sym-g32-rotated": ("llama", dataclasses.replace(  # q rotated in-graph before the plugin, v folded
        PRESETS["int4-sym-g32"][0], key=dataclasses.replace(PRESETS["int4-sym-g32"][0].key, rotation="hadamard"),
        value=dataclasses.replace(PRESETS["int4-sym-g32"][0].value, rotation="hadamard"))),
    "llama-high-int6": ("llama", KVQuantScheme(  # calibrated 8-bit channels in 4-bit keys; 6-bit code planes
        key=TensorQuant(format="int", bits=4, axis="channel", group_size=8, high_channels=4),
        value=TensorQuant(format="int_sym", bits=6, group_size=16), residual_length=8)),
    "llama-int3-high": ("llama", KVQuantScheme(  # 3-bit code planes beside 8-bit channels; clipped 3-bit values
        key=TensorQuant(format="int", bits=3, axis="channel", group_size=8, high_channels=8),
        value=TensorQuant(format="int", bits=3, group_size=16, clip=0.85))),
    "llama-ort-int4-hc16": ("llama", PRESETS["ort-int4-hc16"][0]),  # static 8-bit channels, symmetric values
    "llama-override": ("llama", dataclasses.replace(
        PRESETS["int4-g32"][0], sink_tokens=2, residual_length=8,
        layer_overrides=(LayerOverride(layer=1, key=TensorQuant.fp16(),
                                       value=TensorQuant(format="int", bits=2, axis="channel", group_size=4)),))),
}


def _static(model, scheme):
    if not scheme.needs_calibration:
        return None
    from kvq_export.calibration import calibrate_static_scales

    rng = np.random.default_rng(3)
    return calibrate_static_scales(model, scheme, [list(rng.integers(0, 128, 48)) for _ in range(2)])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(case: str, flavor: str):
        if (case, flavor) not in made:
            arch, scheme = CASES[case]
            model = tiny_model(arch)
            out = tmp_path_factory.mktemp("trt") / f"{case}-{flavor}"
            made[case, flavor] = export_model(model, scheme, out, flavor=flavor, static=_static(model, scheme))
        return made[case, flavor]

    return get


def _load(directory) -> onnx.ModelProto:
    return onnx.load(str(directory / "model.onnx"))


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every typed value: inputs, outputs, initializers, inferred intermediates."""
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {v.name: v.type.tensor_type.elem_type for v in
           [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]}
    out.update({t.name: t.data_type for t in model.graph.initializer})
    return out


def _io(values) -> list[tuple]:
    return [(v.name, v.type.tensor_type.elem_type,
             tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)) for v in values]


def test_trt_is_a_known_flavor():
    assert "trt" in flavor_names()


@pytest.mark.parametrize("case", sorted(CASES))
def test_plugin_nodes_match_the_declared_signature(exported, case):
    directory = exported(case, "trt")
    manifest = Manifest.load(directory)
    assert manifest.flavor == "trt"
    model = _load(directory)
    onnx.checker.check_model(model)
    assert not model.functions, "a local function body would make TensorRT inline it instead of the plugin"
    assert PLUGIN_NAMESPACE in {o.domain for o in model.opset_import}

    nodes = [n for n in model.graph.node if n.domain == PLUGIN_NAMESPACE]
    assert len(nodes) == manifest.num_layers, "one plugin node per layer"
    signatures = manifest_signatures(manifest)
    types = _types(model)
    for layer, (node, sig) in enumerate(zip(nodes, signatures)):
        assert node.op_type == sig.name and node.domain == sig.namespace
        assert len(node.input) == len(sig.inputs) and len(node.output) == 1
        for name, declared in zip(node.input[1:], sig.inputs[1:]):
            assert name == declared.source, (layer, declared.name)
        for name, declared in zip(node.input, sig.inputs):
            assert types.get(name) == DType.get(declared.dtype).proto, (layer, declared.name, types.get(name))
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        want = sig.node_attributes(aot=True)
        assert list(attrs) == list(want)
        for key, value in want.items():
            got = attrs[key].decode() if isinstance(attrs[key], bytes) else attrs[key]
            assert got == pytest.approx(value) if isinstance(value, float) else got == value, (layer, key)
            kind = next(a.type for a in node.attribute if a.name == key)
            assert kind == {int: onnx.AttributeProto.INT, float: onnx.AttributeProto.FLOAT,
                            str: onnx.AttributeProto.STRING}[type(value)], key
        assert attrs["plugin_namespace"] == b"kvq" and attrs["aot"] == 1
        assert attrs["window"] == (manifest.model.sliding_windows[layer] or 0)
        key_layout, value_layout = StreamLayout.for_layer(manifest.scheme, layer, manifest.model.head_dim)
        assert StreamLayout.from_attributes("key", want) == dataclasses.replace(key_layout, clip=1.0)
        assert StreamLayout.from_attributes("value", want) == dataclasses.replace(value_layout, clip=1.0)


@pytest.mark.parametrize("flavor", ["trt", "reference"])
@pytest.mark.parametrize("case", ["llama-high-int6", "llama-int3-high", "llama-ort-int4", "llama-ort-int4-hc16"])
def test_every_initializer_is_read_by_a_node(exported, case, flavor):
    # each flavour reads a different part of a stream's calibrated constants (the plugin a channel order, the
    # reference graph permutation matrices); one it never reads is dead weight ONNX Runtime warns about
    graph = _load(exported(case, flavor)).graph
    read = {name for node in graph.node for name in node.input}
    assert [t.name for t in graph.initializer if t.name not in read] == []


@pytest.mark.parametrize("case", ["llama-kivi-4", "llama-ort-int4", "llama-override", "llama-int4-sym-g32-rotated",
                                  "llama-high-int6", "llama-ort-int4-hc16"])
def test_cache_io_and_update_equal_the_reference_flavour(exported, case):
    trt_dir, ref_dir = exported(case, "trt"), exported(case, "reference")
    trt_model, ref_model = _load(trt_dir), _load(ref_dir)
    assert _io(trt_model.graph.input) == _io(ref_model.graph.input)
    assert _io(trt_model.graph.output) == _io(ref_model.graph.output)
    assert Manifest.load(trt_dir).to_dict()["cache"] == Manifest.load(ref_dir).to_dict()["cache"]

    # layer 0's present state depends on no plugin output: extract and run that subgraph from both exports
    manifest = Manifest.load(trt_dir)
    past = [t for t in manifest.cache("past") if t.layer in (None, 0)]
    names_in = ["input_ids", "attention_mask", *(t.name for t in past)]
    names_out = [tensor_name("present", t.layer, t.part, t.role) for t in past]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (2, 200)).astype(np.int64)  # past kivi's window: groups get quantized
    mask = np.ones_like(ids)
    mask[1, :40] = 0
    results = []
    for directory in (trt_dir, ref_dir):
        sub = directory.parent / f"{directory.name}-layer0.onnx"
        onnx.utils.extract_model(str(directory / "model.onnx"), str(sub), names_in, names_out)
        sess = ort.InferenceSession(str(sub), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": ids, "attention_mask": mask}
        for t in past:
            shape = [2 if d == "batch" else (d if isinstance(d, int) else 0) for d in t.shape]
            feeds[t.name] = np.zeros(shape, DType.get(t.dtype).bits_numpy)
        results.append(sess.run(names_out, feeds))
    for name, a, b in zip(names_out, *results):
        assert np.array_equal(a, b), name


def test_rotated_keys_reach_the_plugin_rotated(exported):
    """The plugin's q is the body's rotation MatMul output; its signature ignores the rotation."""
    directory = exported("llama-int4-sym-g32-rotated", "trt")
    model = _load(directory)
    producer = {out: node for node in model.graph.node for out in node.output}
    rotations = {t.name for t in model.graph.initializer if t.name.startswith("rotation.")}
    for node in (n for n in model.graph.node if n.domain == PLUGIN_NAMESPACE):
        q = producer[node.input[0]]
        while q.op_type in ("Identity", "Cast"):
            q = producer[q.input[0]]
        assert q.op_type == "MatMul" and q.input[1] in rotations
    plain = Manifest.load(exported("llama-int4-sym-g32", "trt"))
    assert [s.name for s in manifest_signatures(Manifest.load(directory))] == \
        [s.name for s in manifest_signatures(plain)]


FOUR_BY_TWO = attention_facts(num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2)


def test_signature_is_derived_from_the_scheme():
    kivi = plugin_signature(PRESETS["kivi-4"][0], 0, attention_facts(num_heads=9, num_kv_heads=3, head_dim=64,
                                                                       scaling=0.125))
    assert kivi.plugin_id == "kvq::kvq_attention_asym_asym"
    assert [i.name for i in kivi.inputs] == [
        "q", "seq_lengths", "key_sinks", "key_codes", "key_scales", "key_zero_points", "key_recent",
        "value_sinks", "value_codes", "value_scales", "value_zero_points", "value_recent"]
    assert [i.source for i in kivi.inputs[5:7]] == ["present.0.key.zero_points", "present.0.key.recent"]
    assert kivi.io_types("fp16")[:4] == ["FP16", "INT64", "FP16", "UINT8"] and kivi.io_types()[-1] == "FP32"
    fp8 = plugin_signature(PRESETS["fp8"][0], 0, FOUR_BY_TWO, dtype="fp16")
    assert fp8.name == "kvq_attention_sym_sym" and fp8.inputs[3].dtype == "float8e4m3fn"
    assert fp8.output_dtype == "float16" and fp8.attribute_dict["scale"] == pytest.approx(32**-0.5)
    static = plugin_signature(PRESETS["ort-int8"][0], 1, FOUR_BY_TWO)
    assert [i.source for i in static.inputs if i.role == "scales"] == ["static.1.key.scales", "static.1.value.scales"]
    fp16 = plugin_signature(PRESETS["fp16"][0], 0, attention_facts(num_heads=4, num_kv_heads=2, head_dim=32, window=16))
    assert fp16.name == "kvq_attention_fp16_fp16" and len(fp16.inputs) == 4
    assert fp16.attribute_dict["window"] == 16


def test_unknown_flavor_lists_trt():
    with pytest.raises(ExportError, match="trt"):
        export_model(tiny_model("llama"), "int4-sym-g32", "/nonexistent/never-written", flavor="nope")
