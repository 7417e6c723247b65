"""Attention over the stored quantized cache: the fused Triton decode kernel and the prefill path.

* :func:`decode_attention` (op ``decode_attention``): one Triton kernel reads the packed codes, scales and
  zero points of the quantized region and the high-precision sinks/recent window straight from the stored
  layout, dequantizes in registers and runs an online softmax; all query heads of one kv head share one
  pass over the cache (GQA); the sequence is split across programs (flash-decoding) and a second small
  kernel merges the splits. A few query tokens are handled with causal masking by position.
* :func:`prefill_attention`: long prompts dequantize the stored cache into a temporary fp32 buffer
  (:func:`kvq_plugins.layout.dequantize_stream`, torch) and call standard attention
  (``torch.nn.functional.scaled_dot_product_attention``). That buffer is the only place a dequantized
  cache is ever materialized.
* :func:`attention` picks one of the two by the number of query tokens.

Query token ``j`` of ``t`` in row ``b`` sits at position ``max(seq_lengths[b] - t + j, 0)``: this call's
tokens are the row's last ``t`` (left padding of the call clamps to 0, like the reference graph), and
``seq_lengths`` already counts them (it is the *present* count).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvq_plugins.layout import QUANT_ROLES, StreamLayout, check_stream, dequantize_stream
from kvq_plugins.registry import register_kernel

from kvq_export.errors import QuantizationError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: calls with more query tokens than this use the prefill path (dequantized buffer + standard attention)
DECODE_MAX_TOKENS = 16


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def stream_constants(prefix: str, layout: StreamLayout) -> dict[str, int | bool]:
    """The kernel's per-stream constexprs (``K_*`` / ``V_*``) for a layout."""
    if not layout.quantized:
        return {f"{prefix}_QUANT": False, f"{prefix}_FP8": False, f"{prefix}_BITS": 8, f"{prefix}_OFFSET": 0,
                f"{prefix}_CHANNEL": False, f"{prefix}_GROUP": 1, f"{prefix}_META": 1, f"{prefix}_STATIC": False,
                f"{prefix}_HAS_ZERO": False, f"{prefix}_UNIT": 1, f"{prefix}_HIGH": 0, f"{prefix}_HIGH_OFFSET": 0,
                f"{prefix}_RESIDUAL": 0}
    channel = layout.axis == "channel"
    group = 1 if layout.static and channel else layout.group
    return {
        f"{prefix}_QUANT": True, f"{prefix}_FP8": layout.format == "fp8_e4m3",
        f"{prefix}_BITS": layout.bits, f"{prefix}_OFFSET": layout.offset,
        f"{prefix}_CHANNEL": channel and not layout.static, f"{prefix}_GROUP": group,
        f"{prefix}_META": layout.meta_width, f"{prefix}_STATIC": layout.static,
        f"{prefix}_HAS_ZERO": layout.has_zero, f"{prefix}_UNIT": layout.unit, f"{prefix}_HIGH": layout.high,
        f"{prefix}_HIGH_OFFSET": layout.high_levels[2], f"{prefix}_RESIDUAL": layout.residual_length,
    }


def kernel_constants(key: StreamLayout, value: StreamLayout, *, num_heads: int, kv_heads: int, scale: float,
                     window: int | None, dot_f16: bool, t_max: int, num_splits: int,
                     block_n: int | None = None) -> dict[str, object]:
    """Every constexpr of the fused kernel (shared by the JIT launcher and the TensorRT AOT compile)."""
    if key.head_dim != value.head_dim or key.sink_tokens != value.sink_tokens:
        raise QuantizationError("key and value layouts disagree on head_dim or sink tokens")
    groups = num_heads // kv_heads
    return {
        "SM_SCALE": float(scale), "WINDOW": int(window or 0), "NUM_HEADS": num_heads, "KV_HEADS": kv_heads,
        "GROUPS": groups, "HEAD_DIM": key.head_dim, "BLOCK_M": max(16, min(64, _next_pow2(groups * t_max))),
        "BLOCK_N": block_n or 32, "BLOCK_D": max(16, _next_pow2(key.head_dim)), "NUM_SPLITS": num_splits,
        "DOT_F16": dot_f16, "SINKS": key.sink_tokens,
        **stream_constants("K", key), **stream_constants("V", value),
    }


def _stream_args(layout: StreamLayout, tensors: Mapping[str, torch.Tensor]) -> tuple[list, list[int]]:
    """Pointers in :data:`QUANT_ROLES` order (None for roles the stream lacks) and region lengths.

    The lengths are those of the sinks, quantized and recent regions.
    """
    import torch

    ptrs = []
    for role in QUANT_ROLES:
        t = tensors.get(role) if role in layout.roles else None
        if t is not None:
            t = t.contiguous()
            if t.dtype == torch.float8_e4m3fn:
                t = t.view(torch.uint8)
        ptrs.append(t)
    lengths = [tensors["sinks"].shape[2] if layout.quantized else 0,
               tensors["codes"].shape[2] if layout.quantized else 0, tensors["recent"].shape[2]]
    return ptrs, lengths


