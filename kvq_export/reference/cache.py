"""The reference quantized KV cache: ground truth for every backend.

:class:`StreamCache` holds the keys *or* the values of one layer for ``batch x kv_heads`` and follows the scheme
exactly: :meth:`~StreamCache.append` takes new tokens ``[B, H, t, D]``, :meth:`~StreamCache.tensors` returns what is
stored by role (the ``regions`` layout: ``sinks``, ``codes``, ``scales``, ``zero_points``, ``recent``; a static
stream's scales ``[H, n]``), :meth:`~StreamCache.dequantized` what attention reads ``[B, H, T, D]`` in token order.
A rotated stream stores ``x @ R``; ``basis`` (:class:`~kvq_export.vocab.Basis`) says whether tokens go in and come
out in the model's basis (the default) or as stored. :class:`LayerCache` pairs a layer's two streams and
:class:`ReferenceCache` holds every layer of one scheme, with the calibrated static metadata.

The order of rounding, sinks, window and flushes, and of rotation: docs/concepts/flavours.md#the-reference-cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvq_export.dtypes import DType
from kvq_export.errors import QuantizationError
from kvq_export.reference.codec import Quantized, check_finite, dequantize_packed, quantize_packed
from kvq_export.region_split import REGION_ROLES, RegionSplit
from kvq_export.rotation import rotate_torch, rotation_matrix
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Basis, Format, Part, ScaleMode, parse_enum

ROLES = REGION_ROLES


class StreamCache:
    """Keys or values of one layer (see the module docstring for the layout)."""

    def __init__(
        self,
        tq: TensorQuant,
        scheme: KVQuantScheme,
        *,
        static_scales: torch.Tensor | None = None,
        static_zeros: torch.Tensor | None = None,
        high_channels: torch.Tensor | None = None,
    ) -> None:
        self.tq = tq
        self.scheme = scheme
        self.split = RegionSplit.of(tq, scheme)
        self.hp_dtype = DType.get(scheme.hp_dtype).torch
        self._static: dict[str, torch.Tensor] = {}
        if tq.quantized and tq.scales == ScaleMode.STATIC:
            if static_scales is None or (tq.has_zero_point and static_zeros is None):
                raise QuantizationError("a static-scale stream needs its calibrated scales (and zero points)")
            sdtype = DType.get(tq.scale_dtype).torch
            self._static["static_scales"] = static_scales.to(sdtype)
            if tq.has_zero_point:
                self._static["static_zeros"] = static_zeros.to(sdtype)
        if tq.quantized and tq.high_channels:
            if high_channels is None:
                raise QuantizationError(f"a stream with {tq.high_channels} high channels per head needs their "
                                        "calibrated indices (high_channels [kv_heads, n])")
            self._static["high_channels"] = torch.as_tensor(high_channels).to(torch.int64)
        self.sinks: torch.Tensor | None = None
        self.recent: torch.Tensor | None = None
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.zeros: torch.Tensor | None = None
        self.rotation = None  # R [D, D] (numpy float64) of a rotated stream, set with the first tokens
        self._dequantized: torch.Tensor | None = None  # fp32 copy of the quantized region, grown per flush

    # -- state -------------------------------------------------------------------------------------
    @property
    def high_channels(self) -> torch.Tensor | None:
        """The calibrated ``[H, n]`` int64 high channels of the stream (None without them)."""
        return self._static.get("high_channels")

    @property
    def length(self) -> int:
        """Tokens held (all regions)."""
        if self.recent is None:
            return 0
        return self.sinks.shape[2] + self.quantized_length + self.recent.shape[2]

    @property
    def quantized_length(self) -> int:
        """Tokens in the quantized region."""
        return 0 if self.codes is None else self.codes.shape[2]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Stored tensors by role (only the roles this stream has; none while it holds no token)."""
        if self.length == 0:
            return {}
        if not self.tq.quantized:
            return {"recent": self.recent}
        out = {"sinks": self.sinks, "codes": self.codes}
        out["scales"] = self._static.get("static_scales", self.scales)
        if self.tq.has_zero_point:
            out["zero_points"] = self._static.get("static_zeros", self.zeros)
        out["recent"] = self.recent
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    # -- update ------------------------------------------------------------------------------------
    def _init_storage(self, x: torch.Tensor) -> None:
        batch, heads, _, dim = x.shape
        self.tq.check_head_dim(dim, "stream")
        self.rotation = rotation_matrix(self.tq.rotation, dim)
        empty = x.new_empty((batch, heads, 0, dim), dtype=self.hp_dtype)
        self.sinks, self.recent = empty, empty.clone()
        if not self.tq.quantized:
            return
        code_dtype = torch.float8_e4m3fn if self.tq.format == Format.FP8_E4M3 else torch.uint8
        self.codes = x.new_empty((batch, heads, 0, self.tq.packed_dim(dim)), dtype=code_dtype)
        self._dequantized = x.new_empty((batch, heads, 0, dim), dtype=torch.float32)
        if self.tq.scales == ScaleMode.DYNAMIC:
            kind, entries = self.tq.metadata_shape(dim)
            sdtype = DType.get(self.tq.scale_dtype).torch
            self.scales = x.new_empty((batch, heads, 0, entries), dtype=sdtype)
            self.zeros = self.scales.clone() if self.tq.has_zero_point else None

    def append(self, x: torch.Tensor, *, basis: Basis = Basis.MODEL) -> None:
        """Append ``x`` of shape ``[B, H, t, D]`` (t >= 0 new tokens, any float dtype).

        ``basis="model"``: ``x`` is rotated first when the stream is; ``"stored"``: ``x`` is already rotated.
        """
        basis = parse_enum(Basis, basis, "basis", QuantizationError)
        if x.dim() != 4:
            raise QuantizationError(f"expected new tokens as [batch, kv_heads, tokens, head_dim], got {list(x.shape)}")
        if self.recent is None:
            self._init_storage(x)
        elif x.shape[:2] != self.recent.shape[:2] or x.shape[3] != self.recent.shape[3]:
            raise QuantizationError(
                f"new tokens of shape {list(x.shape)} do not match the cache's {list(self.recent.shape)}"
            )
        check_finite(x)
        if basis is Basis.MODEL:
            x = rotate_torch(x, self.rotation)
        x = x.to(self.hp_dtype)
        if not self.tq.quantized:
            self.recent = torch.cat([self.recent, x], dim=2)
            return
        take = min(self.scheme.sink_tokens - self.sinks.shape[2], x.shape[2])
        if take > 0:
            self.sinks = torch.cat([self.sinks, x[:, :, :take]], dim=2)
            x = x[:, :, take:]
        recent = torch.cat([self.recent, x], dim=2)
        flush = self.split.flush(recent.shape[2])
        if flush:
            self._store(recent[:, :, :flush])
        self.recent = recent[:, :, flush:]

    def _store(self, tokens: torch.Tensor) -> None:
        q = quantize_packed(tokens, self.tq, **self._static)
        self.codes = torch.cat([self.codes, q.codes], dim=2)
        if self.tq.scales == ScaleMode.DYNAMIC:
            self.scales = torch.cat([self.scales, q.scales], dim=2)
            if q.zeros is not None:
                self.zeros = torch.cat([self.zeros, q.zeros], dim=2)
        deq = dequantize_packed(q, self.tq, high_channels=self.high_channels)
        self._dequantized = torch.cat([self._dequantized, deq], dim=2)

    # -- read --------------------------------------------------------------------------------------
    def quantized_region(self) -> Quantized | None:
        """The quantized region as stored (packed codes + metadata), or None when empty/unquantized."""
        if not self.tq.quantized or self.codes is None:
            return None
        t = self.tensors()
        return Quantized(t["codes"], t["scales"], t.get("zero_points"))

    def dequantized(self, dtype: torch.dtype = torch.float32, *, basis: Basis = Basis.MODEL) -> torch.Tensor:
        """What attention sees: ``[B, H, T, D]``, tokens in their original order.

        ``basis="model"`` un-rotates a rotated stream (``y @ R.T`` in float32); ``"stored"`` does not.
        """
        basis = parse_enum(Basis, basis, "basis", QuantizationError)
        if self.recent is None:
            raise QuantizationError("the cache is empty")
        if not self.tq.quantized:
            out = self.recent
        else:
            out = torch.cat([self.sinks.float(), self._dequantized, self.recent.float()], dim=2)
        if basis is Basis.MODEL and self.rotation is not None:
            out = rotate_torch(out, self.rotation, inverse=True)
        return out.to(dtype)


