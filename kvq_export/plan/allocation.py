"""``kvq plan``'s allocation: one option per layer, least summed damage within a byte budget.

:func:`layer_options` prices each layer's options (damage and cache bytes), :func:`allocate` solves the
multiple-choice knapsack on a byte grid, and :func:`scheme_from_choice` writes the choice as a scheme.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.plan.candidates import CandidateSet
from kvq_export.plan.damage import Damage
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant

#: budget grid of the allocation (the knapsack's byte unit is ``budget / RESOLUTION``)
RESOLUTION = 4000


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

