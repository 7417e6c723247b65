"""What the ort-gqa graph computes once per call, before the layers: :class:`GQACall`.

From the past lengths and the attention mask: GroupQueryAttention's length inputs, the exact branch's condition and
inputs (see :mod:`kvq_export.flavors.ort_gqa.graph`), the left/right realignment of each row's new tokens, and
either the node's rotary tables (RoPE in the node) or the new tokens' positions (RoPE in the body).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kvq_export.arch.rope import RopeSpec
from kvq_export.errors import ExportError
from kvq_export.flavors.ort_gqa.genai_graph import REAL_TOKENS, ROWS_BACK, ROWS_TO_FRONT
from kvq_export.flavors.ort_gqa.high_nodes import NodeShape
from kvq_export.flavors.reference.graph import LaidOutCall
from kvq_export.graph.builder import GraphBuilder
from kvq_export.graph.decoder_spec import DecoderSpec
from kvq_export.naming import EXACT_PREFILL, ROTARY_TABLES, tensor_name


@dataclass(frozen=True, kw_only=True)
class GQACall(LaidOutCall):
    """What :meth:`GQACacheGraph.begin` computes once per call, read by every layer's nodes.

    int32 inputs of the node: ``seqlens_k`` [B], ``query_seqlens`` [B], ``total`` (scalar). The exact branch:
    ``held`` [1] (the longest row already held), ``exact`` (bool scalar: a prompt, a chunk, or empty caches),
    ``exact_total`` and ``exact_seqlens`` (its node's inputs), ``new_rows`` [B, kv_heads, t, 1] (each new token's
    place in its row: GatherND indices, batch_dims 2), ``new_cells`` [B, kv_heads, t, 3] (the same places as
    ScatterND indices into a buffer) and ``new_real`` [B, 1, t, 1] (which new tokens are real). The realignment:
    ``to_right`` / ``to_left`` [B, t, 1] and ``valid`` [B, t, 1]. ``zero``: the compute dtype's 0; ``tables``:
    cos/sin per distinct RoPE (fused RoPE); ``shape``: the node's rows, as the high-channel nodes read them.
    """

    seqlens_k: ir.Value
    query_seqlens: ir.Value
    total: ir.Value
    held: ir.Value
    exact: ir.Value
    exact_total: ir.Value
    exact_seqlens: ir.Value
    new_rows: ir.Value
    new_cells: ir.Value
    new_real: ir.Value
    to_right: ir.Value
    to_left: ir.Value
    valid: ir.Value
    zero: ir.Value
    tables: dict[int, tuple[ir.Value, ir.Value]]
    shape: NodeShape

    @property
    def np_type(self) -> np.dtype:
        """The compute dtype as numpy's."""
        return ir.DataType(self.compute_type).numpy()



def begin_call(b: GraphBuilder, spec: DecoderSpec, past: dict[str, ir.Value], attention_mask: ir.Value,
               shape: NodeShape, *, fused_rotary: bool, exact_switch: bool = False) -> GQACall:
    """The call's :class:`GQACall` from the declared ``past`` inputs and the attention mask.

    ``fused_rotary``: the node applies RoPE (its cos/sin tables, no positions); otherwise the body does (the new
    tokens' positions, no tables). ``exact_switch``: the exact branch's condition also reads the optional input
    :data:`~kvq_export.naming.EXACT_PREFILL` (default true; false: every call attends over stored codes).
    """
    n0 = past[tensor_name("past", None, None, "seq_lengths")]
    mask = b.op("Cast", attention_mask, to=ir.DataType.INT64)
    m = b.op("ReduceSum", mask, b.const([1]), keepdims=0)  # new real tokens per row [B]
    n1 = b.op("Add", n0, m)
    t = b.op("Gather", b.op("Shape", mask), b.const([1]), axis=0)  # [1]
    t_scalar = b.op("Squeeze", t, b.const([0]))
    lengths = _lengths(b, n0, n1, m, t, t_scalar)
    if exact_switch:
        switch = b.initializer(EXACT_PREFILL, np.array(True))
        lengths["exact"] = b.op("And", lengths["exact"], switch)
    # row b holds its m_b tokens contiguously from `first` (t - m_b when left-padded as kvq feeds them,
    # 0 when right-padded as onnxruntime-genai feeds a prompt); GQA wants them at [0, m_b)
    s = b.op("Unsqueeze", b.op("Range", b.const(0), t_scalar, b.const(1)), b.const([0]))  # [1, t]
    new_rows, new_cells = _new_places(b, n0, s, mask, shape.facts.num_kv_heads)
    new_real = b.op("Unsqueeze", b.op("Less", s, b.op("Unsqueeze", m, b.const([1]))), b.const([1, 3]))
    shift = b.op("ArgMax", b.op("Cast", mask, to=ir.DataType.INT32), axis=1, keepdims=1)  # [B, 1]; 0 if idle
    to_right = b.op("Unsqueeze", b.op("Mod", b.op("Add", s, shift), t), b.const([-1]))  # [B, t, 1]
    to_left = b.op("Unsqueeze", b.op("Mod", b.op("Add", s, b.op("Sub", t, shift)), t), b.const([-1]))
    valid = b.op("Unsqueeze", b.op("Cast", mask, to=ir.DataType.BOOL), b.const([-1]))  # [B, t, 1]
    # named: onnxruntime-genai's variant of the graph (right-padded rows only) bypasses what reads them
    to_right.name, to_left.name, valid.name = ROWS_TO_FRONT, ROWS_BACK, REAL_TOKENS
    np_type = ir.DataType(spec.dtype).numpy()
    zero = b.const(np.array(0, dtype=np_type))
    tables: dict[int, tuple[ir.Value, ir.Value]] = {}
    positions = None
    if fused_rotary:
        for layer in range(spec.facts.num_layers):  # one table pair per distinct RoPE (Gemma3: local, global)
            rope = spec.rope_for(layer)
            if id(rope) not in tables:
                tables[id(rope)] = rotary_tables(b, spec, np_type, rope)
    else:  # positions of the new tokens for the body's RoPE (pads clamp to 0), as in the reference flavour
        offset = b.op("Sub", b.op("Unsqueeze", n0, b.const([1])), shift)
        positions = b.op("Max", b.op("Add", s, offset), b.const(0))
    return GQACall(spec=spec, positions=positions, past=past, n1=n1, **lengths, new_rows=new_rows,
                   new_cells=new_cells, new_real=new_real, to_right=to_right, to_left=to_left, valid=valid,
                   zero=zero, tables=tables, shape=shape)