@dataclass
class LayerCache:
    """Keys and values of one layer."""

    key: StreamCache
    value: StreamCache

    def update(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None):
        """Append new K/V ``[B, H, t, D]``; return the dequantized K/V for attention."""
        self.key.append(k)
        self.value.append(v)
        out = dtype or k.dtype
        return self.key.dequantized(out), self.value.dequantized(out)

    @property
    def nbytes(self) -> int:
        """Bytes stored by both streams."""
        return self.key.nbytes + self.value.nbytes


StaticScales = Mapping[int, Mapping[str, Mapping[str, torch.Tensor]]]
"""``{layer: {"key"|"value": {"scales": [H, n], "zero_points": [H, n], "high_channels": [H, n]}}}`` from
calibration (each stream has the roles its scheme needs)."""


class ReferenceCache:
    """The model-level reference cache: one :class:`LayerCache` per layer, driven by one scheme."""

    def __init__(self, scheme: KVQuantScheme, num_layers: int, static: StaticScales | None = None) -> None:
        self.scheme = scheme
        self.layers: list[LayerCache] = []
        for layer, streams in enumerate(scheme.streams(num_layers)):
            made = []
            for part, tq in zip(Part, streams):
                meta = (static or {}).get(layer, {}).get(part, {})
                made.append(StreamCache(tq, scheme, static_scales=meta.get("scales"),
                                        static_zeros=meta.get("zero_points"),
                                        high_channels=meta.get("high_channels")))
            self.layers.append(LayerCache(*made))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None):
        """Append to ``layer`` and return its dequantized K/V."""
        return self.layers[layer].update(k, v, dtype)

    @property
    def seq_length(self) -> int:
        """Tokens held (layer 0)."""
        return self.layers[0].key.length if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by every stored tensor of every layer."""
        return sum(layer.nbytes for layer in self.layers)

    def nbytes_by_role(self) -> dict[str, int]:
        """Stored bytes summed per role over all layers and both streams."""
        out = dict.fromkeys(ROLES, 0)
        for layer in self.layers:
            for stream in (layer.key, layer.value):
                for role, tensor in stream.tensors().items():
                    out[role] += tensor.numel() * tensor.element_size()
        return out

