"""The one dtype vocabulary: every name kvq writes converts consistently to every framework."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from kvq_export.dtypes import DType, onnx_name
from kvq_export.errors import KVQError

NAMES = ("fp16", "fp32", "float16", "float32", "int64", "int32", "int8", "uint8", "bool", "float8e4m3fn", "fp8_e4m3")


@pytest.mark.parametrize("name", NAMES)
def test_every_framework_agrees_on_the_element_size(name):
    d = DType.get(name)
    assert d.numpy.itemsize == d.itemsize
    assert torch.empty((), dtype=d.torch).element_size() == d.itemsize
    assert d.ir.itemsize == d.itemsize
    assert d.ort_type == ("tensor(float)" if d.onnx == "float32" else f"tensor({d.onnx})")
    assert ir.DataType.from_numpy(d.numpy) == d.ir


def test_onnx_runtime_type_strings_match_a_real_session(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    names = ("float32", "float16", "int64", "int8", "uint8")
    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n in names], "types",
        [helper.make_tensor_value_info(n, getattr(TensorProto, DType.get(n).ir.name), [1]) for n in names],
        [helper.make_tensor_value_info(f"{n}_out", getattr(TensorProto, DType.get(n).ir.name), [1]) for n in names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert {i.name: i.type for i in session.get_inputs()} == {n: DType.get(n).ort_type for n in names}


def test_short_and_onnx_names_are_one_row():
    assert DType.get("fp16") is DType.get("float16")
    assert onnx_name("fp32") == "float32" and onnx_name("uint8") == "uint8"
    assert DType.get("fp16").numpy == np.float16


@pytest.mark.parametrize("bad", ["bf16", "float", "", None, 16])
def test_unknown_names_list_the_allowed_ones(bad):
    with pytest.raises(KVQError, match="allowed: .*float16"):
        DType.get(bad)


@pytest.mark.parametrize("name", NAMES)
def test_an_onnx_element_type_number_finds_its_row(name):
    from onnx import TensorProto

    d = DType.get(name)
    assert d.proto == getattr(TensorProto, d.ir.name) == int(d.ir)
    assert DType.of_onnx(d.proto) is d and DType.of_onnx(d.ir) is d


@pytest.mark.parametrize("bad", [16, 0, "10", True, None])
def test_unknown_onnx_element_types_list_the_known_ones(bad):
    with pytest.raises(KVQError, match=r"unknown ONNX element type .*allowed: 1 \(float32\), 10 \(float16\)"):
        DType.of_onnx(bad)
