"""The one function that names every cache tensor and its dynamic axes.

The exporter, the runtime, the manifest, the Polygraphy data loader and the plugin all read
:func:`cache_tensors`; nothing else spells a cache tensor name.

Layout of the exported cache (for ``past`` inputs and ``present`` outputs alike):

* ``{direction}.seq_lengths`` int64 ``[batch]``: real tokens held per sequence (left padding excluded).
* per layer ``i`` and ``part`` in ``key``/``value``, the roles of :data:`kvq_export.reference.cache.ROLES`
  that the stream has, named ``{direction}.{i}.{part}.{role}``.

Every region (sinks, quantized, recent) of a batch is sized to the longest row and each row's valid
entries are *right-aligned* (padding on the left); which entries are valid follows from
``seq_lengths`` alone through :func:`kvq_export.reference.cache.split_lengths`, so no mask is stored.
That is the ``regions`` layout (the reference flavour's).

A flavour may use another layout (:data:`LAYOUTS`, :data:`FLAVOR_LAYOUTS`); the manifest records its name
and rules. ``buffer`` (the ``ort-gqa`` flavour): one tensor per layer and stream,
``{direction}.{i}.{part}.buffer`` ``[batch, kv_heads, capacity, packed head_dim]``, whose row ``b`` holds
its ``seq_lengths[b]`` tokens at positions ``[0, seq_lengths[b])`` (*left*-aligned, the rest unspecified).
``capacity`` is chosen by the runtime, and past and present are meant to be the same buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvq_export.dtypes import onnx_name
from kvq_export.scheme import KVQuantScheme, TensorQuant

DIRECTIONS = ("past", "present")
PARTS = ("key", "value")
PACKING = "uint8, lowest bits first: element i -> byte i // (8 // bits), bit offset (i % (8 // bits)) * bits"
#: 5-bit codes (ggml q5_0 / q5_1): two planes along head_dim D.
PACKING_5BIT = ("uint8, two planes: bytes [0, D/2) hold the low 4 bits (element i -> byte i // 2, bit offset "
                "(i % 2) * 4), bytes [D/2, D/2 + D/8) the fifth bits (element i -> byte D/2 + i // 8, bit i % 8)")

#: Cache layouts: ``regions`` (sinks / quantized / recent, right-aligned; the reference) and ``buffer``
#: (one fixed-capacity buffer per stream, left-aligned, shared by past and present).
LAYOUTS = ("regions", "buffer")
#: Flavours whose cache is not in the ``regions`` layout.
FLAVOR_LAYOUTS = {"ort-gqa": "buffer"}
#: Symbolic name of a ``buffer`` layout's token axis.
CAPACITY_AXIS = "capacity"
#: How a ``buffer`` holds int_sym codes (ONNX Runtime GroupQueryAttention's convention), by bits.
BUFFER_CODES = {
    8: "int8 two's complement q (kvq's stored code is q + 128, i.e. the same byte with its top bit flipped)",
    4: "uint8, two codes per byte, element 2j in the low nibble and 2j+1 in the high nibble, each stored as "
       "q + 8 (exactly kvq's packed int_sym codes)",
}


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

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the manifest."""
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out


def tensor_name(direction: str, layer: int | None, part: str | None, role: str) -> str:
    """``past.3.key.codes``; ``past.seq_lengths`` for the per-row lengths."""
    if layer is None:
        return f"{direction}.{role}"
    return f"{direction}.{layer}.{part}.{role}"


def region_axis(direction: str, layer: int, part: str, region: str, unit: str = "tokens") -> str:
    """Symbolic name of a region's length axis (``past.3.key.quantized_tokens``)."""
    return f"{direction}.{layer}.{part}.{region}_{unit}"


