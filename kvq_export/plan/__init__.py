"""``kvq plan``: choose per-layer key/value formats under a bit budget by measured attention damage.

:func:`plan_scheme` takes a causal LM, calibration token windows, a ``budget`` in bits per cached element at
``context`` tokens (the memory model's count, metadata and high-precision windows included) and a candidate set
(:data:`CANDIDATE_SETS`, or comma-separated presets / scheme files, each one layer option); it returns a
:class:`Plan`: one candidate per layer, the one with the least summed damage (``metric``: ``attention`` or ``kl``)
whose cache never exceeds the budget, written as a scheme with ``layer_overrides``, beside every measured damage.

The stages are submodules, each usable alone: :mod:`.candidates` (what a layer may take), :mod:`.calibrate` (the
candidates' static metadata), :mod:`.damage` (the metrics), :mod:`.allocation` (the knapsack and the scheme it
writes), :mod:`.result` (:class:`Plan` and its report), :mod:`.genai` (onnxruntime-genai's view) and
:mod:`.planner` (:func:`plan_scheme`, which runs them in order). Their names are importable from here.

How the damage is measured and the budget allocated, and why: docs/howto/measure.md (section "How a plan is
chosen").
"""

from __future__ import annotations

from kvq_export.plan.allocation import RESOLUTION, Option, allocate, layer_options, scheme_from_choice
from kvq_export.plan.calibrate import calibrate_candidates
from kvq_export.plan.candidates import (
    CANDIDATE_SETS,
    GQA_HIGH_CHANNELS,
    RECENT_VALUE_WINDOWS,
    CandidateSet,
    candidate_set,
    fitting,
    with_value_window,
)
from kvq_export.plan.damage import (
    BATCH_ELEMENTS,
    Damage,
    attention_damage,
    attention_damages,
    measure_attention,
    measure_kl,
    o_proj_weight,
    reference_dequant,
)
from kvq_export.plan.genai import genai_view
from kvq_export.plan.planner import METRICS, measure_candidates, plan_scheme
from kvq_export.plan.result import Plan

__all__ = [
    "BATCH_ELEMENTS", "CANDIDATE_SETS", "GQA_HIGH_CHANNELS", "METRICS", "RECENT_VALUE_WINDOWS", "RESOLUTION",
    "CandidateSet", "Damage", "Option", "Plan", "allocate", "attention_damage", "attention_damages",
    "calibrate_candidates", "candidate_set", "fitting", "genai_view", "layer_options", "measure_attention",
    "measure_candidates", "measure_kl", "o_proj_weight", "plan_scheme", "reference_dequant", "scheme_from_choice",
    "with_value_window",
]
