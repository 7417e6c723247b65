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

from kvq_export.scheme_rules import code_planes
from kvq_export.vocab import Axis, Direction, Format, Part, Quantizer, Role, plain

DIRECTIONS = tuple(Direction)
PARTS = tuple(Part)
def packing_rule(bits: int, high_channels: int = 0) -> str:
    """The manifest's byte layout of ``bits``-wide integer codes along head_dim ``D`` (see the codec).

    One plane: packed lowest bits first. 3-, 5- and 6-bit codes: a plane of the low bits, then a plane of
    the higher bits (:func:`~kvq_export.scheme_rules.code_planes`). High channels: their 8-bit codes first.
    """
    planes = code_planes(bits)
    width, start = ("D", "") if not high_channels else ("(D - n)", "n + ")

    def plane(first: str, w: int, what: str) -> str:
        per = 8 // w
        return (f"{what} (element i -> byte {first}i // {per}, bit offset (i % {per}) * {w})" if per > 1
                else f"{what} (element i -> byte {first}i)")

    if len(planes) == 1:
        rule = plane(start, bits, "packed lowest bits first")
    else:
        low, high = planes
        split = f"{start}{width} * {low} / 8"
        rule = (f"two planes: {plane(start, low, f'the low {low} bits')}, then from byte {split} "
                f"{plane(split + ' + ', high, f'the top {high} bit(s)')}")
    if not high_channels:
        return f"uint8, {rule}"
    return ("uint8 per token and head: bytes [0, n) hold the 8-bit codes of the head's n high channels (ascending "
            "channel order, as listed in the calibration file's '<layer>.<part>.high_channels'), then the other "
            f"D - n channels in ascending order as element i = 0 .. D - n - 1, {rule}; every channel dequantizes "
            "as code * scale + zero_point")


#: A ``buffer``-layout graph's optional bool input (default true): whether a call of several new tokens attends over
#: their exact keys and values (true) or, as a decode step does, over their stored codes (false, so that what a row
#: holds follows from its tokens alone, however they were split into calls).
EXACT_PREFILL = "exact_prefill"

#: Symbolic name of a ``buffer`` layout's token axis.
CAPACITY_AXIS = "capacity"


@dataclass(frozen=True)
class CacheTensor:
    """One cache graph input or output, as the manifest describes it."""

    name: str
    direction: Direction
    layer: int | None
    part: Part | None  # None for seq_lengths
    role: Role
    dtype: str  # ONNX element type name
    shape: tuple[int | str, ...]  # ints, or symbolic axis names
    region: str | None = None  # sinks | quantized | recent
    packing: str | None = None
    group_axis: Axis | None = None  # quantized roles
    group_size: int | None = None
    format: Format | None = None
    bits: int | None = None
    quantizer: Quantizer | None = None  # how codes were chosen (decoding is the same)
    high_channels: int | None = None  # channels per head stored at 8 bits (see packing_rule)

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the manifest."""
        out = {key: plain(value) for key, value in asdict(self).items()}
        out["shape"] = list(self.shape)
        if self.high_channels is None:  # only streams that have them say so
            del out["high_channels"]
        return out


def tensor_name(direction: str, layer: int | None, part: Part | None, role: str) -> str:
    """``past.3.key.codes``; ``past.seq_lengths`` for the per-row lengths."""
    if layer is None:
        return f"{direction}.{role}"
    return f"{direction}.{layer}.{part}.{role}"


def region_axis(direction: str, layer: int, part: Part, region: str, unit: str = "tokens") -> str:
    """Symbolic name of a region's length axis (``past.3.key.quantized_tokens``)."""
    return f"{direction}.{layer}.{part}.{region}_{unit}"


def present_name(past_name: str) -> str:
    """The output that feeds a given past input on the next step."""
    direction, rest = past_name.split(".", 1)
    if direction != Direction.PAST:
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


def packed_probe_name(layer: int, *, projected: bool = False) -> str:
    """Name of the packed q|k|v ``[B, t, (Hq + 2 Hkv) * D]`` after RoPE (``probe.3.qkv``).

    What a graph whose attention kernel reads the three packed exposes instead of the :data:`PROBES` (splitting
    it in the graph would cost a node at every step). ``projected=True``: the raw projection before RoPE
    (``probe.3.qkv.projected``), for a kernel that applies RoPE itself.
    """
    return f"probe.{layer}.qkv" + (".projected" if projected else "")
