"""The one function that names every cache tensor (:func:`tensor_name`) and its dynamic axes.

Every cache tensor is ``{direction}.{i}.{part}.{role}`` (``past.3.key.codes``) plus ``{direction}.seq_lengths``
(int64 ``[batch]``: real tokens held per sequence, left padding excluded). Which roles a stream has, their
shapes and their meaning belong to the cache layout (:mod:`kvq_export.cache_layout`), which builds every
tensor description through these names; the exporter, the runtime, the manifest, the Polygraphy data
loader and the plugin all read those descriptions, so nothing else spells a cache tensor name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

DIRECTIONS = ("past", "present")
PARTS = ("key", "value")
PACKING = "uint8, lowest bits first: element i -> byte i // (8 // bits), bit offset (i % (8 // bits)) * bits"
#: 5-bit codes (ggml q5_0 / q5_1): two planes along head_dim D.
PACKING_5BIT = ("uint8, two planes: bytes [0, D/2) hold the low 4 bits (element i -> byte i // 2, bit offset "
                "(i % 2) * 4), bytes [D/2, D/2 + D/8) the fifth bits (element i -> byte D/2 + i // 8, bit i % 8)")
#: 6-bit codes: the same two planes, the second holding the top two bits.
PACKING_6BIT = ("uint8, two planes: bytes [0, D/2) hold the low 4 bits (element i -> byte i // 2, bit offset "
                "(i % 2) * 4), bytes [D/2, D/2 + D/4) the top 2 bits (element i -> byte D/2 + i // 4, bit offset "
                "(i % 4) * 2)")
#: Per-channel streams with ``high_channels`` n: the 8-bit channels first, then the rest packed.
PACKING_HIGH = ("uint8 per token and head: bytes [0, n) hold the 8-bit codes of the head's n high channels (ascending "
                "channel order, as listed in the calibration file's '<layer>.<part>.high_channels'), then the other "
                "channels in ascending order packed lowest bits first (element i of them -> byte n + i // (8 // bits), "
                "bit offset (i % (8 // bits)) * bits); every channel dequantizes as code * scale + zero_point")

#: Symbolic name of a ``buffer`` layout's token axis.
CAPACITY_AXIS = "capacity"


@dataclass(frozen=True)
class CacheTensor:
    """One cache graph input or output, as the manifest describes it."""

    name: str
    direction: str
    layer: int | None
    part: str | None  # key | value | None for seq_lengths
    role: str  # seq_lengths | sinks | codes | scales | zero_points | recent | buffer
    dtype: str  # ONNX element type name
    shape: tuple[int | str, ...]  # ints, or symbolic axis names
    region: str | None = None  # sinks | quantized | recent
    packing: str | None = None
    group_axis: str | None = None  # token | channel (quantized roles)
    group_size: int | None = None
    format: str | None = None
    bits: int | None = None
    quantizer: str | None = None  # kvq | ggml: how codes were chosen (decoding is the same)
    high_channels: int | None = None  # channels per head stored at 8 bits (see PACKING_HIGH)

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the manifest."""
        out = asdict(self)
        out["shape"] = list(self.shape)
        if self.high_channels is None:  # only streams that have them say so
            del out["high_channels"]
        return out


def tensor_name(direction: str, layer: int | None, part: str | None, role: str) -> str:
    """``past.3.key.codes``; ``past.seq_lengths`` for the per-row lengths."""
    if layer is None:
        return f"{direction}.{role}"
    return f"{direction}.{layer}.{part}.{role}"


def region_axis(direction: str, layer: int, part: str, region: str, unit: str = "tokens") -> str:
    """Symbolic name of a region's length axis (``past.3.key.quantized_tokens``)."""
    return f"{direction}.{layer}.{part}.{region}_{unit}"


def present_name(past_name: str) -> str:
    """The output that feeds a given past input on the next step."""
    direction, rest = past_name.split(".", 1)
    if direction != "past":
        raise ValueError(f"not a past cache tensor: {past_name}")
    return f"present.{rest}"


#: Inside-graph values a validator may expose as extra outputs (post-RoPE q, and this call's k/v
#: before they are stored), one set per layer. Every flavour names them the same way.
PROBES = ("q", "key", "value")

#: Initializers of a graph whose attention kernel applies RoPE itself: cos/sin ``[max_positions, head_dim/2]``.
ROTARY_TABLES = ("rope.cos_cache", "rope.sin_cache")


def probe_name(layer: int, which: str, *, projected: bool = False) -> str:
    """Name of an attention input inside the graph (``probe.3.key``); see :data:`PROBES`.

    ``projected=True`` names the raw projection ``[B, t, H*D]`` before RoPE (``probe.3.key.projected``): what a
    graph whose fused attention kernel applies RoPE (tables :data:`ROTARY_TABLES`) exposes instead.
    """
    if which not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {which!r}")
    return f"probe.{layer}.{which}" + (".projected" if projected else "")
