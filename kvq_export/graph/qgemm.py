"""The w8a8 linear: int8 weights per output channel, int8 activations per token, on ONNX Runtime's QGEMM kernels.

One node per linear, ``kvq.QGemmRows(x, w_codes, w_scales)``, a model-local function ONNX Runtime inlines when
it loads the graph::

    scale  = max(|x|, last axis) / 127                 one scale per row (token), from max(x) and min(x)
    x_q    = QuantizeLinear(x, scale, 128)             uint8, zero point 128, blocks of the whole row
    y      = MatMulIntegerToFloat(x_q, w_codes, scale, w_scales, 128)

``MatMulIntegerToFloat`` runs on MLAS's u8 x s8 QGEMM (AVX512-VNNI, AVX-VNNI, or AMX where the CPU has it, chosen
at run time) and scales each int32 sum by its row's and its column's scale as it writes it (a row scale of shape
``[..., 1]`` broadcasts over the columns, exactly). Integer sums are exact in any order, so a row's result
depends on that row alone: a batched request computes what it computes alone, whatever else shares the call.
ONNX Runtime's own ``DynamicQuantizeMatMul`` would share one activation scale over the whole input, so one row's
outlier would round every other row: the reason for the per-row form.

The embedding (and a tied head reading it) stays int8 blocks of 32 (``GatherBlockQuantized`` / ``MatMulNBits``
8-bit): a head's row scale would follow the final norm's outlier channels, which smoothing
(:mod:`kvq_export.calibration.smoothing`) cannot reach through a table the embedding shares.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kvq_export.errors import ExportError
from kvq_export.graph.builder import CONTRIB_DOMAIN
from kvq_export.weight_blocks import CHANNEL_CODE_MAX, W8A8_MIN_OPSET

#: the domain of kvq's model-local functions
FUNCTION_DOMAIN = "kvq"
#: the op (a model-local function) of one w8a8 linear
QGEMM_ROWS = "QGemmRows"
#: the uint8 zero point of the activations: symmetric codes -127..127 shifted to 1..255 (MLAS' fast QGEMM is u8 x s8)
ACTIVATION_ZERO_POINT = 128
#: the smallest row scale: an all-zero row quantizes to zero codes instead of dividing by zero
_TINY = np.float32(1e-30)


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def qgemm_rows_function(opset: int) -> onnx.FunctionProto:
    """The ``kvq.QGemmRows`` function proto (attribute ``hidden``: the rows' length, the input dimension K)."""
    quantize = helper.make_node("QuantizeLinear", ["x", "row_scale", "row_zero"], ["x_q"], axis=-1)
    quantize.attribute.append(onnx.AttributeProto(name="block_size", ref_attr_name="hidden",
                                                  type=onnx.AttributeProto.INT))  # a block is the whole row
    nodes = [
        _constant("last_axis", np.array([-1], np.int64)),
        _constant("tiny_scale", _TINY * np.float32(1 / CHANNEL_CODE_MAX)),
        _constant("per_code", np.float32(1 / CHANNEL_CODE_MAX)),
        _constant("per_negative_code", np.float32(-1 / CHANNEL_CODE_MAX)),
        _constant("zero", np.uint8(ACTIVATION_ZERO_POINT)),
        # max|x| / 127 as max(max(x) / 127, min(x) / -127): two reads of x, no |x| written (scaling by a positive
        # constant keeps the order, so this is max|x| / 127 bit for bit)
        helper.make_node("ReduceMax", ["x", "last_axis"], ["top"], keepdims=1),
        helper.make_node("ReduceMin", ["x", "last_axis"], ["bottom"], keepdims=1),
        helper.make_node("Mul", ["top", "per_code"], ["top_scale"]),
        helper.make_node("Mul", ["bottom", "per_negative_code"], ["bottom_scale"]),
        helper.make_node("Max", ["top_scale", "bottom_scale", "tiny_scale"], ["row_scale"]),
        helper.make_node("Shape", ["row_scale"], ["rows"]),
        helper.make_node("Expand", ["zero", "rows"], ["row_zero"]),
        quantize,
        helper.make_node("MatMulIntegerToFloat", ["x_q", "w", "row_scale", "w_scale", "zero"], ["y"],
                         domain=CONTRIB_DOMAIN),
    ]
    return helper.make_function(FUNCTION_DOMAIN, QGEMM_ROWS, ["x", "w", "w_scale"], ["y"], nodes,
                                [helper.make_opsetid("", opset), helper.make_opsetid(CONTRIB_DOMAIN, 1)],
                                attributes=["hidden"])


def qgemm_rows_node(x: str, codes: str, scales: str, y: str, *, hidden: int, name: str) -> onnx.NodeProto:
    """One w8a8 linear ``y = x @ (codes * scales)``: ``codes`` int8 ``[hidden, N]``, ``scales`` float32 ``[N]``."""
    return helper.make_node(QGEMM_ROWS, [x, codes, scales], [y], name=name, domain=FUNCTION_DOMAIN, hidden=hidden)


def add_qgemm_rows_function(model: onnx.ModelProto) -> None:
    """Ship ``kvq.QGemmRows`` with ``model`` (once) and import its domain."""
    if any(f.domain == FUNCTION_DOMAIN and f.name == QGEMM_ROWS for f in model.functions):
        return
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < W8A8_MIN_OPSET:
        raise ExportError(f"w8a8 weights need opset >= {W8A8_MIN_OPSET} (QuantizeLinear in blocks); the graph has "
                          f"opset {opset}")
    model.functions.append(qgemm_rows_function(opset))
    for domain in (FUNCTION_DOMAIN, CONTRIB_DOMAIN):
        if not any(o.domain == domain for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(domain, 1))
