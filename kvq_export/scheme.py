"""`KVQuantScheme`: the one frozen, validated description of a quantized KV cache.

Everything in kvq (reference cache, memory model, exporter, runtime, plugin, validator) takes this
object; nothing re-describes a cache on its own. Keys and values are described separately by a
:class:`TensorQuant` because their errors act at different places in attention (keys before softmax,
values after it).

Token layout of one sequence of length T in one layer (for keys and values independently)::

    [ sinks (first S tokens, high precision) | quantized region | recent window (high precision) ]

* ``token`` axis (and every ``static``-scale stream): a token is quantized as soon as it is older than
  the ``residual_length`` R most recent tokens, so exactly ``min(R, T - S)`` tokens stay in high precision.
* ``channel`` axis with dynamic scales: tokens leave the recent window a whole group of ``group_size``
  consecutive tokens at a time (the group's per-channel range needs all of them), so between R and
  R + group_size - 1 tokens stay in high precision.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvq_export._read import parse_json
from kvq_export.dtypes import DType
from kvq_export.errors import SchemeError
from kvq_export.rotation import check_rotation
from kvq_export.scheme_rules import GGML_TYPES, HP_DTYPES, check_tensor_quant, fail, pack_unit
from kvq_export.vocab import Axis, Format, Part, Quantizer, Rotation, ScaleMode, plain

if TYPE_CHECKING:
    from kvq_export.model_facts import CacheGeometry

@dataclass(frozen=True)
class TensorQuant:
    """How one cache tensor (keys or values) is stored.

    Attributes:
        format: ``fp16`` (not quantized), ``int`` (asymmetric: per-group scale and minimum),
            ``int_sym`` (symmetric: per-group scale, codes stored with an offset of 2**(bits-1)),
            ``fp8_e4m3`` (float8 e4m3fn codes with a per-group scale).
        bits: 2, 3, 4, 6 or 8 for int formats (4, 5 or 8 with the ggml quantizer); 8 for fp8; 16 for fp16.
        axis: ``token`` (groups run along head_dim within one token) or ``channel`` (each channel is
            grouped across ``group_size`` consecutive tokens).
        group_size: group length along the axis, or ``None`` for the whole axis (per-token head
            vector for ``token``; all tokens of a channel for ``channel``, static scales only).
        scale_dtype: storage dtype of scales and minimums.
        clip: the group's range is shrunk by this ratio about its midpoint (symmetric: ``amax * clip``).
        scales: ``dynamic`` (from each group as tokens arrive) or ``static`` (fixed per layer, head and
            channel/group, from a calibration artifact kept beside the scheme).
        quantizer: the rule that picks scales and codes. ``kvq``: round-half-even codes against the
            stored (rounded) metadata, symmetric formats on ``2**(bits-1) - 1`` levels each side.
            ``ggml``: llama.cpp's reference quantizers bit for bit (:data:`GGML_TYPES`: ``int_sym`` 4/5/8 =
            q4_0/q5_0/q8_0, ``int`` 4/5 = q4_1/q5_1; token axis, groups of 32, fp16 dynamic scales, no
            clip). Dequantization is the same for both: ``(code - offset) * scale`` or ``code * scale + min``.
        rotation: ``none`` or ``hadamard``: the stream is stored in a rotated basis ``x @ R``
            (:mod:`kvq_export.rotation`; keys: q and k rotated after RoPE; values: v rotated before it is
            stored and the attention output rotated back). Allowed for unquantized streams too (a no-op
            in exact arithmetic).
        high_channels: per-channel (``axis: channel``) ``int`` / ``int_sym`` streams only: this many channels
            of each kv head are stored with 8-bit codes instead of ``bits``. Which channels is model data,
            chosen by calibration (the ones whose error moves attention scores most: largest
            ``E[q_c²] · range_c²``) and kept in the calibration artifact beside the scheme as
            ``high_channels`` ``[kv_heads, n]`` (ascending). A channel's code range is its own (``int``:
            ``2**8 - 1`` or ``2**bits - 1`` steps over the group's range; ``int_sym``: ``±127`` or
            ``±(2**(bits-1) - 1)``, with static scales too), so dequantization stays ``code * scale + min`` or
            ``(code - offset) * scale`` with the channel's own offset. 0: every channel at ``bits``.
        residual_length: this stream's own recent window (tokens kept in ``hp_dtype`` before they are
            quantized), in place of the scheme's ``residual_length``; ``None``: the scheme's. Keys and values
            can then keep different windows (a short window of exact values is cheap and protects the recent
            tokens that local heads read most; per-channel keys already keep their partial group).
    """

    format: Format = Format.INT
    bits: int = 4
    axis: Axis = Axis.TOKEN
    group_size: int | None = None
    scale_dtype: str = "fp16"
    clip: float = 1.0
    scales: ScaleMode = ScaleMode.DYNAMIC
    quantizer: Quantizer = Quantizer.KVQ
    rotation: Rotation = Rotation.NONE
    high_channels: int = 0
    residual_length: int | None = None

    def __post_init__(self) -> None:
        check_tensor_quant(self)

    # -- derived facts ---------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        """False for the unquantized ``fp16`` format."""
        return self.format != Format.FP16

    @property
    def has_zero_point(self) -> bool:
        """Asymmetric int stores a per-group minimum beside the scale."""
        return self.format == Format.INT

    @property
    def is_int(self) -> bool:
        """Integer codes (packed when bits < 8)."""
        return self.format in (Format.INT, Format.INT_SYM)

    @property
    def streaming(self) -> bool:
        """Whether tokens are quantized one at a time (token axis or static scales)."""
        return self.axis == Axis.TOKEN or self.scales == ScaleMode.STATIC

    @property
    def flush_unit(self) -> int:
        """How many tokens leave the recent window together (1, or a channel-axis group)."""
        return 1 if self.streaming else int(self.group_size)  # type: ignore[arg-type]

    def token_group(self, head_dim: int) -> int:
        """Group length along head_dim for ``token``-axis streams (whole head vector when None)."""
        return head_dim if self.group_size is None else self.group_size

    def packed_dim(self, head_dim: int) -> int:
        """Bytes per token per head for the code payload (3/5/6 bits: two planes; high channels: one byte each)."""
        if not self.quantized:
            return 0
        if not self.is_int:
            return head_dim
        # 8-bit high channels first, then the others packed in their planes (see the codec)
        return self.high_channels + (head_dim - self.high_channels) * self.bits // 8

    @property
    def ggml_type(self) -> str | None:
        """The ggml block type this stream reproduces (``q4_0`` ...), None for the kvq quantizer."""
        return GGML_TYPES.get((self.format, self.bits)) if self.quantizer == Quantizer.GGML else None

    def metadata_shape(self, head_dim: int) -> tuple[str, int]:
        """(``per_token`` | ``per_group_of_tokens`` | ``per_layer``, entries per unit) for scales.

        ``per_token``: ``head_dim // group`` scales per token; ``per_group_of_tokens``: ``head_dim``
        scales per ``group_size`` tokens; ``per_layer``: static, per kv head, independent of length.
        """
        if self.scales == ScaleMode.STATIC:
            return "per_layer", (head_dim // self.token_group(head_dim) if self.axis == Axis.TOKEN else head_dim)
        if self.axis == Axis.TOKEN:
            return "per_token", head_dim // self.token_group(head_dim)
        return "per_group_of_tokens", head_dim

    def effective_bits(self, head_dim: int, hp_dtype: str = "fp16") -> float:
        """Stored bits per element ignoring windows (static scales add nothing per element)."""
        if not self.quantized:
            return 8.0 * DType.get(hp_dtype).itemsize
        meta_bits = 8 * DType.get(self.scale_dtype).itemsize * (2 if self.has_zero_point else 1)
        code_bits = self.bits + self.high_channels * (8 - self.bits) / head_dim
        if self.scales == ScaleMode.STATIC:
            return code_bits
        group = self.token_group(head_dim) if self.axis == Axis.TOKEN else self.group_size
        return code_bits + meta_bits / group  # type: ignore[operator]

    # -- validation ------------------------------------------------------------------------------
    def check_head_dim(self, head_dim: int, where: str) -> None:
        """Raise when this stream cannot describe a cache with ``head_dim`` channels."""
        if self.rotation != Rotation.NONE:
            check_rotation(self.rotation, head_dim, where)
        if not self.quantized:
            return
        if self.axis == Axis.TOKEN and self.group_size is not None and head_dim % self.group_size:
            raise fail(
                f"{where}.group_size", self.group_size,
                f"for axis=token it must divide head_dim={head_dim} (allowed: "
                f"{', '.join(str(d) for d in range(1, head_dim + 1) if head_dim % d == 0)}, or null)",
            )
        if not self.is_int:
            return
        unit = pack_unit(self.bits)
        if head_dim % unit:
            raise fail(f"{where}.bits", self.bits, f"{self.bits}-bit codes fill whole bytes in groups of {unit} "
                        f"channels; head_dim={head_dim} is not a multiple of {unit}")
        if self.high_channels and (self.high_channels >= head_dim or (head_dim - self.high_channels) % unit):
            raise fail(f"{where}.high_channels", self.high_channels,
                        f"allowed for head_dim={head_dim} and {self.bits}-bit codes: 1..{head_dim - unit} "
                        f"leaving a multiple of {unit} channels to pack")

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (``high_channels``, ``residual_length`` only when set: older schemes read as before)."""
        data = {name: plain(value) for name, value in dataclasses.asdict(self).items()}
        if not self.high_channels:
            del data["high_channels"]
        if self.residual_length is None:
            del data["residual_length"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "tensor") -> TensorQuant:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming the allowed ones."""
        if not isinstance(data, Mapping):
            raise SchemeError(f"invalid {where}: expected an object with fields {', '.join(_TQ_FIELDS)}")
        unknown = sorted(set(data) - set(_TQ_FIELDS))
        if unknown:
            raise SchemeError(f"unknown field(s) {', '.join(unknown)} in {where}; allowed: {', '.join(_TQ_FIELDS)}")
        try:
            return cls(**data)
        except SchemeError as err:
            raise SchemeError(f"{where}: {err}") from None

    @classmethod
    def fp16(cls) -> TensorQuant:
        """The unquantized stream."""
        return cls(format=Format.FP16, bits=16)

    def describe(self) -> str:
        """Short human description, e.g. ``int4 asym token g32 fp16-scale``."""
        rotation = "" if self.rotation == Rotation.NONE else f" rot-{self.rotation}"
        if not self.quantized:
            return f"fp16{rotation}"
        if self.ggml_type:
            return f"ggml {self.ggml_type}{rotation}"
        name = {Format.INT: f"int{self.bits}", Format.INT_SYM: f"int{self.bits} sym",
                Format.FP8_E4M3: "fp8 e4m3"}[self.format]
        group = "whole" if self.group_size is None else f"g{self.group_size}"
        clip = "" if self.clip == 1.0 else f" clip{self.clip:g}"
        high = f" +{self.high_channels}ch-int8" if self.high_channels else ""
        recent = "" if self.residual_length is None else f" recent{self.residual_length}"
        return f"{name}{high} {self.axis} {group} {self.scale_dtype}-scale {self.scales}{clip}{rotation}{recent}"


_TQ_FIELDS = tuple(f.name for f in dataclasses.fields(TensorQuant))
#: Fields that mean nothing for an unquantized stream, with the only values it may carry.
#: Fields that mean nothing on an unquantized stream (rotation does: an fp16 stream may be stored rotated).

@dataclass(frozen=True)
class LayerOverride:
    """Per-layer replacement of the key and/or value description (mixed precision across layers)."""

    layer: int
    key: TensorQuant | None = None
    value: TensorQuant | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise fail("layer_overrides.layer", self.layer, "allowed: a layer index >= 0")
        if self.key is None and self.value is None:
            raise fail("layer_overrides", self.layer, "an override must set key, value or both")


@dataclass(frozen=True)
class KVQuantScheme:
    """A whole quantized KV cache: key/value streams, windows and per-layer overrides.

    Frozen and hashable; equality ignores ``name`` (a label, not part of the cache format).
    """

    key: TensorQuant = field(default_factory=TensorQuant.fp16)
    value: TensorQuant = field(default_factory=TensorQuant.fp16)
    residual_length: int = 0
    sink_tokens: int = 0
    hp_dtype: str = "fp16"
    layer_overrides: tuple[LayerOverride, ...] = ()
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for label, count in (("residual_length", self.residual_length), ("sink_tokens", self.sink_tokens)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise fail(label, count, "allowed: an integer >= 0")
        if not isinstance(self.hp_dtype, str) or self.hp_dtype not in HP_DTYPES:
            raise fail("hp_dtype", self.hp_dtype, f"allowed: {', '.join(HP_DTYPES)}")
        if self.name is not None and not isinstance(self.name, str):
            raise fail("name", self.name, "allowed: a string or null")
        overrides = tuple(sorted(self.layer_overrides, key=lambda o: o.layer))
        layers = [o.layer for o in overrides]
        if len(set(layers)) != len(layers):
            raise fail("layer_overrides", layers, "each layer may be overridden once")
        object.__setattr__(self, "layer_overrides", overrides)
        for layer in range(-1, len(overrides)):
            key, value = (self.key, self.value) if layer < 0 else self.for_layer(overrides[layer].layer)
            for where, tq in (("key", key), ("value", value)):
                residual = self.residual_for(tq)
                if tq.quantized and not tq.streaming and residual % tq.flush_unit:
                    label = "residual_length" if tq.residual_length is None else f"{where}.residual_length"
                    raise fail(
                        label, residual,
                        f"with {where}.axis=channel it must be a multiple of group_size={tq.group_size}",
                    )

    # -- per-layer view --------------------------------------------------------------------------
    def residual_for(self, tq: TensorQuant) -> int:
        """The recent window of stream ``tq``: its own ``residual_length``, else the scheme's."""
        return self.residual_length if tq.residual_length is None else tq.residual_length

    def for_layer(self, layer: int) -> tuple[TensorQuant, TensorQuant]:
        """(key, value) descriptions in force for ``layer``."""
        for override in self.layer_overrides:
            if override.layer == layer:
                return override.key or self.key, override.value or self.value
        return self.key, self.value

    def streams(self, num_layers: int) -> list[tuple[TensorQuant, TensorQuant]]:
        """(key, value) for every layer of a model."""
        return [self.for_layer(i) for i in range(num_layers)]

    @property
    def quantized(self) -> bool:
        """True when any stream of any layer is quantized."""
        tqs = [self.key, self.value] + [t for o in self.layer_overrides for t in (o.key, o.value) if t]
        return any(t.quantized for t in tqs)

    @property
    def has_static_scales(self) -> bool:
        """True when any stream's scales are static (fixed per layer, not stored per token)."""
        tqs = [self.key, self.value] + [t for o in self.layer_overrides for t in (o.key, o.value) if t]
        return any(t.quantized and t.scales == ScaleMode.STATIC for t in tqs)

    @property
    def needs_calibration(self) -> bool:
        """True when any stream needs a calibration artifact (static scales, or chosen high channels)."""
        tqs = [self.key, self.value] + [t for o in self.layer_overrides for t in (o.key, o.value) if t]
        return any(t.quantized and (t.scales == ScaleMode.STATIC or t.high_channels) for t in tqs)

    def check_model(self, geometry: CacheGeometry) -> None:
        """Raise when the scheme cannot describe the cache of the model of ``geometry`` (group sizes, layer indices)."""
        num_layers, head_dim = geometry.num_layers, geometry.head_dim
        for override in self.layer_overrides:
            if override.layer >= num_layers:
                raise fail(
                    "layer_overrides.layer", override.layer, f"the model has layers 0..{num_layers - 1}"
                )
        for layer, (key, value) in enumerate(self.streams(num_layers)):
            where = "" if layer == 0 and not self.layer_overrides else f"layer {layer} "
            key.check_head_dim(head_dim, f"{where}key")
            value.check_head_dim(head_dim, f"{where}value")

    def effective_bits(self, head_dim: int, num_layers: int = 1) -> float:
        """Mean stored bits per element, ignoring sinks and the recent window."""
        streams = self.streams(num_layers)
        total = sum(k.effective_bits(head_dim, self.hp_dtype) + v.effective_bits(head_dim, self.hp_dtype)
                    for k, v in streams)
        return total / (2 * len(streams))

    def describe(self) -> str:
        """One-line human description."""
        text = f"K: {self.key.describe()} | V: {self.value.describe()}"
        if self.residual_length:
            text += f" | recent {self.residual_length}"
        if self.sink_tokens:
            text += f" | sinks {self.sink_tokens}"
        if self.layer_overrides:
            text += f" | {len(self.layer_overrides)} layer override(s)"
        return text

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (stable key order)."""
        return {
            "name": self.name,
            "key": self.key.to_dict(),
            "value": self.value.to_dict(),
            "residual_length": self.residual_length,
            "sink_tokens": self.sink_tokens,
            "hp_dtype": self.hp_dtype,
            "layer_overrides": [
                {"layer": o.layer, **({"key": o.key.to_dict()} if o.key else {}),
                 **({"value": o.value.to_dict()} if o.value else {})}
                for o in self.layer_overrides
            ],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text; :meth:`from_json` inverts it exactly."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVQuantScheme:
        """Build and validate from the plain-JSON form."""
        if not isinstance(data, Mapping):
            raise SchemeError("invalid scheme: expected a JSON object")
        unknown = sorted(set(data) - set(_SCHEME_FIELDS))
        if unknown:
            raise SchemeError(
                f"unknown field(s) {', '.join(unknown)} in scheme; allowed: {', '.join(_SCHEME_FIELDS)}"
            )
        overrides = []
        if not isinstance(data.get("layer_overrides") or [], (list, tuple)):
            raise fail("layer_overrides", data["layer_overrides"], "allowed: a list of {layer, key, value} objects")
        for i, item in enumerate(data.get("layer_overrides") or ()):
            if not isinstance(item, Mapping) or "layer" not in item:
                raise SchemeError(f"invalid layer_overrides[{i}]: expected an object with 'layer' and key/value")
            extra = sorted(set(item) - {"layer", "key", "value"})
            if extra:
                raise SchemeError(
                    f"unknown field(s) {', '.join(extra)} in layer_overrides[{i}]; allowed: layer, key, value")
            overrides.append(LayerOverride(
                layer=item["layer"],
                key=TensorQuant.from_dict(item["key"], f"layer_overrides[{i}].key") if "key" in item else None,
                value=TensorQuant.from_dict(item["value"], f"layer_overrides[{i}].value") if "value" in item else None,
            ))
        kwargs = {k: data[k] for k in ("residual_length", "sink_tokens", "hp_dtype", "name") if k in data}
        for part in Part:
            if part in data:
                kwargs[part] = TensorQuant.from_dict(data[part], part)
        return cls(layer_overrides=tuple(overrides), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> KVQuantScheme:
        """Parse JSON text (see :meth:`to_json`)."""
        return cls.from_dict(parse_json(text, "scheme", error=SchemeError))  # bounded integers and nesting

    def with_name(self, name: str | None) -> KVQuantScheme:
        """Same scheme, another label."""
        return dataclasses.replace(self, name=name)


_SCHEME_FIELDS = ("name", "key", "value", "residual_length", "sink_tokens", "hp_dtype", "layer_overrides")


def bits_label(bits: float) -> str:
    """Format effective bits compactly (``4.5``, ``8``, ``5.25``)."""
    return f"{bits:.3f}".rstrip("0").rstrip(".") if not math.isinf(bits) else "inf"