def stream_tensors(
    direction: str, layer: int, part: str, tq: TensorQuant, scheme: KVQuantScheme, *, kv_heads: int, head_dim: int
) -> Iterator[CacheTensor]:
    """The tensors of one layer's keys or values."""
    hp = onnx_name(scheme.hp_dtype)
    rows = ("batch", kv_heads)

    def tensor(role, dtype, shape, region, **quant):
        return CacheTensor(tensor_name(direction, layer, part, role), direction, layer, part, role, dtype,
                           tuple(shape), region, **quant)

    recent = (*rows, region_axis(direction, layer, part, "recent"), head_dim)
    if not tq.quantized:
        yield tensor("recent", hp, recent, "recent")
        return
    yield tensor("sinks", hp, (*rows, region_axis(direction, layer, part, "sinks"), head_dim), "sinks")
    quant = {"group_axis": tq.axis, "group_size": tq.token_group(head_dim) if tq.axis == "token" else tq.group_size,
             "format": tq.format, "bits": tq.bits, "quantizer": tq.quantizer}
    tokens = region_axis(direction, layer, part, "quantized")
    code_type = "float8e4m3fn" if tq.format == "fp8_e4m3" else "uint8"
    packing = (PACKING_5BIT if tq.bits == 5 else PACKING) if tq.is_int and tq.bits < 8 else None
    yield tensor("codes", code_type, (*rows, tokens, tq.packed_dim(head_dim)), "quantized", packing=packing, **quant)
    if tq.scales == "dynamic":
        kind, entries = tq.metadata_shape(head_dim)
        length = tokens if kind == "per_token" else region_axis(direction, layer, part, "quantized", "groups")
        meta_shape: tuple[int | str, ...] = (*rows, length, entries)
        meta_type = onnx_name(tq.scale_dtype)
        yield tensor("scales", meta_type, meta_shape, "quantized", **quant)
        if tq.has_zero_point:
            yield tensor("zero_points", meta_type, meta_shape, "quantized", **quant)
    yield tensor("recent", hp, recent, "recent")


def buffer_tensor(
    direction: str, layer: int, part: str, tq: TensorQuant, scheme: KVQuantScheme, *, kv_heads: int, head_dim: int
) -> CacheTensor:
    """The one tensor of a stream in the ``buffer`` layout (codes or high-precision values)."""
    name = tensor_name(direction, layer, part, "buffer")
    shape = ("batch", kv_heads, CAPACITY_AXIS)
    if not tq.quantized:
        return CacheTensor(name, direction, layer, part, "buffer", onnx_name(scheme.hp_dtype), (*shape, head_dim))
    quant = {"group_axis": tq.axis, "group_size": tq.token_group(head_dim) if tq.axis == "token" else tq.group_size,
             "format": tq.format, "bits": tq.bits}
    dtype = "int8" if tq.bits == 8 else "uint8"
    return CacheTensor(name, direction, layer, part, "buffer", dtype, (*shape, tq.packed_dim(head_dim)),
                       packing=BUFFER_CODES.get(tq.bits), **quant)


def layout_for_flavor(flavor: str) -> str:
    """The cache layout a flavour's graphs use (``regions`` unless :data:`FLAVOR_LAYOUTS` says otherwise)."""
    return FLAVOR_LAYOUTS.get(flavor, "regions")


def cache_tensors(
    scheme: KVQuantScheme, *, num_layers: int, kv_heads: int, head_dim: int, direction: str = "past",
    layout: str = "regions",
) -> list[CacheTensor]:
    """Every cache tensor crossing the graph boundary in ``direction`` (``past`` or ``present``).

    Static scales are model constants, not cache state: they live in the graph and the manifest's
    calibration section, not here. ``layout`` is one of :data:`LAYOUTS`.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out = [CacheTensor(tensor_name(direction, None, None, "seq_lengths"), direction, None, None, "seq_lengths",
                       "int64", ("batch",))]
    for layer, streams in enumerate(scheme.streams(num_layers)):
        for part, tq in zip(PARTS, streams):
            if layout == "buffer":
                out.append(buffer_tensor(direction, layer, part, tq, scheme, kv_heads=kv_heads, head_dim=head_dim))
            else:
                out.extend(stream_tensors(direction, layer, part, tq, scheme, kv_heads=kv_heads, head_dim=head_dim))
    return out


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
