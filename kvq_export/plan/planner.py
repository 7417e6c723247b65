"""``kvq plan``'s pipeline (see :mod:`kvq_export.plan`): measure the candidates, allocate, report.

:func:`plan_scheme` runs the stages in order; each is a function of its own, so a test or a tool can run one
alone: :func:`measure_candidates` (samples, calibration, damages), :func:`kvq_export.plan.allocation.allocate`
and :func:`kvq_export.plan.genai.genai_view`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvq_export.calibration.measure import measured_model
from kvq_export.calibration.passes import check_windows, collect_attention_samples
from kvq_export.calibration.positions import KeyPositions
from kvq_export.errors import KVQError
from kvq_export.memory import predict, stream_bytes
from kvq_export.model_source import model_facts
from kvq_export.plan.allocation import RESOLUTION, Option, allocate, layer_options, scheme_from_choice
from kvq_export.plan.calibrate import calibrate_candidates
from kvq_export.plan.candidates import CandidateSet, candidate_set, fitting, with_value_window
from kvq_export.plan.damage import Damage, measure_attention, measure_kl
from kvq_export.plan.genai import genai_view
from kvq_export.plan.result import Plan
from kvq_export.progress import task
from kvq_export.request import (
    DEFAULT_CALIBRATION,
    DEFAULT_PLAN_CANDIDATES,
    CalibrationSpec,
    PlanMetric,
    WeightSpec,
)
from kvq_export.scheme import KVQuantScheme, TensorQuant

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvq_export.model_facts import ModelFacts

logger = logging.getLogger(__name__)

METRICS = tuple(str(metric) for metric in PlanMetric)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch at one intra-op thread inside the block (restored after).

    Candidate calibration and damage measurement are thousands of small tensor ops: a second thread adds a
    barrier to each, and on shared cores that barrier waits for a descheduled thread. The results are the same.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def plan_scheme(
    model: PreTrainedModel,
    windows: Sequence[Sequence[int]],
    *,
    budget: float,
    context: int,
    candidates: CandidateSet | str = DEFAULT_PLAN_CANDIDATES,
    metric: PlanMetric | str = PlanMetric.ATTENTION,
    calibration: CalibrationSpec = DEFAULT_CALIBRATION,
    name: str | None = None,
    resolution: int = RESOLUTION,
    sink_tokens: int = 0,
    value_window: int | None = None,
    servable: bool = False,
    weights: WeightSpec | None = None,
) -> Plan:
    """Plan a per-layer scheme for ``model`` (see :mod:`kvq_export.plan`).

    Args:
        model: a Hugging Face causal LM (Llama family).
        windows: calibration token windows (e.g. :func:`kvq_export.calibration.calibration_windows`).
        budget: most bits per cached element at ``context`` tokens (memory model, batch 1).
        context: the cache length the budget is stated at.
        candidates: a :class:`CandidateSet` or a spec for :func:`candidate_set`.
        metric: ``attention`` or ``kl``.
        calibration: how static candidates are calibrated (its method and percentile; ``windows`` are its text).
        name: the planned scheme's name.
        resolution: the knapsack grid (see :func:`allocate`).
        sink_tokens: first tokens of every sequence kept in high precision in every layer (attention sinks
            draw much of the attention and stretch a per-channel key group's range); measured and paid for
            in the budget like any other stored byte.
        value_window: every value candidate keeps this many newest tokens exact (:func:`with_value_window`;
            measured per query and paid for in the budget); None: the candidates' own windows.
        servable: keep to a plan onnxruntime-genai serves (:meth:`Plan.servable`) when GroupQueryAttention can hold
            the plan at all.
        weights: how the export stores the weights (None: as computed). int4 / int8 blocks: the candidates are
            calibrated and their damage measured on the model with the weights the export computes with
            (:func:`kvq_export.calibration.measure.measured_model`, the same model ``kvq calibrate`` and ``kvq
            export`` calibrate on).

    Raises:
        KVQError: unknown metric, a non-positive budget/context, or a budget no choice fits.

    """
    metric = _checked_settings(metric, budget, context, sink_tokens)
    model, facts, cset, windows, measured_on = _measured_inputs(model, windows, candidates, value_window, weights)
    static_by, damages = measure_candidates(model, windows, cset, metric, calibration, facts.num_layers, sink_tokens)
    options = layer_options(damages, cset, facts.num_layers, _stream_bytes_at(facts, context, sink_tokens))
    budget_bytes = _budget_bytes(budget, facts, context)
    scheme, total = _allocated_scheme(options, budget_bytes, resolution, name or f"plan-{budget:g}b", sink_tokens)
    bits = predict(scheme, facts, context).bits_per_element
    uniform = _uniform(cset, options, facts, context, sink_tokens)
    logger.info("planned %s: %.3f bits/element at %d tokens (budget %g), predicted damage %.4g (%s metric)",
                scheme.name, bits, context, budget, total, metric)
    genai, nearest = genai_view(scheme, options, budget_bytes, facts, context, about=cset.about,
                                resolution=resolution)
    settings = _recorded_settings(cset, calibration, sink_tokens, value_window, windows, measured_on)
    plan = Plan(scheme, bits, total, budget, context, metric, damages, uniform, settings, genai, nearest, static_by)
    return _served(plan, servable)


def _measured_inputs(
    model: PreTrainedModel, windows: Sequence[Sequence[int]], candidates: CandidateSet | str, value_window: int | None,
    weights: WeightSpec | None,
) -> tuple[PreTrainedModel, ModelFacts, CandidateSet, list[list[int]], dict | None]:
    """(model, facts, candidates, windows, weights record): what the plan measures, checked and prepared.

    The model runs the weights an export stores as ``weights`` (:func:`measured_model`; the record None for its
    own); the candidates are ``candidates`` with ``value_window`` applied, fitted to its heads; the windows are
    checked against its vocabulary.
    """
    cset = candidate_set(candidates) if isinstance(candidates, str) else candidates
    if value_window is not None:
        cset = with_value_window(cset, value_window)
    model, measured_on = measured_model(model, weights, windows)
    facts = model_facts(model.config)
    return model, facts, fitting(cset, facts.head_dim), check_windows(windows, facts.vocab_size), measured_on


def _checked_settings(metric: PlanMetric | str, budget: float, context: int, sink_tokens: int) -> PlanMetric:
    """The metric as a :class:`PlanMetric`, once the metric, budget, context and sink tokens are checked."""
    if metric not in METRICS:
        raise KVQError(f"unknown plan metric {metric!r}; allowed: {', '.join(METRICS)}")
    metric = PlanMetric(metric)
    if not (isinstance(budget, (int, float)) and budget > 0) or context < 1:
        raise KVQError(f"invalid budget={budget!r} / context={context!r}: need a positive bits/element and >= 1 token")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise KVQError(f"invalid sink_tokens={sink_tokens!r}: allowed: an integer >= 0")
    return metric


def measure_candidates(
    model: PreTrainedModel, windows: Sequence[Sequence[int]], cset: CandidateSet, metric: PlanMetric,
    calibration: CalibrationSpec, num_layers: int, sink_tokens: int = 0,
) -> tuple[dict[TensorQuant, dict[int, dict[str, dict]]], list[Damage]]:
    """Every candidate's calibrated metadata (:func:`calibrate_candidates`) and damage by ``metric``.

    One model pass over ``windows`` collects the attention samples both stages read; the ``kl`` metric then
    runs the model again per layer, stream and candidate (:func:`measure_kl`). Static scales are calibrated on
    the samples shifted to every position of the context (:mod:`kvq_export.calibration.positions`), as ``kvq
    export`` calibrates them; damage is measured where the model ran the windows.
    """
    samples = collect_attention_samples(model, windows, list(range(num_layers)), num_layers)
    positions = KeyPositions.of(model.config, model_facts(model.config).max_position_embeddings)
    with _one_thread():
        static_by = calibrate_candidates(model, cset, positions.every_layer(samples), num_layers,
                                         str(calibration.method), calibration.percentile)
        if metric == PlanMetric.ATTENTION:
            damages = measure_attention(model, samples, cset, static_by, num_layers, sink_tokens)
    if metric == PlanMetric.KL:  # model forwards: at the caller's threads
        damages = measure_kl(model, windows, cset, static_by, num_layers, sink_tokens)
    return static_by, damages


def _stream_bytes_at(facts: ModelFacts, context: int, sink_tokens: int) -> Callable[[TensorQuant], int]:
    """A stream's cache bytes at ``context`` tokens (batch 1, ``sink_tokens`` exact), as a function of its format."""

    def nbytes(tq: TensorQuant) -> int:
        scheme = KVQuantScheme(key=tq, value=tq, sink_tokens=sink_tokens)
        return sum(stream_bytes(tq, scheme, facts, seq_len=context, batch=1).values())

    return nbytes


def _budget_bytes(budget: float, facts: ModelFacts, context: int) -> int:
    """The cache bytes ``budget`` bits per element allow at ``context`` tokens (batch 1, keys and values)."""
    elements = 2 * facts.num_layers * facts.num_kv_heads * context * facts.head_dim
    return int(budget * elements / 8)


def _allocated_scheme(options: Sequence[Sequence[Option]], budget_bytes: int, resolution: int, name: str,
                      sink_tokens: int) -> tuple[KVQuantScheme, float]:
    """The scheme of the options :func:`allocate` chooses per layer, and its predicted damage (summed).

    Allocating is reported as the plan's progress step.
    """
    with task("plan: allocating bits", total=1) as advance:
        chosen = allocate(options, budget_bytes, resolution)
        advance()
    picked = [options[layer][i] for layer, i in enumerate(chosen)]
    scheme = scheme_from_choice([(option.key, option.value) for option in picked], name, sink_tokens)
    return scheme, sum(option.damage for option in picked)


def _uniform(cset: CandidateSet, options: Sequence[Sequence[Option]], facts: ModelFacts, context: int,
             sink_tokens: int) -> list[dict[str, Any]]:
    """The report's uniform schemes: each option of ``cset`` in every layer, with its bits and summed damage."""
    uniform = []
    for i, (key, value) in enumerate(cset.options()):
        same = KVQuantScheme(key=key, value=value, sink_tokens=sink_tokens)
        uniform.append({"key": key.describe(), "value": value.describe(),
                        "bits_per_element": predict(same, facts, context).bits_per_element,
                        "damage": sum(row[i].damage for row in options)})
    return uniform


def _recorded_settings(cset: CandidateSet, calibration: CalibrationSpec, sink_tokens: int, value_window: int | None,
                       windows: Sequence[Sequence[int]], measured_on: dict | None) -> dict[str, Any]:
    """How the plan was made, as :attr:`Plan.settings` records it."""
    return {"candidates": cset.about, "calib_method": str(calibration.method), "sink_tokens": sink_tokens,
            "value_window": value_window, "windows": len(windows), "tokens": sum(len(w) for w in windows),
            "weights": measured_on}


def _served(plan: Plan, servable: bool) -> Plan:
    """The plan to return: with ``servable`` the one onnxruntime-genai serves (:meth:`Plan.servable`), else ``plan``.

    Without ``servable``, a plan onnxruntime-genai cannot serve is returned with a warning naming the nearest plan
    it serves.
    """
    if servable:
        return plan.servable()
    genai, nearest = plan.genai, plan.genai_nearest
    if genai is not None and not genai["servable"]:
        near = genai["nearest"]
        offer = "no plan of one cache type fits the budget" if near is None else (
            f"the nearest plan it serves (--candidates {near['candidates']}): {near['bits_per_element']:.3f} "
            f"bits/element, predicted damage {near['predicted_damage']:.4g}: {nearest.describe()}")
        logger.warning("onnxruntime-genai cannot serve %s: %s; %s", plan.scheme.name, genai["reason"], offer)
    return plan
