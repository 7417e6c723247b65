"""The export's stages, each a plain function a test or a tool can run alone.

::

    load_source -> read_facts -> [plan_budget] -> plan_export -> calibrate -> build_graph -> quantize_weights -> package

:func:`plan_export` checks everything (the scheme against the model and the flavor, calibration, weights) and
returns a frozen :class:`ExportPlan` before anything is computed or written; the rest carry the plan out.
:func:`~kvq_export.export.exporter.export` runs them into a directory of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvq_export
from kvq_export.arch import Arch, get_arch
from kvq_export.calibration import Calibration, calibrate_static_scales, calibration_windows
from kvq_export.calibration.artifact import StaticLike, describe_weights
from kvq_export.calibration.smoothing import smoothed_model, smoothing_record
from kvq_export.errors import ExportError
from kvq_export.export.budget import PlannedScheme, plan_request
from kvq_export.flavors import Flavor, Runtime, get_flavor, write_runtime_files
from kvq_export.graph_facts import graph_metadata
from kvq_export.manifest import CALIBRATION_NAME, MODEL_NAME, Manifest, weight_checksums
from kvq_export.manifest_sections import BuildRecord, CalibrationRecord, GraphValue, TokenizerFacts
from kvq_export.model_digest import model_identity
from kvq_export.model_facts import ModelFacts
from kvq_export.model_source import canonical_spec, load_model
from kvq_export.request import (
    DEFAULT_CALIBRATION,
    MIN_OPSET,
    CalibrationMethod,
    CalibrationSpec,
    ExportRequest,
    WeightFormat,
    WeightSpec,
)
from kvq_export.weight_blocks import W8A8_MIN_OPSET

if TYPE_CHECKING:
    import onnx_ir as ir

    from kvq_export.flavors.cache_graph import CacheGraph

logger = logging.getLogger(__name__)


def check_opset(opset: int) -> None:
    """Refuse an opset the installed onnx or ONNX Runtime cannot load (the export would be written and fail)."""
    low, high = supported_opsets()
    if isinstance(opset, bool) or not isinstance(opset, int) or not low <= opset <= high:
        import onnx
        import onnxruntime

        raise ExportError(f"opset {opset!r} is not supported: allowed {low}..{high} (the range both onnx "
                          f"{onnx.__version__} and ONNX Runtime {onnxruntime.__version__} load)")


@functools.cache
def supported_opsets() -> tuple[int, int]:
    """(lowest, highest) default-domain opset kvq exports: its own minimum, the newest both onnx and ONNX Runtime load.

    ONNX Runtime states no maximum in Python: the newest opset it loads is found by loading a one-node model,
    newest first (a few milliseconds each).
    """
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [value],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    for opset in range(onnx.defs.onnx_opset_version(), MIN_OPSET - 1, -1):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - any refusal means "not this opset"
            continue
        return MIN_OPSET, opset
    return MIN_OPSET, MIN_OPSET - 1  # loads nothing: every opset is refused, with the range stated


# -- the stages --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """The model an export reads: a Hugging Face causal LM, its tokenizer (None without) and its spec."""

    model: Any
    tokenizer: Any
    spec: str | None  # what the request named (None: a model handed over in memory)


def load_source(request: ExportRequest, model: Any = None, tokenizer: Any = None) -> Source:
    """The request's model: ``model`` (already loaded, with ``tokenizer``) or loaded from ``request.model``."""
    if model is None:
        if request.model is None:
            raise ExportError("the request names no model (model=None): pass the loaded model to export()")
        spec = canonical_spec(request.model)  # absolute: the manifest names the same model from any directory
        model, tokenizer = load_model(spec)
        return _smoothed(request, Source(model, tokenizer, spec))
    return _smoothed(request, Source(model, tokenizer, None))


