"""Measure a :class:`~kvq_export.calibration.artifact.Calibration` on a model: passes, then methods.

A stream (keys or values of one layer) whose :class:`~kvq_export.scheme.TensorQuant` has ``scales="static"``
quantizes every token against fixed metadata; :func:`calibrate_static_scales` measures that metadata on what the
cache receives (:mod:`.passes`) by the chosen method (:mod:`.methods`), and chooses the high channels of streams
that keep them (:mod:`.high_channels`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvq_export.calibration.artifact import HIGH_CHANNELS, Calibration, high_channel_streams, static_streams
from kvq_export.calibration.high_channels import choose_high_channels
from kvq_export.calibration.methods import attention_metadata, check_method, stream_metadata
from kvq_export.calibration.passes import check_windows, collect_attention_samples, collect_kv, stream_samples
from kvq_export.calibration.positions import KeyPositions
from kvq_export.errors import SchemeError
from kvq_export.model_source import model_facts
from kvq_export.progress import task
from kvq_export.request import DEFAULT_PERCENTILE
from kvq_export.rotation import rotate_torch, rotation_matrix
from kvq_export.vocab import Part, WeightFormat

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from kvq_export.calibration.passes import AttentionSample
    from kvq_export.model_facts import ModelFacts
    from kvq_export.request import WeightSpec
    from kvq_export.scheme import KVQuantScheme, TensorQuant

    #: (layer, ``key``|``value``, stream) of the streams to calibrate, and the attention samples per layer
    Streams = Sequence[tuple[int, Part, TensorQuant]]
    Samples = Mapping[int, Sequence[AttentionSample]]

logger = logging.getLogger(__name__)


def calibrate_static_scales(
    model: PreTrainedModel,
    scheme: KVQuantScheme,
    token_windows: Sequence[Sequence[int]],
    *,
    method: str = "absmax",
    percentile: float = DEFAULT_PERCENTILE,
    weights: WeightSpec | None = None,
) -> Calibration:
    """Measure the static scales (and zero points) and high channels ``scheme`` needs on ``model``.

    Args:
        model: a Hugging Face causal LM (Llama family). It is run in eval mode under
            ``torch.inference_mode``, one window per forward; its training flag is restored.
        scheme: the cache scheme; only its ``scales="static"`` streams are calibrated.
        token_windows: token-id sequences (e.g. from :func:`kvq_export.corpus.token_windows`); each is
            one independent sequence starting at position 0.
        method: ``absmax`` (the group maximum: no calibration value is clipped), ``percentile``, or
            ``attention`` (per-channel clipping chosen by its effect on attention, see :mod:`.methods`).
        percentile: for ``method="percentile"``, in (50, 100]: the percentile of ``|x|`` (symmetric and
            fp8) or of ``x`` for the top of the range (``int``, whose bottom uses ``100 - percentile``).
        weights: how the export stores the weights (None: as computed). int4 / int8 blocks: the passes run on the
            model with the weights the export computes with (:func:`measured_model`), and the result records them
            (:attr:`Calibration.weights`).

    Returns:
        the arrays of the static and high-channel streams only, checked against the scheme and the model.

    Raises:
        SchemeError: the scheme has no static stream, or does not fit the model.
        KVQError: bad method/percentile, empty or malformed windows.
        QuantizationError: non-finite K/V, or a scale that overflows ``scale_dtype``.

    """
    check_method(method, percentile)
    model, measured_on = measured_model(model, weights, token_windows)
    facts = model_facts(model.config)
    scheme.check_model(facts)
    targets, high = _streams_to_calibrate(scheme, facts.num_layers)
    windows = check_windows(token_windows, facts.vocab_size)
    static: dict[int, dict[Part, dict]] = {}
    positions = KeyPositions.of(model.config, facts.max_position_embeddings)
    samples = _shared_samples(model, windows, targets, high, method, facts.num_layers, positions)
    if high:
        _choose_high_channels(model, samples, high, static)
        logger.info("chose the high channels of %d stream(s) on %d token(s)", len(high),
                    sum(len(w) for w in windows))
    if targets:
        _static_scales(model, windows, samples, targets, static, facts, method, percentile, positions)
    return _checked(static, scheme, facts, measured_on)


def measured_model(model: PreTrainedModel, weights: WeightSpec | None,
                   windows: Sequence[Sequence[int]] = ()) -> tuple[PreTrainedModel, dict | None]:
    """The model calibration and planning run for an export storing its weights as ``weights``, and its record.

    Int blocks: a copy with the weights the export computes with (ONNX Runtime's codes and scales dequantized,
    :func:`kvq_export.calibration.weights.dequantized_model`) and their settings (:attr:`Calibration.weights`); else
    ``model`` itself and None (its own weights). w8a8: the model smoothed on ``windows`` first, as an export smooths
    it on the same calibration text (:mod:`kvq_export.calibration.smoothing`), unless it was smoothed already.
    """
    measured_on = None if weights is None else weights.calibration_weights
    if measured_on is None:
        return model, None
    from kvq_export.calibration.smoothing import smoothed_model, smoothing_record
    from kvq_export.calibration.weights import dequantized_model

    if weights.format == WeightFormat.W8A8 and smoothing_record(model) is None:
        model = smoothed_model(model, windows)
    return dequantized_model(model, weights), measured_on


def _streams_to_calibrate(scheme: KVQuantScheme, num_layers: int) -> tuple[Streams, Streams]:
    """(static-scale streams, high-channel streams) of ``scheme``; a :class:`SchemeError` when there are none."""
    targets, high = static_streams(scheme, num_layers), high_channel_streams(scheme, num_layers)
    if not targets and not high:
        raise SchemeError(
            f"scheme {scheme.name or scheme.describe()!r} has no static-scale or high-channel streams: "
            "nothing to calibrate"
        )
    return targets, high


def _shared_samples(model: PreTrainedModel, windows: list[list[int]], targets: Streams, high: Streams, method: str,
                    num_layers: int, positions: KeyPositions) -> Samples | None:
    """The attention samples of the layers calibrated, when the channel choice or the method reads them (else None).

    One pass over the windows serves both; without either, :func:`_stream_scales` collects only the K/V it needs.
    Each layer reads its windows' samples at every offset of :mod:`.positions` (keys as they stand anywhere in the
    context), made when it is read.
    """
    if not high and method != "attention":
        return None
    layers = sorted({layer for layer, _, _ in (*high, *targets)})
    return positions.every_layer(collect_attention_samples(model, windows, layers, num_layers))


def _choose_high_channels(model: PreTrainedModel, samples: Samples, high: Streams, static: dict) -> None:
    """Choose each high-channel stream's 8-bit channels into ``static`` (values: weighed through ``o_proj``)."""
    for layer, part, tq in high:
        o_proj = model.model.layers[layer].self_attn.o_proj.weight.detach().cpu() if part == Part.VALUE else None
        static.setdefault(layer, {}).setdefault(part, {})[HIGH_CHANNELS] = choose_high_channels(
            samples[layer], part, tq, o_proj)


