"""Appending new tokens to a stored stream: the host-side region moves around the quantize kernel.

:func:`append_stream` is the torch twin of the graph's ``QuantizedCacheGraph.store()``: the new tokens
(right-aligned, ``m[b]`` real ones per row) join the recent window, the sink region fills, whatever leaves
the window (a token, or a whole channel-axis group) is quantized by the given ``quantize`` function (the
Triton kernel :func:`kvq_plugins.quantize.quantize_block`, or the codec reference), and the regions are
rebuilt right-aligned. The region moves are plain torch gathers (:func:`kvq_plugins.layout.take`) on the
host side of the kernel launch; only the quantization runs in Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvq_plugins.layout import StreamLayout, take

from kvq_export.errors import QuantizationError

if TYPE_CHECKING:
    import torch

Quantizer = Callable[..., tuple]


def _longest(counts: torch.Tensor) -> int:
    return int(counts.max()) if counts.numel() else 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def append_stream(
    layout: StreamLayout,
    past: Mapping[str, torch.Tensor],
    n0: torch.Tensor,
    x: torch.Tensor,
    m: torch.Tensor,
    *,
    quantize: Quantizer,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Append ``x [B, H, t, D]`` (each row's ``m[b]`` real tokens right-aligned) to a stream holding ``n0``.

    ``past`` maps roles to the stored tensors (an empty stream has 0-length regions; static streams carry
    their ``[H, n]`` metadata under ``scales``/``zero_points``, high-channel streams their
    ``channel_order``). Returns ``(present tensors by role, n1)``
    in the same layout, bit for bit what the reference cache stores.
    """
    import torch

    from kvq_export.dtypes import DType

    n0, m = n0.to(torch.int64), m.to(torch.int64)
    n1 = n0 + m
    x_hp = x.to(DType.get(layout.hp_dtype).torch)
    before, after = layout.counts(n0), layout.counts(n1)
    if not layout.quantized:
        recent = take([(past["recent"], before[2]), (x_hp, m)], None, after[2], _longest(after[2]))
        return {"recent": recent}, n1
    pending_count = before[2] + m
    pending = take([(past["recent"], before[2]), (x_hp, m)], None, pending_count, _longest(pending_count))
    pend = [(pending, pending_count)]
    to_sinks, to_quant = after[0] - before[0], after[1] - before[1]
    sinks = take([(past["sinks"], before[0]), *pend], None, after[0], _longest(after[0]))
    block = take(pend, to_sinks, to_quant, _longest(to_quant))
    recent = take(pend, to_sinks + to_quant, after[2], _longest(after[2]))
    static = {}
    if layout.static:
        static = {"static_scales": past["scales"], "static_zeros": past.get("zero_points")}
    if layout.high:
        static["channel_order"] = past["channel_order"]
    codes_new, scales_new, zeros_new = quantize(block, to_quant, layout, **static)
    codes = take([(_bits(past["codes"]), before[1]), (_bits(codes_new), to_quant)], None, after[1],
                 _longest(after[1]))
    if layout.format == "fp8_e4m3":
        codes = codes.view(torch.float8_e4m3fn)
    present = {"sinks": sinks, "codes": codes}
    if layout.static:
        present["scales"] = past["scales"]
        if layout.has_zero:
            present["zero_points"] = past["zero_points"]
    else:
        unit = 1 if layout.axis == "token" else layout.group
        q0, dq, q1 = before[1] // unit, to_quant // unit, after[1] // unit
        meta_len = _longest(after[1]) // unit
        present["scales"] = take([(past["scales"], q0), (scales_new, dq)], None, q1, meta_len)
        if layout.has_zero:
            present["zero_points"] = take([(past["zero_points"], q0), (zeros_new, dq)], None, q1, meta_len)
    present["recent"] = recent
    if layout.high:
        present["channel_order"] = past["channel_order"]
    return present, n1


def empty_stream(layout: StreamLayout, batch: int, heads: int, *, device=None,
                 static: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A stream holding no token (every region of length 0), in the stored dtypes.

    ``static`` gives the constants a stream may carry: ``scales``/``zero_points`` of a static stream,
    ``channel_order`` of a stream with high channels.
    """
    import torch

    from kvq_export.dtypes import DType

    hp = DType.get(layout.hp_dtype).torch
    dim = layout.head_dim

    def region(width: int, dtype) -> torch.Tensor:
        return torch.zeros((batch, heads, 0, width), dtype=dtype, device=device)

    if not layout.quantized:
        return {"recent": region(dim, hp)}
    out = {"sinks": region(dim, hp),
           "codes": region(layout.packed_dim, torch.uint8).view(
               torch.float8_e4m3fn if layout.format == "fp8_e4m3" else torch.uint8)}
    if layout.static:
        if static is None:
            raise QuantizationError("a static-scale stream needs its [kv_heads, n] scales (and zero points)")
        out["scales"] = static["scales"]
        if layout.has_zero:
            out["zero_points"] = static["zero_points"]
    else:
        sdtype = DType.get(layout.scale_dtype).torch
        out["scales"] = region(layout.meta_width, sdtype)
        if layout.has_zero:
            out["zero_points"] = region(layout.meta_width, sdtype)
    out["recent"] = region(dim, hp)
    if layout.high:
        if static is None or "channel_order" not in static:
            raise QuantizationError("a stream with high channels needs its [kv_heads, head_dim] channel_order")
        out["channel_order"] = static["channel_order"]
    return out
