"""The candidates ``kvq plan`` chooses from: per-layer key/value options and the built-in sets.

A :class:`CandidateSet` says what each layer may take; :data:`CANDIDATE_SETS` names the built-in ones, and
:func:`candidate_set` reads a name or comma-separated presets / scheme files. :func:`with_value_window` and
:func:`fitting` derive the set a plan actually measures.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass

from kvq_export.errors import KVQError, SchemeError
from kvq_export.presets import resolve_scheme
from kvq_export.scheme import TensorQuant

logger = logging.getLogger(__name__)

#: High channels per head the ``ort-gqa`` set offers its int4 layers.
GQA_HIGH_CHANNELS = (8, 16, 24)


def _static(bits: int, fmt: str = "int_sym") -> TensorQuant:
    return TensorQuant(format=fmt, bits=bits, axis="channel", scales="static", scale_dtype="fp32")


def _sym_token(bits: int, group: int) -> TensorQuant:
    return TensorQuant(format="int_sym", bits=bits, axis="token", group_size=group)


def _channel(bits: int, group: int) -> TensorQuant:
    return TensorQuant(format="int", bits=bits, axis="channel", group_size=group)


def _token(bits: int, group: int) -> TensorQuant:
    return TensorQuant(format="int", bits=bits, axis="token", group_size=group)


def _high(tq: TensorQuant, channels: int) -> TensorQuant:
    return dataclasses.replace(tq, high_channels=channels)


def _rot(tq: TensorQuant, clip: float = 1.0) -> TensorQuant:
    return dataclasses.replace(tq, rotation="hadamard", clip=clip)


def _ggml_rot(fmt: str, bits: int) -> TensorQuant:
    return TensorQuant(format=fmt, bits=bits, group_size=32, quantizer="ggml", rotation="hadamard")


@dataclass(frozen=True)
class CandidateSet:
    """What each layer may choose.

    ``tied``: a layer takes one of ``pairs`` (key and value chosen together, e.g. one GroupQueryAttention
    node has one ``kv_cache_bit_width``); otherwise any key of ``keys`` with any value of ``values``.
    """

    about: str
    keys: tuple[TensorQuant, ...] = ()
    values: tuple[TensorQuant, ...] = ()
    pairs: tuple[tuple[TensorQuant, TensorQuant], ...] = ()

    @property
    def tied(self) -> bool:
        """True when key and value are chosen together."""
        return bool(self.pairs)

    def options(self) -> list[tuple[TensorQuant, TensorQuant]]:
        """Every (key, value) a layer may take."""
        return list(self.pairs) if self.tied else list(itertools.product(self.keys, self.values))


CANDIDATE_SETS: dict[str, CandidateSet] = {
    # int4 with n channels per head at 8 bits rides a head of head_dim + n nibbles (see the ort-gqa flavour):
    # ONNX Runtime wants a head size that is a multiple of 8, so n steps by 8 (4.5 / 5.0 / 5.5 bits at head_dim
    # 64); its CPU kernel is fast only at multiples of 16, so n = 8 and 24 trade speed for bits there.
    "ort-gqa": CandidateSet(
        "GroupQueryAttention: per layer int8 or int4 (one bit width per node), static per-channel scales, keys "
        "with or without zero points; int4 with 8 / 16 / 24 channels per head at 8 bits (zero-point keys)",
        pairs=((_static(8), _static(8)), (_static(8, "int"), _static(8)),
               (_static(4), _static(4)), (_static(4, "int"), _static(4)),
               *((_high(_static(4, "int"), n), _high(_static(4), n)) for n in GQA_HIGH_CHANNELS)),
    ),
    "kivi": CandidateSet(
        "per-channel keys / per-token values, asymmetric int8/int4/int2, groups of 32 or 64, no window",
        keys=(_channel(8, 64), _channel(4, 32), _channel(4, 64), _channel(2, 32), _channel(2, 64)),
        values=(_token(8, 64), _token(4, 32), _token(4, 64), _token(2, 32), _token(2, 64)),
    ),
    # Keys: per-channel (plain or Hadamard-rotated; longer groups cost fewer scale bits; int4 with the channels
    # that move scores most at 8 bits) or rotated token-wise ggml q5/q8 blocks. Values: per-token in the rotated
    # basis, where 2-bit codes need a clipped range (0.8 of the group's: on SmolLM2 it cuts their attention
    # damage by a third against the full range) and 3-bit codes gain from a mild clip (0.85-0.9; asymmetric: a
    # symmetric 3-bit group has only 7 levels), and rotated values are centred enough for symmetric groups of a
    # whole 64-channel head (4.25 bits for int4).
    "accuracy": CandidateSet(
        "per-channel int8/int6/int4/int3/int2 keys (groups 32-256, plain or rotated; int4 with 4-24 and int3 "
        "with 8-16 channels per head at 8 bits), rotated q8_0 / q5_0 / int8-sym-g32 keys; rotated per-token "
        "int8/int6/int4/int3/int2 values (int3 clipped to 0.85-1, int2 to 0.8; symmetric int8/int6/int4 g32/g64), "
        "rotated q8_0/q5_1/q5_0/q4_0 values; no window",
        keys=(_channel(8, 64), _channel(4, 32), _rot(_channel(4, 32)), _channel(4, 64), _rot(_channel(4, 64)),
              _channel(4, 128), _rot(_channel(4, 128)), _channel(4, 256), _channel(2, 64), _channel(2, 128),
              _ggml_rot("int_sym", 8), _ggml_rot("int_sym", 5),
              _rot(TensorQuant(format="int_sym", bits=8, group_size=32)),
              _channel(8, 128), _channel(8, 256), _rot(_channel(4, 256)), _rot(_channel(8, 256)),
              _rot(_channel(8, 128)),
              *(_high(_channel(4, g), n) for g, ns in ((64, (4, 8)), (128, (4, 8, 16, 24)), (256, (4, 8, 16, 24)))
                for n in ns),
              _channel(6, 128), _channel(6, 256), _rot(_channel(6, 256)),
              _channel(3, 64), _channel(3, 128), _channel(3, 256), _rot(_channel(3, 128)),
              _high(_channel(3, 128), 8), _high(_channel(3, 256), 8), _high(_channel(3, 256), 16)),
        values=(_rot(_token(8, 64)), _ggml_rot("int_sym", 8), _ggml_rot("int", 5), _ggml_rot("int_sym", 5),
                _rot(_token(4, 32)), _rot(_token(4, 64)), _ggml_rot("int_sym", 4), _rot(_token(2, 32), 0.8),
                _rot(_token(2, 64), 0.8), _rot(_token(2, 64)),
                _rot(_sym_token(4, 64)), _rot(_sym_token(8, 64)), _rot(_sym_token(4, 32)),
                _rot(_sym_token(6, 32)), _rot(_sym_token(6, 64)), _rot(_token(6, 64)),
                *(_rot(_token(3, g), clip) for g in (32, 64) for clip in (1.0, 0.9, 0.85))),
    ),
}


_GQA = CANDIDATE_SETS["ort-gqa"]
# onnxruntime-genai allocates one cache element type for every layer, and GroupQueryAttention reads 8-bit codes only
# as int8, 4-bit ones only as uint8: plans of one of these sets are the ones it serves
CANDIDATE_SETS.update({f"ort-gqa-int{bits}": CandidateSet(
    f"the ort-gqa set's {bits}-bit layer options only: one cache element type, so onnxruntime-genai serves every "
    "plan of it", pairs=tuple(pair for pair in _GQA.pairs if pair[0].bits == bits)) for bits in (4, 8)})


def _recent(tq: TensorQuant, tokens: int) -> TensorQuant:
    return dataclasses.replace(tq, residual_length=tokens)


#: Recent windows (exact tokens) the ``accuracy-recent`` set offers the low-bit values. Local heads read
#: their newest tokens most, so a short exact window removes much of a 2-3-bit value stream's error for a
#: few bits per token (16 fp16 tokens at 4096 cost 0.05 bits per value element).
RECENT_VALUE_WINDOWS = (8, 16, 32, 64)
_ACCURACY = CANDIDATE_SETS["accuracy"]
CANDIDATE_SETS["accuracy-recent"] = CandidateSet(
    "the accuracy set, plus its rotated int4 / int3 / int2 values (g64, and int3 / int2 g32) with a recent window of "
    f"{' / '.join(map(str, RECENT_VALUE_WINDOWS))} exact tokens (counted in the budget; keys keep no window)",
    keys=_ACCURACY.keys,
    values=_ACCURACY.values + tuple(
        _recent(value, tokens) for value in (_rot(_token(4, 64)), _rot(_sym_token(4, 64)), _rot(_token(2, 64), 0.8),
                                             *(_rot(_token(3, 64), clip) for clip in (1.0, 0.9, 0.85)),
                                             _rot(_token(3, 32), 0.9), _rot(_token(2, 32), 0.8))
        for tokens in RECENT_VALUE_WINDOWS),
)


def with_value_window(cset: CandidateSet, tokens: int) -> CandidateSet:
    """``cset`` with every quantized value keeping its ``tokens`` newest tokens exact (its own recent window).

    Channel-axis values whose group does not divide ``tokens`` are left out (their window moves in whole groups).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise KVQError(f"invalid value window {tokens!r}: allowed: an integer >= 0 (tokens)")

    def windowed(value: TensorQuant) -> TensorQuant | None:
        if not value.quantized:
            return value
        return None if tokens % value.flush_unit else _recent(value, tokens)

    values = tuple(dict.fromkeys(v for v in map(windowed, cset.values) if v is not None))
    pairs = tuple(dict.fromkeys((k, w) for k, w in ((k, windowed(v)) for k, v in cset.pairs) if w is not None))
    kept = CandidateSet(f"{cset.about}; every value keeps its {tokens} newest tokens exact", cset.keys, values, pairs)
    if not kept.options():
        raise KVQError(f"no value candidate of {cset.about!r} can keep a window of {tokens} tokens "
                       "(channel-axis values need a multiple of their group size)")
    return kept


