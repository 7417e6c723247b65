"""Calibrate ``kvq plan``'s static and high-channel candidates once, from the planner's attention samples.

The metadata is what :func:`kvq_export.calibration.calibrate_static_scales` gives each candidate on the same samples
with the same method, so the measured damages (and an export of the plan) use the arrays an export would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvq_export.calibration.artifact import HIGH_CHANNELS, PARTS
from kvq_export.calibration.high_channels import channel_importance, ranging_group, top_channels
from kvq_export.calibration.methods import stream_from_samples
from kvq_export.calibration.passes import stream_samples
from kvq_export.plan.candidates import CandidateSet
from kvq_export.plan.damage import o_proj_weight
from kvq_export.progress import task
from kvq_export.request import CalibrationMethod
from kvq_export.rotation import rotation_matrix
from kvq_export.scheme import TensorQuant
from kvq_export.vocab import Part, ScaleMode

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _calibrated_parts(cset: CandidateSet) -> dict[TensorQuant, tuple[str, ...]]:
    """Each static or high-channel candidate with the parts (``key``/``value``) the set offers it for."""
    parts: dict[TensorQuant, list[str]] = {}
    for pair in cset.options():
        for part, tq in zip(PARTS, pair):
            if tq.quantized and (tq.scales == ScaleMode.STATIC or tq.high_channels) and part not in parts.get(tq, ()):
                parts.setdefault(tq, []).append(part)
    return {tq: tuple(p) for tq, p in parts.items()}


def calibrate_candidates(model: PreTrainedModel, cset: CandidateSet, samples, num_layers: int, method: str,
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
            here = samples[layer]  # read once: a mapping may make a layer's samples when it is read
            # a rotated stream stores x @ R: its static scales belong to that basis (as kvq export calibrates them)
            bases: dict[str, list] = {"none": here}
            for tq, parts in wanted.items():
                if tq.scales == ScaleMode.STATIC and tq.rotation not in bases:
                    matrix = rotation_matrix(tq.rotation, here[0].keys.shape[-1])
                    bases[tq.rotation] = [s.rotated(matrix) for s in here]
                for part in parts:
                    high = None
                    if tq.high_channels:
                        ranking = (part, ranging_group(tq))
                        if ranking not in rankings:
                            rankings[ranking] = channel_importance(
                                here, part, tq, o_proj_weight(model, layer) if part == Part.VALUE else None)
                        high = top_channels(rankings[ranking], tq.high_channels)
                    if tq.scales == ScaleMode.STATIC:
                        basis, stream = bases[tq.rotation], (part, tq.rotation)
                        if stream not in streams and method != CalibrationMethod.ATTENTION:
                            streams[stream] = torch.cat([s.keys if part == Part.KEY else s.values
                                                         for s in stream_samples(basis, part)], dim=1)
                        meta = stream_from_samples(basis, part, tq, method=method, percentile=percentile,
                                                   high_channels=high, stream=streams.get(stream))
                    else:
                        meta = {HIGH_CHANNELS: high}
                    out[tq].setdefault(layer, {})[part] = meta
            advance()
    return out

