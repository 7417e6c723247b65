"""Calibration windows shifted to every position the cache will hold: static key scales that do not clip far keys.

Keys are cached after RoPE: a key's channel pair ``(j, j + rotary/2)`` at position p is its pre-RoPE pair turned by
``p * inv_freq[j]``. A static scale measured on windows of W tokens sees each pair turned by at most
``W * inv_freq[j]``; at the model's far positions the slow and middle frequencies turn further and keys leave the
calibrated range. On SmolLM2 (int8 per-channel absmax scales from 1024-token windows) 0.1% of key elements were
clipped at positions below 512 and 1.6% at 4096-8192, and the int8 cache's perplexity cost grew with position.

What attention makes of a query and a key depends only on their distance, so a window shifted to start at
position s (every query and key turned by ``s * inv_freq`` together) is as good a sample as the window itself.
Calibration therefore measures each window at offsets 0, W, 2W, ... until it has covered the model's positions:
the scales are measured as if the calibration text stood at every position of a full context (the clipped share
of keys is then about 0.1% at every position). Values are not rotated and are measured once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvq_export.calibration.passes import AttentionSample

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def window_offsets(window: int, max_positions: int) -> list[int]:
    """Start positions at which a window of ``window`` tokens is measured: 0, W, 2W, ... covering every position.

    The last offset is ``max_positions - window`` where the strides do not end there exactly.
    """
    if window >= max_positions:
        return [0]
    offsets = list(range(0, max_positions - window + 1, window))
    if offsets[-1] != max_positions - window:
        offsets.append(max_positions - window)
    return offsets


def shift_keys(x: torch.Tensor, inv_freq: np.ndarray, offset: int) -> torch.Tensor:
    """Post-RoPE ``x`` [..., D] (rotate_half layout) as it would be ``offset`` positions later.

    The first ``2 * len(inv_freq)`` channels turn pairwise by ``offset * inv_freq``; the rest (partial rotary)
    pass through. RoPE's attention scaling is already in ``x`` and is not applied again.
    """
    import torch

    if offset == 0:
        return x
    half = int(inv_freq.shape[-1])
    angle = offset * inv_freq.astype(np.float64)  # float64: offsets of thousands of radians keep their phase
    cos = torch.as_tensor(np.cos(angle), dtype=x.dtype)
    sin = torch.as_tensor(np.sin(angle), dtype=x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def shifted(sample: AttentionSample, inv_freq: np.ndarray, offset: int) -> AttentionSample:
    """``sample``'s window ``offset`` positions later: queries and keys turned together, so scores are unchanged."""
    if offset == 0:
        return sample
    return replace(sample, q=shift_keys(sample.q, inv_freq, offset), keys=shift_keys(sample.keys, inv_freq, offset),
                   offset=sample.offset + offset)


def keys_at_every_position(keys: torch.Tensor, window_lengths: list[int], inv_freq: np.ndarray,
                           max_positions: int) -> torch.Tensor:
    """``keys`` [H, tokens, D] of consecutive windows, each repeated at its :func:`window_offsets`, concatenated."""
    import torch

    out, start = [], 0
    for length in window_lengths:
        window = keys[:, start:start + length]
        out += [shift_keys(window, inv_freq, offset) for offset in window_offsets(length, max_positions)]
        start += length
    return torch.cat(out, dim=1)


@dataclass(frozen=True, eq=False)
class KeyPositions:
    """Each layer's RoPE frequencies and the positions the cache will hold: what shifting a window needs."""

    inv_freq: Mapping[int, np.ndarray]
    max_positions: int

    @classmethod
    def of(cls, config: PretrainedConfig, max_positions: int) -> KeyPositions:
        """The frequencies of every layer of ``config``'s architecture (its registered family says them)."""
        from kvq_export.arch import get_arch

        arch = get_arch(config)
        return cls({layer: arch.layer_rope(layer).inv_freq for layer in range(arch.num_layers)}, max_positions)

    def keys(self, layer: int, keys: torch.Tensor, window_lengths: list[int]) -> torch.Tensor:
        """:func:`keys_at_every_position` of ``layer``."""
        return keys_at_every_position(keys, window_lengths, self.inv_freq[layer], self.max_positions)

    def samples(self, layer: int, samples: Sequence[AttentionSample]) -> list[AttentionSample]:
        """Every window's attention sample at each of its offsets (queries and keys turned together)."""
        return [shifted(s, self.inv_freq[layer], offset) for s in samples
                for offset in window_offsets(s.keys.shape[1], self.max_positions)]

    def every_layer(self, samples: Mapping[int, Sequence[AttentionSample]]) -> Mapping[int, list[AttentionSample]]:
        """:meth:`samples` of each layer, made when a layer is read (one layer's copies in memory at a time)."""
        return _Shifted(self, samples)


class _Shifted(Mapping):
    """The layers of ``samples``, each read as :meth:`KeyPositions.samples` (made anew at every read)."""

    def __init__(self, positions: KeyPositions, samples: Mapping[int, Sequence[AttentionSample]]) -> None:
        self._positions, self._samples = positions, samples

    def __getitem__(self, layer: int) -> list[AttentionSample]:
        return self._positions.samples(layer, self._samples[layer])

    def __iter__(self):
        return iter(self._samples)

    def __len__(self) -> int:
        return len(self._samples)
