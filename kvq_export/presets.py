"""Named schemes: one table, listed by ``kvq schemes``.

Defaults everywhere unless a row says otherwise: fp16 scales, dynamic scales, no recent window,
no sinks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvq_export._read import read_text, warn_shadowed
from kvq_export.errors import SchemeError
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.scheme_rules import INT_BITS

_FP16 = TensorQuant.fp16()


def _int(bits: int, group: int | None, *, sym: bool, axis: str = "token", **kw) -> TensorQuant:
    return TensorQuant(format="int_sym" if sym else "int", bits=bits, axis=axis, group_size=group, **kw)


def _kivi(bits: int) -> KVQuantScheme:
    return KVQuantScheme(
        key=_int(bits, 32, sym=False, axis="channel"), value=_int(bits, 32, sym=False), residual_length=128
    )


def _kivi_r0(key_bits: int, value_bits: int, group: int) -> KVQuantScheme:
    # KIVI's split without its recent window: keys per-channel (groups of `group` tokens), values per-token.
    # Only the tokens of a partial key group stay in fp16 (fewer than `group`).
    return KVQuantScheme(key=_int(key_bits, group, sym=False, axis="channel"),
                         value=_int(value_bits, group, sym=False), residual_length=0)


def _ggml(kind: str) -> TensorQuant:
    fmt, bits = {"q4_0": ("int_sym", 4), "q4_1": ("int", 4), "q5_0": ("int_sym", 5), "q5_1": ("int", 5),
                 "q8_0": ("int_sym", 8)}[kind]
    return TensorQuant(format=fmt, bits=bits, group_size=32, quantizer="ggml")


def _rotated(tq: TensorQuant) -> TensorQuant:
    return dataclasses.replace(tq, rotation="hadamard")


def _ort(bits: int, *, key_zero_points: bool = False, value_zero_points: bool = False,
         high_channels: int = 0) -> KVQuantScheme:
    # GroupQueryAttention's quantized cache: static float32 scales per (kv head, channel); streams with zero
    # points reach the node as symmetric codes through an offset (keys' after RoPE; values' added back to the
    # node's output), 8-bit high channels as two nibbles of a wider node head (see the ort-gqa flavor).
    def stream(zero_points: bool):
        return _int(bits, None, sym=not zero_points, axis="channel", scales="static", scale_dtype="fp32",
                    high_channels=high_channels)

    return KVQuantScheme(key=stream(key_zero_points), value=stream(value_zero_points))


#: name -> (scheme, one-line description). The single source of preset truth.
PRESETS: dict[str, tuple[KVQuantScheme, str]] = {
    "fp16": (KVQuantScheme(key=_FP16, value=_FP16), "baseline: unquantized fp16 cache"),
    "int8": (
        KVQuantScheme(key=_int(8, None, sym=True), value=_int(8, None, sym=True)),
        "symmetric int8, one scale per token head vector",
    ),
    "int8-sym-g32": (
        KVQuantScheme(key=_int(8, 32, sym=True), value=_int(8, 32, sym=True)),
        "int8 sym (255 levels, round-half-even), token groups of 32",
    ),
    "int8-sym-g32-rot": (
        KVQuantScheme(key=_rotated(_int(8, 32, sym=True)), value=_rotated(_int(8, 32, sym=True))),
        "int8 sym (255 levels), token groups of 32, in a Hadamard-rotated basis: the most accurate 8-bit class",
    ),
    "int4-sym-g32": (
        KVQuantScheme(key=_int(4, 32, sym=True), value=_int(4, 32, sym=True)),
        "int4 sym (15 levels: amax/7, codes -7..7), token groups of 32",
    ),
    "int4-g32": (
        KVQuantScheme(key=_int(4, 32, sym=False), value=_int(4, 32, sym=False)),
        "int4 with min (round-half-even), token groups of 32",
    ),
    # llama.cpp's block formats, bit-exact with ggml's reference quantizers, without rotation.
    **{kind: (KVQuantScheme(key=_ggml(kind), value=_ggml(kind)), f"ggml {kind} (exact), unrotated")
       for kind in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")},
    "k-q8_0-v-q4_0": (
        KVQuantScheme(key=_ggml("q8_0"), value=_ggml("q4_0")),
        "mixed K/V like llama.cpp -ctk q8_0 -ctv q4_0 (exact), unrotated",
    ),
    # The same formats stored in a Hadamard-rotated basis, as llama.cpp stores a quantized cache.
    **{f"{kind}-rot": (KVQuantScheme(key=_rotated(_ggml(kind)), value=_rotated(_ggml(kind))),
                       f"ggml {kind} (exact) in a Hadamard-rotated basis, like llama.cpp")
       for kind in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")},
    "k-q8_0-v-q4_0-rot": (
        KVQuantScheme(key=_rotated(_ggml("q8_0")), value=_rotated(_ggml("q4_0"))),
        "mixed K q8_0 / V q4_0 (exact) in a Hadamard-rotated basis, like llama.cpp",
    ),
    "kivi-4-r0": (_kivi_r0(4, 4, 32), "keys per-channel / values per-token int4 g32, no recent window"),
    "kivi-4-r0-g64": (_kivi_r0(4, 4, 64), "keys per-channel / values per-token int4 g64, no recent window"),
    "k8v4-r0-g64": (_kivi_r0(8, 4, 64), "mixed: keys int8 per-channel g64 / values int4 per-token g64, no window"),
    # The most accurate uniform schemes per class on SmolLM2 (models/smollm2.md): per-channel keys (int4 with
    # the 4 channels per head that move scores most at 8 bits, chosen by calibration at export), values
    # per-token in the rotated basis. No window, except in the 3.5-bit class: 2-bit values that keep their 64
    # newest tokens exact (0.1 bits/element at 4096 tokens; at 512 the window is an eighth of the cache).
    "k-int4-hc4-v-q4_0-rot": (
        KVQuantScheme(key=_int(4, 128, sym=False, axis="channel", high_channels=4), value=_rotated(_ggml("q4_0"))),
        "keys int4 per-channel g128 with 4 calibrated 8-bit channels per head / values ggml q4_0 rotated",
    ),
    "k-int6-v-int6-rot": (
        KVQuantScheme(key=_int(6, 128, sym=False, axis="channel"), value=_rotated(_int(6, 32, sym=True))),
        "keys int6 per-channel g128 / values int6 sym per-token g32 rotated",
    ),
    "k-int3-v-int3-rot": (
        KVQuantScheme(key=_int(3, 64, sym=False, axis="channel"),
                      value=_rotated(_int(3, 64, sym=False, clip=0.85))),
        "keys int3 per-channel g64 / values int3 per-token g64 rotated, range clipped to 0.85",
    ),
    "k-int4-v-int2-rot-r64": (
        KVQuantScheme(key=_int(4, 128, sym=False, axis="channel"),
                      value=_rotated(_int(2, 64, sym=False, clip=0.8, residual_length=64))),
        "keys int4 per-channel g128 / values int2 per-token g64 rotated, range clipped to 0.8, newest 64 in fp16",
    ),
    "kivi-4": (_kivi(4), "KIVI: keys per-channel / values per-token int4 g32, recent 128 in fp16"),
    "kivi-2": (_kivi(2), "KIVI: keys per-channel / values per-token int2 g32, recent 128 in fp16"),
    "fp8": (
        KVQuantScheme(key=TensorQuant(format="fp8_e4m3", bits=8), value=TensorQuant(format="fp8_e4m3", bits=8)),
        "fp8 e4m3, one dynamic scale per token head vector",
    ),
    "ort-int8": (_ort(8), "ORT GroupQueryAttention int8: sym, static fp32 per-channel scales"),
    "ort-int8-asymv": (_ort(8, value_zero_points=True),
                       "ORT GroupQueryAttention int8: sym keys, values with static per-channel zero points (the "
                       "most accurate int8 cache the node holds with RoPE fused)"),
    "ort-int4": (_ort(4), "ORT GroupQueryAttention int4: sym, static fp32 per-channel scales"),
    "ort-int4-asymk": (_ort(4, key_zero_points=True),
                       "ORT GroupQueryAttention int4: keys with static per-channel zero points, sym values"),
    "ort-int4-hc16": (_ort(4, key_zero_points=True, high_channels=16),
                      "ORT GroupQueryAttention int4 as ort-int4-asymk, with 16 channels per kv head at 8 bits in "
                      "both streams (calibrated choice; the node's head of head_dim + 16 stays a multiple of 16)"),
}
PRESETS = {name: (scheme.with_name(name), text) for name, (scheme, text) in PRESETS.items()}


def preset_names() -> list[str]:
    """Names of the presets, in table order."""
    return list(PRESETS)


def get_preset(name: str) -> KVQuantScheme:
    """The preset called ``name``; an unknown name lists the allowed ones."""
    try:
        return PRESETS[name][0]
    except KeyError:
        raise SchemeError(f"unknown scheme preset {name!r}; allowed: {', '.join(PRESETS)}") from None


def resolve_scheme(spec: str | KVQuantScheme) -> KVQuantScheme:
    """A preset name, a path to a scheme JSON file, inline JSON, or a scheme object."""
    if isinstance(spec, KVQuantScheme):
        return spec
    if spec in PRESETS:
        warn_shadowed(spec, "a preset scheme")
        return PRESETS[spec][0]
    text = spec.strip()
    if text.startswith("{"):
        return KVQuantScheme.from_json(text)
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise SchemeError(f"scheme file {spec} does not exist")
        scheme = KVQuantScheme.from_json(read_text(path, "scheme file", error=SchemeError))
        return scheme if scheme.name else scheme.with_name(path.stem)
    raise SchemeError(f"unknown scheme {spec!r}; allowed: a preset ({', '.join(PRESETS)}) or a scheme .json file")


def _tensor_formats() -> dict[str, TensorQuant]:
    """Named per-tensor formats, derived from the preset table.

    Every preset that stores keys and values alike, and nothing more, lends its name to that format (``q8_0``,
    ``int8``, ``fp8``, ``q4_0-rot`` ...); plain asymmetric integers at every width complete the set, token-wise
    (``int2-g32``) and channel-wise like KIVI's keys (``int2-ch-g32``).
    """
    formats = {name: scheme.key for name, (scheme, _) in PRESETS.items()
               if scheme.key == scheme.value and scheme.residual_length == 0 and scheme.sink_tokens == 0
               and not scheme.layer_overrides}
    for bits in INT_BITS:
        formats.setdefault(f"int{bits}-g32", _int(bits, 32, sym=False))
        formats.setdefault(f"int{bits}-ch-g32", _int(bits, 32, sym=False, axis="channel"))
    return formats


#: name -> one stream's format: what ``kvq --key`` / ``--value`` accept (llama.cpp's ``-ctk`` / ``-ctv``).
TENSOR_FORMATS: dict[str, TensorQuant] = _tensor_formats()


def tensor_format_names() -> list[str]:
    """Names ``--key`` / ``--value`` accept, in table order."""
    return list(TENSOR_FORMATS)


def tensor_format(name: str) -> TensorQuant:
    """The per-tensor format called ``name``; an unknown name lists the allowed ones."""
    try:
        return TENSOR_FORMATS[name]
    except KeyError:
        raise SchemeError(f"unknown key/value format {name!r}; allowed: {', '.join(TENSOR_FORMATS)}") from None


def scheme_from_formats(key: str, value: str, *, name: str | None = None) -> KVQuantScheme:
    """The scheme storing keys as format ``key`` and values as format ``value`` (no window, no sinks).

    Named ``name``, else after the formats: ``q8_0`` when both are ``q8_0``, ``k-q8_0-v-q4_0`` when they differ.
    """
    scheme = KVQuantScheme(key=tensor_format(key), value=tensor_format(value))
    return scheme.with_name(name or (key if key == value else f"k-{key}-v-{value}"))


def presets_json() -> str:
    """Every preset as JSON (for documentation and tooling)."""
    return json.dumps({name: scheme.to_dict() for name, (scheme, _) in PRESETS.items()}, indent=2)
