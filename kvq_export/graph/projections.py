"""Linear projections read from a Hugging Face state dict, written as MatMuls (fused or one per projection).

:class:`StateWeights` reads state-dict tensors as numpy arrays of the compute dtype, checking names and shapes;
:class:`Projections` writes ``x @ W.T + bias`` with ``W`` stored pre-transposed (``[in, out]``) under its Hugging
Face name, folds head-block rotations into the stored weights (:func:`fold_rotation`), and, for a fused body,
writes the projections that read one input as one MatMul over their concatenated weights.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from kvq_export.arch import LinearNames
from kvq_export.dtypes import DType
from kvq_export.errors import ModelError
from kvq_export.graph.builder import GraphBuilder

#: One projection of a shared input: its names, its output features and the rotation folded into its outputs.
ProjectionSpec = tuple[LinearNames, int, "np.ndarray | None"]


def fold_rotation(wt: np.ndarray, rotate_out: np.ndarray | None, rotate_in: np.ndarray | None) -> np.ndarray:
    """Fold head-block rotations into a pre-transposed weight ``[in, out]`` (float64 result).

    ``rotate_out``: output columns, block by block of R's size, become ``wt[:, block] @ R`` (so
    ``x @ wt`` yields every head rotated); ``rotate_in``: input rows become ``R.T @ wt[block]`` (so a
    rotated input is rotated back before the product).
    """
    out = wt.astype(np.float64)
    if rotate_out is not None:
        d = rotate_out.shape[0]
        out = (out.reshape(out.shape[0], -1, d) @ rotate_out).reshape(out.shape)
    if rotate_in is not None:
        d = rotate_in.shape[0]
        out = (rotate_in.T @ out.reshape(-1, d, out.shape[1])).reshape(out.shape)
    return out


def joined_name(names: list[str]) -> str:
    """One name for several: ``a.{q,k,v}_proj.weight`` from their common prefix and suffix."""
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[len(prefix):][::-1] for n in names])[::-1]
    middles = [n[len(prefix):len(n) - len(suffix)] for n in names]
    return f"{prefix}{{{','.join(middles)}}}{suffix}"


def block_diag(matrix: np.ndarray, heads: int) -> np.ndarray:
    """``heads`` copies of a per-head ``R`` on the diagonal: rotates a ``[.., heads * D]`` projection."""
    return np.kron(np.eye(heads), matrix)


class StateWeights:
    """Reads state-dict tensors as numpy arrays of the compute dtype, checking names and shapes."""

    def __init__(self, state: Mapping[str, Any], dtype: ir.DataType, model_type: str) -> None:
        self.state = state
        self.np_dtype = np.dtype(dtype.numpy())
        self.model_type = model_type

    def array(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None,
              dtype: np.dtype | None = None) -> np.ndarray:
        """Return the tensor ``name`` as a numpy array of the compute dtype (or ``dtype``), checking its shape.

        With ``rows``, ``shape`` is that of the slice ``[start:stop]`` of a fused tensor along its first axis.
        """
        np_dtype = self.np_dtype if dtype is None else np.dtype(dtype)
        if name not in self.state:
            raise ModelError(
                f"{self.model_type}: weight {name!r} is missing from the state dict "
                "(expected a *ForCausalLM state dict with transformers' names)"
            )
        tensor = self.state[name]
        if hasattr(tensor, "detach"):  # torch: cast in torch (numpy has no bfloat16)
            array = tensor.detach().to(device="cpu", dtype=DType.get(np_dtype.name).torch).numpy()
        else:
            array = np.asarray(tensor, dtype=np_dtype)
        if rows is not None:
            if rows[1] > array.shape[0]:
                raise ModelError(f"{self.model_type}: weight {name!r} has {array.shape[0]} rows; "
                                 f"expected at least {rows[1]}")
            array = array[rows[0]:rows[1]]
        if array.shape != shape:
            raise ModelError(f"{self.model_type}: weight {name!r} has shape {array.shape}, expected {shape}")
        return array

    def initializer(self, b: GraphBuilder, name: str, shape: tuple[int, ...]) -> ir.Value:
        """Add the tensor ``name`` unchanged as an initializer of the same name."""
        return b.initializer(name, self.array(name, shape))


class Projections:
    """Writes linear projections from ``weights`` into one :class:`GraphBuilder`.

    ``fused``: projections that read the same input are one MatMul over their concatenated ``[in, sum(out)]``
    weights (folded rotations and biases included), then a Split (see :meth:`linears`).
    """

    def __init__(self, b: GraphBuilder, weights: StateWeights, *, fused: bool = False) -> None:
        self.b = b
        self.weights = weights
        self.fused = fused

    def linear(self, x: ir.Value, names: LinearNames, in_features: int, out_features: int, *,
               rotate_out: np.ndarray | None = None, rotate_in: np.ndarray | None = None) -> ir.Value:
        """``x @ W.T + bias`` with W stored pre-transposed ([in, out]) under its HF name.

        ``rotate_out``: every head-sized block of outputs (and bias) is rotated, ``y_block @ R``;
        ``rotate_in``: every head-sized block of inputs is un-rotated first, ``x_block @ R.T``. Both are
        folded into the stored weight (float64, then cast to the compute dtype).
        """
        b = self.b
        wt, bias = self.linear_arrays(names, in_features, out_features, rotate_out=rotate_out, rotate_in=rotate_in)
        y = b.op("MatMul", x, b.initializer(names.initializer, wt))
        if bias is not None:
            y = b.op("Add", y, b.initializer(names.bias, bias))
        return y

    def linear_arrays(self, names: LinearNames, in_features: int, out_features: int, *,
                      rotate_out: np.ndarray | None = None,
                      rotate_in: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The stored ``[in, out]`` weight and the ``[out]`` bias (or None) of :meth:`linear`, rotations folded."""
        weight = self.weights.array(names.weight, (out_features, in_features), names.rows)
        wt = np.ascontiguousarray(weight.T)  # [in, out]
        if rotate_out is not None or rotate_in is not None:
            wt = fold_rotation(wt, rotate_out, rotate_in).astype(weight.dtype)
        bias = None
        if names.bias is not None:
            bias = self.weights.array(names.bias, (out_features,))
            if rotate_out is not None:
                bias = fold_rotation(bias[None, :], rotate_out, None)[0].astype(bias.dtype)
        return wt, bias

    def linears(self, x: ir.Value, in_features: int, parts: list[ProjectionSpec]
                ) -> tuple[list[ir.Value], ir.Value | None]:
        """Several projections of the same ``x``: ``(names, out_features, rotate_out)`` each.

        Returns the outputs in order and, fused, their concatenation before the Split (else None). Unfused:
        one :meth:`linear` each. Fused: one MatMul over the concatenated ``[in, sum(out)]`` weights (plus one
        Add of the concatenated biases, zeros for a part without one), then a Split. Every output column is
        the same dot product as in its own MatMul, so only the kernel's summation order can differ.
        """
        if not self.fused:
            return [self.linear(x, names, in_features, out, rotate_out=rot) for names, out, rot in parts], None
        sizes = [out for _, out, _ in parts]
        joined = self.fused_projection(x, in_features, parts)
        outputs = self.b.op_multi("Split", joined, self.b.const(sizes), num_outputs=len(sizes), axis=-1)
        return list(outputs), joined

    def fused_projection(self, x: ir.Value, in_features: int,
                         parts: list[ProjectionSpec]) -> ir.Value:
        """The fused form of :meth:`linears` before its Split: ``x`` times the concatenated weights, plus bias."""
        b = self.b
        arrays = [self.linear_arrays(names, in_features, out, rotate_out=rot) for names, out, rot in parts]
        weight = np.concatenate([wt for wt, _ in arrays], axis=1)
        y = b.op("MatMul", x, b.initializer(self.fused_name([names for names, _, _ in parts]), weight))
        if any(bias is not None for _, bias in arrays):
            bias = np.concatenate([np.zeros(out, weight.dtype) if bias is None else bias
                                   for (_, out, _), (_, bias) in zip(parts, arrays)])
            names = [n.bias or f"{n.initializer}.zero_bias" for n, _, _ in parts]
            y = b.op("Add", y, b.initializer(joined_name(names), bias))
        return y

    def fused_name(self, parts: list[LinearNames]) -> str:
        """Initializer name of concatenated projections: ``...self_attn.{q,k,v}_proj.weight``.

        Slices of one fused tensor give its name back (``...qkv_proj.weight``; a row range when they do not
        cover all of it).
        """
        weights = {names.weight for names in parts}
        if len(weights) == 1 and all(names.rows for names in parts):
            name = parts[0].weight
            rows = [names.rows for names in parts]
            if all(a[1] == b[0] for a, b in zip(rows, rows[1:])):
                start, stop = rows[0][0], rows[-1][1]
                whole = start == 0 and stop == int(np.shape(self.weights.state[name])[0])
                return name if whole else f"{name}[{start}:{stop}]"
        return joined_name([names.initializer for names in parts])
