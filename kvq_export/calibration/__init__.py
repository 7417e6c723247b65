"""Static-scale calibration: per-layer, per-(kv head, channel or group) scales and high channels from real K/V.

* :mod:`.passes` -- the model forward passes: calibration text cut into windows, the post-RoPE K/V each window
  leaves in the cache and the queries that read it;
* :mod:`.methods` -- how a stream's scales (and zero points) are chosen from those: ``absmax``, ``percentile``
  and ``attention``;
* :mod:`.high_channels` -- which channels a stream keeps at 8 bits;
* :mod:`.measure` -- :func:`calibrate_static_scales`, the three above run for one scheme on one model;
* :mod:`.artifact` -- :class:`Calibration`, the frozen result: the only reader and writer of ``calibration.npz``,
  its digest, and its check against a scheme;
* :mod:`.graph_check` -- a calibration compared with the constants of the graph built from it.
"""

from __future__ import annotations

from kvq_export.calibration.artifact import HIGH_CHANNELS, META_ROLES, PARTS, Calibration
from kvq_export.calibration.measure import calibrate_static_scales
from kvq_export.calibration.methods import ATTENTION_CLIP_GRID, METHODS
from kvq_export.calibration.passes import calibration_windows

__all__ = ["ATTENTION_CLIP_GRID", "HIGH_CHANNELS", "META_ROLES", "METHODS", "PARTS", "Calibration",
           "calibrate_static_scales", "calibration_windows"]
