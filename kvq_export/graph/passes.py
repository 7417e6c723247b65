"""Graph rewrites as ``onnx_ir`` passes, run by onnx_ir's :class:`~onnx_ir.passes.PassManager`.

Each rewrite is a pass in the shape of onnxscript's: ``requires`` checks what it needs of the graph, ``call``
rewrites and returns a ``PassResult(model, modified)``, ``ensures`` checks what it promised; a pass that finds
nothing to change where it should have says why. The passes kvq runs after building a graph:

* :class:`kvq_export.graph.weights.QuantizeWeightsPass` -- the weights stored as fp16 or int8 / int4 blocks;
* :class:`kvq_export.flavors.ort_gqa.genai_graph.GenaiProloguePass` and
  :class:`kvq_export.flavors.ort_gqa.genai_graph.BypassRealignmentPass` -- onnxruntime-genai's variant of an ort-gqa
  graph.

:func:`run_passes` runs them and gives back the one-line :class:`~kvq_export.errors.KVQError` a pass raised (the
pass manager wraps every error in its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes import InvariantError, PassBase, PassError, PassManager, PassResult

from kvq_export.errors import KVQError


def run_passes(model: ir.Model, passes: Sequence[PassBase]) -> PassResult:
    """Run ``passes`` over ``model`` once, in order; a :class:`KVQError` inside one is raised as itself."""
    try:
        return PassManager(list(passes), steps=1, early_stop=False)(model)
    except (PassError, InvariantError) as err:
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, KVQError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None
