"""``kvq plan``: choose per-layer key/value formats under a bit budget by measured attention damage.

Layers differ a lot in how much a quantization error hurts (an outlier channel in one layer's keys can
cost more than every other layer's keys together), so a mixed-precision cache spends bits where the
damage is. The planner

1. runs the model once over calibration text and keeps, per layer, sampled post-RoPE queries, every
   cached key/value and the size of the residual stream entering the layer
   (:func:`kvq_export.calibration.passes.collect_attention_samples`);
2. calibrates every static candidate format from those samples (``--calib-method``, default absmax like
   ``kvq export``'s, the same arithmetic ``kvq export`` applies);
3. measures, per layer and candidate, the damage to attention (the ``metric``):

   * ``attention`` (default, one model pass in all): the candidate's key-induced and value-induced
     attention-output error (:mod:`kvq_export.validate.attention`'s decomposition, with the exact
     ``softmax(q Kᵀ s)`` of the sampled queries), carried through the layer's ``o_proj`` into the
     residual stream and divided by that stream's size: ``mean_q |o_proj(ô - o)|² / |h|²``. Key and
     value errors are measured together for layers whose two streams are chosen together (``tied``
     candidate sets) and separately otherwise (then added);
   * ``kl``: the logit KL divergence from the unquantized model with only that layer's stream(s)
     quantized in kvq's reference cache (one full forward per layer, stream and candidate: exact end to
     end, slow on large models);

4. picks one candidate per layer minimising the summed damage with the cache's bits/element at
   ``context`` tokens (the memory model's count: metadata and high-precision windows included) at most
   ``budget`` — an exact multiple-choice knapsack over bytes (dynamic programming on a grid of
   ``budget / resolution`` bytes with costs rounded up, so the result never exceeds the budget);
5. writes the choice as a scheme with ``layer_overrides`` (the most common choice is the default).

Candidate sets (:data:`CANDIDATE_SETS`) or any comma-separated presets / scheme files (each one a layer
option: its key and value together).

The stages live in submodules: :mod:`.candidates` (what a layer may take), :mod:`.calibrate` (the candidates'
static metadata), :mod:`.damage` (the metrics), :mod:`.allocation` (the knapsack and the scheme it writes),
:mod:`.result` (:class:`Plan` and its report), :mod:`.genai` (onnxruntime-genai's view) and :mod:`.planner`
(:func:`plan_scheme`, which runs them in order). Their names are importable from here.
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
