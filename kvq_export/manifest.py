"""``kvq.json``: the contract between an export directory and the runtimes that serve it.

It records the scheme, the model facts, opset, flavour and kvq version, the graph inputs, and for every
cache input/output its name, layer, key/value, role, dtype, symbolic shape, packing order, group axis
and size (from :func:`kvq_export.naming.cache_tensors`). :func:`decode_cache` turns cache tensors back
into K/V using nothing but the manifest (and the calibration file it names), which is how a production
runtime can check its own decoder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export._atomic import atomic_write
from kvq_export.errors import RuntimeInputError
from kvq_export.naming import PARTS, CacheTensor, cache_tensors, layout_for_flavor, tensor_name
from kvq_export.reference.cache import split_lengths
from kvq_export.scheme import KVQuantScheme

MANIFEST_NAME = "kvq.json"
MODEL_NAME = "model.onnx"
CALIBRATION_NAME = "calibration.npz"
FORMAT_VERSION = 1

#: How a runtime finds the valid entries of each region; repeated in every manifest for its readers.
LAYOUT_RULES = (
    "Each row b holds seq_lengths[b] real tokens. Per layer and stream, split them as "
    "sinks = min(sink_tokens, n); rest = n - sinks; quantized = floor(max(0, rest - residual_length) / unit) * unit "
    "(unit = group_size for channel-axis dynamic streams, else 1); recent = rest - quantized "
    "(an unquantized stream keeps all n in recent). Every region tensor is sized to the longest row and each "
    "row's valid entries are right-aligned (padding on the left); channel-axis scales/zero_points count groups "
    "(quantized / group_size). Token order is sinks, quantized, recent. Feed present.* outputs back as past.* "
    "inputs unchanged; an empty cache is every region with 0 tokens and seq_lengths = 0."
)
#: The rules of the ``buffer`` layout (the ``ort-gqa`` flavour's GroupQueryAttention cache).
BUFFER_LAYOUT_RULES = (
    "Each row b holds seq_lengths[b] real tokens. Per layer and stream there is one tensor <dir>.<i>.<part>.buffer "
    "[batch, kv_heads, capacity, packed head_dim]; row b's tokens sit at positions [0, seq_lengths[b]) in token "
    "order (left-aligned), positions beyond are unspecified. The runtime chooses capacity (dim 2) and binds the "
    "same buffer as past.* input and present.* output (ONNX Runtime IO binding), so new tokens are written in "
    "place and nothing is copied per step; a step needs max(seq_lengths) + new tokens <= capacity (grow by "
    "copying the valid rows into a larger buffer). Without binding, present.* comes back as a copy of "
    "max(capacity, longest row) positions. Quantized buffers hold symmetric codes with the static scales of the "
    "calibration file: 8-bit as int8 q, 4-bit as uint8 with two codes per byte (low nibble first) stored as "
    "q + 8; x = q * scale. An empty cache is seq_lengths = 0 (buffer contents irrelevant)."
)
#: Layout name -> its rules, repeated in every manifest.
LAYOUT_TEXT = {"regions": LAYOUT_RULES, "buffer": BUFFER_LAYOUT_RULES}


@dataclass(frozen=True)
class Manifest:
    """The parsed ``kvq.json`` of one export directory."""

    scheme: KVQuantScheme
    model: dict[str, Any]
    flavor: str
    opset: int
    dtype: str
    kvq_version: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    tokenizer: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None
    format_version: int = FORMAT_VERSION
    layout: str | None = None  # cache layout name; None: the flavour's (see naming.layout_for_flavor)
    #: other runtimes that can serve the export: name -> {"supported": bool, their files, or "reason"}
    runtimes: dict[str, Any] = field(default_factory=dict)

    # -- the cache ------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return int(self.model["num_layers"])

    @property
    def cache_layout(self) -> str:
        """The cache layout (``regions`` or ``buffer``, see :data:`kvq_export.naming.LAYOUTS`)."""
        return self.layout or layout_for_flavor(self.flavor)

    def cache(self, direction: str = "past") -> list[CacheTensor]:
        """Cache tensors for ``direction`` (recomputed from the scheme: the single naming function)."""
        return cache_tensors(self.scheme, num_layers=self.num_layers, kv_heads=int(self.model["num_kv_heads"]),
                             head_dim=int(self.model["head_dim"]), direction=direction, layout=self.cache_layout)

    # -- (de)serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "format_version": self.format_version,
            "kvq_version": self.kvq_version,
            "flavor": self.flavor,
            "opset": self.opset,
            "dtype": self.dtype,
            "model": self.model,
            "scheme": self.scheme.to_dict(),
            "tokenizer": self.tokenizer,
            "calibration": self.calibration,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "runtimes": self.runtimes,
            "cache": {
                "layout": LAYOUT_TEXT[self.cache_layout],
                "layout_name": self.cache_layout,
                "past": [t.to_dict() for t in self.cache("past")],
                "present": [t.to_dict() for t in self.cache("present")],
            },
        }

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``kvq.json`` atomically into ``directory``."""
        return atomic_write(Path(directory) / MANIFEST_NAME, json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """Parse and check a manifest dict (the cache section must match the scheme's naming)."""
        try:
            version = int(data["format_version"])
            if version != FORMAT_VERSION:
                raise RuntimeInputError(
                    f"manifest format_version {version} is not supported (expected {FORMAT_VERSION})")
            manifest = cls(
                scheme=KVQuantScheme.from_dict(data["scheme"]), model=dict(data["model"]), flavor=data["flavor"],
                opset=int(data["opset"]), dtype=data["dtype"], kvq_version=data["kvq_version"],
                inputs=list(data["inputs"]), outputs=list(data["outputs"]), tokenizer=dict(data.get("tokenizer") or {}),
                calibration=data.get("calibration"), format_version=version,
                layout=(data.get("cache") or {}).get("layout_name"), runtimes=dict(data.get("runtimes") or {}),
            )
        except KeyError as err:
            raise RuntimeInputError(f"manifest is missing the field {err.args[0]!r}") from None
        if manifest.cache_layout not in LAYOUT_TEXT:
            raise RuntimeInputError(f"manifest cache layout {manifest.cache_layout!r} is not supported "
                                    f"(known: {', '.join(LAYOUT_TEXT)})")
        listed = [t["name"] for t in data.get("cache", {}).get("past", [])]
        expected = [t.name for t in manifest.cache("past")]
        if listed != expected:
            raise RuntimeInputError("manifest cache section does not match its scheme: "
                                    f"{len(listed)} listed vs {len(expected)} expected tensors")
        return manifest

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Manifest:
        """Read ``DIR/kvq.json``."""
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise RuntimeInputError(f"{directory} is not a kvq export directory: {MANIFEST_NAME} is missing")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise RuntimeInputError(f"{path} is not valid JSON: {err}") from None
        return cls.from_dict(data)


def load_static(directory: str | os.PathLike[str], manifest: Manifest) -> dict | None:
    """The calibrated static scales the manifest names, as ``{layer: {part: {role: array}}}``."""
    if not manifest.calibration:
        return None
    path = Path(directory) / manifest.calibration["file"]
    with np.load(path) as data:
        out: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        for key in data.files:
            layer, part, role = key.split(".")
            out.setdefault(int(layer), {}).setdefault(part, {})[role] = data[key]
    return out


def decode_cache(
    manifest: Manifest, tensors: Mapping[str, np.ndarray], *, direction: str = "present", static: Mapping | None = None
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Dequantize a cache using only the manifest: ``[row][layer] -> (K, V)`` each float32 ``[H, n_row, D]``.

    ``tensors`` maps cache tensor names to arrays (fp8 codes may be given as raw uint8 bits). Static
    scales come from ``static`` (see :func:`load_static`).
    """
    lengths = np.asarray(tensors[tensor_name(direction, None, None, "seq_lengths")]).astype(np.int64)
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in lengths]
    if manifest.cache_layout == "buffer":
        for layer, streams in enumerate(manifest.scheme.streams(manifest.num_layers)):
            for row, n in enumerate(lengths):
                k, v = (_decode_buffer_row(tq, np.asarray(tensors[tensor_name(direction, layer, part, "buffer")])
                                           [row, :, :int(n)], (static or {}).get(layer, {}).get(part))
                        for part, tq in zip(PARTS, streams))
                rows[row].append((k, v))
        return rows
    for layer, streams in enumerate(manifest.scheme.streams(manifest.num_layers)):
        for row, n in enumerate(lengths):
            k, v = (
                _decode_row(manifest.scheme, tq, row, int(n), (static or {}).get(layer, {}).get(part),
                            {role: tensors.get(tensor_name(direction, layer, part, role))
                             for role in ("sinks", "codes", "scales", "zero_points", "recent")})
                for part, tq in zip(PARTS, streams)
            )
            rows[row].append((k, v))
    return rows


def _decode_row(scheme, tq, row: int, n: int, static_meta, arrays) -> np.ndarray:
    """One row of one stream -> float32 [H, n, D] (sinks, quantized, recent in token order)."""
    import torch

    def last(role: str, count: int) -> torch.Tensor:  # the row's right-aligned valid entries
        array = arrays[role][row]
        return torch.from_numpy(np.ascontiguousarray(array[:, array.shape[1] - count:]))

    sinks, quantized, recent = split_lengths(tq, scheme, n)
    pieces = []
    if tq.quantized:
        pieces.append(last("sinks", sinks).float())
        if quantized:
            pieces.append(_dequantize_region(tq, last, quantized, static_meta))
    pieces.append(last("recent", recent).float())
    return torch.cat(pieces, dim=1).numpy()


def buffer_codes_to_kvq(tq, stored: np.ndarray) -> np.ndarray:
    """A ``buffer`` layout's stored codes -> kvq's stored (packed) int_sym codes, uint8.

    8-bit buffers hold int8 ``q``; kvq stores ``q + 128`` (the same byte with its top bit flipped).
    4-bit buffers already hold kvq's packing (``q + 8`` per nibble, low nibble first).
    """
    if tq.bits == 8:
        return (np.asarray(stored).view(np.uint8) ^ np.uint8(0x80)).astype(np.uint8)
    return np.asarray(stored, dtype=np.uint8)


def _decode_buffer_row(tq, stored: np.ndarray, static_meta) -> np.ndarray:
    """One row of a ``buffer`` stream (its valid positions) -> float32 [H, n, D]."""
    import torch

    if not tq.quantized:
        return np.asarray(stored, dtype=np.float32)
    codes = torch.from_numpy(np.ascontiguousarray(buffer_codes_to_kvq(tq, stored)))
    return _dequantize_region(tq, lambda role, count: codes, int(stored.shape[1]), static_meta).numpy()


def _dequantize_region(tq, last, count: int, static_meta):
    """One row's quantized region -> float32 [H, count, D] through the reference codec."""
    import torch

    from kvq_export.reference.codec import TORCH_DTYPES, Quantized, dequantize_packed

    codes = last("codes", count)
    if tq.format == "fp8_e4m3" and codes.dtype == torch.uint8:  # raw bits as ONNX Runtime returns them
        codes = codes.view(torch.float8_e4m3fn)
    if tq.scales == "static":  # [H, n], shared by every row, stored rounded to scale_dtype
        sdtype = TORCH_DTYPES[tq.scale_dtype]
        scales = torch.as_tensor(static_meta["scales"]).to(sdtype)
        zeros = torch.as_tensor(static_meta["zero_points"]).to(sdtype) if tq.has_zero_point else None
    else:
        groups = count if tq.axis == "token" else count // tq.group_size
        scales = last("scales", groups)[None]
        zeros = last("zero_points", groups)[None] if tq.has_zero_point else None
    return dequantize_packed(Quantized(codes[None], scales, zeros), tq)[0]
