"""The export pipeline's planning stage: ``kvq export --budget`` is ``kvq plan`` then ``kvq export --scheme``.

An :class:`~kvq_export.request.ExportRequest` with a ``plan`` (a :class:`~kvq_export.request.PlanSpec`: a bit budget
and ``kvq plan``'s settings) names no scheme. :func:`plan_request` runs ``kvq plan``'s planner
(:func:`kvq_export.plan.plan_scheme`) on the request's calibration text and returns the request with the planned
scheme: what ``kvq export --scheme PLAN.json`` is given after ``kvq plan --out PLAN.json`` with the same settings
(int4 / int8 weights included: both measure on the model with the weights the export computes with).
The planner calibrates every static candidate on that text with the request's method, so the export takes the
chosen candidates' metadata from the plan (:meth:`~kvq_export.plan.Plan.static_for`) instead of running the model
over the same text a second time.

Candidates: the plan's own, else the flavor's default (:func:`plan_candidates`): ``kvq plan``'s default set
(``ort-gqa``), and for a flavor onnxruntime-genai serves the best plan of that set it serves
(:meth:`~kvq_export.plan.Plan.servable`: the plan ``kvq plan --candidates ort-gqa-int4`` or ``ort-gqa-int8``
writes). Candidates the flavor cannot hold are left out before the model runs; none left is a one-line error.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvq_export.calibration import calibration_windows
from kvq_export.errors import ExportError
from kvq_export.flavors import Flavor, Runtime
from kvq_export.plan import CandidateSet, Plan, candidate_set, fitting, plan_scheme, with_value_window
from kvq_export.request import (
    DEFAULT_CALIBRATION,
    DEFAULT_PLAN_CANDIDATES,
    CalibrationMethod,
    ExportRequest,
    PlanSpec,
)
from kvq_export.scheme import KVQuantScheme

if TYPE_CHECKING:
    from kvq_export.model_facts import ModelFacts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedScheme:
    """A planned request: the request as asked, the same request with the planned scheme, and the plan."""

    asked: ExportRequest  # with its plan (what kvq.json's build.request records)
    request: ExportRequest  # with the planned scheme instead (what every later stage carries out)
    plan: Plan
    candidates: str  # the --candidates of kvq plan that plans the same scheme
    static: dict[int, dict[str, dict[str, Any]]]  # the planned scheme's calibrated metadata (empty: it needs none)
    tokens: int  # calibration tokens the plan read
    num_layers: int

    def record(self) -> dict[str, Any]:
        """``kvq.json``'s ``plan`` section: the budget, what the plan achieved, its per-layer choices, how to redo it.

        The planned scheme itself is the manifest's ``scheme`` (as ``kvq plan`` writes it); ``command`` is the
        ``kvq plan`` call that writes it again.
        """
        plan, spec = self.plan, self.asked.plan
        report = plan.to_dict()
        del report["scheme"], report["damages"]  # the scheme is the manifest's own; damages: kvq plan --report
        return {"request": spec.to_dict(), "candidates": self.candidates, **report,
                "layers": [{"layer": layer, "key": key.describe(), "value": value.describe()}
                           for layer, (key, value) in enumerate(plan.scheme.streams(self.num_layers))],
                "command": shlex.join(plan_command(self.asked, self.candidates, plan.scheme.name))}


def plan_command(request: ExportRequest, candidates: str, name: str | None) -> list[str]:
    """The ``kvq plan`` arguments that plan ``request``'s scheme (with ``candidates``) into ``<name>.json``."""
    spec, calibration = request.plan, request.calibration  # numbers as their exact repr (":g" would round them)
    args = ["kvq", "plan"] + (["--model", request.model] if request.model else [])
    args += ["--budget", str(spec.budget), "--context", str(spec.context), "--candidates", candidates,
             "--metric", str(spec.metric), "--calib-corpus", calibration.corpus, "--calib-tokens",
             str(calibration.tokens), "--calib-offset", str(calibration.offset), "--calib-method",
             str(calibration.method)]
    if calibration.method == CalibrationMethod.PERCENTILE:
        args += ["--percentile", str(calibration.percentile)]
    if spec.sink_tokens:
        args += ["--sink-tokens", str(spec.sink_tokens)]
    if spec.value_window is not None:
        args += ["--value-window", str(spec.value_window)]
    weights = request.weights
    if weights.quantized:  # the model the candidates are measured on: the export's weights (accuracy_level aside)
        args += ["--weights", str(weights.format)]
    if weights.blocked:
        args += ["--weight-block-size", str(weights.block_size)]
        args += [] if weights.symmetric else ["--weight-asymmetric"]
    return args + ["--name", name or "plan", "--out", f"{name or 'plan'}.json"]


