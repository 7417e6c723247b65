"""``kvq plan``: choose per-layer key/value formats under a bit budget by measured attention damage.

Layers differ a lot in how much a quantization error hurts (an outlier channel in one layer's keys can
cost more than every other layer's keys together), so a mixed-precision cache spends bits where the
damage is. The planner

1. runs the model once over calibration text and keeps, per layer, sampled post-RoPE queries, every
   cached key/value and the size of the residual stream entering the layer
   (:func:`kvq_export.calibration.passes.collect_attention_samples`);
2. calibrates every static candidate format from those samples (``--calib-method``, default absmax like
   ``kvq export``'s, the same arithmetic ``kvq export`` applies);
3. measures, per layer and candidate, the damage to attention (the ``metric``):

   * ``attention`` (default, one model pass in all): the candidate's key-induced and value-induced
     attention-output error (:mod:`kvq_export.validate.attention`'s decomposition, with the exact
     ``softmax(q Kᵀ s)`` of the sampled queries), carried through the layer's ``o_proj`` into the
     residual stream and divided by that stream's size: ``mean_q |o_proj(ô - o)|² / |h|²``. Key and
     value errors are measured together for layers whose two streams are chosen together (``tied``
     candidate sets) and separately otherwise (then added);
   * ``kl``: the logit KL divergence from the unquantized model with only that layer's stream(s)
     quantized in kvq's reference cache (one full forward per layer, stream and candidate: exact end to
     end, slow on large models);

4. picks one candidate per layer minimising the summed damage with the cache's bits/element at
   ``context`` tokens (the memory model's count: metadata and high-precision windows included) at most
   ``budget`` — an exact multiple-choice knapsack over bytes (dynamic programming on a grid of
   ``budget / resolution`` bytes with costs rounded up, so the result never exceeds the budget);
5. writes the choice as a scheme with ``layer_overrides`` (the most common choice is the default).

Candidate sets (:data:`CANDIDATE_SETS`) or any comma-separated presets / scheme files (each one a layer
option: its key and value together).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_export.cache_layout import BUFFER
from kvq_export.calibration.artifact import HIGH_CHANNELS, PARTS, Calibration
from kvq_export.calibration.high_channels import channel_importance, ranging_group, top_channels
from kvq_export.calibration.measure import measured_model
from kvq_export.calibration.methods import stream_from_samples
from kvq_export.calibration.passes import check_windows, collect_attention_samples
from kvq_export.errors import KVQError, SchemeError
from kvq_export.export.genai_package import mixed_types_reason
from kvq_export.export.gqa_capability import unsupported
from kvq_export.memory import predict, stream_bytes
from kvq_export.model_source import model_facts
from kvq_export.presets import resolve_scheme
from kvq_export.progress import task
from kvq_export.request import (
    DEFAULT_CALIBRATION,
    DEFAULT_PLAN_CANDIDATES,
    CalibrationMethod,
    CalibrationSpec,
    PlanMetric,
    WeightSpec,
)
from kvq_export.rotation import rotation_matrix
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Part, ScaleMode

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from kvq_export.calibration.passes import AttentionSample
    from kvq_export.model_facts import ModelFacts

logger = logging.getLogger(__name__)

METRICS = tuple(str(metric) for metric in PlanMetric)
#: budget grid of the allocation (the knapsack's byte unit is ``budget / RESOLUTION``)
RESOLUTION = 4000


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


# -- damage ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Damage:
    """Measured damage of one (layer, key, value) choice; ``None`` streams are left unquantized."""

    layer: int
    key: TensorQuant | None
    value: TensorQuant | None
    damage: float
    key_induced: float = 0.0
    value_induced: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"layer": self.layer, "key": self.key.describe() if self.key else None,
                "value": self.value.describe() if self.value else None, "damage": self.damage,
                "key_induced": self.key_induced, "value_induced": self.value_induced}


def _calibrated_parts(cset: CandidateSet) -> dict[TensorQuant, tuple[str, ...]]:
    """Each static or high-channel candidate with the parts (``key``/``value``) the set offers it for."""
    parts: dict[TensorQuant, list[str]] = {}
    for pair in cset.options():
        for part, tq in zip(PARTS, pair):
            if tq.quantized and (tq.scales == ScaleMode.STATIC or tq.high_channels) and part not in parts.get(tq, ()):
                parts.setdefault(tq, []).append(part)
    return {tq: tuple(p) for tq, p in parts.items()}


def _static_for(model: PreTrainedModel, cset: CandidateSet, samples, num_layers: int, method: str,
                percentile: float):
    """Calibrated metadata per static or high-channel candidate: ``{tq: {layer: {"key"|"value": {...}}}}``.

    Only the parts the set offers a candidate for are calibrated. The channel ranking behind high channels is
    measured once per (layer, part, ranging group) and each candidate keeps its own number of top channels; each
    layer's K/V is joined along the tokens once for every static format.
    """
    import torch

    wanted = _calibrated_parts(cset)
    out: dict[TensorQuant, dict[int, dict[str, dict]]] = {tq: {} for tq in wanted}
    with task("plan: calibrating candidates", total=num_layers) as advance:
        for layer in range(num_layers):
            rankings: dict[tuple[str, int | None], torch.Tensor] = {}
            streams: dict[tuple[str, str], torch.Tensor] = {}
            # a rotated stream stores x @ R: its static scales belong to that basis (as kvq export calibrates them)
            bases: dict[str, list] = {"none": samples[layer]}
            for tq, parts in wanted.items():
                if tq.scales == ScaleMode.STATIC and tq.rotation not in bases:
                    matrix = rotation_matrix(tq.rotation, samples[layer][0].keys.shape[-1])
                    bases[tq.rotation] = [s.rotated(matrix) for s in samples[layer]]
                for part in parts:
                    high = None
                    if tq.high_channels:
                        ranking = (part, ranging_group(tq))
                        if ranking not in rankings:
                            rankings[ranking] = channel_importance(
                                samples[layer], part, tq, _o_proj(model, layer) if part == Part.VALUE else None)
                        high = top_channels(rankings[ranking], tq.high_channels)
                    if tq.scales == ScaleMode.STATIC:
                        basis, stream = bases[tq.rotation], (part, tq.rotation)
                        if stream not in streams and method != CalibrationMethod.ATTENTION:
                            streams[stream] = torch.cat([s.keys if part == Part.KEY else s.values for s in basis],
                                                        dim=1)
                        meta = stream_from_samples(basis, part, tq, method=method, percentile=percentile,
                                                   high_channels=high, stream=streams.get(stream))
                    else:
                        meta = {HIGH_CHANNELS: high}
                    out[tq].setdefault(layer, {})[part] = meta
            advance()
    return out


def _layer_static(static_by: Mapping, layer: int, key: TensorQuant | None, value: TensorQuant | None) -> dict:
    out: dict[str, Any] = {}
    for part, tq in (("key", key), ("value", value)):
        if tq is not None and tq in static_by:
            out[part] = static_by[tq][layer][part]
    return out


def _reference_dequant(x: torch.Tensor, tq: TensorQuant, meta: Mapping | None, sink_tokens: int = 0) -> torch.Tensor:
    """What attention reads for ``x`` [H, T, D] after kvq's reference cache stores it (no recent window).

    The first ``sink_tokens`` tokens stay in high precision.
    """
    import torch

    from kvq_export.reference.cache import StreamCache  # lazy: imports torch

    metadata = {k: torch.as_tensor(np.asarray(v)) for k, v in (meta or {}).items()}
    stream = StreamCache(tq, KVQuantScheme(key=tq, value=tq, hp_dtype="fp32", sink_tokens=sink_tokens),
                         static_scales=metadata.get("scales"), static_zeros=metadata.get("zero_points"),
                         high_channels=metadata.get("high_channels"))
    stream.append(x[None])
    return stream.dequantized(torch.float32)[0]


def _older(weights: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
    """Attention weights on the tokens older than each query's exact window (which reads values exactly)."""
    return weights if window is None else weights.masked_fill(window, 0.0)