def default_splits(batch: int, kv_heads: int, m_blocks: int, longest: int, block_n: int, device) -> int:
    """Flash-decoding splits: enough programs for about two waves of the GPU, >= 4 blocks per split."""
    import torch

    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * kv_heads * m_blocks
    by_length = max(1, longest // (4 * block_n))
    return max(1, min(by_length, -(-2 * sms // programs), 64))


@register_kernel("decode_attention")
def decode_attention(
    q: torch.Tensor,
    seq_lengths: torch.Tensor,
    key: Mapping[str, torch.Tensor],
    value: Mapping[str, torch.Tensor],
    key_layout: StreamLayout,
    value_layout: StreamLayout,
    *,
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused dequant + attention of ``q [B, Hq, t, D]`` over a stored cache; returns ``[B, Hq, t, D]`` in q's dtype.

    ``key``/``value`` map roles (``sinks``, ``codes``, ``scales``, ``zero_points``, ``recent``) to the
    stored tensors of one layer (static streams: ``scales``/``zero_points`` are the ``[kv_heads, n]``
    constants); ``seq_lengths`` is the int64 present count per row. ``num_splits`` defaults to a
    heuristic (1 on CPU); ``out`` may be given (it is fully overwritten).
    """
    import torch
    from kvq_plugins import triton_kernels as tk

    kernels = tk.build()
    batch, num_heads, t, dim = q.shape
    kv_heads = key["recent"].shape[1]
    _check_device(q, tk.device_type())
    if num_heads % kv_heads:
        raise QuantizationError(f"{num_heads} query heads are not a multiple of {kv_heads} kv heads")
    check_stream(key_layout, key, batch, kv_heads, "key")
    check_stream(value_layout, value, batch, kv_heads, "value")
    q = q.contiguous()
    seq_lengths = seq_lengths.to(device=q.device, dtype=torch.int64).contiguous()
    if out is None:
        out = torch.empty_like(q)
    consts = kernel_constants(key_layout, value_layout, num_heads=num_heads, kv_heads=kv_heads, scale=scale,
                              window=window, dot_f16=q.dtype == torch.float16, t_max=t, num_splits=1,
                              block_n=block_n)
    m_blocks = -(-(consts["GROUPS"] * t) // consts["BLOCK_M"])
    splits = num_splits or default_splits(batch, kv_heads, m_blocks, int(seq_lengths.max()) if batch else 0,
                                          consts["BLOCK_N"], q.device)
    consts["NUM_SPLITS"] = splits
    k_ptrs, k_len = _stream_args(key_layout, key)
    v_ptrs, v_len = _stream_args(value_layout, value)
    if splits > 1:
        part_o = torch.empty((batch * num_heads * t * splits, dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch * num_heads * t * splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = None
    grid = (batch * kv_heads, m_blocks, splits)
    logger.debug("decode_attention: grid %s, %d query tokens, block_n %d", grid, t, consts["BLOCK_N"])
    if batch and t:
        with tk.launch_context():
            _launch(kernels, grid, q, seq_lengths, k_ptrs, v_ptrs, t, k_len, v_len, out, part_o, part_ml, consts)
    return out


def _launch(kernels, grid, q, seq_lengths, k_ptrs, v_ptrs, t, k_len, v_len, out, part_o, part_ml, consts) -> None:
    """The fused kernel, then (with several splits) the reduction over one program per query row."""
    kernels["_decode_attention_kernel"][grid](q, seq_lengths, *k_ptrs, *v_ptrs, t, *k_len, *v_len,
                                              out, part_o, part_ml, **consts)
    splits = consts["NUM_SPLITS"]
    if splits > 1:
        batch, num_heads, _, dim = q.shape
        kernels["_reduce_kernel"][(batch * num_heads * t,)](
            part_o, part_ml, out, HEAD_DIM=dim, BLOCK_D=consts["BLOCK_D"], NUM_SPLITS=splits,
            BLOCK_S=_next_pow2(splits))


def prefill_attention(
    q: torch.Tensor,
    seq_lengths: torch.Tensor,
    key: Mapping[str, torch.Tensor],
    value: Mapping[str, torch.Tensor],
    key_layout: StreamLayout,
    value_layout: StreamLayout,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Prefill: dequantize the stored cache into a temporary fp32 buffer, then standard attention (torch SDPA).

    Same contract as :func:`decode_attention`; meant for many query tokens, where the cache is read once
    for all of them and the attention is compute-bound.
    """
    import torch

    n = seq_lengths.to(device=q.device, dtype=torch.int64)
    total = int(n.max()) if n.numel() else 0
    k = dequantize_stream(key_layout, key, n, total)
    v = dequantize_stream(value_layout, value, n, total)
    batch, num_heads, t, _ = q.shape
    groups = num_heads // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    key_pos = torch.arange(total, device=q.device)[None, :] - (total - n[:, None])  # [B, N]; < 0 = padding
    qpos = (n[:, None] - t + torch.arange(t, device=q.device)[None, :]).clamp(min=0)  # [B, t]
    allowed = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= qpos[:, :, None])
    if window:
        allowed &= key_pos[:, None, :] > qpos[:, :, None] - window
    allowed = allowed[:, None]  # [B, 1, t, N]
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=allowed, scale=scale)
    out = torch.where(allowed.any(-1, keepdim=True), out, torch.zeros_like(out))  # rows that see no key
    return out.to(q.dtype)


def attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """:func:`decode_attention` for up to :data:`DECODE_MAX_TOKENS` query tokens, else :func:`prefill_attention`."""
    if q.shape[2] <= DECODE_MAX_TOKENS:
        return decode_attention(q, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k in ("scale", "window")}
    return prefill_attention(q, *args, **kwargs)


def _check_device(q: torch.Tensor, expected: str) -> None:
    if q.device.type != expected:
        how = ("the kernels were built for CUDA; pass CUDA tensors" if expected == "cuda" else
               "the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 was set when they were built); "
               "pass CPU tensors")
        raise QuantizationError(f"tensors are on {q.device.type}, but {how}")
