"""RoPE: its frequencies (transformers' own, per family and layer type) and its part of the decoder graph.

:func:`rope_spec` turns a config's ``rope_parameters`` into a :class:`RopeSpec` (inverse frequencies and attention
scaling, bit-identical to transformers); :class:`RotaryGraph` emits the cos/sin tables from the positions once per
distinct RoPE and applies them, to one head-split tensor (:meth:`RotaryGraph.apply`) or to the q and k heads of a
packed ``[B, t, (Hq + 2 Hkv) * D]`` projection (:meth:`RotaryGraph.apply_packed`). transformers and torch are
imported only inside :func:`rope_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from kvq_export.errors import ExportError, ModelError
from kvq_export.export.builder import GraphBuilder

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvq_export.model_facts import ModelFacts

#: RoPE variants whose frequencies depend on the sequence length at run time: one static graph can't.
DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """RoPE: cos/sin = cos/sin(position * inv_freq) * attention_scaling (HF rotate_half layout).

    It rotates the first ``rotary_dim`` (= 2 * len(inv_freq)) channels of each head and passes the rest
    through (partial rotary). ``layer_type`` names the per-layer-type entry it came from (Gemma3), or None.
    """

    rope_type: str
    inv_freq: np.ndarray  # float32 [rotary_dim // 2]
    attention_scaling: float
    layer_type: str | None = None

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates."""
        return 2 * int(self.inv_freq.shape[-1])


def rope_spec(config: PretrainedConfig, params: dict[str, Any], layer_type: str | None, *, head_dim: int,
              partial_rotary: bool, model_type: str) -> RopeSpec:
    """Inverse frequencies and attention scaling of ``params``, computed by transformers' own RoPE functions.

    ``partial_rotary``: whether the family honours ``partial_rotary_factor`` (the default RoPE then covers that
    share of ``head_dim``); ``layer_type``: the per-layer-type entry ``params`` came from (Gemma3), or None.
    """
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise ExportError(
            f"rope_type {rope_type!r} changes its frequencies with the sequence length at run time; "
            f"a static ONNX graph cannot follow it (static types: default, "
            f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - DYNAMIC_ROPE_TYPES))})"
        )
    if rope_type == "default":
        # Same expression as the models' compute_default_rope_parameters (bit-identical).
        base = params["rope_theta"]
        factor = float(params.get("partial_rotary_factor", 1.0)) if partial_rotary else 1.0
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        attention_scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, **kwargs)
    else:
        raise ExportError(
            f"unknown rope_type {rope_type!r}; supported: default, "
            f"{', '.join(sorted(set(ROPE_INIT_FUNCTIONS) - DYNAMIC_ROPE_TYPES))}"
        )
    inv = inv_freq.detach().to(torch.float32).cpu().numpy()
    if not (np.isfinite(inv).all() and (inv > 0).all() and math.isfinite(float(attention_scaling))):
        raise ModelError(f"{model_type}: RoPE parameters {dict(params)} give non-finite or non-positive rotary "
                         "frequencies; allowed: a finite rope_theta > 0 (and finite scaling factors)")
    rotary = 2 * inv.shape[-1]
    if rotary > head_dim or rotary % 2:
        raise ExportError(f"{model_type}: RoPE covers {rotary} of {head_dim} head dims")
    return RopeSpec(rope_type, inv, float(attention_scaling), layer_type)


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
