"""Static-scale calibration: per-layer, per-(kv head, channel or group) scales from real K/V.

A stream (keys or values of one layer) whose :class:`~kvq_export.scheme.TensorQuant` has
``scales="static"`` quantizes every token against fixed metadata. :func:`calibrate_static_scales`
measures that metadata on what the cache receives: the model's post-RoPE keys and values as they
enter the cache (read from a ``transformers`` ``DynamicCache`` after one forward per window), in
float32, over every token of every window.

The result is the ``static`` mapping the reference cache and the exporters take::

    {layer: {"key" | "value": {"scales": [kv_heads, n], "zero_points": [kv_heads, n]}}}

numpy float32 arrays, ``n = head_dim // group`` for ``token``-axis streams and ``n = head_dim`` for
``channel``-axis streams; ``zero_points`` only for the asymmetric ``int`` format; only the layers and
parts whose stream is static. Values are already rounded to the stream's ``scale_dtype`` (so storing
them as that dtype is exact) and every scale is at least the smallest positive *normal* number of that
dtype (an all-zero channel would otherwise get scale 0; subnormals may be flushed to zero by GPU
kernels).

The arithmetic is the one :func:`kvq_export.reference.codec.quantize` applies to a dynamic group, with
the group's statistic taken over all calibration tokens instead:

* ``int_sym``: ``scale = (stat(|x|) * clip) / qmax``, ``qmax = 2**(bits-1) - 1``;
* ``fp8_e4m3``: ``scale = (stat(|x|) * clip) / 448``;
* ``int``: ``lo, hi = low/high stat(x)`` shrunk by ``clip`` about their midpoint, then
  ``scale = (hi - lo) / (2**bits - 1)`` and ``zero_point = lo``;

all in float32, the ``* clip`` step only when ``clip != 1``. ``stat`` is the max (``absmax``) or the
``percentile`` (``100 - percentile`` for ``lo``) over the group's values.

``attention`` chooses a clip ratio per (kv head, channel or group) from :data:`ATTENTION_CLIP_GRID`
(multiplying the absmax statistic; ``int`` shrinks the range about its midpoint) that minimises what the
error does to attention, not the tensor error. With the exact attention ``A = softmax(q Kᵀ s)`` of the
model's own (post-RoPE) queries on the calibration windows (causal, every kv group's query heads):

* values: the value-induced output error ``A (V̂ - V)``; output channel ``j`` depends only on value
  channel ``j``, so ``Σ_q ((A E_c)_qj)²`` (``E_c = V̂_c - V``) is minimised per channel exactly;
* keys: a quantization error ``e`` shifts the scores by ``δs = s q eᵀ``, and to second order the
  attention KL is ``½ Var_A(δs)``; its per-channel part ``s² Σ_q q_j² (Σ_n A_qn e_nj² - (Σ_n A_qn e_nj)²)``
  (cross-channel terms dropped) is minimised per channel.

The per-channel choice is then checked against the real key-/value-induced output error of the whole
head (``‖(A' - A) V‖²`` and ``‖A (V̂ - V)‖²`` summed over the calibration queries), and per (layer, kv
head) the best of the per-channel ratios, the best single ratio and absmax is kept, so on the
calibration text the method is never worse than ``absmax`` by that measure.

High channels (``TensorQuant.high_channels = n``, per-channel ``int`` / ``int_sym`` streams) are chosen here too,
and kept as role ``high_channels``: ``[kv_heads, n]`` ascending channel indices (int32), the ``n`` channels of
each kv head whose quantization error moves attention most. A key error ``e_c`` in channel ``c`` shifts every
score by ``s q_c e_c``, and a channel's error grows with its group range, so keys rank channels by
``E[q_c²] · E[range_c²]`` (the model's own post-RoPE queries; ranges over the stream's token groups, over each
calibration window for static scales, which are then fitted with each channel's own code range). A value
error in channel ``c`` reaches the residual stream through the ``o_proj`` columns that read it, so values rank
by ``Σ ‖o_proj[:, c]‖² · E[range_c²]`` over the kv head's query heads.

Files: :func:`save_calibration` writes one ``.npz`` with keys
``"<layer>.<key|value>.<scales|zero_points|high_channels>"``; :func:`calibration_digest` fingerprints a
calibration for manifests.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_export._atomic import atomic_writer
from kvq_export.corpus import load_corpus, token_windows
from kvq_export.dtypes import DType
from kvq_export.errors import KVQError, ModelError, QuantizationError, SchemeError
from kvq_export.model_source import model_facts
from kvq_export.progress import task
from kvq_export.request import DEFAULT_PERCENTILE, CalibrationMethod
from kvq_export.rotation import rotate_torch, rotation_matrix
from kvq_export.scheme import KVQuantScheme, TensorQuant

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

METHODS = tuple(str(method) for method in CalibrationMethod)
#: clip ratios (of the absmax statistic) the ``attention`` method tries per channel
ATTENTION_CLIP_GRID = tuple(round(1.0 - 0.04 * i, 2) for i in range(16))
#: decode queries per window the ``attention`` method scores (evenly spaced positions)
ATTENTION_QUERIES = 128
PARTS = ("key", "value")
META_ROLES = ("scales", "zero_points")
#: calibration role holding a stream's chosen 8-bit channels ``[kv_heads, n]`` (integer indices)
HIGH_CHANNELS = "high_channels"

StaticArrays = dict[int, dict[str, dict[str, np.ndarray]]]
"""``{layer: {"key"|"value": {"scales": [H, n], "zero_points": [H, n]}}}`` of numpy float32."""
StaticLike = Mapping[int, Mapping[str, Mapping[str, Any]]]
"""Any such mapping (numpy arrays, torch tensors or nested lists), as the functions below accept."""


def static_streams(scheme: KVQuantScheme, num_layers: int) -> list[tuple[int, str, TensorQuant]]:
    """(layer, ``key``|``value``, stream) for every quantized stream with static scales."""
    return [
        (layer, part, tq)
        for layer, streams in enumerate(scheme.streams(num_layers))
        for part, tq in zip(PARTS, streams, strict=True)
        if tq.quantized and tq.scales == "static"
    ]


def high_channel_streams(scheme: KVQuantScheme, num_layers: int) -> list[tuple[int, str, TensorQuant]]:
    """(layer, ``key``|``value``, stream) for every stream that keeps calibrated high channels."""
    return [
        (layer, part, tq)
        for layer, streams in enumerate(scheme.streams(num_layers))
        for part, tq in zip(PARTS, streams, strict=True)
        if tq.quantized and tq.high_channels
    ]


def ranging_group(tq: TensorQuant) -> int | None:
    """Tokens per range :func:`channel_importance` measures for ``tq`` (None: a whole window, static scales).

    Streams with the same ranging group rank channels alike (only how many they keep differs).
    """
    return None if tq.scales == "static" else int(tq.group_size)


def channel_importance(samples: Sequence[AttentionSample], part: str, tq: TensorQuant,
                       o_proj: torch.Tensor | None = None) -> torch.Tensor:
    """``[kv_heads, D]``: how much a channel's quantization error moves attention (see the module docstring)."""
    weight = range_sq = None
    ranging = ranging_group(tq)
    for sample in samples:
        x = sample.keys if part == "key" else sample.values  # [H, T, D]
        heads, tokens, dim = x.shape
        group = tokens if ranging is None else min(ranging, tokens)  # static: one range
        grouped = x[:, : tokens // group * group].reshape(heads, tokens // group, group, dim)
        r = (grouped.amax(2) - grouped.amin(2)).pow(2).mean(1)  # [H, D]
        range_sq = r if range_sq is None else range_sq + r
        if part == "key":
            w = sample.grouped_queries().pow(2).mean(1)  # [H, D]
            weight = w if weight is None else weight + w
    if part == "value":
        if o_proj is None:
            raise KVQError("ranking value channels needs the layer's o_proj weight")
        heads, dim = range_sq.shape
        weight = o_proj.float().pow(2).sum(0).reshape(heads, -1, dim).sum(1)
    return weight * range_sq


def choose_high_channels(samples: Sequence[AttentionSample], part: str, tq: TensorQuant,
                         o_proj: torch.Tensor | None = None) -> np.ndarray:
    """The ``tq.high_channels`` most important channels of each kv head, ascending, as int32 ``[H, n]``."""
    return top_channels(channel_importance(samples, part, tq, o_proj), tq.high_channels)


def top_channels(importance: torch.Tensor, n: int) -> np.ndarray:
    """The ``n`` channels of each kv head with the largest ``importance`` ``[H, D]``, ascending, int32 ``[H, n]``.

    Ties go to the lower channel index.
    """
    import torch

    ranked = importance.argsort(dim=-1, descending=True, stable=True)
    chosen, _ = torch.sort(ranked[:, :n], dim=-1)
    return chosen.numpy().astype(np.int32)


def calibrate_static_scales(
    model: PreTrainedModel,
    scheme: KVQuantScheme,
    token_windows: Sequence[Sequence[int]],
    *,
    method: str = "absmax",
    percentile: float = DEFAULT_PERCENTILE,
) -> StaticArrays:
    """Measure the static scales (and zero points) of every static stream of ``scheme`` on ``model``.

    Args:
        model: a Hugging Face causal LM (Llama family). It is run in eval mode under
            ``torch.inference_mode``, one window per forward; its training flag is restored.
        scheme: the cache scheme; only its ``scales="static"`` streams are calibrated.
        token_windows: token-id sequences (e.g. from :func:`kvq_export.corpus.token_windows`); each is
            one independent sequence starting at position 0.
        method: ``absmax`` (the group maximum: no calibration value is clipped), ``percentile``, or
            ``attention`` (per-channel clipping chosen by its effect on attention, see the module docstring).
        percentile: for ``method="percentile"``, in (50, 100]: the percentile of ``|x|`` (symmetric and
            fp8) or of ``x`` for the top of the range (``int``, whose bottom uses ``100 - percentile``).

    Returns:
        the ``static`` mapping described in the module docstring.

    Raises:
        SchemeError: the scheme has no static stream, or does not fit the model.
        KVQError: bad method/percentile, empty or malformed windows.
        QuantizationError: non-finite K/V, or a scale that overflows ``scale_dtype``.

    """
    _check_method(method, percentile)

    facts = model_facts(model.config)
    scheme.check_model(facts.num_layers, facts.head_dim)
    targets = static_streams(scheme, facts.num_layers)
    high = high_channel_streams(scheme, facts.num_layers)
    if not targets and not high:
        raise SchemeError(
            f"scheme {scheme.name or scheme.describe()!r} has no static-scale or high-channel streams: "
            "nothing to calibrate"
        )
    windows = _check_windows(token_windows, facts.vocab_size)
    static: StaticArrays = {}
    samples = None
    if high or method == "attention":  # one pass over the windows serves the channel choice and the scales
        samples = collect_attention_samples(model, windows, sorted({layer for layer, _, _ in (*high, *targets)}),
                                            facts.num_layers)
    if high:
        for layer, part, tq in high:
            o_proj = model.model.layers[layer].self_attn.o_proj.weight.detach().cpu() if part == "value" else None
            static.setdefault(layer, {}).setdefault(part, {})[HIGH_CHANNELS] = choose_high_channels(
                samples[layer], part, tq, o_proj)
        logger.info("chose the high channels of %d stream(s) on %d token(s)", len(high),
                    sum(len(w) for w in windows))
        if not targets:
            return static
    import torch

    def chosen(layer: int, part: str):  # a static stream's high channels, chosen above (None without)
        high = static.get(layer, {}).get(part, {}).get(HIGH_CHANNELS)
        return None if high is None else torch.as_tensor(high).to(torch.int64)

    if method == "attention":
        with task("calibration: streams", total=len(targets)) as advance:
            for layer, part, tq in targets:
                rotation = rotation_matrix(tq.rotation, facts.head_dim)
                static.setdefault(layer, {}).setdefault(part, {}).update(attention_metadata(
                    [s.rotated(rotation) for s in samples[layer]], part, tq, chosen(layer, part)))
                advance()
    else:
        if samples is None:
            with task("calibration: forward passes", total=len(windows)) as advance:
                collected = _collect_kv(model, windows, {(layer, part) for layer, part, _ in targets},
                                        facts.num_layers, advance)
        else:  # the samples hold every window's K/V already (the same forward passes)
            collected = {(layer, part): torch.cat([s.keys if part == "key" else s.values for s in samples[layer]],
                                                  dim=1) for layer, part, _ in targets}
        for layer, part, tq in targets:
            # a rotated stream stores (and so quantizes) x @ R: its static scales belong to that basis
            values = rotate_torch(collected.pop((layer, part)), rotation_matrix(tq.rotation, facts.head_dim))
            static.setdefault(layer, {}).setdefault(part, {}).update(
                _stream_metadata(values, tq, method, percentile, chosen(layer, part)))
    tokens = sum(len(w) for w in windows)
    logger.info(
        "calibrated %d static stream(s) over %d layer(s) on %d token(s) in %d window(s) (method=%s%s)",
        len(targets), len(static), tokens, len(windows), method,
        f", percentile={percentile:g}" if method == "percentile" else "",
    )
    return static


def calibration_windows(tokenizer: Any, corpus: str, tokens: int, *, offset: int = 0) -> list[list[int]]:
    """About ``tokens`` calibration tokens of ``corpus`` from token ``offset`` on, in whole windows of <= 1024.

    ``kvq export``, ``kvq bench`` and ``kvq plan`` cut calibration text the same way, so the same options
    give the same scales.
    """
    window = min(1024, tokens)
    return token_windows(tokenizer, load_corpus(corpus), max(1, tokens // window), window, offset=offset)


def _check_method(method: str, percentile: float) -> None:
    if method not in METHODS:
        raise KVQError(f"unknown calibration method {method!r}; allowed: {', '.join(METHODS)}")
    number = isinstance(percentile, (int, float)) and not isinstance(percentile, bool)
    if method == "percentile" and not (number and 50.0 < percentile <= 100.0):
        raise KVQError(f"invalid percentile={percentile!r}: allowed: a number in (50, 100]")


def _check_windows(token_windows: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Plain lists of ints; raise for no window, an empty window or an id outside the vocabulary."""
    windows = [[int(t) for t in window] for window in token_windows]
    if not windows:
        raise KVQError("no calibration token windows given: need at least one non-empty window of token ids")
    for i, window in enumerate(windows):
        if not window:
            raise KVQError(f"calibration token window {i} is empty")
        bad = [t for t in window if not 0 <= t < vocab_size]
        if bad:
            raise KVQError(
                f"calibration token window {i} has id {bad[0]} outside the vocabulary [0, {vocab_size})"
            )
    return windows


def _collect_kv(
    model: PreTrainedModel, windows: list[list[int]], needed: set[tuple[int, str]], num_layers: int,
    advance: Callable[[], None] | None = None,
) -> dict[tuple[int, str], torch.Tensor]:
    """Run every window through ``model``; return the needed K/V streams as float32 ``[H, tokens, D]``.

    ``advance`` is called after each window.
    """
    import torch
    from transformers.cache_utils import DynamicCache

    from kvq_export.reference.codec import check_finite

    device = next(model.parameters()).device
    chunks: dict[tuple[int, str], list[torch.Tensor]] = {key: [] for key in needed}
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for window in windows:
                # A config-less DynamicCache keeps every token in every layer (no sliding-window layers).
                cache = DynamicCache()
                ids = torch.tensor([window], dtype=torch.long, device=device)
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                if len(cache.layers) != num_layers:
                    raise ModelError(
                        f"the model filled {len(cache.layers)} cache layer(s), its config says {num_layers}"
                    )
                for layer, part in needed:
                    stored = cache.layers[layer].keys if part == "key" else cache.layers[layer].values
                    if stored is None or stored.dim() != 4 or stored.shape[2] != len(window):
                        got = None if stored is None else list(stored.shape)
                        raise ModelError(
                            f"layer {layer} cached {part}s of shape {got} for a window of {len(window)} "
                            "tokens; calibration needs every token in the cache"
                        )
                    x = stored[0].to(device="cpu", dtype=torch.float32)
                    check_finite(x)
                    chunks[(layer, part)].append(x)
                if advance is not None:
                    advance()
    finally:
        model.train(was_training)
    return {key: torch.cat(parts, dim=1) for key, parts in chunks.items()}


@dataclass
class AttentionSample:
    """One calibration window of one layer: sampled post-RoPE queries and every cached K/V (float32).

    ``q`` [Hq, P, D] at token positions ``positions`` [P]; ``keys``/``values`` [Hkv, T, D]; ``scaling``
    the softmax scale.
    """

    q: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    residual_norm: torch.Tensor | None = None  # [P]: |residual stream| entering the layer (for planning)

    def rotated(self, matrix: np.ndarray | None) -> AttentionSample:
        """The same window in a rotated basis (q, K and V times ``matrix``).

        Scores and errors are unchanged in exact arithmetic, but a rotated stream is quantized in that basis.
        """
        if matrix is None:
            return self
        return replace(self, q=rotate_torch(self.q, matrix), keys=rotate_torch(self.keys, matrix),
                                   values=rotate_torch(self.values, matrix))

    def attention(self) -> torch.Tensor:
        """Exact causal attention weights ``[Hkv, G * P, T]`` (each kv head's query heads stacked)."""
        return self.attention_with(self.keys)

    def grouped_queries(self) -> torch.Tensor:
        """Queries by kv head ``[Hkv, G * P, D]`` (query head ``h`` reads kv head ``h // G``)."""
        hkv = self.keys.shape[0]
        hq, p, d = self.q.shape
        return self.q.reshape(hkv, (hq // hkv) * p, d)

    def scores(self, keys: torch.Tensor) -> torch.Tensor:
        """Scaled scores ``[Hkv, G * P, T]`` of the sampled queries over ``keys`` [Hkv, T, D], unmasked."""
        import torch

        return torch.bmm(self.grouped_queries(), keys.transpose(1, 2)) * self.scaling

    def attention_with(self, keys: torch.Tensor, recent: int = 0,
                       exact_scores: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention weights of the sampled queries over ``keys`` [Hkv, T, D].

        ``recent`` > 0: each query reads its ``recent`` newest keys (its own included) from the exact
        ``self.keys`` instead, as a cache with that high-precision window does. ``exact_scores``: those
        keys' :meth:`scores`, when the caller already has them.
        """
        import torch

        scores = self.scores(keys)
        if recent:
            exact = self.scores(self.keys) if exact_scores is None else exact_scores
            scores = torch.where(self.recent_mask(recent)[None], exact, scores)
        return self.softmax(scores)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Causal attention weights from :meth:`scores` (the future masked out)."""
        import torch

        return torch.softmax(scores.masked_fill(self._key_offsets()[None] > 0, float("-inf")), dim=-1)

    def recent_mask(self, recent: int) -> torch.Tensor:
        """``[G * P, T]`` bool: key ``j`` is among the ``recent`` newest tokens a query at its position holds."""
        return self._key_offsets() > -recent

    def _key_offsets(self) -> torch.Tensor:
        """``[G * P, T]``: each key's position minus its query's (> 0: the future; rows as in ``grouped_queries``)."""
        import torch

        groups = self.q.shape[0] // self.keys.shape[0]
        return torch.arange(self.keys.shape[1])[None, :] - self.positions.repeat(groups)[:, None]


def collect_attention_samples(
    model: PreTrainedModel, windows: list[list[int]], layers: list[int], num_layers: int
) -> dict[int, list[AttentionSample]]:
    """K/V from the cache and post-RoPE queries (hooked on each attention module) for every window.

    Queries are taken at :data:`ATTENTION_QUERIES` evenly spaced positions of each window (all of them
    when the window is shorter). RoPE is applied with the module's own ``position_embeddings`` and
    ``transformers``' Llama ``apply_rotary_pos_emb`` (the Llama family's convention).
    """
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    try:
        modules = {layer: model.model.layers[layer].self_attn for layer in layers}
    except (AttributeError, IndexError) as err:
        raise ModelError(f"the attention calibration needs a Llama-family model (model.layers[i].self_attn): {err}") \
            from None
    captured: dict[int, torch.Tensor] = {}
    residual: dict[int, torch.Tensor] = {}

    def stream_hook(layer: int):
        def run(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            residual[layer] = hidden[0].to(device="cpu", dtype=torch.float32).norm(dim=-1)
        return run

    def hook(layer: int):
        def run(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            batch, tokens, _ = hidden.shape
            q = module.q_proj(hidden).view(batch, tokens, -1, module.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            captured[layer] = q[0].to(device="cpu", dtype=torch.float32)
        return run

    handles = [modules[layer].register_forward_pre_hook(hook(layer), with_kwargs=True) for layer in layers]
    handles += [model.model.layers[layer].register_forward_pre_hook(stream_hook(layer), with_kwargs=True)
                for layer in layers]
    samples: dict[int, list[AttentionSample]] = {layer: [] for layer in layers}
    try:
        with task("attention samples: forward passes", total=len(windows)) as advance:
            for window in windows:
                captured.clear()
                kv = _collect_kv(model, [window], {(layer, part) for layer in layers for part in PARTS}, num_layers)
                n = len(window)
                positions = torch.unique(torch.linspace(0, n - 1, min(n, ATTENTION_QUERIES)).round().long())
                for layer in layers:
                    module = modules[layer]
                    scaling = float(getattr(module, "scaling", module.head_dim ** -0.5))
                    samples[layer].append(AttentionSample(captured[layer][:, positions].contiguous(), positions,
                                                          kv[(layer, "key")], kv[(layer, "value")], scaling,
                                                          residual[layer][positions].contiguous()))
                advance()
    finally:
        for handle in handles:
            handle.remove()
    return samples


def static_from_samples(samples: Mapping[int, list[AttentionSample]], scheme: KVQuantScheme, num_layers: int,
                        *, method: str = "attention", percentile: float = DEFAULT_PERCENTILE,
                        high_channels: Mapping[int, Mapping[str, np.ndarray]] | None = None) -> StaticArrays:
    """Metadata of every static stream of ``scheme`` by ``method`` from already collected samples.

    The same numbers :func:`calibrate_static_scales` gives on the windows the samples came from, without
    running the model again (the planner calibrates many candidate formats from one pass). Streams with high
    channels take their chosen ``[H, n]`` channels from ``high_channels`` ``{layer: {part: ...}}`` (see
    :func:`choose_high_channels`) and keep them in the result.
    """
    _check_method(method, percentile)
    static: StaticArrays = {}
    for layer, part, tq in static_streams(scheme, num_layers):
        if layer not in samples:
            raise KVQError(f"no attention samples were collected for layer {layer}")
        static.setdefault(layer, {})[part] = stream_from_samples(
            samples[layer], part, tq, method=method, percentile=percentile,
            high_channels=(high_channels or {}).get(layer, {}).get(part))
    return static


def stream_from_samples(samples: Sequence[AttentionSample], part: str, tq: TensorQuant, *, method: str,
                        percentile: float = DEFAULT_PERCENTILE, high_channels: np.ndarray | None = None,
                        stream: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Metadata of one static stream (one layer's ``part``) by ``method`` from that layer's samples.

    ``stream``: the samples' ``part`` already joined along the tokens ``[H, N, D]`` (a caller calibrating
    many formats of one stream joins it once); ``high_channels``: see :func:`static_from_samples`.
    """
    import torch

    from kvq_export.reference.codec import check_high_channels

    heads, _, dim = samples[0].keys.shape
    high = None if not tq.high_channels else check_high_channels(high_channels, tq, heads, dim)
    if method == "attention":
        meta = attention_metadata(list(samples), part, tq, high)
    else:
        if stream is None:
            stream = torch.cat([s.keys if part == "key" else s.values for s in samples], dim=1)
        meta = _stream_metadata(stream, tq, method, percentile, high)
    if high is not None:
        meta[HIGH_CHANNELS] = high.numpy().astype(np.int32)
    return meta


def candidate_metadata(tq: TensorQuant, stats: tuple[torch.Tensor, ...], ratio: torch.Tensor,
                       high: torch.Tensor | None = None) -> dict:
    """Scales (and zero points) ``[H, n]`` for the absmax statistics shrunk by ``ratio`` ([H, n] or scalar).

    ``high``: the stream's ``[H, n]`` high channels (kept in the result, and fitted to their 8-bit levels).
    """
    import torch

    sdtype = DType.get(tq.scale_dtype).torch
    if tq.has_zero_point:
        lo, hi = stats
        mid, half = (hi + lo) * 0.5, (hi - lo) * (0.5 * ratio)
        meta = fit_metadata(tq, (mid - half, mid + half), high)
    else:
        meta = fit_metadata(tq, (stats[0] * ratio,), high)
    meta["scales"] = torch.clamp_min(meta["scales"], torch.finfo(sdtype).tiny)
    return {role: t.float() for role, t in meta.items()} | ({} if high is None else {HIGH_CHANNELS: high})


def fit_metadata(tq: TensorQuant, stats: tuple[torch.Tensor, ...],
                 high: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Scales (and zero points) in ``scale_dtype`` for per-unit statistics: (min, max) for ``int``, (max|x|,).

    ``high``: the stream's ``[H, n]`` high channels, fitted to their own 8-bit code range.
    """
    from kvq_export.reference.codec import channel_levels, metadata_from_range, scale_from_amax

    levels = None if high is None else channel_levels(tq, high, stats[0].shape[-1])
    if tq.has_zero_point:
        scale, zero = metadata_from_range(tq, *stats, None if levels is None else levels[1] - levels[0])
        return {"scales": scale, "zero_points": zero}
    return {"scales": scale_from_amax(tq, stats[0], None if levels is None else levels[1])}


def fake_quant(x: torch.Tensor, tq: TensorQuant, meta: dict) -> torch.Tensor:
    """Quantize then dequantize ``x`` [H, T, D] with static metadata, exactly as the reference codec does."""
    from kvq_export.reference.codec import dequantize, quantize

    high = meta.get(HIGH_CHANNELS)
    q = quantize(x, tq, static_scales=meta["scales"], static_zeros=meta.get("zero_points"), high_channels=high)
    return dequantize(q, tq, high_channels=high)


def _unit_sum(per_channel: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """Sum ``[..., D]`` per-channel objectives over each static group: ``[..., n]``."""
    if tq.axis == "channel":
        return per_channel
    dim = per_channel.shape[-1]
    group = tq.token_group(dim)
    return per_channel.reshape(*per_channel.shape[:-1], dim // group, group).sum(dim=-1)


def _output_error(samples: list[AttentionSample], part: str, tq: TensorQuant, meta: dict) -> torch.Tensor:
    """Key- or value-induced attention-output error energy per kv head [H] over all sampled queries."""
    import torch

    total = None
    for sample in samples:
        a = sample.attention()
        if part == "key":
            a_hat = sample.attention_with(fake_quant(sample.keys, tq, meta))
            err = torch.bmm(a_hat - a, sample.values)
        else:
            err = torch.bmm(a, fake_quant(sample.values, tq, meta) - sample.values)
        energy = err.pow(2).sum(dim=(1, 2)).double()
        total = energy if total is None else total + energy
    return total


def attention_metadata(samples: list[AttentionSample], part: str, tq: TensorQuant,
                       high: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Static metadata of one stream with per-(head, unit) clip ratios chosen by attention error.

    ``high``: the stream's ``[H, n]`` high channels (:func:`choose_high_channels`), when it keeps them.
    """
    import torch

    xs = [s.keys if part == "key" else s.values for s in samples]
    values = static_groups(torch.cat(xs, dim=1), tq)
    stats = absmax_stats(values, tq)
    grid = torch.tensor(ATTENTION_CLIP_GRID, dtype=torch.float32)
    objective = None  # [C, H, n]
    for sample, x in zip(samples, xs):
        a = sample.attention()
        if part == "key":
            q2 = sample.grouped_queries().pow(2) * sample.scaling ** 2  # [H, G*P, D]
            weight = torch.bmm(a.transpose(1, 2), q2)  # [H, T, D]: attention received x query energy
        rows = []
        for ratio in grid:
            err = fake_quant(x, tq, candidate_metadata(tq, stats, ratio, high)) - x  # [H, T, D]
            moved = torch.bmm(a, err)  # [H, G*P, D]
            if part == "key":
                per_channel = (weight * err.pow(2)).sum(dim=1) - (q2 * moved.pow(2)).sum(dim=1)
            else:
                per_channel = moved.pow(2).sum(dim=1)
            rows.append(_unit_sum(per_channel.double(), tq))
        window_objective = torch.stack(rows)
        objective = window_objective if objective is None else objective + window_objective
    per_unit = grid[objective.argmin(dim=0)]  # [H, n]
    uniform = grid[objective.sum(dim=2).argmin(dim=0)][:, None].expand_as(per_unit)  # [H, n]
    choices = [per_unit, uniform, torch.ones_like(per_unit)]
    metas = [candidate_metadata(tq, stats, ratio, high) for ratio in choices]
    errors = torch.stack([_output_error(samples, part, tq, meta) for meta in metas])  # [3, H]
    best = errors.argmin(dim=0)  # per kv head
    out = {role: torch.stack([metas[int(best[h])][role][h] for h in range(best.shape[0])])
           for role in META_ROLES if role in metas[0]}
    logger.debug("attention calibration %s: choice per head %s (0 per-channel, 1 uniform, 2 absmax), "
                 "output error vs absmax %s", part, best.tolist(),
                 (errors.min(dim=0).values / errors[2].clamp_min(1e-300)).tolist())
    return {role: array.numpy().astype(np.float32).copy() for role, array in out.items()}


def static_groups(x: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """``[H, N, D]`` -> ``[H, n, M]``: one static group per row of the last dim (all its values)."""
    heads, tokens, dim = x.shape
    if tq.axis == "channel":
        return x.permute(0, 2, 1)
    group = tq.token_group(dim)
    return x.reshape(heads, tokens, dim // group, group).permute(0, 2, 1, 3).reshape(heads, dim // group, -1)


def absmax_stats(values: torch.Tensor, tq: TensorQuant) -> tuple[torch.Tensor, ...]:
    """:func:`fit_metadata`'s statistics of grouped values (:func:`static_groups`): (min, max), or (max|x|,)."""
    return (values.amin(dim=-1), values.amax(dim=-1)) if tq.has_zero_point else (values.abs().amax(dim=-1),)


def _stat(values: torch.Tensor, method: str, q: float, *, low: bool = False) -> torch.Tensor:
    """Max (min when ``low``) or percentile ``q`` over the last dim, as float32."""
    import torch

    if method == "absmax":
        return values.amin(dim=-1) if low else values.amax(dim=-1)
    pct = np.percentile(values.numpy(), q, axis=-1)  # linear interpolation, float64
    return torch.from_numpy(np.ascontiguousarray(pct)).to(torch.float32)


def _stream_metadata(
    x: torch.Tensor, tq: TensorQuant, method: str, percentile: float, high: torch.Tensor | None = None
) -> dict[str, np.ndarray]:
    """Scales (and zero points) of one stream from its calibration values ``[H, N, D]`` (``high``: see fit_metadata)."""
    import torch

    sdtype = DType.get(tq.scale_dtype).torch
    values = static_groups(x, tq)
    if tq.has_zero_point:
        stats = (_stat(values, method, 100.0 - percentile, low=True), _stat(values, method, percentile))
    else:
        stats = (_stat(values.abs(), method, percentile),)
    fitted = fit_metadata(tq, stats, high)
    scale, zero = fitted["scales"], fitted.get("zero_points")
    if not bool(torch.isfinite(scale).all()) or (zero is not None and not bool(torch.isfinite(zero).all())):
        raise QuantizationError(
            f"a calibrated scale or zero point overflows scale_dtype={tq.scale_dtype} (values too large); "
            "use scale_dtype fp32"
        )
    scale = torch.clamp_min(scale, torch.finfo(sdtype).tiny)
    out = {"scales": scale.to(torch.float32).numpy().copy()}
    if zero is not None:
        out["zero_points"] = zero.to(torch.float32).numpy().copy()
    return out


# -- conversion, checks and files --------------------------------------------------------------------
def static_to_torch(static: StaticLike) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Convert to torch float32 tensors (what :class:`~kvq_export.reference.cache.ReferenceCache` takes)."""
    import torch

    return {
        int(layer): {
            part: {role: torch.as_tensor(np.asarray(a, dtype=np.int64 if role == HIGH_CHANNELS else np.float32))
                   for role, a in meta.items()}
            for part, meta in parts.items()
        }
        for layer, parts in static.items()
    }


def check_calibration(
    static: StaticLike,
    scheme: KVQuantScheme,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Raise :class:`SchemeError` unless ``static`` has every array the scheme's static streams need.

    Checks presence, shape ``[num_kv_heads, n]``, finiteness and strictly positive scales. Shapes
    cannot tell two schemes with the same layout apart (ort-int8 vs ort-int4): compare digests for that.
    """
    for layer, part, tq in high_channel_streams(scheme, num_layers):
        chosen = static.get(layer, {}).get(part, {}).get(HIGH_CHANNELS)
        if chosen is None:
            raise SchemeError(f"the calibration lacks high_channels for layer {layer} {part} "
                              f"({tq.high_channels} 8-bit channels per head)")
        import torch

        from kvq_export.reference.codec import check_high_channels

        try:
            check_high_channels(torch.as_tensor(np.asarray(chosen)), tq, num_kv_heads, head_dim)
        except QuantizationError as err:
            raise SchemeError(f"calibration {layer}.{part}: {err}") from None
    for layer, part, tq in static_streams(scheme, num_layers):
        meta = static.get(layer, {}).get(part)
        if meta is None:
            raise SchemeError(
                f"the calibration has no entry for layer {layer} {part} (a static-scale stream)"
            )
        n = tq.metadata_shape(head_dim)[1]
        for role in ("scales", "zero_points") if tq.has_zero_point else ("scales",):
            if role not in meta:
                raise SchemeError(f"the calibration lacks {role} for layer {layer} {part}")
            array = np.asarray(meta[role])
            if array.shape != (num_kv_heads, n):
                raise SchemeError(
                    f"calibration {layer}.{part}.{role} has shape {list(array.shape)}; the scheme needs "
                    f"[kv_heads={num_kv_heads}, {n}]"
                )
            if not np.isfinite(array).all() or (role == "scales" and not (array > 0).all()):
                raise SchemeError(f"calibration {layer}.{part}.{role} has non-finite or non-positive values")


def _flatten(static: StaticLike) -> dict[str, np.ndarray]:
    """``{"<layer>.<part>.<role>": float32 array}`` in a stable (layer, part, role) order."""
    flat: dict[str, np.ndarray] = {}
    for layer in sorted(static, key=int):
        for part in PARTS:
            for role in (*META_ROLES, HIGH_CHANNELS):
                array = static[layer].get(part, {}).get(role)
                if array is not None:
                    dtype = np.int32 if role == HIGH_CHANNELS else np.float32
                    flat[f"{int(layer)}.{part}.{role}"] = np.ascontiguousarray(np.asarray(array), dtype=dtype)
    return flat


def save_calibration(static: StaticLike, path: str | os.PathLike[str]) -> Path:
    """Write ``static`` to one ``.npz`` (keys ``"3.key.scales"``) atomically; return the path.

    The file is written to a temporary name beside ``path`` and renamed over it, so a reader never sees
    a partial file. The name is used as given (no ``.npz`` is appended).
    """
    target = Path(path)
    flat = _flatten(static)
    if not flat:
        raise KVQError("nothing to save: the calibration has no arrays")
    with atomic_writer(target, "wb") as handle:
        np.savez(handle, **flat)
    logger.info(
        "saved calibration (%d array(s), digest %s) to %s", len(flat), calibration_digest(static), target
    )
    return target


def load_calibration(path: str | os.PathLike[str]) -> StaticArrays:
    """Read a file written by :func:`save_calibration` back into the ``static`` mapping."""
    source = Path(path)
    if not source.is_file():
        raise KVQError(f"calibration file {str(source)!r} does not exist")
    try:
        with np.load(source, allow_pickle=False) as data:
            flat = {name: data[name] for name in data.files}
    except (OSError, ValueError) as err:
        raise KVQError(f"calibration file {str(source)!r} is not a readable .npz: {err}") from None
    static: StaticArrays = {}
    for name, array in flat.items():
        layer, _, rest = name.partition(".")
        part, _, role = rest.partition(".")
        if not layer.isdigit() or part not in PARTS or role not in (*META_ROLES, HIGH_CHANNELS):
            raise KVQError(
                f"calibration file {str(source)!r} has an unexpected array {name!r}; expected names like "
                "'3.key.scales', '3.value.zero_points' or '3.key.high_channels'"
            )
        if array.dtype != (np.int32 if role == HIGH_CHANNELS else np.float32) or array.ndim != 2:
            raise KVQError(
                f"calibration array {name!r} must be 2-D {'int32' if role == HIGH_CHANNELS else 'float32'}, "
                f"got {array.dtype} {list(array.shape)}"
            )
        static.setdefault(int(layer), {}).setdefault(part, {})[role] = array
    if not static:
        raise KVQError(f"calibration file {str(source)!r} holds no arrays")
    return {layer: static[layer] for layer in sorted(static)}


def calibration_digest(static: StaticLike, length: int = 16) -> str:
    """Short sha256 hex digest of the arrays (names, shapes and float32 bytes), for manifests."""
    digest = hashlib.sha256()
    for name, array in _flatten(static).items():
        digest.update(f"{name}:{'x'.join(map(str, array.shape))}:".encode())
        digest.update(array.astype("<f4", copy=False).tobytes())
    return digest.hexdigest()[:length]