def _smoothed(request: ExportRequest, source: Source) -> Source:
    """w8a8 weights: the model with its activation outliers moved into its weights, on the calibration text."""
    if request.weights.format != WeightFormat.W8A8 or smoothing_record(source.model) is not None:
        return source
    _check_weights(request, get_flavor(request.flavor))  # before a minute of smoothing is spent on a refusal
    if source.tokenizer is None:
        raise ExportError("w8a8 weights smooth the activations on calibration text, which needs the model's tokenizer")
    spec = request.calibration or DEFAULT_CALIBRATION
    windows = calibration_windows(source.tokenizer, spec.corpus, spec.tokens, offset=spec.offset)
    smoothed = smoothed_model(source.model, windows, text={"corpus": spec.corpus, "offset": spec.offset})
    return Source(smoothed, source.tokenizer, source.spec)


def read_facts(source: Source) -> tuple[Arch, ModelFacts]:
    """The model's registered architecture reader and the facts it reads (what ``kvq.json`` records)."""
    arch = get_arch(source.model.config)
    return arch, ModelFacts.from_config(source.model.config, arch, source=source.spec)


def plan_budget(request: ExportRequest, source: Source, *, static: StaticLike | None = None) -> PlannedScheme:
    """Plan the scheme of a request that gives a bit budget instead (``kvq plan``'s planner on its calibration text).

    What can be checked without the scheme (the opset, the weights for the flavor, no ``static`` handed over: a
    planned export calibrates its own candidates) is checked before the model runs.
    """
    if request.plan is None:
        raise ExportError("the request names its scheme: there is nothing to plan")
    if static is not None:
        raise ExportError("a planned export calibrates its own scales on the request's calibration text: give "
                          "static metadata with a scheme, not with a plan")
    check_opset(request.opset)
    flavor = get_flavor(request.flavor)
    _check_weights(request, flavor)
    _, facts = read_facts(source)
    return plan_request(request, source, flavor, facts)


@dataclass(frozen=True)
class ExportPlan:
    """A checked export: every stage after :func:`plan_export` only carries it out."""

    request: ExportRequest  # with its scheme (a planned request: the planned one)
    flavor: Flavor
    arch: Arch
    facts: ModelFacts
    static: Calibration | None  # calibrated arrays handed over by the caller (None: calibrate, or none needed)
    planned: PlannedScheme | None = None  # how the scheme was planned (None: the request named it)

    @property
    def calibrates(self) -> bool:
        """Whether :func:`calibrate` runs the model over the request's calibration text."""
        return self.request.scheme.needs_calibration and self.static is None


def plan_export(request: ExportRequest, source: Source, *, static: StaticLike | None = None,
                planned: PlannedScheme | None = None) -> ExportPlan:
    """Check that ``request`` can be carried out on ``source`` before anything is computed or written.

    A request with a bit budget is carried out as ``planned`` (:func:`plan_budget`) says. Raises a one-line
    :class:`~kvq_export.errors.KVQError` for a scheme the model or the flavor cannot hold, a static-scale scheme with
    neither scales nor calibration text (kvq never guesses a scale or a channel), given scales that do not fit the
    scheme and the model, and a weight format kvq cannot write.
    """
    if request.plan is not None:
        if planned is None or planned.asked != request:
            raise ExportError("the request gives a bit budget, not a scheme: plan it first (plan_budget)")
        request = planned.request
    check_opset(request.opset)
    arch, facts = read_facts(source)
    scheme = request.scheme
    scheme.check_model(facts)
    flavor = get_flavor(request.flavor)
    flavor.check(scheme, facts)
    static = None if static is None else Calibration.of(static)
    if scheme.needs_calibration and static is not None:
        static.check(scheme, facts)
        # scales measured on other weights than the export's misplace their ranges (fp32 scales on int4 weights)
        static.check_weights(request.weights.calibration_weights)
    if scheme.needs_calibration and static is None:
        if request.calibration is None:
            needs = "static scales" if scheme.has_static_scales else "calibrated high channels"
            raise ExportError(f"scheme {scheme.name or 'custom'} uses {needs}: calibrate first (give --calib-corpus; "
                              "kvq never guesses a scale or a channel)")
        if source.tokenizer is None:
            raise ExportError("calibrating from a corpus needs the model's tokenizer")
    _check_weights(request, flavor)
    return ExportPlan(request, flavor, arch, facts, static, planned)


