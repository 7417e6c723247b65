"""Decode schedules long enough to cross every boundary a scheme's cache layout has."""

from __future__ import annotations

from kvq_export.scheme import KVQuantScheme


def longest_window(scheme: KVQuantScheme, layer: int = 0) -> int:
    """The longest recent window among ``layer``'s key and value streams."""
    return max(scheme.residual_for(tq) for tq in scheme.for_layer(layer))


def longest_unit(scheme: KVQuantScheme, layer: int = 0) -> int:
    """The most tokens that leave one of ``layer``'s recent windows together (1 when none is quantized)."""
    return max([tq.flush_unit for tq in scheme.for_layer(layer) if tq.quantized] + [1])


def crossing_steps(scheme: KVQuantScheme, least_unit: int = 1, units: int = 3) -> int:
    """Decode steps that fill the recent window and flush at least ``units`` units after it."""
    return units * max(longest_unit(scheme), least_unit) + longest_window(scheme) + 2
