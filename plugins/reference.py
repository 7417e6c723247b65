"""Plain-torch references of every kernel op, registered by op name (what the kernel tests compare with).

They are built on kvq's own reference codec (:mod:`kvq_export.reference.codec`), row by row, so they say
what the stored cache *means*, independently of the vectorized helpers the kernels' host code uses:

* ``decode_attention``: each row's valid entries are cut out of the right-aligned regions, dequantized by
  the codec and attended to in float64 (causal by position, GQA, optional sliding window);
* ``quantize``: each row's right-aligned tokens are quantized and packed by the codec;
* ``append``: the host-side region moves of :func:`kvq_plugins.cache_update.append_stream` with the codec
  as the quantizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvq_plugins.cache_update import append_stream
from kvq_plugins.layout import StreamLayout, high_channels
from kvq_plugins.registry import register_reference

from kvq_export.dtypes import DType

if TYPE_CHECKING:
    import torch


def stream_row(layout: StreamLayout, tensors: Mapping[str, torch.Tensor], row: int, n: int) -> torch.Tensor:
    """Row ``row``'s ``n`` tokens as fp32 ``[H, n, D]``, dequantized by the reference codec."""
    import torch

    from kvq_export.reference.codec import Quantized, dequantize_packed

    sinks, quant, recent = (int(c[0]) for c in layout.counts(torch.tensor([n])))
    rec = tensors["recent"][row]
    parts = [rec[:, rec.shape[1] - recent:].float()]
    if not layout.quantized:
        return parts[0]
    sk = tensors["sinks"][row]
    codes = tensors["codes"][row]
    codes = codes[:, codes.shape[1] - quant:]
    if layout.format == "fp8_e4m3" and codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    meta = []
    for role in ("scales", "zero_points") if layout.has_zero else ("scales",):
        m = tensors[role]
        if not layout.static:
            rows = quant if layout.axis == "token" else quant // layout.group
            m = m[row][:, m.shape[2] - rows:]
        meta.append(m)
    tq = layout.tensor_quant()
    if quant:
        deq = dequantize_packed(Quantized(codes, meta[0], meta[1] if len(meta) > 1 else None), tq,
                                high_channels=high_channels(layout, tensors))
    else:  # (the codec cannot reshape an empty static token-axis block)
        deq = rec.new_zeros((rec.shape[0], 0, rec.shape[2]), dtype=torch.float32)
    return torch.cat([sk[:, sk.shape[1] - sinks:].float(), deq, parts[0]], dim=1)


@register_reference("decode_attention")
def decode_attention_reference(
    q: torch.Tensor,
    seq_lengths: torch.Tensor,
    key: Mapping[str, torch.Tensor],
    value: Mapping[str, torch.Tensor],
    key_layout: StreamLayout,
    value_layout: StreamLayout,
    *,
    scale: float,
    window: int | None = None,
    **_: object,
) -> torch.Tensor:
    """float64 attention of ``q [B, Hq, t, D]`` over the codec-dequantized cache -> float64 ``[B, Hq, t, D]``.

    Query ``j`` of row ``b`` is at position ``max(n_b - t + j, 0)``; a query that sees no key gives 0.
    """
    import torch

    batch, num_heads, t, dim = q.shape
    out = torch.zeros((batch, num_heads, t, dim), dtype=torch.float64)
    for row in range(batch):
        n = int(seq_lengths[row])
        if n == 0:
            continue
        k = stream_row(key_layout, key, row, n).double().cpu()
        v = stream_row(value_layout, value, row, n).double().cpu()
        groups = num_heads // k.shape[0]
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = q[row].double().cpu() @ k.transpose(1, 2) * scale
        qpos = (n - t + torch.arange(t)).clamp(min=0)
        key_pos = torch.arange(n)
        allowed = key_pos[None, :] <= qpos[:, None]
        if window:
            allowed &= key_pos[None, :] > qpos[:, None] - window
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[row] = torch.nan_to_num(probs, nan=0.0) @ v
    return out


@register_reference("quantize")
def quantize_reference(
    x: torch.Tensor,
    counts: torch.Tensor,
    layout: StreamLayout,
    *,
    static_scales: torch.Tensor | None = None,
    static_zeros: torch.Tensor | None = None,
    channel_order: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantize each row's right-aligned ``counts[b]`` tokens of ``x [B, H, F, D]`` with the codec.

    Returns (packed codes ``[B, H, F, P]``, scales, zero points) right-aligned like the input, zeros to the
    left; metadata is ``[B, H, F or F/G, n]`` for dynamic streams and None for static ones.
    """
    import torch

    from kvq_export.reference.codec import quantize_packed

    tq = layout.tensor_quant()
    batch, heads, length, dim = x.shape
    code_dtype = torch.float8_e4m3fn if layout.format == "fp8_e4m3" else torch.uint8
    codes = torch.zeros((batch, heads, length, layout.packed_dim), dtype=torch.uint8).to(code_dtype)
    scales = zeros = None
    meta_len = length if layout.axis == "token" else length // max(layout.group, 1)
    if not layout.static:
        scales = torch.zeros((batch, heads, meta_len, layout.meta_width), dtype=DType.get(layout.scale_dtype).torch)
        zeros = scales.clone() if layout.has_zero else None
    static = {"static_scales": static_scales, "static_zeros": static_zeros} if layout.static else {}
    if layout.high:
        static["high_channels"] = high_channels(layout, {"channel_order": channel_order})
    for row in range(batch):
        c = int(counts[row])
        if c == 0:
            continue
        q = quantize_packed(x[row:row + 1, :, length - c:].cpu(), tq, **static)
        codes[row, :, length - c:] = q.codes[0]
        if scales is not None:
            mc = q.scales.shape[2]
            scales[row, :, meta_len - mc:] = q.scales[0]
            if zeros is not None:
                zeros[row, :, meta_len - mc:] = q.zeros[0]
    return codes, scales, zeros


@register_reference("append")
def append_reference(layout: StreamLayout, past: Mapping[str, torch.Tensor], n0: torch.Tensor, x: torch.Tensor,
                     m: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`kvq_plugins.cache_update.append_stream` with the codec as the quantizer."""
    return append_stream(layout, past, n0, x, m, quantize=quantize_reference)
