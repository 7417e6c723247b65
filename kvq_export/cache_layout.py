"""Cache layouts: how a flavour's graphs hold the KV cache across the graph boundary.

A :class:`CacheLayout` owns everything that depends on how the cache is laid out: its tensors (named by
:func:`kvq_export.naming.tensor_name`), the rules the manifest repeats for other readers, how a runtime
makes an empty cache, grows it and binds it, how a benchmark fills one with synthetic data, and how the
stored values are decoded back to floats. Every flavour declares its layout (``layout`` of its cache
graph); the manifest records the layout's name.

* :data:`REGIONS` (the reference and TensorRT flavours): per stream ``sinks`` / ``codes`` + metadata /
  ``recent``, every region sized to the longest row with each row's valid entries right-aligned; which
  entries are valid follows from ``seq_lengths`` alone through :class:`RegionSplit`, so no mask is stored.
* :data:`BUFFER` (the ``ort-gqa`` flavour): one fixed-capacity tensor per stream, row ``b``'s tokens at
  positions ``[0, seq_lengths[b])``, bound as past input and present output at once (written in place).

:class:`~kvq_export.region_split.RegionSplit` (:mod:`kvq_export.region_split`) is the one place that splits a
stream's tokens into sinks, quantized and recent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from kvq_export.dtypes import DType, onnx_name
from kvq_export.errors import RuntimeInputError
from kvq_export.model_facts import CacheGeometry
from kvq_export.naming import (
    CAPACITY_AXIS,
    DIRECTIONS,
    PARTS,
    CacheTensor,
    packing_rule,
    region_axis,
    tensor_name,
)
from kvq_export.region_split import REGION_NAMES, RegionSplit, split_lengths
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Axis, Direction, Format, LayoutName, Part, Role, ScaleMode


# -- synthetic values (a benchmark's cache: shapes matter, values only have to be valid) ---------------------
def random_values(dtype: str, shape: list[int] | tuple[int, ...], rng: np.random.Generator, *,
                  scales: bool = False) -> np.ndarray:
    """Valid random contents of a ``dtype`` tensor (ONNX name).

    Codes are random bytes (fp8: finite e4m3 only); values are N(0, 0.5) in float32 (a caller casts them to a
    narrower float type), ``scales`` small positive floats.
    """
    if dtype == "float8e4m3fn":
        magnitude = rng.integers(0, 0x77, shape, dtype=np.uint8)  # below the NaN pattern 0x7F
        return magnitude | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)
    if dtype in ("int8", "uint8"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max + 1, shape, dtype=dtype)
    if scales:
        return rng.uniform(0.005, 0.02, shape).astype(np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(np.float32)


def _quant_facts(tq: TensorQuant, head_dim: int, **extra) -> dict[str, Any]:
    """The quantization fields a quantized stream's tensors carry in the manifest."""
    group = tq.token_group(head_dim) if tq.axis == Axis.TOKEN else tq.group_size
    high = {"high_channels": tq.high_channels} if tq.high_channels else {}
    return {"group_axis": tq.axis, "group_size": group, "format": tq.format, "bits": tq.bits, **high, **extra}