def attention_damage(
    samples: Sequence[AttentionSample], o_proj: torch.Tensor, key: TensorQuant | None, value: TensorQuant | None,
    meta: Mapping[str, Mapping] | None = None, sink_tokens: int = 0,
) -> tuple[float, float, float]:
    """(residual damage, key-induced, value-induced) of quantizing one layer's key and/or value.

    ``o_proj`` is the layer's output projection weight ``[hidden, Hq * D]``. The damage is the mean over
    sampled queries of ``|o_proj(ô - o)|² / |h|²`` (``h`` the residual stream entering the layer); the
    key-/value-induced errors are ``|(A' - A) V| / |o|`` and ``|A (V̂ - V)| / |o|`` averaged over query
    heads and queries (the quantities ``kvq validate`` reports). The first ``sink_tokens`` tokens stay exact,
    and so do the newest ``residual_length`` tokens of a stream that sets one, as seen from each query.
    """
    return attention_damages(samples, o_proj, [(key, value, meta or {})], sink_tokens)[0]


#: attention weights ([configs, Hkv, G * P, T] elements) one batch of configurations may hold at once
BATCH_ELEMENTS = 1 << 23


def attention_damages(
    samples: Sequence[AttentionSample], o_proj: torch.Tensor,
    configs: Sequence[tuple[TensorQuant | None, TensorQuant | None, Mapping[str, Mapping]]], sink_tokens: int = 0,
) -> list[tuple[float, float, float]]:
    """:func:`attention_damage` of several (key, value, metadata) configurations of one layer.

    The exact attention of each sample is computed once and shared by every configuration; each distinct
    (stream, metadata) is stored and read back once per sample, and configurations are measured in batches
    (one matmul / softmax for a batch, the same per-configuration arithmetic).
    """
    import torch

    totals = np.zeros((len(configs), 3))
    with torch.inference_mode():
        for sample in samples:
            exact = _ExactAttention(sample)
            read = _StoredReads(sample, sink_tokens)
            batch = max(1, BATCH_ELEMENTS // max(1, exact.a.numel()))
            for start in range(0, len(configs), batch):
                chunk = configs[start:start + batch]
                totals[start:start + len(chunk)] += _batch_damages(exact, read, o_proj, chunk)
    return [tuple(float(x) for x in row / len(samples)) for row in totals]


class _ExactAttention:
    """One sample's unquantized attention: scores, weights ``a``, output ``o`` and the norms damage divides by."""

    def __init__(self, sample: AttentionSample) -> None:
        import torch

        self.sample = sample
        self.scores = sample.scores(sample.keys)
        self.a = sample.softmax(self.scores)
        self.o = torch.bmm(self.a, sample.values)
        self.norm_o = self.o.norm(dim=-1).clamp_min(1e-30)
        p = sample.q.shape[1]
        self.residual = sample.residual_norm.clamp_min(1e-30) if sample.residual_norm is not None else torch.ones(p)


class _StoredReads:
    """What attention reads for each (part, stream, metadata) of one sample, stored and read back once."""

    def __init__(self, sample: AttentionSample, sink_tokens: int) -> None:
        self.sample, self.sink_tokens = sample, sink_tokens
        self.cache: dict[tuple[str, TensorQuant, int], torch.Tensor] = {}
        self.held: list[Mapping | None] = []  # keeps each metadata object (and so its id) alive

    def __call__(self, part: str, tq: TensorQuant, meta: Mapping | None) -> torch.Tensor:
        key = (part, tq, id(meta))
        if key not in self.cache:
            x = self.sample.keys if part == Part.KEY else self.sample.values
            self.cache[key] = _reference_dequant(x, tq, meta, self.sink_tokens)
            self.held.append(meta)
        return self.cache[key]


def _batch_damages(exact: _ExactAttention, read: _StoredReads, o_proj: torch.Tensor,
                   configs: Sequence[tuple[TensorQuant | None, TensorQuant | None, Mapping[str, Mapping]]],
                   ) -> np.ndarray:
    """``[len(configs), 3]``: one sample's (damage, key-induced, value-induced) of each configuration."""
    import torch

    sample, a, v = exact.sample, exact.a, exact.sample.values
    out = np.zeros((len(configs), 3))
    err = exact.o.new_zeros((len(configs), *exact.o.shape))  # [C, Hkv, G*P, D]: ô - o
    weights = {}  # config -> its attention weights where its key is quantized (else the exact ones)
    keyed = [i for i, (key, _, _) in enumerate(configs) if key is not None]
    if keyed:
        k_hat = torch.stack([read("key", configs[i][0], configs[i][2].get("key")) for i in keyed])
        scores = torch.matmul(sample.grouped_queries(), k_hat.transpose(-1, -2)) * sample.scaling
        for row, i in enumerate(keyed):
            recent = configs[i][0].residual_length or 0
            if recent:  # the newest keys of each query are read exactly
                scores[row] = torch.where(sample.recent_mask(recent)[None], exact.scores, scores[row])
        a_hat = sample.softmax(scores)
        err[keyed] = torch.matmul(a_hat, v) - exact.o
        key_induced = err[keyed].norm(dim=-1) / exact.norm_o
        for row, i in enumerate(keyed):
            weights[i] = a_hat[row]
            out[i, 1] = float(key_induced[row].mean())
    # value errors, read through each configuration's weights on the tokens older than its value window
    valued = [i for i, (_, value, _) in enumerate(configs) if value is not None]
    if valued:
        v_err = torch.stack([read("value", configs[i][1], configs[i][2].get("value")) - v for i in valued])
        windows = [sample.recent_mask(configs[i][1].residual_length)[None] if configs[i][1].residual_length
                   else None for i in valued]
        induced = torch.matmul(torch.stack([_older(a, w) for w in windows]), v_err)  # A (V̂ - V) on older tokens
        through = induced.clone()  # the same through each configuration's own weights (the exact ones: as above)
        rows = [row for row, i in enumerate(valued) if i in weights]
        if rows:
            through[rows] = torch.matmul(torch.stack([_older(weights[valued[row]], windows[row]) for row in rows]),
                                       v_err[rows])
        err[valued] += through
        value_induced = induced.norm(dim=-1) / exact.norm_o
        for row, i in enumerate(valued):
            out[i, 2] = float(value_induced[row].mean())
    hq, p, d = sample.q.shape
    per_head = err.reshape(len(configs), hq, p, d).permute(0, 2, 1, 3).reshape(len(configs), p, hq * d)
    moved = torch.matmul(per_head, o_proj.T)  # [C, P, hidden]
    energy = moved.pow(2).sum(dim=-1) / exact.residual.pow(2)
    for i in range(len(configs)):
        out[i, 0] = float(energy[i].mean())
    return out


def _o_proj(model: PreTrainedModel, layer: int) -> torch.Tensor:
    """The layer's attention output projection ``[hidden, Hq * D]`` as float32 (Llama-family layout)."""
    import torch

    return model.model.layers[layer].self_attn.o_proj.weight.detach().to(device="cpu", dtype=torch.float32)


def measure_attention(
    model: PreTrainedModel, samples: Mapping[int, Sequence[AttentionSample]], cset: CandidateSet,
    static_by: Mapping, num_layers: int, sink_tokens: int = 0,
) -> list[Damage]:
    """Damage of every candidate of every layer by the ``attention`` metric."""
    out = []
    with task("plan: measuring attention damage", total=num_layers) as advance:
        for layer in range(num_layers):
            configs = [(key, value, _layer_static(static_by, layer, key, value))
                       for key, value in _measured_configs(cset)]
            damages = attention_damages(samples[layer], _o_proj(model, layer), configs, sink_tokens)
            out += [Damage(layer, key, value, *damage) for (key, value, _), damage in zip(configs, damages)]
            advance()
    return out


def _measured_configs(cset: CandidateSet) -> list[tuple[TensorQuant | None, TensorQuant | None]]:
    """Tied: each pair at once; untied: each key alone, then each value alone (damages add up)."""
    if cset.tied:
        return [(k if k.quantized else None, v if v.quantized else None) for k, v in cset.pairs]
    return [(k if k.quantized else None, None) for k in cset.keys] + \
        [(None, v if v.quantized else None) for v in cset.values]


def measure_kl(
    model: PreTrainedModel, windows: Sequence[Sequence[int]], cset: CandidateSet, static_by: Mapping,
    num_layers: int, sink_tokens: int = 0,
) -> list[Damage]:
    """Damage of every candidate of every layer as the logit KL from the unquantized model (mean per token)."""
    import torch

    from kvq_export.reference.hf_cache import reference_hf_cache  # lazy: imports torch and transformers

    configs = [(layer, k, v) for layer in range(num_layers) for k, v in _measured_configs(cset)]
    totals = np.zeros(len(configs))
    tokens = 0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), task("plan: measuring logit KL", total=len(windows) * len(configs)) as advance:
            for window in windows:
                ids = torch.tensor([list(window)], dtype=torch.long, device=device)
                base = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
                p = base.exp()
                for i, (layer, key, value) in enumerate(configs):
                    override = LayerOverride(layer, key=key or TensorQuant.fp16(), value=value or TensorQuant.fp16())
                    scheme = KVQuantScheme(hp_dtype="fp32", layer_overrides=(override,), sink_tokens=sink_tokens)
                    static = Calibration.of({layer: _layer_static(static_by, layer, key, value)}).to_torch()
                    cache, _ = reference_hf_cache(scheme, num_layers, static)
                    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0].float()
                    quant = torch.log_softmax(logits, dim=-1)
                    totals[i] += float((p * (base - quant)).sum())
                    advance()
                tokens += len(window)
    finally:
        model.train(was_training)
    return [Damage(layer, k, v, max(float(t) / tokens, 0.0)) for (layer, k, v), t in zip(configs, totals)]