def _check_weights(request: ExportRequest, flavor: Flavor) -> None:
    weights = request.weights
    if weights.quantized and Runtime.ONNXRUNTIME not in flavor.runtimes:
        ops = "MatMulNBits and GatherBlockQuantized" if weights.blocked else "MatMulIntegerToFloat"
        raise ExportError(f"weights.format={weights.format} stores ONNX Runtime's {ops}, which the {flavor.name} "
                          f"flavor's runtimes cannot run; allowed there: {WeightFormat.FP32}, {WeightFormat.FP16}")
    if weights.format == WeightFormat.W8A8 and (str(request.dtype) != "fp32" or request.opset < W8A8_MIN_OPSET):
        raise ExportError(f"w8a8 weights need --dtype fp32 (ONNX Runtime's MatMulIntegerToFloat computes float32 on "
                          f"CPU) and opset >= {W8A8_MIN_OPSET} (QuantizeLinear in blocks); got dtype "
                          f"{request.dtype}, opset {request.opset}")


@dataclass(frozen=True)
class Calibrated:
    """The calibration an export is built with, and how it was chosen (the manifest's ``calibration``)."""

    calibration: Calibration | None
    provenance: dict[str, Any]


def calibrate(plan: ExportPlan, source: Source) -> Calibrated:
    """The static scales (and high channels) of the plan: given, calibrated on the request's text, or none.

    A planned scheme's come from the planner, which calibrated every candidate on the same text the same way.
    Both run the model with the weights the export computes with (int blocks dequantized, see
    :func:`~kvq_export.calibration.measure.measured_model`), and the calibration records them.
    """
    if not plan.calibrates:
        return Calibrated(plan.static, {"source": "given"})
    spec: CalibrationSpec = plan.request.calibration
    weights = plan.request.weights
    if plan.planned is not None:
        static = Calibration.of(plan.planned.static, weights=weights.calibration_weights)
        tokens = plan.planned.tokens
        static.check(plan.request.scheme, plan.facts)
    else:
        windows = calibration_windows(source.tokenizer, spec.corpus, spec.tokens, offset=spec.offset)
        static = calibrate_static_scales(source.model, plan.request.scheme, windows, method=spec.method,
                                         percentile=spec.percentile, weights=weights)
        tokens = sum(len(w) for w in windows)
    provenance = {"source": "calibrated", "corpus": spec.corpus, "tokens": tokens,
                  "offset": spec.offset, "method": str(spec.method),
                  **({"percentile": spec.percentile} if spec.method == CalibrationMethod.PERCENTILE else {})}
    return Calibrated(static, provenance)


def build_graph(plan: ExportPlan, source: Source, static: Calibration | None) -> tuple[ir.Model, CacheGraph]:
    """The decoder graph around the flavor's cache graph; it carries its own scheme (an edited kvq.json is refused)."""
    from kvq_export.export.decoder import build_decoder  # lazy: imports onnx

    request = plan.request
    cache = plan.flavor.build(request.scheme, plan.facts, static=static)
    graph = build_decoder(source.model, plan.arch, cache, dtype=request.dtype, opset=request.opset,
                          facts=plan.facts)
    # the graph carries what it fixes (scheme, model facts, flavor, layout, dtype, embedded scales, EOS/pad ids):
    # a loader compares it with the manifest, so an edited kvq.json or calibration file is refused
    digest = static.digest() if static is not None and request.scheme.needs_calibration else None
    graph.metadata_props.update(graph_metadata(request.scheme, plan.facts, flavor=str(plan.flavor.name),
                                               layout=plan.flavor.layout.name, dtype=request.dtype,
                                               opset=request.opset, calibration_digest=digest,
                                               tokenizer=_tokenizer_facts(source.tokenizer, source.model.config)))
    return graph, cache


def quantize_weights(graph: ir.Model, spec: WeightSpec, source: Source | None = None) -> ir.Model:
    """The built graph with its weights stored as ``spec`` says (fp32: as built; see :mod:`.weights`).

    The graph records how; a w8a8 graph also records the smoothing its source model was given.
    """
    from kvq_export.graph import weights  # lazy: imports onnx

    smoothing = smoothing_record(source.model) if source is not None else None
    return weights.quantize_weights(graph, format=str(spec.format), block_size=spec.block_size,
                                    symmetric=spec.symmetric, accuracy_level=spec.accuracy_level,
                                    smoothing=smoothing)


