"""Weight storage formats of an export: fp32 as built, fp16, block-quantized int8 / int4, or w8a8.

:func:`quantize_weights` rewrites a built decoder graph after :func:`~kvq_export.export.decoder.build_decoder`
and before :func:`~kvq_export.graph.builder.save`::

    graph = build_decoder(model, arch, cache)
    graph = quantize_weights(graph, format="int4")      # block_size=32, symmetric, accuracy_level 4
    save(graph, out / "model.onnx")

Input: the in-memory graph, an ``onnx_ir.Model`` or an ``onnx.ModelProto`` whose weights are loaded (not left in
external data; a ModelProto is changed in place). Output: the same kind of graph with its weights stored in the
format, recorded under the graph metadata key :data:`WEIGHTS_KEY`; the cache and the compute dtype are untouched.

* ``fp32``: the weights as the graph was built (an fp16-compute graph keeps its fp16 weights);
* ``fp16``: every 2-D weight of an fp32 graph stored as float16, with a ``Cast`` back to float32 in the graph;
* ``int8`` / ``int4``: the weight MatMuls become ``com.microsoft.MatMulNBits`` through ONNX Runtime's own
  quantizer (blocks of ``block_size`` along the input dimension, zero points when not ``symmetric``), the
  embedding ``com.microsoft.GatherBlockQuantized``, and a tied lm_head reads that same quantized table;
* ``w8a8``: every weight MatMul becomes one ``kvq.QGemmRows`` (int8 codes per output channel, each row of
  activations quantized to int8 at run time, on ONNX Runtime's QGEMM kernels: :mod:`kvq_export.graph.qgemm`); the
  embedding and a tied head are int8 blocks, as ``int8`` stores them.

The int formats are ONNX Runtime contrib ops: a graph for another runtime (the ``trt`` flavour) can take ``fp16``
only.

An option kvq does not support, or a graph with no weight to convert, is refused with an
:class:`~kvq_export.errors.ExportError`. The block arithmetic is :mod:`kvq_export.weight_blocks`;
:mod:`kvq_export.weight_bytes` reports what an export directory's weights hold. Why each format is stored as it
is, and why ``accuracy_level`` defaults to 4: docs/design/weights.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import FunctionalPass, PassResult

from kvq_export.errors import ExportError
from kvq_export.graph.builder import CONTRIB_DOMAIN
from kvq_export.graph.passes import run_passes
from kvq_export.graph.qgemm import add_qgemm_rows_function, qgemm_rows_node
from kvq_export.vocab import WeightFormat
from kvq_export.weight_blocks import (
    BITS,
    DEFAULT_ACCURACY_LEVEL,
    W8A8_TABLE_BITS,
    W8A8_TABLE_BLOCK,
    block_quantizer,
    channel_codes,
    check_weight_options,
    ort_quantizer,
)

logger = logging.getLogger(__name__)

#: graph metadata key recording how the weights are stored (JSON)
WEIGHTS_KEY = "kvq.weights"

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def quantize_weights(
    model: onnx.ModelProto | ir.Model,
    *,
    format: str,
    block_size: int = 32,
    symmetric: bool = True,
    accuracy_level: int | None = DEFAULT_ACCURACY_LEVEL,
    smoothing: Mapping[str, Any] | None = None,
) -> onnx.ModelProto | ir.Model:
    """Store ``model``'s weights in ``format`` (see the module docstring); returns the same kind of model.

    An ``onnx_ir.Model`` goes through :class:`QuantizeWeightsPass` (a new model); a ModelProto is changed in place.

    Args:
        model: a built decoder graph with its weights in memory.
        format: ``fp32`` (unchanged), ``fp16``, ``int8`` or ``int4``.
        block_size: elements per scale along each weight's input dimension (int formats).
        symmetric: no zero points (int formats); asymmetric blocks store a zero point per block.
        accuracy_level: MatMulNBits' activation compute type (1 float32 .. 4 int8); None leaves ONNX Runtime's.
        smoothing: w8a8: what :func:`~kvq_export.calibration.smoothing.smoothed_model` did to the model the graph
            was built from, recorded beside the format.

    Raises:
        ExportError: an option kvq does not support, or a graph with no weight to convert.

    """
    check_weight_options(format, block_size, symmetric, accuracy_level)
    if format == WeightFormat.FP32:
        return model
    if format == WeightFormat.INT8 and accuracy_level != 4:
        logger.warning("int8 weights with accuracy_level %s: ONNX Runtime's CPU kernel for them is slow (more than 10x "
                       "fp32 weights per decode step); accuracy_level=4 (int8 activations) is the fast one",
                       accuracy_level)
    rewrite = QuantizeWeightsPass(format=format, block_size=block_size, symmetric=symmetric,
                                  accuracy_level=accuracy_level, smoothing=smoothing)
    if isinstance(model, ir.Model):
        return run_passes(model, [rewrite]).model
    _refuse_stored({prop.key: prop.value for prop in model.metadata_props})
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ExportError(f"weight {external[0]} is still in external data: load the model with its weights "
                          "(onnx.load(path), load_external_data=True) before converting them")
    return rewrite.rewrite(model)


class QuantizeWeightsPass(FunctionalPass):
    """The graph's weights stored as fp16 or int8 / int4 blocks (not fp32: the graph as built); a new model.

    Requires weights not converted already; ensures the graph records how its weights are stored
    (``kvq.weights``). A graph with no weight to convert is refused with the reason.
    """

    def __init__(self, *, format: str, block_size: int = 32, symmetric: bool = True,
                 accuracy_level: int | None = DEFAULT_ACCURACY_LEVEL,
                 smoothing: Mapping[str, Any] | None = None) -> None:
        check_weight_options(format, block_size, symmetric, accuracy_level)
        if format == WeightFormat.FP32:
            raise ExportError("fp32 weights are the graph as built: no pass rewrites them")
        self.format, self.block_size, self.symmetric = WeightFormat(format), block_size, symmetric
        self.accuracy_level, self.smoothing = accuracy_level, dict(smoothing) if smoothing else None

    def requires(self, model: ir.Model) -> None:
        _refuse_stored(model.metadata_props)

    def call(self, model: ir.Model) -> PassResult:
        ir.external_data.load_to_model(model)  # a loaded model may still point into its data file
        return PassResult(ir.from_proto(self.rewrite(ir.to_proto(model))), modified=True)

    def ensures(self, model: ir.Model) -> None:
        if WEIGHTS_KEY not in model.metadata_props:
            raise ExportError(f"{type(self).__name__}: the graph does not record how its weights are stored")

    def rewrite(self, proto: onnx.ModelProto) -> onnx.ModelProto:
        """The rewrite itself, on a ModelProto with its weights in memory (changed in place and returned)."""
        if self.format == WeightFormat.FP16:
            record = _store_fp16(proto)
        elif self.format == WeightFormat.W8A8:
            proto, record = _quantize_channels(proto)
            record.update({"smoothing": self.smoothing} if self.smoothing else {})
        else:
            proto, record = _quantize_blocks(proto, BITS[self.format], self.block_size, self.symmetric,
                                             self.accuracy_level)
        _set_metadata(proto, WEIGHTS_KEY, json.dumps(record, sort_keys=True))
        return proto


def _refuse_stored(metadata) -> None:
    """Refuse a graph whose weights were converted already (it records how, under ``kvq.weights``)."""
    if WEIGHTS_KEY in metadata:
        done = json.loads(metadata[WEIGHTS_KEY]).get("format")
        raise ExportError(f"the graph's weights are stored as {done} already; convert the graph as built")


# -- which initializers are weights ---------------------------------------------------------------------
def _is_weight(name: str) -> bool:
    """Whether initializer ``name`` is one of the model's weights.

    The decoder stores weights under their Hugging Face names (``....weight``; a fused slice adds ``[a:b]``); its
    own float constants (rotations, channel permutations, rope tables) have other names and stay as built.
    """
    base = name.rsplit("[", 1)[0] if name.endswith("]") else name
    return base.endswith(".weight")


def is_parameter(name: str) -> bool:
    """Whether initializer ``name`` holds a model parameter: a weight (``<name>.fp16`` once stored as fp16), a bias."""
    base = name.removesuffix(".fp16")
    return _is_weight(base) or (base.rsplit("[", 1)[0] if base.endswith("]") else base).endswith(".bias")


class _Graph:
    """Lookups over one GraphProto that the rewrites below keep current."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}

    def consumers(self, name: str) -> list[tuple[onnx.NodeProto, int]]:
        return [(n, i) for n in self.graph.node for i, x in enumerate(n.input) if x == name]

    def used(self, name: str) -> bool:
        return any(name in n.input for n in self.graph.node) or any(o.name == name for o in self.graph.output)

    def add_initializer(self, array: np.ndarray, name: str) -> str:
        tensor = onnx.numpy_helper.from_array(np.ascontiguousarray(array), name)
        self.graph.initializer.append(tensor)
        self.inits[name] = tensor
        return name

    def drop_initializer(self, name: str) -> None:
        if not self.used(name):
            self.graph.initializer.remove(self.inits.pop(name))

    def replace_node(self, old: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
        index = list(self.graph.node).index(old)
        self.graph.node.remove(old)
        for offset, node in enumerate(new):
            self.graph.node.insert(index + offset, node)

    def weight_matmuls(self) -> list[onnx.NodeProto]:
        """MatMuls whose B is a 2-D float weight initializer."""
        return [n for n in self.graph.node if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in self.inits
                and _is_weight(n.input[1]) and len(self.inits[n.input[1]].dims) == 2
                and self.inits[n.input[1]].data_type in _FLOATS]


def attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


# -- fp16 storage -----------------------------------------------------------------------------------------
def _store_fp16(proto: onnx.ModelProto) -> dict[str, Any]:
    """Every 2-D float32 weight becomes a float16 initializer plus a Cast back to float32 under its old name."""
    g = _Graph(proto.graph)
    casts = []
    for tensor in list(proto.graph.initializer):
        if tensor.data_type != onnx.TensorProto.FLOAT or len(tensor.dims) != 2 or not _is_weight(tensor.name):
            continue
        array = onnx.numpy_helper.to_array(tensor)
        if np.abs(array).max(initial=0) > np.finfo(np.float16).max:
            raise ExportError(f"weight {tensor.name} has values beyond float16's range; store it as fp32 or int8")
        stored = g.add_initializer(array.astype(np.float16), f"{tensor.name}.fp16")
        proto.graph.initializer.remove(g.inits.pop(tensor.name))
        casts.append(onnx.helper.make_node("Cast", [stored], [tensor.name], name=f"{tensor.name}/Cast",
                                           to=onnx.TensorProto.FLOAT))
    for offset, node in enumerate(casts):  # before every consumer
        proto.graph.node.insert(offset, node)
    if casts:
        logger.info("stored %d weights as float16", len(casts))
    elif any(t.data_type == onnx.TensorProto.FLOAT16 and _is_weight(t.name) for t in proto.graph.initializer):
        logger.info("the graph's weights are float16 already")
    else:
        raise ExportError("found no float weight initializer to store as fp16 (is this a kvq decoder graph?)")
    return {"format": "fp16"}


# -- block quantization -------------------------------------------------------------------------------------
@dataclass
class _Embedding:
    """An embedding table, the Gathers that read it and the lm_head nodes that read it transposed."""

    name: str
    gathers: list[onnx.NodeProto] = field(default_factory=list)
    heads: list[tuple[onnx.NodeProto, onnx.NodeProto | None]] = field(default_factory=list)  # (MatMul|Gemm, Transpose)
    others: int = 0  # consumers left as they are (they keep the full-precision table)


def _find_embeddings(g: _Graph) -> list[_Embedding]:
    found = []
    for name, tensor in g.inits.items():
        if not _is_weight(name) or len(tensor.dims) != 2 or tensor.data_type not in _FLOATS:
            continue
        uses = g.consumers(name)
        if not any(n.op_type == "Gather" and i == 0 and attribute(n, "axis", 0) == 0 for n, i in uses):
            continue
        emb = _Embedding(name)
        for node, index in uses:
            if node.op_type == "Gather" and index == 0 and attribute(node, "axis", 0) == 0:
                emb.gathers.append(node)
            elif node.op_type == "Transpose" and list(attribute(node, "perm", [])) == [1, 0]:
                readers = g.consumers(node.output[0])
                if readers and all(r.op_type == "MatMul" and i == 1 for r, i in readers):
                    emb.heads.extend((r, node) for r, _ in readers)
                else:
                    emb.others += 1
            elif (node.op_type == "Gemm" and index == 1 and len(node.input) == 2 and attribute(node, "transB", 0) == 1
                  and attribute(node, "transA", 0) == 0 and attribute(node, "alpha", 1.0) == 1.0):
                emb.heads.append((node, None))
            else:
                emb.others += 1
        found.append(emb)
    return found


def _quantize_embedding(g: _Graph, emb: _Embedding, bits: int, block_size: int, symmetric: bool,
                        accuracy_level: int | None) -> int:
    """Replace the Gathers and tied heads of ``emb``; return how many MatMulNBits it made."""
    table = onnx.numpy_helper.to_array(g.inits[emb.name])
    vocab, hidden = table.shape
    # [V, H] is MatMulNBits' [N, K]: quantize its transpose as the K x N weight of a MatMul
    packed, scales, zero_points = block_quantizer(bits, block_size, symmetric).qbits_block_quant(
        np.ascontiguousarray(table.T))
    blocks, width = packed.shape[1], packed.shape[1] * packed.shape[2]
    data = g.add_initializer(packed, f"{emb.name}_Q{bits}")
    scale = g.add_initializer(scales, f"{emb.name}_scales")
    extra = [] if symmetric else [g.add_initializer(zero_points, f"{emb.name}_zero_points")]
    rows = f"{data}/rows"
    reshape = onnx.helper.make_node("Reshape", [data, g.add_initializer(np.array([vocab, width], np.int64),
                                                                        f"{data}/rows_shape")],
                                    [rows], name=f"{data}/Reshape")
    for number, gather in enumerate(emb.gathers):
        padded = blocks * block_size != hidden  # a last partial block: ORT pads it, the gather returns the padding
        out = f"{gather.output[0]}/padded" if padded else gather.output[0]
        nodes = [reshape] if number == 0 else []
        nodes.append(onnx.helper.make_node(
            "GatherBlockQuantized", [rows, gather.input[1], scale, *extra], [out], domain=CONTRIB_DOMAIN,
            name=f"{gather.name}_Q{bits}", bits=bits, block_size=block_size, gather_axis=0, quantize_axis=1))
        if padded:
            nodes.append(onnx.helper.make_node(
                "Slice", [out, g.add_initializer(np.array([0], np.int64), f"{out}/starts"),
                          g.add_initializer(np.array([hidden], np.int64), f"{out}/ends"),
                          g.add_initializer(np.array([-1], np.int64), f"{out}/axes")],
                [gather.output[0]], name=f"{gather.name}_Q{bits}/Slice"))
        g.replace_node(gather, nodes)
    for head, transpose in emb.heads:
        attrs = {"K": hidden, "N": vocab, "bits": bits, "block_size": block_size}
        if accuracy_level:
            attrs["accuracy_level"] = accuracy_level
        g.replace_node(head, [onnx.helper.make_node("MatMulNBits", [head.input[0], data, scale, *extra],
                                                    [head.output[0]], domain=CONTRIB_DOMAIN,
                                                    name=f"{head.name}_Q{bits}", **attrs)])
        if transpose is not None and not g.used(transpose.output[0]):
            g.graph.node.remove(transpose)
    g.drop_initializer(emb.name)
    if emb.others:
        logger.warning("%s has %d other readers: it stays in full precision for them", emb.name, emb.others)
    logger.info("embedding %s: GatherBlockQuantized%s", emb.name,
                f" and the tied lm_head's MatMulNBits on one {bits}-bit table" if emb.heads else "")
    return len(emb.heads)


def _quantize_blocks(proto: onnx.ModelProto, bits: int, block_size: int, symmetric: bool,
                     accuracy_level: int | None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    g = _Graph(proto.graph)
    embeddings = _find_embeddings(g)
    heads = sum(_quantize_embedding(g, emb, bits, block_size, symmetric, accuracy_level) for emb in embeddings)
    weights = g.weight_matmuls()
    if not weights and not embeddings:
        raise ExportError("found no weight MatMul or embedding Gather to quantize (is this a kvq decoder graph?)")
    _name_nodes(proto.graph.node, "MatMul")
    chosen = {n.name for n in weights}
    # other MatMuls with a constant B (rotations, channel permutations) stay in float32: they are exact transforms
    keep = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name not in chosen]
    quantizer = ort_quantizer().MatMulNBitsQuantizer(
        proto, bits=bits, block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level,
        nodes_to_exclude=keep, op_types_to_quantize=("MatMul",))
    quantizer.process()
    proto = quantizer.model.model
    made = sum(n.op_type == "MatMulNBits" for n in proto.graph.node)
    if made != len(weights) + heads:
        left = sorted(chosen & {n.name for n in proto.graph.node if n.op_type == "MatMul"})
        raise ExportError(f"ONNX Runtime's quantizer left {len(left)} weight MatMul(s) unquantized ({left[0]}, ...)")
    logger.info("quantized %d MatMuls to %d-bit MatMulNBits (blocks of %d, %s, accuracy_level %s)",
                made, bits, block_size, "symmetric" if symmetric else "asymmetric", accuracy_level)
    return proto, {"format": f"int{bits}", "block_size": block_size, "symmetric": symmetric,
                   "accuracy_level": accuracy_level}


# -- w8a8: int8 channels for QGEMM --------------------------------------------------------------------------------
def _quantize_channels(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Every weight MatMul a ``kvq.QGemmRows`` on int8 codes per output channel; the embedding int8 blocks."""
    g = _Graph(proto.graph)
    embeddings, weights = _find_embeddings(g), g.weight_matmuls()
    if not weights and not embeddings:
        raise ExportError("found no weight MatMul or embedding Gather to quantize (is this a kvq decoder graph?)")
    not_float = [n.input[1] for n in weights if g.inits[n.input[1]].data_type != onnx.TensorProto.FLOAT]
    not_float += [e.name for e in embeddings if g.inits[e.name].data_type != onnx.TensorProto.FLOAT]
    if not_float:
        raise ExportError(f"w8a8 weights need a float32-compute graph ({not_float[0]} is not float32): ONNX "
                          "Runtime's MatMulIntegerToFloat computes float32 on CPU; export with --dtype fp32")
    add_qgemm_rows_function(proto)
    _name_nodes(proto.graph.node, "MatMul")
    # the embedding and a tied head stay int8 blocks: a head's row scale would follow the final norm's outliers,
    # which no smoothing reaches through a table the embedding shares
    heads = sum(_quantize_embedding(g, emb, W8A8_TABLE_BITS, W8A8_TABLE_BLOCK, True, DEFAULT_ACCURACY_LEVEL)
                for emb in embeddings)
    for node in weights:
        weight = onnx.numpy_helper.to_array(g.inits[node.input[1]])
        codes, scales = channel_codes(weight)
        stored = g.add_initializer(codes, f"{node.input[1]}_w8")
        g.replace_node(node, [qgemm_rows_node(node.input[0], stored, g.add_initializer(scales, f"{stored}_scales"),
                                              node.output[0], hidden=weight.shape[0], name=f"{node.name}_w8a8")])
        g.drop_initializer(node.input[1])
    logger.info("quantized %d MatMuls to w8a8 QGemmRows (int8 per output channel, int8 per-token activations); "
                "%d embedding(s) and %d tied head(s) as int8 blocks", len(weights), len(embeddings), heads)
    return proto, {"format": str(WeightFormat.W8A8)}


def _name_nodes(nodes: Iterable[onnx.NodeProto], op_type: str) -> None:
    """Give unnamed ``op_type`` nodes unique names (the quantizer selects nodes by name)."""
    taken = {n.name for n in nodes}
    for number, node in enumerate(n for n in nodes if n.op_type == op_type and not n.name):
        name = f"{op_type}_w{number}"
        while name in taken:
            name += "_"
        node.name = name
        taken.add(name)


def _set_metadata(proto: onnx.ModelProto, key: str, value: str) -> None:
    for prop in proto.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    proto.metadata_props.add(key=key, value=value)
