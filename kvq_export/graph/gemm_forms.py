"""The GEMM forms a linear can take in an ONNX Runtime graph, and which one each weight format gets.

A form is one way to compute ``y = x @ W`` for a ``[K, N]`` weight: its ops, how it stores ``W``, and whether a
row's result depends on the other rows of the call (``rows_alone``). :func:`single_linear` builds a form as a
one-linear graph with the ops, attributes and quantizer the export writes (w8a8: its very node maker; MatMulNBits:
the block quantizer ONNX Runtime's ``MatMulNBitsQuantizer`` calls), so ``kvq bench-kernels`` times what an export
runs. :data:`FORM_OF_WEIGHTS` is the one place that says which form each ``--weights`` format writes;
:func:`fastest_forms` reads a measured kernel table and names, per row count, the fastest form that keeps rows
alone and stays within an error bound -- the evidence that mapping answers to (docs/design/weights.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kvq_export.errors import KVQError
from kvq_export.graph.builder import CONTRIB_DOMAIN
from kvq_export.graph.qgemm import FUNCTION_DOMAIN, qgemm_rows_function, qgemm_rows_node
from kvq_export.request import DEFAULT_OPSET
from kvq_export.vocab import WeightFormat
from kvq_export.weight_blocks import block_quantizer, channel_codes

_OPSET = DEFAULT_OPSET  # what an export is written in


@dataclass(frozen=True)
class GemmForm:
    """One way to run a linear: ``nodes(weight, add)`` returns its nodes from ``x`` to ``y``.

    ``add(array, name)`` stores an initializer and returns its name. ``rows_alone``: by its design, the form
    computes each row from that row only (a batched request computes what it computes alone); the kernel table
    checks it bit for bit on the machine at hand, and only that check chooses.
    """

    name: str
    summary: str
    rows_alone: bool
    nodes: Callable[[np.ndarray, Callable[[np.ndarray, str], str]], list[onnx.NodeProto]]


def _fp32(weight, add):
    return [helper.make_node("MatMul", ["x", add(weight, "w")], ["y"])]


def _nbits(bits: int, level: int):
    def nodes(weight, add):
        k, n = weight.shape
        packed, scales, _ = block_quantizer(bits, 32, True).qbits_block_quant(np.ascontiguousarray(weight))
        return [helper.make_node("MatMulNBits", ["x", add(packed, "w_q"), add(scales, "w_scales")], ["y"],
                                 domain=CONTRIB_DOMAIN, K=k, N=n, bits=bits, block_size=32, accuracy_level=level)]
    return nodes


def _dynamic_quantize(weight, add):
    codes, scales = channel_codes(weight)
    return [helper.make_node("DynamicQuantizeMatMul", ["x", add(codes, "w_q"), add(scales, "w_scales")], ["y"],
                             domain=CONTRIB_DOMAIN)]


def _qgemm_rows(weight, add):
    codes, scales = channel_codes(weight)
    return [qgemm_rows_node("x", add(codes, "w_q"), add(scales, "w_scales"), "y", hidden=weight.shape[0],
                            name="linear")]


GEMM_FORMS: dict[str, GemmForm] = {form.name: form for form in (
    GemmForm("fp32", "MatMul, float32 weights", True, _fp32),
    GemmForm("nbits4", "MatMulNBits 4-bit, blocks of 32, accuracy_level 4 (int8 activations per block)", True,
             _nbits(4, 4)),
    GemmForm("nbits4-fp32", "MatMulNBits 4-bit, blocks of 32, accuracy_level 1 (float32 activations)", False,
             _nbits(4, 1)),  # one row and several take different float kernels
    GemmForm("nbits8", "MatMulNBits 8-bit, blocks of 32, accuracy_level 4", True, _nbits(8, 4)),
    GemmForm("dynamic-quantize", "DynamicQuantizeMatMul: int8 per channel, ONE activation scale per call", False,
             _dynamic_quantize),
    GemmForm("qgemm-rows", "QGemmRows (w8a8): int8 per channel, an activation scale per row, QGEMM", True,
             _qgemm_rows),
)}

#: the form each stored weight format runs its linears in (fp16 storage casts back to float32 first)
FORM_OF_WEIGHTS: Mapping[WeightFormat, str] = {
    WeightFormat.FP32: "fp32", WeightFormat.FP16: "fp32", WeightFormat.INT4: "nbits4", WeightFormat.INT8: "nbits8",
    WeightFormat.W8A8: "qgemm-rows"}


def get_form(name: str) -> GemmForm:
    """The form called ``name``, or a one-line error naming the known ones."""
    try:
        return GEMM_FORMS[name]
    except KeyError:
        raise KVQError(f"unknown GEMM form {name!r}; allowed: {', '.join(GEMM_FORMS)}") from None


def single_linear(form: GemmForm, weight: np.ndarray) -> onnx.ModelProto:
    """A graph ``y[M, N] = x[M, K] @ weight`` in ``form``: the nodes an export writes for one linear."""
    k, n = weight.shape
    initializers: list[onnx.TensorProto] = []

    def add(array: np.ndarray, name: str) -> str:
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    nodes = form.nodes(np.asarray(weight, np.float32), add)
    graph = helper.make_graph(nodes, form.name, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["M", n])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET),
                                                    helper.make_opsetid(CONTRIB_DOMAIN, 1),
                                                    helper.make_opsetid(FUNCTION_DOMAIN, 1)],
                              functions=[qgemm_rows_function(_OPSET)])
    model.ir_version = 10
    return model


def fastest_forms(gflops: Mapping[str, Mapping[int, float]], rows_alone: Mapping[str, bool],
                  errors: Mapping[str, float], *, max_error: float) -> dict[int, str]:
    """Per row count, the fastest form whose rows were measured alone and whose error is at most ``max_error``.

    ``gflops[form][rows]``: measured throughput (summed over the model's shapes); ``rows_alone[form]``: the kernel
    table's bit-for-bit check; ``errors[form]``: its largest relative error against float32.
    """
    eligible = [f for f in gflops if rows_alone.get(f) and errors.get(f, float("inf")) <= max_error]
    row_counts = sorted({m for f in eligible for m in gflops[f]})
    return {m: max((f for f in eligible if m in gflops[f]), key=lambda f: gflops[f][m]) for m in row_counts}