def package(directory: Path, plan: ExportPlan, source: Source, graph: ir.Model, calibrated: Calibrated) -> Manifest:
    """Write the graph, tokenizer, calibration and runtime files into ``directory``; the manifest comes last."""
    from kvq_export.graph.builder import save  # lazy: imports onnx

    request, facts = plan.request, plan.facts
    save(graph, directory / MODEL_NAME)
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(directory)
    written = None
    if calibrated.calibration is not None and request.scheme.needs_calibration:
        calibrated.calibration.save(directory / CALIBRATION_NAME)
        measured_on = calibrated.calibration.weights
        written = CalibrationRecord(file=CALIBRATION_NAME, digest=calibrated.calibration.digest(),
                                    **calibrated.provenance,
                                    # (absent: the model's own weights, as every record written before says)
                                    weights=None if measured_on is None else dict(measured_on),
                                    measured_on=None if measured_on is None else describe_weights(measured_on))
    manifest = Manifest(
        scheme=request.scheme, model=facts, flavor=str(plan.flavor.name), opset=request.opset, dtype=request.dtype,
        layout=plan.flavor.layout.name, kvq_version=kvq_export.__version__,
        inputs=(GraphValue("input_ids", "int64", ("batch", "seq")),
                GraphValue("attention_mask", "int64", ("batch", "seq"),
                           meaning="1 = real token, 0 = left padding of this call's tokens")),
        outputs=(GraphValue("logits", "float32", ("batch", "seq", facts.vocab_size)),),
        tokenizer=_tokenizer_facts(source.tokenizer, source.model.config), calibration=written,
        build=build_record(plan.planned.asked if plan.planned else request, plan.static,
                            model=None if source.spec else source.model),
        plan=plan.planned.record() if plan.planned else None,
    )
    manifest = _write_runtime_files(directory, manifest)
    # checksums last, once: they cover the graphs the runtime files add (hashing the weights is the slow part)
    manifest = dataclasses.replace(manifest, weights=weight_checksums(directory))
    manifest.save(directory)  # last: a directory with kvq.json is complete
    return manifest


def _write_runtime_files(directory: Path, manifest: Manifest) -> Manifest:
    """Add what other runtimes read (onnxruntime-genai's config and graph) and record it in the manifest."""
    return dataclasses.replace(manifest, runtimes={**manifest.runtimes, **write_runtime_files(directory, manifest)})


def build_record(request: ExportRequest, static: StaticLike | None, *, model: Any = None) -> BuildRecord:
    """The manifest's ``build`` section: the source digest and the request (and given static metadata's digest).

    The model is named by its content (:func:`~kvq_export.model_digest.model_identity`: a loaded ``model``, else
    the request's spec), so a reused export is never one of another model that had the same name or path;
    ``source_digest`` is what validation's automatic baseline checks the source against later
    (:func:`~kvq_export.model_digest.recorded_source`).
    """
    named = request.model is not None and model is None
    identity = model_identity(request.model if named else model) if (named or model is not None) else None
    given = static is not None and request.scheme.needs_calibration
    return BuildRecord(kvq_code=source_digest(), request=request.to_dict(), source=identity,
                       source_digest=identity["digest"] if named else None,
                       static=Calibration.of(static).digest() if given else None)


def _tokenizer_facts(tokenizer, config) -> TokenizerFacts:
    eos = getattr(config, "eos_token_id", None)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
    return TokenizerFacts(eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                          bos_token_id=getattr(config, "bos_token_id", None),
                          pad_token_id=getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None,
                          files=tokenizer is not None)


def source_digest() -> str:
    """Digest of kvq_export's source: which code built an export (finer than the version number)."""
    return _source_digest()


@functools.cache
def _source_digest() -> str:
    h = hashlib.sha256()
    root = Path(kvq_export.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