# -- allocation -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One (key, value) choice for one layer with its damage and cache bytes at the planned context."""

    key: TensorQuant
    value: TensorQuant
    damage: float
    nbytes: int


def layer_options(damages: Sequence[Damage], cset: CandidateSet, num_layers: int,
                  stream_bytes: Callable[[TensorQuant], int]) -> list[list[Option]]:
    """Per layer, every option of ``cset`` with its (additive, for untied sets) damage and bytes."""
    table = {(d.layer, d.key, d.value): d.damage for d in damages}

    def measured(layer: int, key: TensorQuant | None, value: TensorQuant | None) -> float:
        return table[(layer, key if key and key.quantized else None, value if value and value.quantized else None)]

    options = []
    for layer in range(num_layers):
        row = []
        for key, value in cset.options():
            damage = measured(layer, key, value) if cset.tied else measured(layer, key, None) + \
                measured(layer, None, value)
            row.append(Option(key, value, damage, stream_bytes(key) + stream_bytes(value)))
        options.append(row)
    return options


def allocate(options: Sequence[Sequence[Option]], budget_bytes: int, resolution: int = RESOLUTION) -> list[int]:
    """Index of the chosen option per layer: least total damage with total bytes <= ``budget_bytes``.

    Exact dynamic programming over a byte grid of ``budget_bytes / resolution``; each option's cost is
    rounded *up* to the grid, so the choice always fits the budget (and is optimal up to that rounding).

    Raises:
        KVQError: no choice fits (the message gives the smallest possible bytes).

    """
    cheapest = sum(min(o.nbytes for o in row) for row in options)
    if cheapest > budget_bytes:
        raise KVQError(f"no allocation fits the budget: it allows {budget_bytes} bytes, the cheapest choice "
                       f"needs {cheapest}")
    unit = budget_bytes / resolution
    inf = math.inf
    best = np.full(resolution + 1, inf)
    best[0] = 0.0
    picks = []
    for row in options:
        nxt = np.full(resolution + 1, inf)
        pick = np.full(resolution + 1, -1, dtype=np.int64)
        for i, option in enumerate(row):
            cost = math.ceil(option.nbytes / unit - 1e-9) if option.nbytes else 0
            if cost > resolution:
                continue
            shifted = np.full(resolution + 1, inf)
            shifted[cost:] = best[: resolution + 1 - cost] + option.damage
            better = shifted < nxt
            nxt[better], pick[better] = shifted[better], i
        best = nxt
        picks.append(pick)
    end = int(np.argmin(best))
    if not np.isfinite(best[end]):  # the rounding up left no room although the exact bytes fit
        raise KVQError(f"no allocation fits the budget of {budget_bytes} bytes at resolution {resolution}")
    chosen = []
    for row, pick in zip(reversed(options), reversed(picks)):
        i = int(pick[end])
        chosen.append(i)
        end -= math.ceil(row[i].nbytes / unit - 1e-9) if row[i].nbytes else 0
    return chosen[::-1]


