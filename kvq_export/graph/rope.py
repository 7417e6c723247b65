"""RoPE's part of the decoder graph: the cos/sin tables and their application.

:class:`RotaryGraph` emits the cos/sin tables from the positions once per distinct
:class:`~kvq_export.arch.rope.RopeSpec` (the frequencies, computed by :mod:`kvq_export.arch.rope`) and applies
them, to one head-split tensor (:meth:`RotaryGraph.apply`) or to the q and k heads of a packed
``[B, t, (Hq + 2 Hkv) * D]`` projection (:meth:`RotaryGraph.apply_packed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from kvq_export.graph.builder import GraphBuilder

if TYPE_CHECKING:
    from kvq_export.arch.rope import RopeSpec
    from kvq_export.model_facts import ModelFacts


class RotaryGraph:
    """RoPE in a decoder graph: tables built once per distinct :class:`RopeSpec`, applied per layer.

    ``facts`` gives the head counts and ``head_dim``; ``from_float`` casts a float32 value to the body's compute
    dtype (the tables are computed in float32, as transformers computes them, then cast).
    """

    def __init__(self, b: GraphBuilder, facts: ModelFacts, *, from_float: Callable[[ir.Value], ir.Value]) -> None:
        self.b = b
        self.facts = facts  # the head counts and head_dim the tables are laid out for
        self.from_float = from_float
        self.tables: dict[int, tuple[ir.Value, ir.Value]] = {}  # id(RopeSpec) -> (cos, sin)

    def _float_tables(self, positions: ir.Value, rope: RopeSpec) -> tuple[ir.Value, ir.Value]:
        """float32 cos/sin [B, t, R] (R = rope.rotary_dim) from int64 positions [B, t], as HF computes them."""
        b = self.b
        name = "rope.inv_freq" if rope.layer_type is None else f"rope.{rope.layer_type}.inv_freq"
        inv_freq = b.initializer(name, rope.inv_freq.astype(np.float32))
        pos = b.op("Unsqueeze", b.op("Cast", positions, to=ir.DataType.FLOAT), b.const([-1]))
        freqs = b.op("Mul", pos, inv_freq)  # [B, t, D/2]
        emb = b.op("Concat", freqs, freqs, axis=-1)  # [B, t, D]
        cos, sin = b.op("Cos", emb), b.op("Sin", emb)
        if rope.attention_scaling != 1.0:
            scale = b.const(rope.attention_scaling)
            cos, sin = b.op("Mul", cos, scale), b.op("Mul", sin, scale)
        return cos, sin

    def add_tables(self, positions: ir.Value, rope: RopeSpec) -> None:
        """cos/sin [B, 1, t, R] in the compute dtype, for :meth:`apply`."""
        cos, sin = self._float_tables(positions, rope)
        heads_axis = self.b.const([1])  # broadcast over heads
        self.tables[id(rope)] = (self.b.op("Unsqueeze", self.from_float(cos), heads_axis),
                                 self.b.op("Unsqueeze", self.from_float(sin), heads_axis))

    def add_packed_tables(self, positions: ir.Value, rope: RopeSpec) -> None:
        """Tables cos and signed sin [B, t, (Hq + 2 Hkv) * D] in the compute dtype, for :meth:`apply_packed`.

        Over one head: cos, and sin negated on the first half (``rotate_half``'s sign), for the R rotary channels;
        1 and 0 on the channels that pass through (partial rotary) and on the value heads, so those come out of
        the same Mul/Mul/Add unchanged (``x * 1 + y * 0 == x`` exactly).
        """
        b = self.b
        cos, sin = self._float_tables(positions, rope)
        half, rest = rope.rotary_dim // 2, self.facts.head_dim - rope.rotary_dim
        sin = b.op("Mul", sin, b.const(np.repeat(np.float32([-1, 1]), half)))
        tables = []
        for table, fill in ((cos, 1.0), (sin, 0.0)):
            if rest:
                table = b.op("Pad", table, b.const([0, 0, 0, 0, 0, rest]), b.const(np.float32(fill)))
            table = b.op("Expand", b.op("Unsqueeze", table, b.const([2, 3])),
                         b.const([1, 1, self.facts.num_heads + self.facts.num_kv_heads, 1, 1]))  # the q and k heads
            table = b.op("Pad", table, b.const([0, 0, 0, 0, 0, 0, 0, self.facts.num_kv_heads, 0, 0]),
                         b.const(np.float32(fill)))  # the value heads
            # flat like the packed row, so no layer reshapes the row for them
            tables.append(self.from_float(b.op("Reshape", table, b.const([0, 0, -1]))))
        self.tables[id(rope)] = (tables[0], tables[1])

    def apply(self, x: ir.Value, rope: RopeSpec) -> ir.Value:
        """Return x * cos + rotate_half(x) * sin, with rotate_half(x) = concat(-x2, x1) (HF layout).

        ``x`` is [B, H, t, D]. Partial rotary: only the first ``rotary_dim`` channels rotate; the rest pass through.
        """
        b = self.b
        cos, sin = self.tables[id(rope)]
        rot, d = rope.rotary_dim, self.facts.head_dim
        passed = None
        if rot < d:
            x, passed = b.op_multi("Split", x, b.const([rot, d - rot]), num_outputs=2, axis=-1)
        half = rot // 2
        x1, x2 = b.op_multi("Split", x, b.const([half, half]), num_outputs=2, axis=-1)
        rotated = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
        out = b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))
        return out if passed is None else b.op("Concat", out, passed, axis=-1)

    def apply_packed(self, qkv: ir.Value, rope: RopeSpec) -> ir.Value:
        """:meth:`apply` on the q and k heads of a packed ``[B, t, (Hq + 2 Hkv) * D]`` projection.

        Per head, ``x * cos + x[rotate] * sin'`` with the tables of :meth:`add_packed_tables`: the same two products
        and sum as ``x * cos + rotate_half(x) * sin``, so the same floats in an fp32 body. They run on the flat row;
        one Gather swaps the halves of every head (whole halves as blocks when RoPE rotates the whole head, which is
        what keeps it cheap at prompt length). (An fp16 body on ONNX Runtime's CPU runs these ops in float32 between
        casts it inserts, and may round at other points than in the per-head form: logits within 2e-4 on the tiny
        test models.)
        """
        b = self.b
        heads = self.facts.num_heads + 2 * self.facts.num_kv_heads
        cos, sin = self.tables[id(rope)]
        half, d = rope.rotary_dim // 2, self.facts.head_dim
        if 2 * half == d:  # every head's two halves swapped as blocks (a Gather of single floats is ~25x slower)
            halves = b.op("Reshape", qkv, b.const([0, 0, heads, 2, half]))
            swapped = b.op("Reshape", b.op("Gather", halves, b.const([1, 0]), axis=3), b.const([0, 0, heads * d]))
        else:  # partial rotary: the tail of each head stays in place
            swap = np.concatenate([np.arange(half, 2 * half), np.arange(half), np.arange(2 * half, d)])
            swap = (np.arange(heads)[:, None] * d + swap).reshape(-1)  # within each head of the flat row
            swapped = b.op("Gather", qkv, b.const(swap), axis=2)
        return b.op("Add", b.op("Mul", qkv, cos), b.op("Mul", swapped, sin))