def _chosen(static: dict, layer: int, part: Part) -> torch.Tensor | None:
    """A static stream's high channels, chosen by :func:`_choose_high_channels` (None without)."""
    import torch

    high = static.get(layer, {}).get(part, {}).get(HIGH_CHANNELS)
    return None if high is None else torch.as_tensor(high).to(torch.int64)


def _static_scales(model: PreTrainedModel, windows: list[list[int]], samples: Samples | None, targets: Streams,
                   static: dict, facts: ModelFacts, method: str, percentile: float, positions: KeyPositions) -> None:
    """Each static stream's scales (and zero points) into ``static``, by ``method``."""
    if method == "attention":
        _attention_scales(samples, targets, static, facts.head_dim)
    else:
        _stream_scales(model, windows, samples, targets, static, facts, method, percentile, positions)
    logger.info(
        "calibrated %d static stream(s) over %d layer(s) on %d token(s) in %d window(s) (method=%s%s)",
        len(targets), len(static), sum(len(w) for w in windows), len(windows), method,
        f", percentile={percentile:g}" if method == "percentile" else "",
    )


def _attention_scales(samples: Samples, targets: Streams, static: dict, head_dim: int) -> None:
    """The ``attention`` method: each static stream's metadata chosen by its effect on the sampled attention."""
    with task("calibration: streams", total=len(targets)) as advance:
        for layer, part, tq in targets:
            rotation = rotation_matrix(tq.rotation, head_dim)
            static.setdefault(layer, {}).setdefault(part, {}).update(attention_metadata(
                [s.rotated(rotation) for s in stream_samples(samples[layer], part)], part, tq,
                _chosen(static, layer, part)))
            advance()


def _stream_scales(model: PreTrainedModel, windows: Sequence[Sequence[int]], samples: Samples | None,
                   targets: Streams, static: dict, facts: ModelFacts, method: str, percentile: float,
                   positions: KeyPositions) -> None:
    """``absmax`` / ``percentile``: each static stream's metadata from every window's K/V of that stream.

    Keys count at every offset of :mod:`.positions` (the samples come shifted already), values once.
    """
    import torch

    if samples is None:
        with task("calibration: forward passes", total=len(windows)) as advance:
            collected = collect_kv(model, windows, {(layer, part) for layer, part, _ in targets}, facts.num_layers,
                                   advance)
    for layer, part, tq in targets:
        if samples is None:
            values = collected.pop((layer, part))
            values = positions.keys(layer, values, [len(w) for w in windows]) if part == Part.KEY else values
        else:  # the samples hold every window's K/V already (the same forward passes), keys at every offset
            values = torch.cat([s.keys if part == Part.KEY else s.values for s in stream_samples(samples[layer], part)],
                               dim=1)
        # a rotated stream stores (and so quantizes) x @ R: its static scales belong to that basis
        values = rotate_torch(values, rotation_matrix(tq.rotation, facts.head_dim))
        static.setdefault(layer, {}).setdefault(part, {}).update(
            stream_metadata(values, tq, method, percentile, _chosen(static, layer, part)))


def _checked(static: dict, scheme: KVQuantScheme, facts, measured_on: dict | None) -> Calibration:
    """The measured arrays as the artifact, refused if the scheme's streams would not find what they need."""
    calibration = Calibration.of(static, weights=measured_on)
    calibration.check(scheme, facts)
    return calibration

