"""A thin graph builder over ``onnx_ir``: ops, constants, weights, inputs, outputs, one model.

The decoder and the KV-cache graphs write nodes through one :class:`GraphBuilder`::

    b = GraphBuilder(opset=23)
    x = b.input("x", ir.DataType.FLOAT, ["batch", 8])
    w = b.initializer("w", np.ones((8, 4), np.float32))
    y = b.op("MatMul", x, w)
    b.output(y, "y", ir.DataType.FLOAT, ["batch", 4])
    save(b.build(), "out/model.onnx")   # writes model.onnx + model.onnx.data

Values made by ops carry no type; :meth:`GraphBuilder.output` needs a dtype unless the value already
has one (graph inputs, initializers and constants do).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.tape import Tape

from kvq_export.errors import ExportError

logger = logging.getLogger(__name__)

IR_VERSION = 10
#: Name of the external-data file written next to ``model.onnx`` by :func:`save`.
EXTERNAL_DATA_SUFFIX = ".data"
#: Domain of ONNX Runtime's contrib ops (GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits, ...).
CONTRIB_DOMAIN = "com.microsoft"

DTypeLike = ir.DataType | np.dtype | type | str


def to_ir_dtype(dtype: DTypeLike) -> ir.DataType:
    """Turn an ``ir.DataType``, a numpy dtype (or type / name like ``"float16"``) into an ``ir.DataType``."""
    if isinstance(dtype, ir.DataType):
        return dtype
    try:
        return ir.DataType.from_numpy(np.dtype(dtype))
    except TypeError as err:
        raise ExportError(f"unsupported dtype {dtype!r}: {err}") from None


def to_numpy_dtype(dtype: DTypeLike) -> np.dtype:
    """Return the numpy dtype for ``dtype`` (bfloat16 and fp8 come from ml_dtypes through onnx_ir)."""
    return np.dtype(to_ir_dtype(dtype).numpy())


class GraphBuilder:
    """Collects nodes, weights, inputs and outputs of one ONNX graph and turns them into an ``ir.Model``.

    Args:
        opset: the default-domain opset the graph targets.
        name: the graph name.

    """

    def __init__(self, opset: int = 23, name: str = "kvq") -> None:
        self.opset = opset
        self.name = name
        self._tape = Tape()
        self._inputs: list[ir.Value] = []
        self._outputs: list[ir.Value] = []
        self._domains: dict[str, int] = {}
        self._functions: list[ir.Function] = []
        self._consts: dict[tuple[ir.DataType, tuple[int, ...], bytes], ir.Value] = {}
        self._names: set[str] = set()  # graph inputs, outputs and initializers (must be unique)
        self._scope: list[str] = []
        self._node_count = 0

    # ----------------------------------------------------------------------------------------- nodes
    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "", **attrs: Any) -> ir.Value:
        """Add one node and return its only output; ``None`` inputs stand for omitted optional inputs.

        Attributes are plain python values (int, float, str, lists, ``ir.DataType``, tensors); an
        attribute given as ``None`` is left out, which keeps call sites free of ``if``s.
        """
        return self.op_multi(op_type, *inputs, num_outputs=1, domain=domain, **attrs)[0]

    def op_multi(
        self, op_type: str, *inputs: ir.Value | None, num_outputs: int, domain: str = "", **attrs: Any
    ) -> list[ir.Value]:
        """Add one node with ``num_outputs`` outputs and return them."""
        if domain and domain not in self._domains:
            self._domains[domain] = 1
        attributes = {k: _attr_value(v) for k, v in attrs.items() if v is not None}
        self._node_count += 1
        name = "/".join([*self._scope, f"{op_type}_{self._node_count}"])
        outs = self._tape.op_multi_out(
            op_type, list(inputs), attributes, num_outputs=num_outputs, domain=domain, name=name
        )
        return list(outs)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix the names of nodes made inside the block (``layers.3/attn/MatMul_17``)."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def subgraph(self, name: str, build: Callable[[], Sequence[ir.Value]]) -> ir.Graph:
        """A subgraph (an ``If`` branch) of the nodes ``build()`` makes; its outputs are what it returns.

        Weights and constants made inside still go to the graph, whose values a subgraph reads from its outer
        scope.
        """
        main, sub = self._tape, Tape()
        sub.initializer = main.initializer  # type: ignore[method-assign]  # weights stay in the graph
        self._tape = sub
        try:
            outputs = list(build())
        finally:
            self._tape = main
        for index, value in enumerate(v for node in sub.nodes for v in node.outputs if v.name is None):
            value.name = f"{name}/{index}"  # the graph's own values are named val_<n> when saved: no shadowing
        return ir.Graph((), outputs, nodes=sub.nodes, name=name)

    def use_domain(self, domain: str, version: int = 1) -> None:
        """Import a custom domain at ``version`` (ops in an unseen domain import it at version 1)."""
        self._domains[domain] = version

    def add_function(self, function: ir.Function) -> None:
        """Ship a local function (the body of a custom-domain op) with the model."""
        self._functions.append(function)
        self._domains.setdefault(function.domain, 1)

    # ------------------------------------------------------------------------------ constants, weights
    def const(self, value: Any, dtype: DTypeLike | None = None) -> ir.Value:
        """Return a small constant as an initializer, shared between equal values of the same dtype.

        Python ints default to int64 and floats to float32; numpy arrays keep their dtype unless
        ``dtype`` is given.
        """
        if dtype is not None:
            array = np.asarray(value, dtype=to_numpy_dtype(dtype))
        elif isinstance(value, np.ndarray | np.generic):
            array = np.asarray(value)
        else:
            array = np.asarray(value)
            if array.dtype.kind == "f":
                array = array.astype(np.float32)
            elif array.dtype.kind in "iu":
                array = array.astype(np.int64)
        array = np.ascontiguousarray(array)
        ir_dtype = ir.DataType.from_numpy(array.dtype)
        key = (ir_dtype, array.shape, array.tobytes())
        found = self._consts.get(key)
        if found is None:
            found = self.initializer(f"const_{len(self._consts)}", array)
            self._consts[key] = found
        return found

    def initializer(self, name: str, array: np.ndarray) -> ir.Value:
        """Add a weight under ``name`` (not copied: do not modify ``array`` afterwards)."""
        self._claim(name)
        return self._tape.initializer(ir.Tensor(np.ascontiguousarray(array), name=name), name=name)

    # ------------------------------------------------------------------------------- inputs, outputs
    def input(self, name: str, dtype: DTypeLike, shape: Sequence[int | str | None]) -> ir.Value:
        """Declare a graph input; string dims are symbolic (``"batch"``), ``None`` is unknown."""
        self._claim(name)
        value = ir.val(name, to_ir_dtype(dtype), ir.Shape(list(shape)))
        self._inputs.append(value)
        return value

    def output(
        self,
        value: ir.Value,
        name: str,
        dtype: DTypeLike | None = None,
        shape: Sequence[int | str | None] | None = None,
    ) -> ir.Value:
        """Mark ``value`` as the graph output ``name`` and return the output value.

        A value that is already a graph input, output or initializer goes through an Identity, so
        it keeps its own name and role.
        """
        if value in self._inputs or value in self._outputs or value.const_value is not None:
            source = value
            value = self.op("Identity", source)
            value.dtype = source.dtype
            value.shape = None if source.shape is None else ir.Shape(list(source.shape))
        self._claim(name)
        value.name = name
        if dtype is not None:
            value.dtype = to_ir_dtype(dtype)
        if shape is not None:
            value.shape = ir.Shape(list(shape))
        self._outputs.append(value)
        return value

    @property
    def inputs(self) -> tuple[ir.Value, ...]:
        """The graph inputs declared so far, in order."""
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[ir.Value, ...]:
        """The graph outputs declared so far, in order."""
        return tuple(self._outputs)

    # ----------------------------------------------------------------------------------------- model
    def build(self, *, producer: str = "kvq", metadata: dict[str, str] | None = None) -> ir.Model:
        """Return the ``ir.Model`` (IR version 10) with every opset the graph uses imported."""
        untyped = [v.name for v in self._outputs if v.dtype is None]
        if untyped:
            raise ExportError(f"graph outputs {untyped} have no dtype; pass dtype= to GraphBuilder.output")
        graph = ir.Graph(
            self._inputs,
            self._outputs,
            nodes=self._tape.nodes,
            initializers=self._tape.initializers,
            opset_imports={"": self.opset, **self._domains},
            name=self.name,
        )
        model = ir.Model(
            graph,
            ir_version=IR_VERSION,
            producer_name=producer,
            functions=self._functions,
            metadata_props=dict(metadata or {}),
        )
        logger.debug(
            "built graph %r: %d nodes, %d initializers", self.name, len(graph), len(graph.initializers)
        )
        return model

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise ExportError(f"graph name {name!r} is used twice")
        self._names.add(name)


def _attr_value(value: Any) -> Any:
    """Attribute values onnx_ir does not take directly: numpy scalars and dtypes."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return to_ir_dtype(value)
    return value


def save(model: ir.Model, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` to ``path`` (``.../model.onnx``) with its weights in ``model.onnx.data`` beside it.

    Both files are written in a temporary folder next to ``path`` and moved into place with
    ``os.replace``, data first, so a reader never sees a half-written pair. Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = path.name + EXTERNAL_DATA_SUFFIX
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp:
        tmp_model = Path(tmp) / path.name
        # The data file's name is recorded inside model.onnx, so it must be final already.
        ir.save(model, tmp_model, external_data=data_name)
        if (Path(tmp) / data_name).exists():
            os.replace(Path(tmp) / data_name, path.parent / data_name)
        else:  # every tensor was small enough to stay inline: drop a stale sidecar of an older model
            (path.parent / data_name).unlink(missing_ok=True)
        os.replace(tmp_model, path)
    logger.info("saved %s (+ %s)", path, data_name)
    return path