def plan_candidates(spec: PlanSpec, flavor: Flavor, facts: ModelFacts) -> tuple[CandidateSet, bool]:
    """The candidates a plan for ``flavor`` chooses from, and whether it keeps to a plan onnxruntime-genai serves.

    ``spec.candidates`` when given, else ``kvq plan``'s default set, kept to the plans onnxruntime-genai serves
    when the flavor's exports are served by it. The plan's value window is applied, and the options the model's
    head size or the flavor cannot hold are left out (a set whose every option is held is returned as it is).

    Raises:
        KVQError: unknown candidates, or none that the model and the flavor can hold (with the flavor's reasons).

    """
    servable = spec.candidates is None and flavor.serves(Runtime.GENAI)
    cset = candidate_set(spec.candidates or DEFAULT_PLAN_CANDIDATES)
    if spec.value_window is not None:
        cset = with_value_window(cset, spec.value_window)
    cset = fitting(cset, facts.head_dim)
    reasons: dict[tuple[Any, Any], list[str]] = {
        (key, value): flavor.unsupported(KVQuantScheme(key=key, value=value, sink_tokens=spec.sink_tokens), facts)
        for key, value in cset.options()}
    held = tuple(pair for pair, why in reasons.items() if not why)
    if not held:
        first = next(iter(reasons.values()))
        raise ExportError(f"flavor {flavor.name} can hold no candidate of {cset.about!r} (e.g. "
                          f"{'; '.join(first)}); give candidates it holds")
    if len(held) == len(reasons):
        return cset, servable
    logger.info("left out %d candidate option(s) the %s flavor cannot hold", len(reasons) - len(held), flavor.name)
    return CandidateSet(f"{cset.about}; the options the {flavor.name} flavor holds", pairs=held), servable


def plan_request(request: ExportRequest, source: Any, flavor: Flavor, facts: ModelFacts) -> PlannedScheme:
    """Plan ``request``'s scheme under its budget on its calibration text (``source``: the loaded model).

    Raises:
        ExportError: the request names a scheme instead of a plan, or the model has no tokenizer.
        KVQError: what :func:`plan_candidates` and :func:`kvq_export.plan.plan_scheme` refuse (a budget no choice
            fits, among them).

    """
    spec, calibration = request.plan, request.calibration or DEFAULT_CALIBRATION
    if spec is None:
        raise ExportError("the request names its scheme: there is nothing to plan")
    if source.tokenizer is None:
        raise ExportError("planning a scheme reads calibration text: the model has no tokenizer")
    cset, servable = plan_candidates(spec, flavor, facts)
    windows = calibration_windows(source.tokenizer, calibration.corpus, calibration.tokens, offset=calibration.offset)
    plan = plan_scheme(source.model, windows, budget=spec.budget, context=spec.context, candidates=cset,
                       metric=str(spec.metric), calibration=calibration, name=spec.name,
                       sink_tokens=spec.sink_tokens, value_window=None,  # the window is in cset already
                       servable=servable, weights=request.weights)
    plan.settings.update(value_window=spec.value_window, model=request.model, corpus=calibration.corpus,
                         offset=calibration.offset)
    # the kvq plan candidates that plan the same scheme: the one-cache-type set of a nearest servable plan
    candidates = (plan.genai or {}).get("candidates") or spec.candidates or DEFAULT_PLAN_CANDIDATES
    logger.info("planned %s for the %s flavor: %.3f bits/element at %d tokens (budget %g): %s", plan.scheme.name,
                flavor.name, plan.bits_per_element, spec.context, spec.budget, plan.scheme.describe())
    resolved = replace(request, scheme=plan.scheme, plan=None, calibration=calibration)
    return PlannedScheme(request, resolved, plan, candidates, plan.static_for(plan.scheme, facts.num_layers),
                         sum(len(w) for w in windows), facts.num_layers)