def _new_places(b: GraphBuilder, n0: ir.Value, s: ir.Value, mask: ir.Value, kv_heads: int) -> tuple[ir.Value, ir.Value]:
    """Where an exact call's new tokens go in the buffers: row b's j-th at n0_b + j (``new_rows``, ``new_cells``).

    A padding token's place lies past its row's length, inside the capacity a step needs. Whole head rows are
    gathered and scattered (GatherND/ScatterND copy a row at a time, where the element-wise GatherElements and
    ScatterElements compute an index per byte).
    """
    places = b.op("Unsqueeze", b.op("Add", b.op("Unsqueeze", n0, b.const([1])), s), b.const([1, 3]))  # [B, 1, t, 1]
    dims = b.op("Shape", mask)  # [B, t]
    wide = b.op("Concat", b.op("Slice", dims, b.const([0]), b.const([1])), b.const([kv_heads]),
                b.op("Slice", dims, b.const([1]), b.const([2])), b.const([1]), axis=0)  # [B, kv_heads, t, 1]
    rows = b.op("Expand", places, wide)
    batch = b.op("Reshape", b.op("Range", b.const(0), b.op("Squeeze", b.op("Slice", dims, b.const([0]), b.const([1])),
                                                        b.const([0])), b.const(1)), b.const([-1, 1, 1, 1]))
    heads = b.const(np.arange(kv_heads, dtype=np.int64).reshape(1, kv_heads, 1, 1))
    cells = b.op("Concat", b.op("Expand", batch, wide), b.op("Expand", heads, wide), rows, axis=-1)
    return rows, cells


def _lengths(b: GraphBuilder, n0: ir.Value, n1: ir.Value, m: ir.Value, t: ir.Value,
             t_scalar: ir.Value) -> dict[str, ir.Value]:
    """The node's int32 length inputs and the exact branch's condition and inputs (:class:`GQACall`'s names)."""
    int32 = ir.DataType.INT32
    seqlens_k = b.op("Cast", b.op("Max", b.op("Sub", n1, b.const(1)), b.const(0)), to=int32)
    query_seqlens = b.op("Cast", m, to=int32)
    # an exact call (the quantized layers' If takes the exact branch): a prompt or a chunk of one, more than
    # one new token, or any call into empty caches; a decode step after a past runs the quantized node
    held_1 = b.op("ReduceMax", n0, b.const([0]), keepdims=1)  # [1]: the longest row already held
    held = b.op("Squeeze", held_1, b.const([0]))
    exact = b.op("Or", b.op("Equal", held, b.const(0)), b.op("Greater", t_scalar, b.const(1)))
    # the exact node's present holds every row's padded chunk after the longest past
    exact_total = b.op("Cast", b.op("Add", held, t_scalar), to=int32)
    # the exact node takes query_seqlens only with a past; a row holding no token at all takes one
    # (padding) token then: never read
    exact_seqlens = b.op("Cast", b.op("Add", m, b.op("Cast", b.op("Equal", n1, b.const(0)),
                                                    to=ir.DataType.INT64)), to=int32)
    longest = b.op("ReduceMax", n1, b.const([0]), keepdims=1)
    total = b.op("Cast", b.op("Squeeze", b.op("Max", longest, t), b.const([0])), to=int32)
    return dict(seqlens_k=seqlens_k, query_seqlens=query_seqlens, total=total, held=held_1, exact=exact,
                exact_total=exact_total, exact_seqlens=exact_seqlens)


def rotary_tables(b: GraphBuilder, spec: DecoderSpec, np_type: np.dtype,
                  rope: RopeSpec | None) -> tuple[ir.Value, ir.Value]:
    """cos/sin tables [max_positions, R/2] in the compute dtype (computed in float32, like the body).

    R is the rotary dim (GQA rotates the first 2 * table width channels); the global RoPE's tables are
    :data:`ROTARY_TABLES`, another layer type's (Gemma3's local layers) ``rope.<layer_type>.*_cache``.
    """
    if rope is None or not spec.facts.max_position_embeddings:
        raise ExportError("ort-gqa with fused rotary needs the model's RoPE and max_position_embeddings")
    pos = np.arange(spec.facts.max_position_embeddings, dtype=np.float32)[:, None]
    freqs = pos * rope.inv_freq.astype(np.float32)[None, :]
    cos, sin = np.cos(freqs), np.sin(freqs)
    if rope.attention_scaling != 1.0:
        cos, sin = cos * np.float32(rope.attention_scaling), sin * np.float32(rope.attention_scaling)
    names = ROTARY_TABLES
    if rope is not spec.rope:
        names = tuple(name.replace("rope.", f"rope.{rope.layer_type}.", 1) for name in ROTARY_TABLES)
    return (b.initializer(names[0], cos.astype(np_type)), b.initializer(names[1], sin.astype(np_type)))
