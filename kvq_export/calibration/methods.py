"""Calibration methods: the static scales (and zero points) of a stream from its calibration K/V.

:data:`METHODS`: ``absmax`` (the group's max: no calibration value is clipped), ``percentile`` (of ``|x|``, or of
``x`` for the top of an ``int`` range and ``100 - percentile`` for its bottom) and ``attention`` (a clip ratio per
(kv head, channel or group) from :data:`ATTENTION_CLIP_GRID`, chosen by the error it causes in attention on the
calibration windows; per kv head the best of those ratios, one shared ratio and absmax by the measured
attention-output error is kept, so on the calibration text it is never worse than ``absmax`` by that measure).

The arithmetic is the one :func:`kvq_export.reference.codec.quantize` applies to a dynamic group, the statistic
taken over all calibration tokens: scales (and zero points) come out rounded to the stream's ``scale_dtype``, every
scale at least that dtype's smallest positive normal number, as float32 ``{role: [kv_heads, n]}``
(:func:`stream_metadata`, :func:`attention_metadata`, :func:`stream_from_samples`) or a
:class:`~kvq_export.calibration.artifact.Calibration` (:func:`static_from_samples`).

The formulas, and why the ``attention`` objective is what it is: docs/concepts/scheme.md#how-the-methods-choose.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvq_export.calibration.artifact import HIGH_CHANNELS, META_ROLES, Calibration, static_streams
from kvq_export.calibration.passes import stream_samples
from kvq_export.dtypes import DType
from kvq_export.errors import KVQError, QuantizationError
from kvq_export.request import DEFAULT_PERCENTILE, CalibrationMethod
from kvq_export.vocab import Part

if TYPE_CHECKING:
    import torch

    from kvq_export.calibration.passes import AttentionSample
    from kvq_export.scheme import KVQuantScheme, TensorQuant

logger = logging.getLogger(__name__)

METHODS = tuple(str(method) for method in CalibrationMethod)
#: clip ratios (of the absmax statistic) the ``attention`` method tries per channel
ATTENTION_CLIP_GRID = tuple(round(1.0 - 0.04 * i, 2) for i in range(16))


def check_method(method: str, percentile: float) -> None:
    """Refuse an unknown method, or a percentile outside (50, 100] for ``percentile``."""
    if method not in METHODS:
        raise KVQError(f"unknown calibration method {method!r}; allowed: {', '.join(METHODS)}")
    number = isinstance(percentile, (int, float)) and not isinstance(percentile, bool)
    if method == "percentile" and not (number and 50.0 < percentile <= 100.0):
        raise KVQError(f"invalid percentile={percentile!r}: allowed: a number in (50, 100]")


def static_from_samples(samples: Mapping[int, list[AttentionSample]], scheme: KVQuantScheme, num_layers: int,
                        *, method: str = "attention", percentile: float = DEFAULT_PERCENTILE,
                        high_channels: Mapping[int, Mapping[Part, np.ndarray]] | None = None) -> Calibration:
    """Metadata of every static stream of ``scheme`` by ``method`` from already collected samples.

    The same numbers :func:`~kvq_export.calibration.measure.calibrate_static_scales` gives on the windows the
    samples came from, without running the model again (the planner calibrates many candidate formats from one
    pass). Streams with high
    channels take their chosen ``[H, n]`` channels from ``high_channels`` ``{layer: {part: ...}}`` (see
    :func:`~kvq_export.calibration.high_channels.choose_high_channels`) and keep them in the result.
    """
    check_method(method, percentile)
    static: dict[int, dict[Part, dict]] = {}
    for layer, part, tq in static_streams(scheme, num_layers):
        if layer not in samples:
            raise KVQError(f"no attention samples were collected for layer {layer}")
        static.setdefault(layer, {})[part] = stream_from_samples(
            samples[layer], part, tq, method=method, percentile=percentile,
            high_channels=(high_channels or {}).get(layer, {}).get(part))
    return Calibration.of(static)


def stream_from_samples(samples: Sequence[AttentionSample], part: Part, tq: TensorQuant, *, method: str,
                        percentile: float = DEFAULT_PERCENTILE, high_channels: np.ndarray | None = None,
                        stream: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Metadata of one static stream (one layer's ``part``) by ``method`` from that layer's samples.

    ``stream``: the samples' ``part`` already joined along the tokens ``[H, N, D]`` (a caller calibrating
    many formats of one stream joins it once); ``high_channels``: see :func:`static_from_samples`.
    """
    import torch

    from kvq_export.reference.codec import check_high_channels  # lazy: imports torch

    heads, _, dim = samples[0].keys.shape
    high = None if not tq.high_channels else check_high_channels(high_channels, tq, heads, dim)
    samples = stream_samples(samples, part)
    if method == "attention":
        meta = attention_metadata(list(samples), part, tq, high)
    else:
        if stream is None:
            stream = torch.cat([s.keys if part == Part.KEY else s.values for s in samples], dim=1)
        meta = stream_metadata(stream, tq, method, percentile, high)
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
    from kvq_export.reference.codec import channel_levels, metadata_from_range, scale_from_amax  # lazy: imports torch

    levels = None if high is None else channel_levels(tq, high, stats[0].shape[-1])
    if tq.has_zero_point:
        scale, zero = metadata_from_range(tq, *stats, None if levels is None else levels[1] - levels[0])
        return {"scales": scale, "zero_points": zero}
    return {"scales": scale_from_amax(tq, stats[0], None if levels is None else levels[1])}


def fake_quant(x: torch.Tensor, tq: TensorQuant, meta: dict) -> torch.Tensor:
    """Quantize then dequantize ``x`` [H, T, D] with static metadata, exactly as the reference codec does."""
    from kvq_export.reference.codec import dequantize, quantize  # lazy: imports torch

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


def _output_error(samples: list[AttentionSample], part: Part, tq: TensorQuant, meta: dict) -> torch.Tensor:
    """Key- or value-induced attention-output error energy per kv head [H] over all sampled queries."""
    import torch

    total = None
    for sample in samples:
        a = sample.attention()
        if part == Part.KEY:
            a_hat = sample.attention_with(fake_quant(sample.keys, tq, meta))
            err = torch.bmm(a_hat - a, sample.values)
        else:
            err = torch.bmm(a, fake_quant(sample.values, tq, meta) - sample.values)
        energy = err.pow(2).sum(dim=(1, 2)).double()
        total = energy if total is None else total + energy
    return total


def attention_metadata(samples: list[AttentionSample], part: Part, tq: TensorQuant,
                       high: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Static metadata of one stream with per-(head, unit) clip ratios chosen by attention error.

    ``high``: the stream's ``[H, n]`` high channels (:mod:`.high_channels`), when it keeps them.
    """
    import torch

    xs = [s.keys if part == Part.KEY else s.values for s in samples]
    values = static_groups(torch.cat(xs, dim=1), tq)
    stats = absmax_stats(values, tq)
    grid = torch.tensor(ATTENTION_CLIP_GRID, dtype=torch.float32)
    objective = None  # [C, H, n]
    for sample, x in zip(samples, xs):
        a = sample.attention()
        if part == Part.KEY:
            q2 = sample.grouped_queries().pow(2) * sample.scaling ** 2  # [H, G*P, D]
            weight = torch.bmm(a.transpose(1, 2), q2)  # [H, T, D]: attention received x query energy
        rows = []
        for ratio in grid:
            err = fake_quant(x, tq, candidate_metadata(tq, stats, ratio, high)) - x  # [H, T, D]
            moved = torch.bmm(a, err)  # [H, G*P, D]
            if part == Part.KEY:
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


def stream_metadata(
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


