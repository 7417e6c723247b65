"""og's variant of an ort-gqa graph, written as onnx_ir passes (see :mod:`kvq_export.flavors.ort_gqa.genai`).

:func:`adapt_graph` runs :class:`GenaiProloguePass`, :class:`BypassRealignmentPass` and onnx_ir's
``RemoveUnusedNodesPass`` through :func:`~kvq_export.graph.passes.run_passes`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass

from kvq_export.errors import ExportError
from kvq_export.graph.passes import run_passes
from kvq_export.naming import tensor_name

logger = logging.getLogger(__name__)

#: The ort-gqa graph's values that realign left-padded rows: the gather indices moving each row's tokens to the
#: front (GroupQueryAttention's right padding) and back, and the mask of real tokens that zeroes padding. og pads
#: on the right, so in its graph they are the identity, and :class:`BypassRealignmentPass` bypasses their readers.
ROWS_TO_FRONT, ROWS_BACK, REAL_TOKENS = "gqa.rows_to_front", "gqa.rows_back", "gqa.real_tokens"
_PREFIX = "genai."  # names of the prologue's nodes and values

SEQ_LENGTHS = tensor_name("past", None, None, "seq_lengths")
PRESENT_SEQ_LENGTHS = tensor_name("present", None, None, "seq_lengths")


def adapt_graph(model_path: str | os.PathLike[str], out_path: str | os.PathLike[str]) -> Path:
    """Write og's variant of a ``buffer``-layout graph beside ``model_path``.

    The weights stay in ``model_path``'s external-data file: the new graph references it, so the two graphs share
    one copy. Raises :class:`ExportError` if the graph lacks the inputs/outputs the rewrite replaces.
    """
    model = ir.load(str(model_path))
    run_passes(model, [GenaiProloguePass(str(model_path)), BypassRealignmentPass(), RemoveUnusedNodesPass()])
    out = Path(out_path)
    ir.save(model, out)  # external tensors stay references into model.onnx.data
    logger.debug("wrote %s", out)
    return out


class GenaiProloguePass(InPlacePass):
    """og's whole-sequence ``attention_mask`` in place of the call's mask and the past lengths.

    A prologue computes both from it; the present lengths output is dropped.

    Requires a kvq buffer-layout graph; ensures og's ``attention_mask`` is the graph's second input.
    """

    def __init__(self, where: str = "the graph") -> None:
        self.where = where

    def requires(self, model: ir.Model) -> None:
        inputs = {value.name for value in model.graph.inputs}
        missing = [name for name in ("input_ids", "attention_mask", SEQ_LENGTHS) if name not in inputs]
        if missing or not any(value.name == PRESENT_SEQ_LENGTHS for value in model.graph.outputs):
            missing = missing or [PRESENT_SEQ_LENGTHS]
            raise ExportError(f"{self.where}: not a kvq buffer-layout graph (missing {missing})")

    def call(self, model: ir.Model) -> PassResult:
        logger.debug("%s: %d prologue nodes", self.where, _prologue(model.graph))
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        names = [value.name for value in model.graph.inputs]
        if names[1:2] != ["attention_mask"] or SEQ_LENGTHS in names:
            raise ExportError(f"{type(self).__name__}: og's attention_mask is not the graph's second input")


class BypassRealignmentPass(InPlacePass):
    """The GatherND and Where nodes that realign left-padded rows bypassed; a graph without them says so."""

    def call(self, model: ir.Model) -> PassResult:
        bypassed = _bypass_realignment(model.graph)
        if not bypassed:
            logger.info("%s changed nothing: no GatherND or Where reads %s (the graph realigns no rows)",
                        type(self).__name__, ", ".join((ROWS_TO_FRONT, ROWS_BACK, REAL_TOKENS)))
        return PassResult(model, modified=bool(bypassed))


def _prologue(graph: ir.Graph) -> int:
    """Replace the call's mask and the past lengths by og's whole-sequence mask; return the nodes added."""
    inputs = {value.name: value for value in graph.inputs}
    present_seq = [value for value in graph.outputs if value.name == PRESENT_SEQ_LENGTHS]
    call_mask_in, past_lengths_in = inputs["attention_mask"], inputs[SEQ_LENGTHS]
    call_mask_in.name = _PREFIX + "unused_call_mask"  # frees the name for og's whole-sequence mask
    full = ir.Value(name="attention_mask", type=ir.TensorType(ir.DataType.INT64),
                    shape=ir.Shape(["batch", "total_sequence_length"]))

    nodes: list[ir.Node] = []

    def op(op_type: str, *args: ir.Value, name: str, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(args), attributes=attrs, outputs=[ir.Value(name=_PREFIX + name)],
                       name=_PREFIX + name)
        nodes.append(node)
        return node.outputs[0]

    def const(name: str, values: list[int]) -> ir.Value:
        return op("Constant", name=name, value=ir.tensor(np.array(values, dtype=np.int64), name=_PREFIX + name))

    axis1 = const("axis1", [1])
    t = op("Shape", inputs["input_ids"], name="new_tokens", start=1, end=2)
    width = op("Shape", full, name="mask_width", start=1, end=2)
    # 1 on every call after the prompt, where each row brings t tokens: the last t of its own ones, wherever
    # they sit in the mask (og.Generator's last column, og.Engine's ragged rows with trailing zeros)
    later = op("Cast", op("Not", op("Equal", width, t, name="is_prompt"), name="not_prompt"), name="later",
               to=ir.DataType.INT64)
    prompt_mask = op("Slice", full, op("Neg", t, name="minus_new_tokens"), const("end", [np.iinfo(np.int64).max]),
                     axis1, name="prompt_mask")
    call = op("Max", prompt_mask, later, name="call_mask")
    past_lengths = op("Sub", op("ReduceSum", full, axis1, name="held", keepdims=0),
                      op("ReduceSum", call, axis1, name="new", keepdims=0), name="past_lengths")
    call_mask_in.replace_all_uses_with(call)
    past_lengths_in.replace_all_uses_with(past_lengths)
    graph.inputs.remove(call_mask_in)
    graph.inputs.remove(past_lengths_in)
    graph.inputs.insert(1, full)
    for value in present_seq:
        graph.outputs.remove(value)
    graph.insert_before(next(iter(graph)), nodes)
    return len(nodes)


def _bypass_realignment(graph) -> int:
    """Drop the GatherND and Where nodes that realign left-padded rows; return how many.

    og's rows are right-padded (a prompt's padding after its tokens; every later call all ones, og.Engine's
    shorter rows included: docs/design/genai.md), so each row's tokens already sit where GroupQueryAttention
    wants them and the gathers are the identity. Padding positions then keep what the node leaves there instead
    of zeros, as in og's own graphs: nothing reads them (og takes each row's logits at its own last token, and
    the node never attends past a row's length).
    """
    realign = {v for node in graph for v in node.outputs if v.name in (ROWS_TO_FRONT, ROWS_BACK, REAL_TOKENS)}
    bypassed = 0
    for value in realign:
        for node, index in list(value.uses()):
            keep = {("GatherND", 1): 0, ("Where", 0): 1}.get((node.op_type, index))
            result = node.outputs[0]
            if keep is None or result.is_graph_output():
                continue
            result.replace_all_uses_with(node.inputs[keep])
            node.graph.remove(node, safe=True)
            bypassed += 1
    return bypassed
