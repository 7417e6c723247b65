"""How a kernel sees one stored cache stream: the layout facts of a scheme, and torch helpers on them.

The stored layout is the one :mod:`kvq_export.naming` describes (the ``regions`` layout): per layer and
stream, ``sinks`` / ``codes`` + ``scales`` (+ ``zero_points``) / ``recent``, every region sized to the
longest row with each row's valid entries right-aligned, and the per-row counts derived from
``seq_lengths`` by :class:`kvq_export.region_split.RegionSplit`. A stream with high channels also carries
its ``channel_order`` ``[kv_heads, head_dim]`` int32 constant (stored position -> channel: each head's
high channels, then the rest; :func:`kvq_export.reference.codec.channel_order`). :class:`StreamLayout` carries
exactly the facts of a :class:`~kvq_export.scheme.TensorQuant` (and its scheme) that a kernel needs, so
the Triton kernels, their torch references and the TensorRT plugin read one description.

Only torch is imported here (never triton or tensorrt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvq_export.errors import QuantizationError
from kvq_export.region_split import REGION_ROLES, RegionSplit
from kvq_export.scheme import KVQuantScheme, TensorQuant

if TYPE_CHECKING:
    import torch

#: Roles of a stream's tensors, in the order the kernels and the plugin take them.
QUANT_ROLES = (*REGION_ROLES, "channel_order")


@dataclass(frozen=True)
class StreamLayout:
    """The stored form of one layer's keys or values.

    Attributes:
        format: ``fp16`` (unquantized: every token in ``recent``), ``int``, ``int_sym`` or ``fp8_e4m3``.
        bits: code width (2, 3, 4, 5, 6, 8; 16 for fp16; 3, 5 and 6 bits are stored as two planes).
        axis: ``token`` or ``channel`` group axis.
        group: token axis: elements per group along head_dim; dynamic channel axis: tokens per group;
            static channel axis: 0 (one scale per channel for all tokens).
        static: scales (and zero points) are per-layer ``[kv_heads, n]`` constants.
        has_zero: asymmetric ``int`` stores a minimum beside each scale.
        head_dim: channels per head.
        sink_tokens: the scheme's sinks; residual_length: the stream's recent window
            (:meth:`~kvq_export.scheme.KVQuantScheme.residual_for`).
        unit: tokens that leave the recent window together (1, or a channel-axis group).
        scale_dtype, hp_dtype: ``fp16`` / ``fp32`` storage of metadata and of sinks/recent.
        clip: range shrink ratio used when quantizing (see :class:`~kvq_export.scheme.TensorQuant`).
        quantizer: ``kvq`` or ``ggml`` (how scales and codes are chosen; the stored meaning is the same).
        high: channels per head stored with 8-bit codes ahead of the others (``TensorQuant.high_channels``).
    """

    format: str
    bits: int
    axis: str
    group: int
    static: bool
    has_zero: bool
    head_dim: int
    sink_tokens: int
    residual_length: int
    unit: int
    scale_dtype: str
    hp_dtype: str
    clip: float = 1.0
    quantizer: str = "kvq"
    high: int = 0

    @classmethod
    def of(cls, tq: TensorQuant, scheme: KVQuantScheme, head_dim: int) -> StreamLayout:
        """The layout of stream ``tq`` of ``scheme`` for heads of ``head_dim`` channels."""
        tq.check_head_dim(head_dim, "stream")
        if not tq.quantized:
            return cls("fp16", 16, "token", 0, False, False, head_dim, scheme.sink_tokens, scheme.residual_for(tq),
                       1, "fp16", scheme.hp_dtype)
        if tq.axis == "token":
            group = tq.token_group(head_dim)
        else:
            group = 0 if tq.scales == "static" else int(tq.group_size)
        return cls(tq.format, tq.bits, tq.axis, group, tq.scales == "static", tq.has_zero_point, head_dim,
                   scheme.sink_tokens, scheme.residual_for(tq), tq.flush_unit, tq.scale_dtype, scheme.hp_dtype,
                   float(tq.clip), tq.quantizer, tq.high_channels)

    @classmethod
    def for_layer(cls, scheme: KVQuantScheme, layer: int, head_dim: int) -> tuple[StreamLayout, StreamLayout]:
        """(keys, values) layouts of ``layer``."""
        key, value = scheme.for_layer(layer)
        return cls.of(key, scheme, head_dim), cls.of(value, scheme, head_dim)

    # -- derived facts ---------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        """False for the unquantized fp16 stream (one ``recent`` tensor)."""
        return self.format != "fp16"

    @property
    def is_int(self) -> bool:
        """Integer codes (packed along head_dim when bits < 8)."""
        return self.format in ("int", "int_sym")

    @property
    def packed_dim(self) -> int:
        """Bytes per token and head of the code payload (the high channels' bytes included)."""
        if not self.quantized:
            return 0
        return self.tensor_quant().packed_dim(self.head_dim)

    @property
    def offset(self) -> int:
        """Stored-code offset of symmetric int codes (``2**(bits-1)``, see the codec), else 0."""
        return 1 << (self.bits - 1) if self.format == "int_sym" else 0

    @property
    def high_levels(self) -> tuple[int, int, int]:
        """The high channels' 8-bit (lowest code, highest code, offset), as the codec has them.

        ``int``: (0, 255, 0); ``int_sym``: (-127, 127, 128). Without high channels (0, 0, ``offset``), so a
        kernel's per-position offset is the stream's own.
        """
        if not self.high:
            return 0, 0, self.offset
        from kvq_export.reference.codec import high_channel_levels

        return high_channel_levels(self.tensor_quant())

    @property
    def meta_width(self) -> int:
        """Entries per metadata row: ``head_dim // group`` (token axis) or ``head_dim`` (channel axis)."""
        if not self.quantized:
            return 0
        return self.head_dim // self.group if self.axis == "token" else self.head_dim

    @property
    def roles(self) -> tuple[str, ...]:
        """Tensors the stream is read from, in kernel/plugin order (static scales included)."""
        if not self.quantized:
            return ("recent",)
        skip = {"zero_points"} if not self.has_zero else set()
        if not self.high:
            skip.add("channel_order")
        return tuple(r for r in QUANT_ROLES if r not in skip)

    @property
    def tag(self) -> str:
        """``fp16``, ``sym``, ``asym``, ``symhc`` or ``asymhc``: the roles the stream has (part of the plugin name)."""
        if not self.quantized:
            return "fp16"
        return ("asym" if self.has_zero else "sym") + ("hc" if self.high else "")

    # -- plugin attributes ------------------------------------------------------------------------------
    def attributes(self, prefix: str) -> dict[str, int | str]:
        """The stream as plugin attributes (ints and strings only: ONNX and TensorRT plugin fields).

        Names: ``{prefix}_format``, ``_bits``, ``_axis``, ``_group``, ``_static``, ``_scale_dtype``,
        ``_quantizer``, ``_high_channels``, ``_residual_length``.
        """
        return {f"{prefix}_format": self.format, f"{prefix}_bits": self.bits, f"{prefix}_axis": self.axis,
                f"{prefix}_group": self.group, f"{prefix}_static": int(self.static),
                f"{prefix}_scale_dtype": self.scale_dtype, f"{prefix}_quantizer": self.quantizer,
                f"{prefix}_high_channels": self.high, f"{prefix}_residual_length": self.residual_length}

    @classmethod
    def from_attributes(cls, prefix: str, attrs: Mapping[str, object]) -> StreamLayout:
        """Inverse of :meth:`attributes` (plus the shared head_dim, sink_tokens, hp_dtype)."""
        fmt, group = str(attrs[f"{prefix}_format"]), int(attrs[f"{prefix}_group"])
        static = bool(attrs[f"{prefix}_static"])
        axis = str(attrs[f"{prefix}_axis"])
        layout = cls(fmt, int(attrs[f"{prefix}_bits"]), axis, group, static, fmt == "int", int(attrs["head_dim"]),
                     int(attrs["sink_tokens"]), int(attrs[f"{prefix}_residual_length"]), 1,
                     str(attrs[f"{prefix}_scale_dtype"]), str(attrs["hp_dtype"]),
                     quantizer=str(attrs.get(f"{prefix}_quantizer", "kvq")),
                     high=int(attrs.get(f"{prefix}_high_channels", 0)))
        return dataclasses.replace(layout, unit=layout.tensor_quant().flush_unit)

    def tensor_quant(self) -> TensorQuant:
        """The :class:`TensorQuant` this layout was made from (for the reference codec)."""
        if not self.quantized:
            return TensorQuant.fp16()
        return TensorQuant(format=self.format, bits=self.bits, axis=self.axis, group_size=self.group or None,
                           scale_dtype=self.scale_dtype, clip=self.clip,
                           scales="static" if self.static else "dynamic", quantizer=self.quantizer,
                           high_channels=self.high)

    # -- per-row counts (torch) ---------------------------------------------------------------------------
    def counts(self, seq_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sinks, quantized, recent) tokens per row of a ``[B]`` int64 tensor (:class:`RegionSplit`)."""
        return self.split.lengths(seq_lengths.to(dtype=_torch().int64))

    @property
    def split(self) -> RegionSplit:
        """The stream's sinks / quantized / recent split rule."""
        return RegionSplit(self.sink_tokens, self.residual_length, self.unit, self.quantized)


def _torch():
    import torch

    return torch


def take(parts: list[tuple[torch.Tensor, torch.Tensor]], start: torch.Tensor | None, count: torch.Tensor,
         out_len: int) -> torch.Tensor:
    """Torch twin of the graph's ``take``: entries ``start .. start+count`` of the concatenated valid entries.

    ``parts`` are ``(tensor [B, H, L_i, W], valid_i [B])`` with each row's valid entries right-aligned; the
    result is ``[B, H, out_len, W]`` with the taken entries right-aligned and zeros to their left.
    """
    torch = _torch()
    first = parts[0][0]
    batch, heads, _, width = first.shape
    zero = first.new_zeros((batch, heads, 1, width))
    src = torch.cat([p for p, _ in parts] + [zero], dim=2)
    j = torch.arange(out_len, device=first.device)[None, :]
    i = j - (out_len - count[:, None])  # index within the taken run
    k = i if start is None else i + start[:, None]
    slot_base = 0
    entry_base = torch.zeros_like(count)
    idx = torch.full((batch, out_len), src.shape[2] - 1, dtype=torch.int64, device=first.device)
    for tensor, valid in parts:
        length = tensor.shape[2]
        inside = (k >= entry_base[:, None]) & (k < (entry_base + valid)[:, None])
        slot = slot_base + (length - valid[:, None]) + (k - entry_base[:, None])
        idx = torch.where(inside, slot, idx)
        slot_base += length
        entry_base = entry_base + valid
    idx = torch.where(i >= 0, idx, torch.full_like(idx, src.shape[2] - 1))
    return torch.gather(src, 2, idx[:, None, :, None].expand(batch, heads, out_len, width))


def dequantize_stream(layout: StreamLayout, tensors: Mapping[str, torch.Tensor], seq_lengths: torch.Tensor,
                      total: int | None = None) -> torch.Tensor:
    """All tokens of a stored stream as fp32 ``[B, H, N, D]``, each row right-aligned in ``N = max(n)``.

    Vectorized torch (any device) with exactly the codec's fp32 arithmetic, so every value equals the
    reference cache's ``dequantized()``; left padding is 0. This is the temporary buffer of the prefill
    path (:func:`kvq_plugins.attention.prefill_attention`).
    """
    torch = _torch()
    from kvq_export.reference.codec import unpack_stream

    n = seq_lengths.to(torch.int64)
    total = int(n.max()) if total is None else total
    recent = tensors["recent"]
    batch, heads, _, dim = recent.shape
    sinks, quant, rec = layout.counts(n)
    p = torch.arange(total, device=recent.device)[None, :]
    k = p - (total - n[:, None])  # token index within the row
    valid = k >= 0

    def gather(t: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        slot = slot.clamp(0, max(t.shape[2] - 1, 0))
        return torch.gather(t, 2, slot[:, None, :, None].expand(batch, heads, total, t.shape[3]))

    out = torch.zeros((batch, heads, total, dim), dtype=torch.float32, device=recent.device)
    in_recent = valid & (k >= (sinks + quant)[:, None])
    if recent.shape[2]:
        slot = recent.shape[2] - rec[:, None] + (k - (sinks + quant)[:, None])
        out = torch.where(in_recent[:, None, :, None], gather(recent, slot).float(), out)
    if not layout.quantized:
        return out
    s_t = tensors["sinks"]
    in_sinks = valid & (k < sinks[:, None])
    if s_t.shape[2]:
        slot = s_t.shape[2] - sinks[:, None] + k
        out = torch.where(in_sinks[:, None, :, None], gather(s_t, slot).float(), out)
    codes = tensors["codes"]
    if not codes.shape[2]:
        return out
    in_quant = valid & ~in_sinks & ~in_recent
    slot = codes.shape[2] - quant[:, None] + (k - sinks[:, None])
    stored = gather(codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes, slot)
    if layout.format == "fp8_e4m3":
        values = stored.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        high = high_channels(layout, tensors)
        values = unpack_stream(stored, layout.tensor_quant(), high).to(torch.float32)
        values = values - code_offsets(layout, high)
    scale, zero = _metadata(layout, tensors, slot, heads, total, gather)
    if layout.axis == "token":
        deq = values.reshape(batch, heads, total, layout.meta_width, layout.group) * scale.unsqueeze(-1)
        if zero is not None:
            deq = deq + zero.unsqueeze(-1)
    else:
        deq = values * scale
        if zero is not None:
            deq = deq + zero
    return torch.where(in_quant[:, None, :, None], deq.reshape(batch, heads, total, dim), out)


def code_offsets(layout: StreamLayout, high: torch.Tensor | None) -> torch.Tensor | float:
    """The stored-code offset of each channel: ``layout.offset``, or ``[H, 1, D]`` when high channels have their own.

    ``int_sym`` high channels are 8-bit codes stored around 128 beside the others' ``2**(bits-1)``
    (:func:`kvq_export.reference.codec.channel_levels`); ``int`` codes have no offset at all.
    """
    if high is None or not layout.offset:
        return float(layout.offset)
    from kvq_export.reference.codec import channel_levels

    return channel_levels(layout.tensor_quant(), high, layout.head_dim)[2][:, None, :]


def high_channels(layout: StreamLayout, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The ``[H, n]`` high channels of a stream (the first ``n`` of its ``channel_order``), or None."""
    return tensors["channel_order"][:, :layout.high].to(_torch().int64) if layout.high else None


def _metadata(layout: StreamLayout, tensors, slot, heads: int, total: int, gather):
    """Per-token metadata rows (fp32) broadcastable against the grouped values."""
    names = ("scales", "zero_points") if layout.has_zero else ("scales",)
    out = []
    for role in names:
        meta = tensors[role]
        if layout.static:  # [H, n]
            row = meta.float()[None, :, None, :]
            out.append(row.expand(slot.shape[0], heads, total, meta.shape[1]))
        elif layout.axis == "token":
            out.append(gather(meta, slot).float())
        else:  # one row per group of tokens; the group slot is the token slot // group
            out.append(gather(meta, slot // layout.group).float())
    return out[0], (out[1] if len(out) > 1 else None)


def check_stream(layout: StreamLayout, tensors: Mapping[str, torch.Tensor], batch: int, heads: int,
                 where: str) -> None:
    """Raise a QuantizationError when a stream's tensors do not have the layout's roles and shapes."""
    missing = [r for r in layout.roles if r not in tensors]
    if missing:
        raise QuantizationError(f"{where}: missing tensor(s) {', '.join(missing)} for a {layout.tag} stream")
    dim = layout.head_dim
    for role in layout.roles:
        t = tensors[role]
        if role == "channel_order":
            if tuple(t.shape) != (heads, dim) or t.dtype != _torch().int32:
                raise QuantizationError(f"{where}.channel_order: must be int32 [{heads}, {dim}], got "
                                        f"{t.dtype} {list(t.shape)}")
            continue
        if role in ("scales", "zero_points") and layout.static:
            want = (heads, layout.meta_width)
            if tuple(t.shape) != want:
                raise QuantizationError(f"{where}.{role}: static metadata must be {list(want)}, got {list(t.shape)}")
            continue
        if t.dim() != 4 or t.shape[0] != batch or t.shape[1] != heads:
            raise QuantizationError(f"{where}.{role}: expected [batch={batch}, kv_heads={heads}, L, W], "
                                    f"got {list(t.shape)}")
        width = {"codes": layout.packed_dim, "scales": layout.meta_width,
                 "zero_points": layout.meta_width}.get(role, dim)
        if t.shape[3] != width:
            raise QuantizationError(f"{where}.{role}: last dim must be {width}, got {t.shape[3]}")
    if layout.quantized and not layout.static and layout.axis == "channel":
        codes, scales = tensors["codes"], tensors["scales"]
        if codes.shape[2] % layout.group or scales.shape[2] != codes.shape[2] // layout.group:
            raise QuantizationError(f"{where}: channel-axis codes hold {codes.shape[2]} tokens but scales "
                                    f"{scales.shape[2]} groups of {layout.group}")


def stack_streams(rows: list, *, device=None) -> dict[str, torch.Tensor]:
    """Stored tensors of one stream for a batch, from one reference ``StreamCache`` per row (batch 1 each).

    Each region is sized to the longest row and each row's entries are right-aligned (zeros to the left),
    the layout the exported graph keeps; static metadata is the shared ``[H, n]`` tensor and a high-channel
    stream's ``channel_order`` the shared ``[H, D]`` int32 constant. At least one row
    must hold a token (an all-empty batch is :func:`kvq_plugins.cache_update.empty_stream`).
    """
    torch = _torch()
    from kvq_export.reference.codec import channel_order

    tensors = [r.tensors() for r in rows]
    full_row = next((t for t in tensors if t), None)
    if full_row is None:
        raise QuantizationError("stack_streams needs at least one row holding a token")
    first = rows[0]
    layout = StreamLayout.of(first.tq, first.scheme, full_row["recent"].shape[-1])
    out: dict[str, torch.Tensor] = {}
    for role in layout.roles:
        if role == "channel_order":
            out[role] = channel_order(first.high_channels, layout.head_dim).to(device=device, dtype=torch.int32)
            continue
        if layout.static and role in ("scales", "zero_points"):
            out[role] = full_row[role].to(device)
            continue
        template = full_row[role][0]
        fp8 = template.dtype == torch.float8_e4m3fn
        parts = [t[role][0] if t else template[:, :0] for t in tensors]
        parts = [p.view(torch.uint8) if fp8 else p for p in parts]
        longest = max(p.shape[1] for p in parts)
        full = parts[0].new_zeros((len(parts), parts[0].shape[0], longest, parts[0].shape[2]))
        for b, p in enumerate(parts):
            full[b, :, longest - p.shape[1]:] = p
        out[role] = (full.view(torch.float8_e4m3fn) if fp8 else full).to(device)
    return out