def candidate_set(spec: str) -> CandidateSet:
    """A built-in set name, or comma-separated presets / scheme files (each a tied layer option)."""
    if spec in CANDIDATE_SETS:
        return CANDIDATE_SETS[spec]

    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise SchemeError(f"no candidates in {spec!r}; allowed: {', '.join(CANDIDATE_SETS)} or presets/scheme files")
    pairs = []
    for name in names:
        scheme = resolve_scheme(name)
        if scheme.layer_overrides or scheme.residual_length or scheme.sink_tokens:
            raise SchemeError(f"candidate {name!r} has layer overrides or windows; a candidate is one layer's "
                              "key and value only")
        if (scheme.key, scheme.value) not in pairs:
            pairs.append((scheme.key, scheme.value))
    return CandidateSet(f"layer options from {', '.join(names)}", pairs=tuple(pairs))


def fitting(cset: CandidateSet, head_dim: int) -> CandidateSet:
    """``cset`` without the candidates a cache of ``head_dim`` channels cannot hold (e.g. groups > head_dim)."""
    def fits(tq: TensorQuant) -> bool:
        try:
            tq.check_head_dim(head_dim, "candidate")
        except SchemeError:
            return False
        return True

    kept = CandidateSet(cset.about, tuple(filter(fits, cset.keys)), tuple(filter(fits, cset.values)),
                        tuple(pair for pair in cset.pairs if fits(pair[0]) and fits(pair[1])))
    if not kept.options():
        raise SchemeError(f"no candidate of {cset.about!r} fits head_dim={head_dim}")
    dropped = len(cset.options()) - len(kept.options())
    if dropped:
        logger.info("left out %d candidate option(s) that do not fit head_dim=%d", dropped, head_dim)
    return kept

