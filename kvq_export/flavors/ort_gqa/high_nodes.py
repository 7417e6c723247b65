"""The nodes around a GroupQueryAttention node whose head is widened by 8-bit high channels.

A layer with high channels gives the node a head of ``head_dim + n`` channels (see
:class:`~kvq_export.flavors.ort_gqa.plan.HighSplit`): :func:`widen` lays out the packed q|k|v rows of a decode
step, :func:`high_nibbles` the 4-bit values a prefill stores, :func:`fold` folds the node's wider output back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kvq_export.flavors.ort_gqa.plan import HighSplit, LayerPlan
from kvq_export.graph.builder import GraphBuilder
from kvq_export.graph.codec import static_name
from kvq_export.model_facts import ModelFacts
from kvq_export.vocab import Part


@dataclass(frozen=True)
class NodeShape:
    """What the high-channel nodes read of the layer's GroupQueryAttention node: the model and the node's rows."""

    facts: ModelFacts
    head_dim: int  # the cache geometry's
    kv_row: int  # channels of one stream's packed row (kv heads x head_dim)
    compute_type: ir.DataType


def quantize(b: GraphBuilder, x: ir.Value, scale: ir.Value, bits: int, compute_type: ir.DataType) -> ir.Value:
    """The node's cache bytes of ``x`` [B, kv_heads, t, head_dim] (unpadded).

    ``clip(round_half_even(x / scale), -2^(b-1), 2^(b-1) - 1)`` as int8, or at 4 bits ``q + 8`` two to a
    uint8, low nibble first: the bytes GroupQueryAttention writes.
    """
    if compute_type != ir.DataType.FLOAT:
        x = b.op("Cast", x, to=ir.DataType.FLOAT)
    half = float(1 << (bits - 1))
    q = b.op("Clip", b.op("Round", b.op("Div", x, scale)), b.const(-half), b.const(half - 1))
    if bits == 8:
        return b.op("Cast", q, to=ir.DataType.INT8)
    return pack(b, b.op("Add", q, b.const(half)))


def pack(b: GraphBuilder, nibbles: ir.Value) -> ir.Value:
    """Float nibbles 0..15 along the last axis -> uint8, two to a byte, low nibble first (half the last axis)."""
    even, odd = (b.op("Slice", nibbles, b.const([start]), b.const([2**62]), b.const([-1]), b.const([2]))
                 for start in (0, 1))
    return b.op("Cast", b.op("Add", even, b.op("Mul", odd, b.const(16.0))), to=ir.DataType.UINT8)

def high_code(b: GraphBuilder, x: ir.Value, codes: dict[str, ir.Value], start: int = 0) -> ir.Value:
    """The 8-bit code ``c`` kvq stores of each high channel in float32 rows ``x`` (elsewhere 0), as its codec does.

    ``codes``: :meth:`LayerPlan.high_code_constants` over the packed row; ``x`` holds its columns from ``start``.
    """
    def const(role: str) -> ir.Value:  # (a Slice of an initializer: folded when the session loads)
        return codes[role] if not start else b.op("Slice", codes[role], b.const([start]), b.const([2**62]))

    c = b.op("Round", b.op("Div", b.op("Sub", x, const("zero")), const("scale")))
    return b.op("Add", b.op("Min", b.op("Max", c, const("low")), const("top")), const("offset"))

def high_nibbles(b: GraphBuilder, node: NodeShape, layer: int, plan: LayerPlan, qkv: ir.Value,
                 codes: dict[str, ir.Value]) -> ir.Value:
    """The 4-bit values ``q + 8`` the node stores of a prefill's keys and values, ``[B, t, 2, kv_heads, D + n]``.

    From the exact packed projections ``qkv`` (right-aligned, after RoPE), only their key and value columns,
    without widening the row: the node's codes of the widened rows :func:`widen` makes, bit for bit. At a
    high channel's place ``hi = floor(c / 16)`` and after ``head_dim`` ``lo = c - 16 hi`` (the node's rounding
    of ``(c - 135.5) s / 16 s`` and ``(lo - 8) s / s``); at every other channel ``clip(round((x - offset) /
    scale), -8, 7) + 8`` at the node's scale, the difference first rounded to the compute dtype (the node's
    input).
    """
    f = node.facts
    heads, n = f.num_kv_heads, plan.k_high.channels.shape[1]
    q_size = f.num_heads * node.head_dim
    x = b.op("Slice", qkv, b.const([q_size]), b.const([2**62]), b.const([2]))  # [B, t, key | value]
    x = x if node.compute_type == ir.DataType.FLOAT else b.op("Cast", x, to=ir.DataType.FLOAT)
    c = high_code(b, x, codes, q_size)
    hi = b.op("Floor", b.op("Mul", c, b.const(1 / 16)))
    lo = b.op("Sub", c, b.op("Mul", hi, b.const(16.0)))
    highs = (plan.k_high, plan.v_high)
    own = np.concatenate([s.reshape(1, heads, 1, -1)[0, :, 0, :node.head_dim].reshape(-1)
                          for s in (plan.k_scale, plan.v_scale)])
    places = np.concatenate([start + high.places().reshape(-1) for start, high in zip((0, node.kv_row), highs)])
    # q + 8 clipped to 0..15, but to 0 at the high channels' places, where hi (0 elsewhere) then wins a Max
    low, top = np.full(2 * node.kv_row, -8.0, np.float32), np.full(2 * node.kv_row, 7.0, np.float32)
    top[places] = -8.0

    def const(role: str, array: np.ndarray) -> ir.Value:
        return b.initializer(static_name(layer, "kv", f"high_channels.prefill_{role}"), array)

    shifted = b.op("Sub", x, const("offset", np.concatenate(plan.stream_offsets(node.kv_row))))
    if node.compute_type != ir.DataType.FLOAT:  # the node quantizes its compute-dtype input
        shifted = b.op("Cast", b.op("Cast", shifted, to=node.compute_type), to=ir.DataType.FLOAT)
    q = b.op("Min", b.op("Max", b.op("Round", b.op("Div", shifted, const("scale", own))), const("low", low)),
             const("top", top))
    own_nibbles = b.op("Max", b.op("Add", q, b.const(8.0)), hi)
    lower = b.op("Gather", lo, const("lower", places), axis=2)
    return b.op("Concat", b.op("Reshape", own_nibbles, b.const([0, 0, 2, heads, node.head_dim])),
                b.op("Reshape", lower, b.const([0, 0, 2, heads, n])), axis=4)

def widen(b: GraphBuilder, node: NodeShape, layer: int, plan: LayerPlan, qkv: ir.Value,
          codes: dict[str, ir.Value]) -> ir.Value:
    """Packed q|k|v rows with the node's head of ``head_dim + n`` channels (see :class:`HighSplit`).

    ``qkv``: ``[B, t, (Hq + 2 Hkv) * D]`` after RoPE. kvq's 8-bit codes ``c`` of both streams' high channels
    are computed as the reference codec does (fp32, round half to even; ``codes``: their constants), over the
    whole row at once (off the high channels the constants are inert and the codes unread: no Gather to pick
    the channels out), and join the row with their lower nibbles ``c mod 16``. One Gather lays out each
    widened row: each query head's channels and again its kv head's high key channels, then each key and
    value head with ``c`` in the high channel's place and ``c mod 16`` after ``head_dim``. One Sub and one Mul
    over the widened row then turn those into values the node's quantizer rounds to exactly ``hi - 8`` and
    ``lo - 8``, and subtract asymmetric streams' offsets from the other channels (minus 0, times 1 elsewhere:
    exact). Decode steps run it (a prefill stores :func:`high_nibbles` instead).
    """
    f = node.facts
    highs = (plan.k_high, plan.v_high)
    q_size, row = f.num_heads * node.head_dim, node.kv_row
    width = q_size + 2 * row
    starts = (q_size, q_size + row)  # where the key and value rows start in the packed row

    def const(role: str, array: np.ndarray) -> ir.Value:
        return b.initializer(static_name(layer, "kv", f"high_channels.{role}"), array)

    x = qkv if node.compute_type == ir.DataType.FLOAT else b.op("Cast", qkv, to=ir.DataType.FLOAT)
    c = high_code(b, x, codes)  # kvq's stored code c
    source = b.op("Concat", x, c, b.op("Mod", c, b.const(16.0), fmod=1), axis=2)  # [row | c | c mod 16]
    own, query = np.arange(width), highs[0].query_widened(f.num_heads)
    index = np.concatenate([query] + [
        high.widened(own[start:start + row], width + start + high.places(), 2 * width + start + high.places())
        for start, high in zip(starts, highs)])
    wide = b.op("Gather", source, b.initializer(static_name(layer, "qkv", "high_channels.widen"), index), axis=2)
    # [c - 135.5 | lo - 8] * s: at node scale 16 s the first rounds to hi - 8, being (c - 128) / 16 - 0.47 with
    # c - 128 = 16 (hi - 8) + lo, always 1/32 or more from a tie
    offsets = plan.stream_offsets(row)
    centre = np.concatenate([np.zeros(query.size, np.float32)] + [
        high.widened(offset.astype(np.float32), 135.5, 8.0) for offset, high in zip(offsets, highs)])
    scale = np.concatenate([np.ones(query.size, np.float32)] + [
        high.widened(np.ones(row, np.float32), high.scale, high.scale) for high in highs])
    wide = b.op("Mul", b.op("Sub", wide, const("centre", centre)), const("nibble_scale", scale))
    return wide if node.compute_type == ir.DataType.FLOAT else b.op("Cast", wide, to=node.compute_type)

def fold(b: GraphBuilder, node: NodeShape, layer: int, out: ir.Value, high: HighSplit) -> ir.Value:
    """The node's output ``[B, t, Hq * (D + n)]`` -> ``[B, t, Hq * D]``.

    Each query head's n extra channels are added onto its kv head's high value channels: one Gather reads
    each channel and the extra channel added to it (a zero column appended for the others), one ReduceSum
    adds the two (no matmul over the whole row).
    """
    padded = b.op("Pad", out, b.const([0, 0, 0, 0, 0, 1]))  # one zero column at the end
    index = np.stack(high.folded(node.facts.num_heads))  # [2, Hq * D]: main, extra
    pairs = b.op("Gather", padded, b.initializer(static_name(layer, Part.VALUE, "high_channels.fold"), index), axis=2)
    return b.op("ReduceSum", pairs, b.const([2]), keepdims=0)
