"""Quantize-and-append with Triton (ops ``quantize`` and ``append``), bit for bit the reference cache.

:func:`quantize_block` runs the quantize kernels of :mod:`kvq_plugins.triton_kernels` on the tokens that
leave the recent window (right-aligned per row): per-group metadata in the stored dtype, then codes
computed against exactly that stored metadata and packed along head_dim. :func:`append` is
:func:`kvq_plugins.cache_update.append_stream` with this quantizer: the region moves (merging the new
tokens into the window, filling sinks, concatenating codes and metadata) are host-side torch, only the
quantization is a Triton kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvq_plugins.cache_update import append_stream
from kvq_plugins.layout import StreamLayout
from kvq_plugins.registry import register_kernel

from kvq_export.dtypes import DType
from kvq_export.errors import QuantizationError
from kvq_export.scheme_rules import FP8_E4M3_MAX, code_planes

if TYPE_CHECKING:
    import torch


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _levels(layout: StreamLayout) -> tuple[int, int, float]:
    """(lowest code, highest code, top) before the offset, as the codec has them; top is the symmetric range end."""
    if layout.format == "fp8_e4m3":
        return 0, 0, FP8_E4M3_MAX
    from kvq_export.reference.codec import int_levels

    lo, hi, _ = int_levels(layout.tensor_quant())
    return lo, hi, 0.0 if layout.format == "int" else float(hi)


@register_kernel("quantize")
def quantize_block(
    x: torch.Tensor,
    counts: torch.Tensor,
    layout: StreamLayout,
    *,
    static_scales: torch.Tensor | None = None,
    static_zeros: torch.Tensor | None = None,
    channel_order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantize each row's right-aligned ``counts[b]`` tokens of ``x [B, H, F, D]`` (Triton).

    Same contract as :func:`kvq_plugins.reference.quantize_reference`: packed codes ``[B, H, F, P]``
    (float8_e4m3fn for fp8), scales and zero points ``[B, H, F or F/G, n]`` (None for static streams),
    zeros left of each row's entries.
    """
    import torch
    from kvq_plugins import triton_kernels as tk
    from kvq_plugins.attention import _check_device

    from kvq_export.reference.codec import check_finite

    kernels = tk.build()
    _check_device(x, tk.device_type())
    if not layout.quantized:
        raise QuantizationError("format fp16 is not quantized")
    batch, heads, length, dim = x.shape
    counts = counts.to(device=x.device, dtype=torch.int64).contiguous()
    x = x.contiguous()
    if length:
        valid = torch.arange(length, device=x.device)[None, :] >= (length - counts[:, None])
        check_finite(torch.where(valid[:, None, :, None], x, torch.zeros_like(x)))
    codes = torch.zeros((batch, heads, length, layout.packed_dim), dtype=torch.uint8, device=x.device)
    sdtype = DType.get(layout.scale_dtype).torch
    channel = layout.axis == "channel" and not layout.static
    unit = layout.group if channel else 1
    if length % unit:
        raise QuantizationError(f"channel-axis quantization needs whole groups of {unit} tokens, got {length}")
    scales = zeros = None
    if layout.static:
        if static_scales is None or (layout.has_zero and static_zeros is None):
            raise QuantizationError("static scales need static_scales (and static_zeros for format int)")
        s_arg = static_scales.to(device=x.device, dtype=sdtype).contiguous()
        z_arg = static_zeros.to(device=x.device, dtype=sdtype).contiguous() if layout.has_zero else None
    else:
        scales = torch.zeros((batch, heads, length // unit, layout.meta_width), dtype=sdtype, device=x.device)
        zeros = torch.zeros_like(scales) if layout.has_zero else None
        s_arg, z_arg = scales, zeros
    name, consts = quantize_constants(layout, heads)
    if not tk.interpreted():
        consts["enable_fp_fusion"] = False  # keep mid - half (clip), x * id + 8.5 (ggml) from becoming FMAs
    args = (x, counts, codes, s_arg, z_arg)
    if name != "_quantize_ggml_kernel":
        if layout.high and channel_order is None:
            raise QuantizationError("a stream with high channels needs its [kv_heads, head_dim] channel_order")
        args += (channel_order.to(device=x.device, dtype=torch.int32).contiguous() if layout.high else None,)
    if name == "_quantize_ggml_kernel":  # fp32 scratch: ggml quantizes with the unrounded d (and minimum)
        scratch = torch.zeros((batch, heads, length, layout.meta_width), dtype=torch.float32, device=x.device)
        args += (scratch, torch.zeros_like(scratch) if layout.has_zero else scratch)
    if batch * heads and length:
        with tk.launch_context():
            if name == "_quantize_channel_kernel":
                grid = (batch * heads, length // layout.group)
            else:
                grid = (batch * heads, -(-length // consts["BLOCK_T"]))
            kernels[name][grid](*args, length, **consts)
    if scales is not None and not bool(torch.isfinite(scales).all()):
        raise QuantizationError(
            f"a group's scale overflows scale_dtype={layout.scale_dtype} (values too large); use scale_dtype fp32")
    if layout.format == "fp8_e4m3":
        codes = codes.view(torch.float8_e4m3fn)
    return codes, scales, zeros


def quantize_constants(layout: StreamLayout, heads: int) -> tuple[str, dict[str, object]]:
    """(kernel name, constexprs) quantizing a stream of this layout with ``heads`` kv heads.

    Token-axis and static streams quantize token by token (``_quantize_token_kernel``; a static channel-axis
    stream is one group per channel: GROUP 1, META head_dim); dynamic channel-axis streams one group of
    tokens per program (``_quantize_channel_kernel``); the ggml quantizer has its own token kernel
    (``_quantize_ggml_kernel``).
    """
    lo, hi, top = _levels(layout)
    dim = layout.head_dim
    if layout.quantizer == "ggml":  # token axis, groups of 32, dynamic fp16 scales (the scheme guarantees it)
        return "_quantize_ggml_kernel", dict(
            HEADS=heads, HEAD_DIM=dim, META=layout.meta_width, BITS=layout.bits, SYM=layout.format == "int_sym",
            BLOCK_T=16, BLOCK_G=_next_pow2(layout.meta_width),
            BLOCK_P=_next_pow2(dim if layout.bits == 8 else dim // 2), BLOCK_H=_next_pow2(max(dim // 8, 1)))
    # byte lanes of the packed planes: the low plane (all of a one-plane code) and the plane of higher bits
    packed = dim - layout.high
    planes = code_planes(layout.bits) if layout.is_int else (8,)
    low_bits, upper_bits = planes[0], sum(planes[1:])
    common = dict(HEADS=heads, HEAD_DIM=dim, BITS=layout.bits, FP8=layout.format == "fp8_e4m3",
                  HAS_ZERO=layout.has_zero, LO=lo, HI=hi, OFFSET=layout.offset, TOP=top, CLIP=layout.clip,
                  HALF_CLIP=0.5 * layout.clip, LOW_BITS=low_bits, BLOCK_P=_next_pow2(packed * low_bits // 8),
                  BLOCK_U=_next_pow2(max(packed * upper_bits // 8, 1)), HIGH=layout.high,
                  **dict(zip(("HIGH_LO", "HIGH_HI", "HIGH_OFFSET"), layout.high_levels)),
                  BLOCK_HI=_next_pow2(max(layout.high, 1)))
    if layout.axis == "channel" and not layout.static:
        return "_quantize_channel_kernel", {**common, "GROUP": layout.group, "BLOCK_G": _next_pow2(layout.group),
                                            "BLOCK_D": _next_pow2(dim)}
    group = 1 if layout.axis == "channel" else layout.group
    return "_quantize_token_kernel", {**common, "GROUP": group, "META": layout.meta_width, "STATIC": layout.static,
                                      "BLOCK_T": 16, "BLOCK_G": _next_pow2(layout.meta_width),
                                      "BLOCK_E": _next_pow2(group)}


@register_kernel("append")
def append(layout: StreamLayout, past: Mapping[str, torch.Tensor], n0: torch.Tensor, x: torch.Tensor,
           m: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Append new tokens to a stored stream: host-side region moves + the Triton quantize kernel."""
    return append_stream(layout, past, n0, x, m, quantize=quantize_block)
