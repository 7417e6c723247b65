"""Calibration's fitting helpers under their older module name, for ``kvq_plugins``.

The plugins' synthetic-data generator fits static metadata as calibration does; everything else lives in
:mod:`kvq_export.calibration` (:class:`~kvq_export.calibration.artifact.Calibration` owns the arrays).
"""

from __future__ import annotations

from kvq_export.calibration.methods import absmax_stats, fit_metadata, static_groups

__all__ = ["absmax_stats", "fit_metadata", "static_groups"]
