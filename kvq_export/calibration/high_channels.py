"""High channels: which channels of each kv head a stream keeps at 8 bits.

A key error ``e_c`` in channel ``c`` shifts every score by ``s q_c e_c``, and a channel's error grows with its
group range, so keys rank channels by ``E[q_c²] · E[range_c²]`` (the model's own post-RoPE queries; ranges over
the stream's token groups, over each calibration window for static scales, which are then fitted with each
channel's own code range). A value error in channel ``c`` reaches the residual stream through the ``o_proj``
columns that read it, so values rank by ``Σ ‖o_proj[:, c]‖² · E[range_c²]`` over the kv head's query heads. The
choice is kept as role ``high_channels``: ``[kv_heads, n]`` ascending channel indices (int32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvq_export.calibration.passes import stream_samples
from kvq_export.errors import KVQError
from kvq_export.vocab import Part

if TYPE_CHECKING:
    import torch

    from kvq_export.calibration.passes import AttentionSample
    from kvq_export.scheme import TensorQuant


def ranging_group(tq: TensorQuant) -> int | None:
    """Tokens per range :func:`channel_importance` measures for ``tq`` (None: a whole window, static scales).

    Streams with the same ranging group rank channels alike (only how many they keep differs).
    """
    return None if tq.scales == "static" else int(tq.group_size)


def channel_importance(samples: Sequence[AttentionSample], part: Part, tq: TensorQuant,
                       o_proj: torch.Tensor | None = None) -> torch.Tensor:
    """``[kv_heads, D]``: how much a channel's quantization error moves attention (see the module docstring)."""
    weight = range_sq = None
    ranging = ranging_group(tq)
    for sample in stream_samples(samples, part):
        x = sample.keys if part == Part.KEY else sample.values  # [H, T, D]
        heads, tokens, dim = x.shape
        group = tokens if ranging is None else min(ranging, tokens)  # static: one range
        grouped = x[:, : tokens // group * group].reshape(heads, tokens // group, group, dim)
        r = (grouped.amax(2) - grouped.amin(2)).pow(2).mean(1)  # [H, D]
        range_sq = r if range_sq is None else range_sq + r
        if part == Part.KEY:
            w = sample.grouped_queries().pow(2).mean(1)  # [H, D]
            weight = w if weight is None else weight + w
    if part == Part.VALUE:
        if o_proj is None:
            raise KVQError("ranking value channels needs the layer's o_proj weight")
        heads, dim = range_sq.shape
        weight = o_proj.float().pow(2).sum(0).reshape(heads, -1, dim).sum(1)
    return weight * range_sq


def choose_high_channels(samples: Sequence[AttentionSample], part: Part, tq: TensorQuant,
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