def scheme_from_choice(choice: Sequence[tuple[TensorQuant, TensorQuant]], name: str | None = None,
                       sink_tokens: int = 0) -> KVQuantScheme:
    """A scheme whose default is the most common (key, value) and whose overrides are the other layers."""
    base_key, base_value = Counter(choice).most_common(1)[0][0]
    overrides = []
    for layer, (key, value) in enumerate(choice):
        if (key, value) != (base_key, base_value):
            overrides.append(LayerOverride(layer, key=key if key != base_key else None,
                                           value=value if value != base_value else None))
    return KVQuantScheme(key=base_key, value=base_value, layer_overrides=tuple(overrides), name=name,
                         sink_tokens=sink_tokens)


# -- the whole plan ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch at one intra-op thread inside the block (restored after).

    Candidate calibration and damage measurement are thousands of small tensor ops: a second thread adds a
    barrier to each, and on shared cores that barrier waits for a descheduled thread (on a loaded 2-core
    machine the measurement ran 6x slower with two threads than with one). The results are the same.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Plan:
    """A planned scheme with what it was chosen from."""

    scheme: KVQuantScheme
    bits_per_element: float
    damage: float
    budget: float
    context: int
    metric: PlanMetric
    damages: list[Damage] = field(default_factory=list)
    uniform: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    #: onnxruntime-genai's view of an ort-gqa plan (None for one GroupQueryAttention cannot hold): whether it
    #: serves the plan, and if not why, and the nearest plan it serves (see :func:`genai_view`)
    genai: dict[str, Any] | None = None
    #: that nearest plan's scheme (None when the plan itself is served, or no plan of one cache type fits)
    genai_nearest: KVQuantScheme | None = None
    #: each calibrated candidate's metadata, ``{tq: {layer: {"key"|"value": {...}}}}``, as the damages were measured
    candidate_static: Mapping[TensorQuant, Mapping[int, Mapping[str, Any]]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the ``--report`` file)."""
        return {"scheme": self.scheme.to_dict(), "bits_per_element": self.bits_per_element,
                "predicted_damage": self.damage, "budget": self.budget, "context": self.context,
                "metric": str(self.metric), "uniform": self.uniform, "settings": self.settings,
                "onnxruntime_genai": self.genai, "damages": [d.to_dict() for d in self.damages]}

    def static_for(self, scheme: KVQuantScheme, num_layers: int) -> dict[int, dict[str, dict[str, Any]]]:
        """The static metadata of ``scheme`` (made of this plan's candidates) from the candidates' calibration.

        The same arrays :func:`kvq_export.calibration.calibrate_static_scales` gives for ``scheme`` on the plan's
        windows with the plan's method (the same samples and arithmetic), so an export of the plan needs no second
        calibration pass. Streams that need no calibration are left out, as there.
        """
        static: dict[int, dict[str, dict[str, Any]]] = {}
        for layer, streams in enumerate(scheme.streams(num_layers)):
            for part, tq in zip(PARTS, streams):
                if tq.quantized and (tq.scales == ScaleMode.STATIC or tq.high_channels):
                    meta = self.candidate_static.get(tq, {}).get(layer, {}).get(part)
                    if meta is None:
                        raise KVQError(f"layer {layer} {part}: {tq.describe()} is not a calibrated {part} candidate "
                                       "of this plan")
                    static.setdefault(layer, {})[part] = dict(meta)
        return static

    def servable(self) -> Plan:
        """The plan onnxruntime-genai serves: this one, or its nearest such plan (:func:`genai_view`) under its name.

        The nearest plan is what ``kvq plan --candidates`` of its one-cache-type candidates writes (the report's
        ``onnxruntime_genai.nearest.candidates``); the measured damages stay those of every candidate.

        Its ``onnxruntime_genai`` entry names those candidates (``candidates``) when it is the nearest plan.

        Raises:
            KVQError: no plan of one cache type fits the budget.

        """
        if self.genai is None or self.genai["servable"]:
            return self
        near = self.genai["nearest"]
        if near is None or self.genai_nearest is None:
            raise KVQError(f"no plan onnxruntime-genai serves fits the budget of {self.budget:g} bits/element "
                           f"({self.genai['reason']}); give candidates explicitly to plan one it does not serve")
        scheme = dataclasses.replace(self.genai_nearest, name=self.scheme.name)
        named = CANDIDATE_SETS.get(near["candidates"])
        settings = {**self.settings, "candidates": named.about if named else near["candidates"]}
        return dataclasses.replace(self, scheme=scheme, bits_per_element=near["bits_per_element"],
                                   damage=near["predicted_damage"], settings=settings, genai_nearest=None,
                                   genai={"servable": True, "candidates": near["candidates"]})


def genai_view(scheme: KVQuantScheme, options: Sequence[Sequence[Option]], budget_bytes: int, facts: ModelFacts,
               context: int, *, about: str, resolution: int = RESOLUTION,
               ) -> tuple[dict[str, Any] | None, KVQuantScheme | None]:
    """Whether onnxruntime-genai serves a plan, and if not, the nearest plan it serves.

    og allocates one cache element type for every layer (:func:`kvq_export.export.genai_package.mixed_types_reason`),
    so a plan mixing 8-bit and 4-bit layers is not served. The nearest plan is the least damage under the same
    budget with every layer's option of one element type: the plan ``kvq plan`` gives with only those candidates
    (``ort-gqa-int4`` / ``ort-gqa-int8`` for the ``ort-gqa`` set). Returns (the report's entry, that scheme);
    (None, None) when GroupQueryAttention cannot hold the plan at all.
    """
    layers, heads, dim = facts.num_layers, facts.num_kv_heads, facts.head_dim
    if unsupported(scheme, layers, dim):
        return None, None

    def buffers(s: KVQuantScheme, num_layers: int):
        return BUFFER.tensors(s, num_layers=num_layers, kv_heads=heads, head_dim=dim)

    reason = mixed_types_reason(buffers(scheme, layers), layers)
    if reason is None:
        return {"servable": True}, None
    kind = {}  # option (key, value) -> its buffers' element types
    for row in options:
        for o in row:
            kind.setdefault((o.key, o.value), tuple(sorted({t.dtype for t in buffers(
                KVQuantScheme(key=o.key, value=o.value, sink_tokens=scheme.sink_tokens), 1)})))
    best: tuple[float, list[tuple[TensorQuant, TensorQuant]], tuple[str, ...]] | None = None
    for types in dict.fromkeys(kind.values()):
        rows = [[o for o in row if kind[(o.key, o.value)] == types] for row in options]
        try:
            chosen = allocate(rows, budget_bytes, resolution)
        except KVQError:  # no plan of this type fits the budget
            continue
        damage = sum(row[i].damage for row, i in zip(rows, chosen))
        if best is None or damage < best[0]:
            best = (damage, [(row[i].key, row[i].value) for row, i in zip(rows, chosen)], types)
    entry: dict[str, Any] = {"servable": False, "reason": reason, "nearest": None}
    if best is None:
        return entry, None
    damage, choice, types = best
    nearest = scheme_from_choice(choice, f"{scheme.name or 'plan'}-genai", scheme.sink_tokens)
    bits = {o.key.bits for o in options[0] if kind[(o.key, o.value)] == types}
    candidates = f"ort-gqa-int{min(bits)}" if about == _GQA.about and len(bits) == 1 else \
        f"only its {'/'.join(types)} candidates"
    entry["nearest"] = {"scheme": nearest.to_dict(), "bits_per_element": predict(nearest, facts, context)
                        .bits_per_element, "predicted_damage": damage, "candidates": candidates}
    return entry, nearest


def plan_scheme(
    model: PreTrainedModel,
    windows: Sequence[Sequence[int]],
    *,
    budget: float,
    context: int,
    candidates: CandidateSet | str = DEFAULT_PLAN_CANDIDATES,
    metric: PlanMetric | str = PlanMetric.ATTENTION,
    calibration: CalibrationSpec = DEFAULT_CALIBRATION,
    name: str | None = None,
    resolution: int = RESOLUTION,
    sink_tokens: int = 0,
    value_window: int | None = None,
    servable: bool = False,
    weights: WeightSpec | None = None,
) -> Plan:
    """Plan a per-layer scheme for ``model`` (see the module docstring).

    Args:
        model: a Hugging Face causal LM (Llama family).
        windows: calibration token windows (e.g. :func:`kvq_export.calibration.calibration_windows`).
        budget: most bits per cached element at ``context`` tokens (memory model, batch 1).
        context: the cache length the budget is stated at.
        candidates: a :class:`CandidateSet` or a spec for :func:`candidate_set`.
        metric: ``attention`` or ``kl``.
        calibration: how static candidates are calibrated (its method and percentile; ``windows`` are its text).
        name: the planned scheme's name.
        resolution: the knapsack grid (see :func:`allocate`).
        sink_tokens: first tokens of every sequence kept in high precision in every layer (attention sinks
            draw much of the attention and stretch a per-channel key group's range); measured and paid for
            in the budget like any other stored byte.
        value_window: every value candidate keeps this many newest tokens exact (:func:`with_value_window`;
            measured per query and paid for in the budget); None: the candidates' own windows.
        servable: keep to a plan onnxruntime-genai serves (:meth:`Plan.servable`) when GroupQueryAttention can hold
            the plan at all.
        weights: how the export stores the weights (None: as computed). int4 / int8 blocks: the candidates are
            calibrated and their damage measured on the model with the weights the export computes with
            (:func:`kvq_export.calibration.measure.measured_model`, the same model ``kvq calibrate`` and ``kvq
            export`` calibrate on).

    Raises:
        KVQError: unknown metric, a non-positive budget/context, or a budget no choice fits.

    """
    if metric not in METRICS:
        raise KVQError(f"unknown plan metric {metric!r}; allowed: {', '.join(METRICS)}")
    metric = PlanMetric(metric)
    if not (isinstance(budget, (int, float)) and budget > 0) or context < 1:
        raise KVQError(f"invalid budget={budget!r} / context={context!r}: need a positive bits/element and >= 1 token")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise KVQError(f"invalid sink_tokens={sink_tokens!r}: allowed: an integer >= 0")
    cset = candidate_set(candidates) if isinstance(candidates, str) else candidates
    if value_window is not None:
        cset = with_value_window(cset, value_window)
    model, measured_on = measured_model(model, weights)
    facts = model_facts(model.config)
    layers, heads, dim = facts.num_layers, facts.num_kv_heads, facts.head_dim
    cset = fitting(cset, dim)
    windows = check_windows(windows, facts.vocab_size)
    samples = collect_attention_samples(model, windows, list(range(layers)), layers)
    with _one_thread():
        static_by = _static_for(model, cset, samples, layers, str(calibration.method), calibration.percentile)
        if metric == PlanMetric.ATTENTION:
            damages = measure_attention(model, samples, cset, static_by, layers, sink_tokens)
    if metric == PlanMetric.KL:  # model forwards: at the caller's threads
        damages = measure_kl(model, windows, cset, static_by, layers, sink_tokens)

    def nbytes(tq: TensorQuant) -> int:
        return sum(stream_bytes(tq, KVQuantScheme(key=tq, value=tq, sink_tokens=sink_tokens), seq_len=context,
                                batch=1, kv_heads=heads,
                                head_dim=dim).values())

    options = layer_options(damages, cset, layers, nbytes)
    elements = 2 * layers * heads * context * dim
    budget_bytes = int(budget * elements / 8)
    with task("plan: allocating bits", total=1) as advance:
        chosen = allocate(options, budget_bytes, resolution)
        advance()
    choice = [(options[layer][i].key, options[layer][i].value) for layer, i in enumerate(chosen)]
    scheme = scheme_from_choice(choice, name or f"plan-{budget:g}b", sink_tokens)
    bits = predict(scheme, facts, context).bits_per_element
    total = sum(options[layer][i].damage for layer, i in enumerate(chosen))
    uniform = []
    for i, (key, value) in enumerate(cset.options()):
        same = KVQuantScheme(key=key, value=value, sink_tokens=sink_tokens)
        uniform.append({"key": key.describe(), "value": value.describe(),
                        "bits_per_element": predict(same, facts, context).bits_per_element,
                        "damage": sum(row[i].damage for row in options)})
    logger.info("planned %s: %.3f bits/element at %d tokens (budget %g), predicted damage %.4g (%s metric)",
                scheme.name, bits, context, budget, total, metric)
    genai, nearest = genai_view(scheme, options, budget_bytes, facts, context, about=cset.about,
                                resolution=resolution)
    plan = Plan(scheme, bits, total, budget, context, metric, damages, uniform,
                {"candidates": cset.about, "calib_method": str(calibration.method), "sink_tokens": sink_tokens,
                 "value_window": value_window, "windows": len(windows),
                 "tokens": sum(len(w) for w in windows), "weights": measured_on}, genai, nearest, static_by)
    if servable:
        return plan.servable()
    if genai is not None and not genai["servable"]:
        near = genai["nearest"]
        offer = "no plan of one cache type fits the budget" if near is None else (
            f"the nearest plan it serves (--candidates {near['candidates']}): {near['bits_per_element']:.3f} "
            f"bits/element, predicted damage {near['predicted_damage']:.4g}: {nearest.describe()}")
        logger.warning("onnxruntime-genai cannot serve %s: %s; %s", scheme.name, genai["reason"], offer)
    return plan
