"""Attention over the dequantized cache in standard ONNX ops (the reference flavour's attention).

The cache bookkeeping (:mod:`kvq_export.flavors.reference.graph`) hands over every stored token of a layer in one
token-ordered tensor ``[B, Hkv, N, D]``, each row's real tokens right-aligned; the mask built here keeps
padding, future tokens and (for sliding-window layers) tokens outside the window out of the softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from kvq_export.graph.builder import GraphBuilder

if TYPE_CHECKING:
    from kvq_export.graph.decoder_spec import DecoderSpec


def attention_mask(b: GraphBuilder, *, positions: ir.Value, total_len: ir.Value, stored: ir.Value,
                   window: int | None, compute_type: ir.DataType) -> ir.Value:
    """Additive mask [B,1,1,t,N]: key j of row b is real (j >= N - stored) and causal/in-window.

    ``positions`` [B, t] of the new tokens, ``total_len`` N (1-element int64), ``stored`` [B] tokens per row.
    """
    n_total = b.op("Squeeze", total_len, b.const([0]))
    j = b.op("Unsqueeze", b.op("Range", b.const(0), n_total, b.const(1)), b.const([0]))  # [1,N]
    key_pos = b.op("Sub", j, b.op("Unsqueeze", b.op("Sub", total_len, stored), b.const([1])))  # [B,N]
    key_pos = b.op("Unsqueeze", key_pos, b.const([1]))  # [B,1,N]
    query_pos = b.op("Unsqueeze", positions, b.const([2]))  # [B,t,1]
    allowed = b.op("And", b.op("GreaterOrEqual", key_pos, b.const(0)),
                   b.op("LessOrEqual", key_pos, query_pos))
    if window:
        allowed = b.op("And", allowed, b.op("Greater", key_pos, b.op("Sub", query_pos, b.const(int(window)))))
    np_type = ir.DataType(compute_type).numpy()
    big = b.const(np.array(np.finfo(np_type).min, dtype=np_type))
    mask = b.op("Where", allowed, b.const(np.array(0, dtype=np_type)), big)
    return b.op("Unsqueeze", mask, b.const([1, 2]))


def grouped_query_attention(b: GraphBuilder, spec: DecoderSpec, q: ir.Value, keys: ir.Value, values: ir.Value,
                            mask: ir.Value, *, total_len: ir.Value, compute_type: ir.DataType) -> ir.Value:
    """Grouped-query attention without repeating K/V: q heads of one kv head share a MatMul.

    q [B, Hq, t, D], keys/values [B, Hkv, N, D] in the compute dtype -> [B, Hq, t, D]. Applies
    ``spec.attn_softcap`` (Gemma2) before the mask; softmax runs in float32 as Hugging Face does.
    """
    facts = spec.facts
    groups = facts.kv_groups
    d = facts.head_dim
    qg = b.op("Reshape", q, b.const([0, facts.num_kv_heads, -1, d]))  # [B,Hkv,g*t,D]
    scores = b.op("MatMul", qg, b.op("Transpose", keys, perm=[0, 1, 3, 2]))
    np_type = ir.DataType(compute_type).numpy()
    scores = b.op("Mul", scores, b.const(np.array(facts.scaling, dtype=np_type)))
    cap = spec.attn_softcap
    if cap:  # Gemma2: cap * tanh(scores / cap), before the mask (transformers' eager order)
        c = b.const(np.array(cap, dtype=np_type))
        scores = b.op("Mul", b.op("Tanh", b.op("Div", scores, c)), c)
    shape5 = b.op("Concat", b.const([0, facts.num_kv_heads, groups, -1]), total_len, axis=0)
    scores = b.op("Add", b.op("Reshape", scores, shape5), mask)
    if compute_type != ir.DataType.FLOAT:
        probs = b.op("Cast", b.op("Softmax", b.op("Cast", scores, to=ir.DataType.FLOAT), axis=-1), to=compute_type)
    else:
        probs = b.op("Softmax", scores, axis=-1)
    probs = b.op("Reshape", probs, b.op("Concat", b.const([0, facts.num_kv_heads, -1]), total_len, axis=0))
    out = b.op("MatMul", probs, values)  # [B,Hkv,g*t,D]
    return b.op("Reshape", out, b.const([0, facts.num_heads, -1, d]))
