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
    assert d.ort_type == f"tensor({d.onnx})"
    assert ir.DataType.from_numpy(d.numpy) == d.ir


def test_short_and_onnx_names_are_one_row():
    assert DType.get("fp16") is DType.get("float16")
    assert onnx_name("fp32") == "float32" and onnx_name("uint8") == "uint8"
    assert DType.get("fp16").numpy == np.float16


@pytest.mark.parametrize("bad", ["bf16", "float", "", None, 16])
def test_unknown_names_list_the_allowed_ones(bad):
    with pytest.raises(KVQError, match="allowed: .*float16"):
        DType.get(bad)