# -- layouts -------------------------------------------------------------------------------------------------
class CacheLayout:
    """A way of holding the cache across the graph boundary (see the module docstring)."""

    name: ClassVar[LayoutName]
    #: The layout's rules, repeated in every manifest.
    rules: ClassVar[str]
    #: One fixed-capacity tensor per stream, shared by past input and present output (written in place).
    shares_buffers: ClassVar[bool] = False
    #: Rows hold at most a capacity chosen by the runtime (grown by copying when a step needs more).
    has_capacity: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"CacheLayout({self.name!r})"

    # -- tensors -------------------------------------------------------------------------------------------
    def stream_tensors(self, direction: Direction, layer: int, part: Part, tq: TensorQuant, scheme: KVQuantScheme,
                       geometry: CacheGeometry) -> list[CacheTensor]:
        """The tensors of one layer's keys or values (``geometry``: the model's, as for :meth:`tensors`)."""
        raise NotImplementedError

    def tensors(self, scheme: KVQuantScheme, geometry: CacheGeometry,
                direction: Direction = Direction.PAST) -> list[CacheTensor]:
        """Every cache tensor crossing the graph boundary in ``direction`` (``past`` or ``present``).

        ``geometry``: the model's :class:`~kvq_export.model_facts.ModelFacts` or a plain
        :class:`~kvq_export.model_facts.Geometry`. Static scales are model constants, not cache state: they
        live in the graph and the manifest's calibration section, not here.
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        direction = Direction(direction)
        out = [CacheTensor(tensor_name(direction, None, None, Role.SEQ_LENGTHS), direction, None, None,
                           Role.SEQ_LENGTHS, "int64", ("batch",))]
        for layer, streams in enumerate(scheme.streams(geometry.num_layers)):
            for part, tq in zip(PARTS, streams):
                out.extend(self.stream_tensors(direction, layer, part, tq, scheme, geometry))
        return out

    # -- runtime -------------------------------------------------------------------------------------------
    def axis_sizes(self, scheme: KVQuantScheme, num_layers: int, length: int, capacity: int | None) -> dict[str, int]:
        """Sizes of the symbolic cache axes (other than ``batch``) when every row holds ``length`` tokens."""
        raise NotImplementedError

    def arrays(self, specs: list[CacheTensor], scheme: KVQuantScheme, num_layers: int, batch: int, length: int, *,
               capacity: int | None = None, rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
        """A cache of ``length`` tokens per row in this layout: zeros, or random valid values with ``rng``.

        ``length=0`` is the empty cache a first step starts from.
        """
        sizes = self.axis_sizes(scheme, num_layers, length, capacity)
        out = {}
        for spec in specs:
            shape = [batch if d == "batch" else d if isinstance(d, int) else sizes[d] for d in spec.shape]
            if spec.role == Role.SEQ_LENGTHS:
                out[spec.name] = np.full(shape, length, np.int64)
            elif rng is None:
                out[spec.name] = np.zeros(shape, dtype=DType.get(spec.dtype).bits_numpy)
            else:
                out[spec.name] = random_values(spec.dtype, shape, rng, scales=spec.role == Role.SCALES)
        return out

    def capacity_for(self, tokens: int) -> int | None:
        """Capacity a new cache needs to hold ``tokens`` per row (None: the layout has no capacity)."""
        return tokens if self.has_capacity else None

    def capacity_of(self, shapes: Mapping[str, tuple[int, ...]]) -> int | None:
        """Tokens per row a cache with these tensor shapes can hold (None: unbounded)."""
        return None

    def shared(self, spec: CacheTensor) -> bool:
        """Whether past tensor ``spec`` is also the present output (bind one buffer to both)."""
        return False

    def grown(self, spec: CacheTensor, array: np.ndarray, capacity: int) -> np.ndarray:
        """``array`` (a tensor of ``spec``) re-made to hold ``capacity`` tokens per row, its contents kept."""
        return array

    # -- decoding ------------------------------------------------------------------------------------------
    def decode_stream(self, scheme: KVQuantScheme, tq: TensorQuant, arrays: Mapping[str, np.ndarray | None],
                      row: int, n: int, static_meta: Mapping | None) -> np.ndarray:
        """Row ``row``'s ``n`` tokens of one stream -> float32 ``[H, n, D]`` in token order (stored basis).

        ``arrays`` maps the stream's roles to their tensors; ``static_meta`` holds a static-scale stream's
        ``scales`` (and ``zero_points``) ``[H, D]``.
        """
        raise NotImplementedError


class RegionsLayout(CacheLayout):
    """Sinks / quantized / recent regions, right-aligned per row (the reference layout)."""

    name = LayoutName.REGIONS
    rules = (
        "Each row b holds seq_lengths[b] real tokens. Per layer and stream, split them as " + RegionSplit.RULE
        + ". Every region tensor is sized to the longest row and each "
        "row's valid entries are right-aligned (padding on the left); channel-axis scales/zero_points count groups "
        "(quantized / group_size). Token order is sinks, quantized, recent. Feed present.* outputs back as past.* "
        "inputs unchanged; an empty cache is every region with 0 tokens and seq_lengths = 0."
    )

    def stream_tensors(self, direction, layer, part, tq, scheme, geometry):
        hp = onnx_name(scheme.hp_dtype)
        rows, head_dim = ("batch", geometry.num_kv_heads), geometry.head_dim

        def tensor(role, dtype, shape, region, **quant):
            return CacheTensor(tensor_name(direction, layer, part, role), direction, layer, part, role, dtype,
                               tuple(shape), region, **quant)

        recent = tensor(Role.RECENT, hp, (*rows, region_axis(direction, layer, part, "recent"), head_dim), "recent")
        if not tq.quantized:
            return [recent]
        out = [tensor(Role.SINKS, hp, (*rows, region_axis(direction, layer, part, "sinks"), head_dim), "sinks")]
        quant = _quant_facts(tq, head_dim, quantizer=tq.quantizer)
        tokens = region_axis(direction, layer, part, "quantized")
        code_type = "float8e4m3fn" if tq.format == Format.FP8_E4M3 else "uint8"
        packing = None
        if tq.is_int and tq.bits < 8:
            packing = packing_rule(tq.bits, tq.high_channels)
        out.append(tensor(Role.CODES, code_type, (*rows, tokens, tq.packed_dim(head_dim)), "quantized", packing=packing,
                          **quant))
        if tq.scales == ScaleMode.DYNAMIC:
            kind, entries = tq.metadata_shape(head_dim)
            length = tokens if kind == "per_token" else region_axis(direction, layer, part, "quantized", "groups")
            meta_type = onnx_name(tq.scale_dtype)
            roles = (Role.SCALES, Role.ZERO_POINTS) if tq.has_zero_point else (Role.SCALES,)
            out += [tensor(role, meta_type, (*rows, length, entries), "quantized", **quant) for role in roles]
        return [*out, recent]

    def axis_sizes(self, scheme, num_layers, length, capacity):
        sizes = {}
        for layer, streams in enumerate(scheme.streams(num_layers)):
            for part, tq in zip(PARTS, streams):
                counts = split_lengths(tq, scheme, length)
                for region, count in zip(REGION_NAMES, counts):
                    sizes[region_axis(Direction.PAST, layer, part, region)] = count
                sizes[region_axis(Direction.PAST, layer, part, "quantized", "groups")] = counts[1] // tq.flush_unit
        return sizes

    def decode_stream(self, scheme, tq, arrays, row, n, static_meta):
        import torch

        def last(role: Role, count: int) -> torch.Tensor:  # the row's right-aligned valid entries
            array = arrays[role][row]
            return torch.from_numpy(np.ascontiguousarray(array[:, array.shape[1] - count:]))

        sinks, quantized, recent = split_lengths(tq, scheme, n)
        pieces = []
        if tq.quantized:
            pieces.append(last(Role.SINKS, sinks).float())
            if quantized:
                pieces.append(_dequantize_region(tq, last, quantized, static_meta))
        pieces.append(last(Role.RECENT, recent).float())
        return torch.cat(pieces, dim=1).numpy()


class BufferLayout(CacheLayout):
    """One fixed-capacity buffer per stream, left-aligned, shared by past and present (ort-gqa)."""

    name = LayoutName.BUFFER
    shares_buffers = True
    has_capacity = True
    #: The role (last name component) of a stream's one tensor.
    role = Role.BUFFER
    #: How a buffer holds int_sym codes (ONNX Runtime GroupQueryAttention's convention), by bits.
    codes = {
        8: "int8 two's complement q (kvq's stored code is q + 128, i.e. the same byte with its top bit flipped)",
        4: "uint8, two codes per byte, element 2j in the low nibble and 2j+1 in the high nibble, each stored as "
           "q + 8 (exactly kvq's packed codes)",
    }
    rules = (
        "Each row b holds seq_lengths[b] real tokens. Per layer and stream there is one tensor <dir>.<i>.<part>.buffer "
        "[batch, kv_heads, capacity, packed head_dim]; row b's tokens sit at positions [0, seq_lengths[b]) in token "
        "order (left-aligned), positions beyond are unspecified. The runtime chooses capacity (dim 2) and binds the "
        "same buffer as past.* input and present.* output (ONNX Runtime IO binding), so new tokens are written in "
        "place and nothing is copied per step; a step needs max(seq_lengths) + new tokens <= capacity (grow by "
        "copying the valid rows into a larger buffer). Without binding, present.* comes back as a copy of "
        "max(capacity, longest row) positions. Quantized buffers hold symmetric codes q with the static scales of "
        "the calibration file: 8-bit as int8 q, 4-bit as uint8 with two codes per byte (low nibble first) stored as "
        "q + 8; int_sym: x = q * scale. A stream of format int (static zero points) stores q = c - 2^(bits-1) for "
        "its unsigned code c (c is the int8 byte with its top bit flipped, or the 4-bit nibble as stored): "
        "x = c * scale + zero_point. A 4-bit stream with n high channels per head (quant.high_channels) holds "
        "head_dim + n nibbles per token and head: nibble j < head_dim is channel j's code, except that a high "
        "channel's place holds the upper nibble h of its 8-bit code c, and nibble head_dim + i holds the lower "
        "nibble l of the i-th high channel (ascending, as listed in the calibration file's "
        "'<layer>.<part>.high_channels'): c = 16 * h + l, dequantized like kvq's 8-bit code (int: c * scale + "
        "zero_point; int_sym: (c - 128) * scale). An empty cache is seq_lengths = 0 (buffer contents irrelevant)."
    )

    def buffer_name(self, direction: Direction, layer: int, part: Part) -> str:
        """``past.3.key.buffer``."""
        return tensor_name(direction, layer, part, self.role)

    def stream_tensors(self, direction, layer, part, tq, scheme, geometry):
        name, head_dim = self.buffer_name(direction, layer, part), geometry.head_dim
        shape = ("batch", geometry.num_kv_heads, CAPACITY_AXIS)
        if not tq.quantized:
            return [CacheTensor(name, direction, layer, part, self.role, onnx_name(scheme.hp_dtype),
                                (*shape, head_dim))]
        dtype = "int8" if tq.bits == 8 else "uint8"
        return [CacheTensor(name, direction, layer, part, self.role, dtype, (*shape, tq.packed_dim(head_dim)),
                            packing=self.packing(tq), **_quant_facts(tq, head_dim))]

    def packing(self, tq: TensorQuant) -> str | None:
        """The stored-code description of a quantized buffer."""
        if tq.high_channels:
            return (f"uint8, head_dim + {tq.high_channels} nibbles per token and head (low nibble first, each "
                    "q + 8): each high channel's 8-bit code c = 16 * (its nibble) + (its extra nibble after "
                    "head_dim), see the layout rules")
        return self.codes.get(tq.bits)

    def axis_sizes(self, scheme, num_layers, length, capacity):
        return {CAPACITY_AXIS: max(capacity or length, length)}

    def capacity_of(self, shapes):
        sizes = {shape[2] for name, shape in shapes.items() if name.endswith("." + self.role)}
        return min(sizes) if sizes else None

    def shared(self, spec: CacheTensor) -> bool:
        return spec.role == self.role

    def grown(self, spec, array, capacity):
        if not self.shared(spec):
            return array
        out = np.zeros((*array.shape[:2], capacity, *array.shape[3:]), dtype=array.dtype)
        out[:, :, :array.shape[2]] = array
        return out

    def decode_stream(self, scheme, tq, arrays, row, n, static_meta):
        import torch

        stored = np.asarray(arrays[self.role])[row, :, :n]
        if not tq.quantized:
            return np.asarray(stored, dtype=np.float32)
        high = static_meta.get("high_channels") if tq.high_channels else None
        codes = torch.from_numpy(np.ascontiguousarray(buffer_codes_to_kvq(tq, stored, high)))
        return _dequantize_region(tq, lambda role, count: codes, n, static_meta).numpy()


def buffer_codes_to_kvq(tq: TensorQuant, stored: np.ndarray, high_channels: np.ndarray | None = None) -> np.ndarray:
    """A ``buffer`` layout's stored codes ``[..., H, T, bytes]`` -> kvq's stored (packed) codes, uint8.

    8-bit buffers hold int8 ``q``; kvq stores ``q + 128`` (the same byte with its top bit flipped).
    4-bit buffers hold kvq's packing (``q + 8`` per nibble, low nibble first); with high channels (their
    ``[H, n]`` indices) the two nibbles of each 8-bit code are joined and put first, as kvq stores them.
    """
    if tq.bits == 8:
        return (np.asarray(stored).view(np.uint8) ^ np.uint8(0x80)).astype(np.uint8)
    stored = np.asarray(stored, dtype=np.uint8)
    if not tq.high_channels:
        return stored
    import torch

    from kvq_export.reference.codec import check_high_channels, pack, unpack  # lazy: imports torch

    nibbles = unpack(torch.from_numpy(np.ascontiguousarray(stored)), 4).numpy()  # [..., H, T, D + n]
    n = tq.high_channels
    dim = nibbles.shape[-1] - n
    high = check_high_channels(torch.as_tensor(np.asarray(high_channels)), tq, nibbles.shape[-3], dim).numpy()
    heads = np.arange(high.shape[0])[:, None]
    upper = np.take_along_axis(nibbles[..., :dim], np.broadcast_to(high[:, None, :], (*nibbles.shape[:-1], n)), -1)
    eight_bit = upper.astype(np.uint16) * 16 + nibbles[..., dim:]
    is_high = np.zeros((high.shape[0], dim), dtype=bool)
    is_high[heads, high] = True
    rest = np.stack([nibbles[..., h, :, :dim][..., ~is_high[h]] for h in range(high.shape[0])], axis=-3)
    return np.concatenate([eight_bit.astype(np.uint8), pack(torch.from_numpy(rest), tq.bits).numpy()], axis=-1)


def _dequantize_region(tq: TensorQuant, last, count: int, static_meta):
    """One row's quantized region -> float32 [H, count, D] through the reference codec.

    ``last(role, count)`` returns the row's last ``count`` entries of a role as a torch tensor.
    """
    import torch

    from kvq_export.reference.codec import Quantized, dequantize_packed  # lazy: imports torch

    codes = last(Role.CODES, count)
    if tq.format == Format.FP8_E4M3 and codes.dtype == torch.uint8:  # raw bits as ONNX Runtime returns them
        codes = codes.view(torch.float8_e4m3fn)
    if tq.scales == ScaleMode.STATIC:  # [H, n], shared by every row, stored rounded to scale_dtype
        sdtype = DType.get(tq.scale_dtype).torch
        scales = torch.as_tensor(static_meta[Role.SCALES]).to(sdtype)
        zeros = torch.as_tensor(static_meta[Role.ZERO_POINTS]).to(sdtype) if tq.has_zero_point else None
    else:
        groups = count if tq.axis == Axis.TOKEN else count // tq.group_size
        scales = last(Role.SCALES, groups)[None]
        zeros = last(Role.ZERO_POINTS, groups)[None] if tq.has_zero_point else None
    high = torch.as_tensor(static_meta["high_channels"]) if tq.high_channels else None
    return dequantize_packed(Quantized(codes[None], scales, zeros), tq, high_channels=high)[0]


REGIONS = RegionsLayout()
BUFFER = BufferLayout()
#: Every layout by name (what a manifest's ``layout_name`` may say).
LAYOUTS: dict[LayoutName, CacheLayout] = {layout.name: layout for layout in (REGIONS, BUFFER)}


def layout_named(name: str) -> CacheLayout:
    """The layout a manifest names; an unknown name is refused with the allowed ones."""
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise RuntimeInputError(f"cache layout {name!r} is not supported; allowed: {', '.join(LAYOUTS)}") from None
