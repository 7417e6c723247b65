"""A :class:`Plan`: the planned scheme, what it was chosen from, and its JSON report."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvq_export.calibration.artifact import PARTS
from kvq_export.errors import KVQError
from kvq_export.plan.candidates import CANDIDATE_SETS
from kvq_export.plan.damage import Damage
from kvq_export.request import PlanMetric
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import ScaleMode


@dataclass
class Plan:
    """A planned scheme with what it was chosen from."""

    scheme: KVQuantScheme
    bits_per_element: float
    damage: float
    budget: float
    context: int
    metric: PlanMetric
    damages: list[Damage] = field(default_factory=list)
    uniform: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    #: onnxruntime-genai's view of an ort-gqa plan (None for one GroupQueryAttention cannot hold): whether it
    #: serves the plan, and if not why, and the nearest plan it serves (see :func:`~kvq_export.plan.genai.genai_view`)
    genai: dict[str, Any] | None = None
    #: that nearest plan's scheme (None when the plan itself is served, or no plan of one cache type fits)
    genai_nearest: KVQuantScheme | None = None
    #: each calibrated candidate's metadata, ``{tq: {layer: {"key"|"value": {...}}}}``, as the damages were measured
    candidate_static: Mapping[TensorQuant, Mapping[int, Mapping[str, Any]]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the ``--report`` file)."""
        return {"scheme": self.scheme.to_dict(), "bits_per_element": self.bits_per_element,
                "predicted_damage": self.damage, "budget": self.budget, "context": self.context,
                "metric": str(self.metric), "uniform": self.uniform, "settings": self.settings,
                "onnxruntime_genai": self.genai, "damages": [d.to_dict() for d in self.damages]}

    def static_for(self, scheme: KVQuantScheme, num_layers: int) -> dict[int, dict[str, dict[str, Any]]]:
        """The static metadata of ``scheme`` (made of this plan's candidates) from the candidates' calibration.

        The same arrays :func:`kvq_export.calibration.calibrate_static_scales` gives for ``scheme`` on the plan's
        windows with the plan's method (the same samples and arithmetic), so an export of the plan needs no second
        calibration pass. Streams that need no calibration are left out, as there.
        """
        static: dict[int, dict[str, dict[str, Any]]] = {}
        for layer, streams in enumerate(scheme.streams(num_layers)):
            for part, tq in zip(PARTS, streams):
                if tq.quantized and (tq.scales == ScaleMode.STATIC or tq.high_channels):
                    meta = self.candidate_static.get(tq, {}).get(layer, {}).get(part)
                    if meta is None:
                        raise KVQError(f"layer {layer} {part}: {tq.describe()} is not a calibrated {part} candidate "
                                       "of this plan")
                    static.setdefault(layer, {})[part] = dict(meta)
        return static

    def servable(self) -> Plan:
        """The plan onnxruntime-genai serves: this one, or its nearest such plan (:mod:`.genai`) under its name.

        The nearest plan is what ``kvq plan --candidates`` of its one-cache-type candidates writes (the report's
        ``onnxruntime_genai.nearest.candidates``); the measured damages stay those of every candidate.

        Its ``onnxruntime_genai`` entry names those candidates (``candidates``) when it is the nearest plan.

        Raises:
            KVQError: no plan of one cache type fits the budget.

        """
        if self.genai is None or self.genai["servable"]:
            return self
        near = self.genai["nearest"]
        if near is None or self.genai_nearest is None:
            raise KVQError(f"no plan onnxruntime-genai serves fits the budget of {self.budget:g} bits/element "
                           f"({self.genai['reason']}); give candidates explicitly to plan one it does not serve")
        scheme = dataclasses.replace(self.genai_nearest, name=self.scheme.name)
        named = CANDIDATE_SETS.get(near["candidates"])
        settings = {**self.settings, "candidates": named.about if named else near["candidates"]}
        return dataclasses.replace(self, scheme=scheme, bits_per_element=near["bits_per_element"],
                                   damage=near["predicted_damage"], settings=settings, genai_nearest=None,
                                   genai={"servable": True, "candidates": near["candidates"]})

