"""How each ``ort-gqa`` layer's GroupQueryAttention node stores its cache: kvq's calibration as node constants.

Numpy only (the graph that uses these is :mod:`kvq_export.flavors.ort_gqa.graph`): per layer a :class:`LayerPlan` with
the node's cache type, its ``PER_TENSOR``/``PER_CHANNEL`` scales (:func:`gqa_scale`), the offsets an asymmetric
stream subtracts before the node (:func:`gqa_offset`) and, for int4 streams with 8-bit high channels, how those
travel as two nibbles of a node head of ``head_dim + n`` channels (:class:`HighSplit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvq_export.dtypes import DType
from kvq_export.errors import ExportError
from kvq_export.graph.codec import high_channel_choice, static_scales
from kvq_export.model_facts import CacheGeometry
from kvq_export.naming import PARTS
from kvq_export.reference.codec import check_high_channels, high_channel_levels
from kvq_export.scheme import TensorQuant
from kvq_export.vocab import Axis, Part, Role


@dataclass(frozen=True)
class HighSplit:
    """How one stream's 8-bit high channels travel through a 4-bit node: two nibbles each.

    kvq's stored 8-bit code ``c`` of a high channel (``int``: ``clip(round((x - zero) / scale), 0, 255)``;
    ``int_sym``: ``clip(round(x / scale), -127, 127) + 128``) is computed in the graph and split as
    ``c = 16 * hi + lo``; the node stores ``hi - 8`` in the channel's own place (node scale ``16 * scale``) and
    ``lo - 8`` in an extra channel after the head's ``head_dim`` (node scale ``scale``), so it reads back
    ``(c - 136) * scale``: kvq's value minus a per-channel constant (``output_offset``).
    """

    channels: np.ndarray  # int64 [kv_heads, n]: the calibrated high channels of each kv head, ascending
    scale: np.ndarray  # float32 [kv_heads, n]: kvq's static scale of each (rounded to scale_dtype)
    zero: np.ndarray  # float32 [kv_heads, n]: its zero point (0 for int_sym)
    low: float  # kvq's 8-bit code range before its offset: int 0..255, int_sym -127..127
    top: float
    offset: float  # added to the clipped code to make the stored code c (int 0, int_sym 128)
    head_dim: int

    @classmethod
    def of(cls, tq: TensorQuant, static: Mapping, layer: int, part: Part, geometry: CacheGeometry) -> HighSplit:
        """The split of one calibrated stream (``static[layer][part]``: its scales, zero points and high channels)."""
        kv_heads, head_dim = geometry.num_kv_heads, geometry.head_dim
        channels = check_high_channels(high_channel_choice(static, layer, part, tq), tq, kv_heads, head_dim).numpy()
        meta = static[layer][part]
        pick = [per_channel(tq, meta[role], geometry, role)[np.arange(kv_heads)[:, None], channels]
                if role in meta else np.zeros(channels.shape, np.float32) for role in (Role.SCALES, Role.ZERO_POINTS)]
        low, top, offset = high_channel_levels(tq)
        return cls(channels, pick[0], pick[1], float(low), float(top), float(offset), head_dim)

    def places(self, heads: int | None = None) -> np.ndarray:
        """int64 ``[heads, n]``: each high channel's place in a ``[heads * head_dim]`` row.

        ``heads``: the kv heads (default), or the query heads, each reading its kv head's channels.
        """
        kv_heads = self.channels.shape[0]
        heads = heads or kv_heads
        per_head = np.repeat(self.channels, heads // kv_heads, axis=0)
        return per_head + np.arange(heads)[:, None] * self.head_dim

    def widened(self, own: np.ndarray, upper: np.ndarray | float, lower: np.ndarray | float) -> np.ndarray:
        """One stream's ``[kv_heads * (head_dim + n)]`` row in the node's layout, from per-channel entries.

        ``own``: ``[kv_heads, head_dim]``, one entry per channel; ``upper``/``lower``: ``[kv_heads, n]`` (or one
        for all), one per high channel. Each head's channels, with a high channel's own place taking its
        ``upper`` entry, then its n ``lower`` entries. Serves both the node row's source positions and the
        per-place constants that go with them.
        """
        heads, n = self.channels.shape
        own = np.array(own).reshape(heads, self.head_dim)
        np.put_along_axis(own, self.channels, np.broadcast_to(upper, (heads, n)).astype(own.dtype), axis=1)
        return np.concatenate([own, np.broadcast_to(lower, (heads, n)).astype(own.dtype)], axis=1).reshape(-1)

    def query_widened(self, num_heads: int) -> np.ndarray:
        """int64 ``[num_heads * (head_dim + n)]``: where the node's query row is read from in the model's.

        Each head's channels, then again its kv head's high key channels.
        """
        own = np.arange(num_heads * self.head_dim).reshape(num_heads, self.head_dim)
        return np.concatenate([own, self.places(num_heads)], axis=1).reshape(-1)

    def folded(self, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
        """(main, extra) int64 ``[num_heads * head_dim]``: where the attention output is read from.

        ``main``: each channel's place in the node's ``[num_heads * (head_dim + n)]`` output row; ``extra``: the
        channel added to it (a high value channel's lower-nibble output; the other channels read index
        ``num_heads * (head_dim + n)``, a zero column appended to the row).
        """
        heads, n = num_heads, self.channels.shape[1]
        wide = self.head_dim + n
        main = (np.arange(heads)[:, None] * wide + np.arange(self.head_dim)).reshape(-1)
        extra = np.full((heads, self.head_dim), heads * wide, dtype=np.int64)
        lows = np.arange(heads)[:, None] * wide + self.head_dim + np.arange(n)
        np.put_along_axis(extra, np.repeat(self.channels, heads // self.channels.shape[0], axis=0), lows, axis=1)
        return main, extra.reshape(-1)

    @property
    def output_offset(self) -> np.ndarray:
        """float32 ``[kv_heads, n]``: kvq's dequantized value minus the node's ``(c - 136) * scale``."""
        kvq_minus_node = np.float32(136 - self.offset) * self.scale  # kvq: (c - offset) * scale + zero
        return (kvq_minus_node + self.zero).astype(np.float32)


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's GQA node stores its cache."""

    bits: int | None  # None: unquantized buffer
    k_quant: str = "NONE"  # NONE | PER_TENSOR | PER_CHANNEL
    v_quant: str = "NONE"
    k_scale: np.ndarray | None = None  # float32 [1] or [1, kv_heads, 1, node head size]
    v_scale: np.ndarray | None = None
    k_offset: np.ndarray | None = None  # float32 [kv_heads * head_dim], asymmetric streams only (gqa_offset)
    v_offset: np.ndarray | None = None
    out_offset: np.ndarray | None = None  # float32 [kv_heads * head_dim] added to each kv head's output
    k_high: HighSplit | None = None  # streams with high channels (both or neither: one node head size)
    v_high: HighSplit | None = None

    def stream_offsets(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The key and value offsets, float32 ``[width]`` zeros for a stream that has none."""
        return tuple(np.zeros(width, np.float32) if o is None else o for o in (self.k_offset, self.v_offset))

    def stored_values(self, part: Part, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray,
                                                                                np.ndarray | None]:
        """``(a, c, lower)``: the values a stream's stored codes stand for, ``u * a + c`` per (kv head, channel).

        ``u`` is the node's stored number: the signed code at 8 bits, the nibble ``q + 8`` at 4 bits; ``a`` and
        ``c`` are float32 ``[kv_heads, head_dim]``. Without high channels the values are what the node reads
        back, ``q * scale`` (offsets stay subtracted, as on the node's input). With high channels they are
        kvq's values themselves, offsets included (what a prefill attends over): a high channel stores ``hi`` in
        its place and ``lo`` in an extra channel, kvq's ``(16 hi + lo - offset) * scale + zero``, so ``lower``
        (float32 ``[kv_heads, n, head_dim]``) carries each extra channel's ``scale`` to its place; else None.
        """
        index = PARTS.index(part)
        scale, high = (self.k_scale, self.v_scale)[index], (self.k_high, self.v_high)[index]
        a = np.broadcast_to(scale.reshape(-1)[0] if scale.size == 1 else scale.reshape(kv_heads, -1)[:, :head_dim],
                            (kv_heads, head_dim)).astype(np.float32)
        c = np.zeros_like(a) if self.bits == 8 else np.float32(-8) * a
        if high is None:
            return a, c, None
        c = c + self.stream_offsets(kv_heads * head_dim)[index].reshape(kv_heads, head_dim)
        heads = np.arange(kv_heads)[:, None]
        c[heads, high.channels] = high.zero - np.float32(high.offset) * high.scale  # a there is 16 * scale
        lower = np.zeros((kv_heads, high.channels.shape[1], head_dim), np.float32)
        lower[heads, np.arange(high.channels.shape[1])[None, :], high.channels] = high.scale
        return a, c, lower

    def high_code_constants(self, starts: tuple[int, int], width: int) -> dict[str, np.ndarray]:
        """float32 ``[width]`` constants of kvq's 8-bit code ``c`` at each high channel's place in a row.

        ``starts``: where the key and the value rows begin in a row of ``width``. ``c = min(max(round((x - zero) /
        scale), low), top) + offset``; off the high channels the constants are inert (``c = 0``, never read).
        """
        highs = (self.k_high, self.v_high)

        def by_place(values, fill: float) -> np.ndarray:
            out = np.full(width, fill, np.float32)
            for start, value, high in zip(starts, values, highs):
                out[start + high.places()] = np.broadcast_to(np.float32(value), high.scale.shape)
            return out

        return {"zero": by_place((h.zero for h in highs), 0), "scale": by_place((h.scale for h in highs), 1),
                "low": by_place((h.low for h in highs), 0), "top": by_place((h.top for h in highs), 0),
                "offset": by_place((h.offset for h in highs), 0)}


def per_channel(tq: TensorQuant, meta: np.ndarray, geometry: CacheGeometry, role: str = "scales") -> np.ndarray:
    """Static metadata ``[kv_heads, n]`` as float32 ``[kv_heads, head_dim]``, first rounded to ``scale_dtype``.

    The rounding is what kvq's codec quantizes with; token-axis groups repeat over their channels.
    """
    kv_heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    sdtype = DType.get(tq.scale_dtype).numpy
    m = np.asarray(meta, dtype=np.float32).astype(sdtype).astype(np.float32)
    if m.shape[0] != kv_heads:
        raise ExportError(f"static {role} have shape {list(m.shape)}; expected [kv_heads={kv_heads}, n]")
    if tq.axis == Axis.TOKEN:  # one value per (head, group of channels): repeat it over the group
        m = np.repeat(m, tq.token_group(head_dim), axis=1)
    if m.shape != (kv_heads, head_dim):
        raise ExportError(f"static {role} expand to {list(m.shape)}; expected [{kv_heads}, {head_dim}]")
    return m


def gqa_scale(tq: TensorQuant, scales: np.ndarray, geometry: CacheGeometry) -> tuple[str, np.ndarray]:
    """Map kvq static scales ``[kv_heads, n]`` to (``PER_TENSOR`` | ``PER_CHANNEL``, float32 GQA scale tensor)."""
    s = per_channel(tq, scales, geometry)
    if np.all(s == s.flat[0]):
        return "PER_TENSOR", s.reshape(-1)[:1].copy()
    return "PER_CHANNEL", np.ascontiguousarray(s.reshape(1, geometry.num_kv_heads, 1, geometry.head_dim))


def gqa_offset(tq: TensorQuant, meta: Mapping, geometry: CacheGeometry) -> np.ndarray | None:
    """The float32 ``[kv_heads * head_dim]`` offset an asymmetric stream subtracts before the node (else None).

    kvq's ``int`` codes are ``c = clip(round((x - zero) / scale), 0, 2^b - 1)``; with ``x - offset`` for
    ``offset = zero + 2^(b-1) * scale`` the node's symmetric ``clip(round(.. / scale), -2^(b-1), 2^(b-1) - 1)``
    is ``c - 2^(b-1)``: the same rounding (an even shift keeps round-half-even) and the same clamp.
    """
    if not tq.has_zero_point:
        return None
    scale, zero = (per_channel(tq, meta[role], geometry, role) for role in (Role.SCALES, Role.ZERO_POINTS))
    return (zero + np.float32(1 << (tq.bits - 1)) * scale).reshape(-1)


def plan_layer(layer: int, key: TensorQuant, value: TensorQuant, static: Mapping,
               geometry: CacheGeometry) -> LayerPlan:
    """How ``layer``'s node stores its keys and values (``static``: the calibration, unread when unquantized)."""
    if not key.quantized:
        return LayerPlan(bits=None)
    kv_heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    types, arrays = [], []
    for part, tq in zip(PARTS, (key, value)):
        kind, array = gqa_scale(tq, static_scales(static, layer, part), geometry)
        types.append(kind)
        arrays.append(array)
    offsets = [gqa_offset(tq, static[layer][part], geometry) for part, tq in zip(PARTS, (key, value))]
    out_offset = offsets[1]
    highs = [HighSplit.of(tq, static, layer, part, geometry) if tq.high_channels else None
             for part, tq in zip(PARTS, (key, value))]
    if highs[0] is not None:  # the node's head grows by n channels: the nibbles' scales (see HighSplit)
        arrays = [_node_scales(a, high, geometry) for a, high in zip(arrays, highs)]
        types = ["PER_CHANNEL", "PER_CHANNEL"]
        out_offset = np.zeros(kv_heads * head_dim, np.float32) if out_offset is None else out_offset.copy()
        out_offset[highs[1].places().reshape(-1)] = highs[1].output_offset.reshape(-1)
    if types[0] != types[1]:  # the CPU kernel needs k_quant_type == v_quant_type
        shape = (1, kv_heads, 1, head_dim)
        arrays = [np.ascontiguousarray(np.broadcast_to(a.reshape(-1)[0] if a.size == 1 else a, shape))
                  for a in arrays]
        types = ["PER_CHANNEL", "PER_CHANNEL"]
    return LayerPlan(key.bits, types[0], types[1], arrays[0], arrays[1], *offsets, out_offset, *highs)


def _node_scales(scales: np.ndarray, high: HighSplit, geometry: CacheGeometry) -> np.ndarray:
    """float32 ``[1, kv_heads, 1, head_dim + n]``: 16x the scale at a high channel, its scale at its extra."""
    heads, d = geometry.num_kv_heads, geometry.head_dim
    s = np.broadcast_to(scales.reshape(-1)[0] if scales.size == 1 else scales.reshape(heads, d), (heads, d)).copy()
    s[np.arange(heads)[:, None], high.channels] = np.float32(16) * high.scale
    return np.ascontiguousarray(np.concatenate([s, high.scale], axis=1).reshape(1, heads, 1, -1))
