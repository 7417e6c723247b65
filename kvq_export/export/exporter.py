"""``export()``: an :class:`~kvq_export.request.ExportRequest` -> a deployable export directory.

The directory holds ``model.onnx`` (+ ``model.onnx.data``), the tokenizer files, the calibration file
for static-scale schemes, and ``kvq.json`` (the manifest). The export is a pipeline of small stages, each a
plain function a test or a tool can run alone::

    load_source -> read_facts -> [plan_budget] -> plan_export -> calibrate -> build_graph -> quantize_weights -> package

A request with a bit budget instead of a scheme is planned first (:func:`plan_budget`, ``kvq plan``'s planner; see
:mod:`kvq_export.export.budget`), and calibrating then reuses the plan's calibration of the chosen candidates.
:func:`plan_export` checks everything (the scheme against the model and the flavor, calibration, weights)
before anything is written; the rest carry the plan out. The directory is written into a hidden temporary
directory beside the target and swapped into place at the end (:mod:`kvq_export._atomic`), so a half-written
export never looks complete and a crash leaves the old export or the new one. A lock file beside the target
lets one export of a directory run at a time; ``force`` replaces only a directory that holds a kvq manifest.
The manifest records sha256 checksums of the weight files, and the graph carries its scheme, so a loader can
refuse corrupted weights and an edited manifest.

Flavours are declared in :mod:`kvq_export.export.flavors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvq_export
from kvq_export._atomic import (
    aside_name,
    clean_leftovers,
    file_mode,
    move_dir_into_place,
    seal_dir,
    temp_dir_beside,
)
from kvq_export.calibration import Calibration, calibrate_static_scales, calibration_windows
from kvq_export.calibration.artifact import StaticLike, describe_weights
from kvq_export.errors import ExportError, KVQError
from kvq_export.export.arch import Arch, get_arch
from kvq_export.export.budget import PlannedScheme, plan_request
from kvq_export.export.flavors import Flavor, FlavorName, Runtime, flavor_names, get_flavor
from kvq_export.export.genai_package import RUNTIME, write_genai_files
from kvq_export.graph_facts import graph_metadata
from kvq_export.manifest import CALIBRATION_NAME, MANIFEST_NAME, MODEL_NAME, Manifest, verify_weights, weight_checksums
from kvq_export.manifest_sections import BuildRecord, CalibrationRecord, GraphValue, TokenizerFacts
from kvq_export.model_digest import model_digest, model_identity
from kvq_export.model_facts import ModelFacts
from kvq_export.model_source import canonical_spec, load_model
from kvq_export.request import (
    DEFAULT_OPSET,
    MIN_OPSET,
    CalibrationMethod,
    CalibrationSpec,
    ExportRequest,
    WeightFormat,
    WeightSpec,
)
from kvq_export.scheme import KVQuantScheme

if TYPE_CHECKING:
    import onnx_ir as ir

    from kvq_export.export.cache_graph import CacheGraph

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_OPSET", "ExportPlan", "Source", "build_graph", "calibrate", "ensure_export", "export",
           "export_model", "flavor_names", "get_flavor", "load_source", "package", "plan_budget", "plan_export",
           "quantize_weights", "read_facts"]



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
        return Source(model, tokenizer, spec)
    return Source(model, tokenizer, None)


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
    _check_weights(request.weights, flavor)
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
    _check_weights(request.weights, flavor)
    return ExportPlan(request, flavor, arch, facts, static, planned)


def _check_weights(weights: WeightSpec, flavor: Flavor) -> None:
    if weights.quantized and Runtime.ONNXRUNTIME not in flavor.runtimes:
        raise ExportError(f"weights.format={weights.format} stores ONNX Runtime's MatMulNBits and "
                          f"GatherBlockQuantized, which the {flavor.name} flavor's runtimes cannot run; allowed "
                          f"there: {WeightFormat.FP32}, {WeightFormat.FP16}")


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


def quantize_weights(graph: ir.Model, spec: WeightSpec) -> ir.Model:
    """The built graph with its weights stored as ``spec`` says (fp32: as built; see :mod:`.weights`)."""
    from kvq_export.export import weights  # lazy: imports onnx

    return weights.quantize_weights(graph, format=str(spec.format), block_size=spec.block_size,
                                    symmetric=spec.symmetric, accuracy_level=spec.accuracy_level)


def package(directory: Path, plan: ExportPlan, source: Source, graph: ir.Model, calibrated: Calibrated) -> Manifest:
    """Write the graph, tokenizer, calibration and runtime files into ``directory``; the manifest comes last."""
    from kvq_export.export.builder import save  # lazy: imports onnx

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
        build=_build_record(plan.planned.asked if plan.planned else request, plan.static,
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
    return dataclasses.replace(manifest, runtimes={**manifest.runtimes,
                                                   RUNTIME: write_genai_files(directory, manifest)})


# -- the entry points --------------------------------------------------------------------------------------
def export(request: ExportRequest, out_dir: str | os.PathLike[str], *, force: bool = False, model: Any = None,
           tokenizer: Any = None, static: StaticLike | None = None) -> Manifest:
    """Carry out ``request`` into ``out_dir``; return the manifest written there.

    ``model`` (with its ``tokenizer``) is the already loaded model, else ``request.model`` is loaded. Static-scale
    schemes take ``static`` (a :class:`~kvq_export.calibration.Calibration` or its nested mapping) or are
    calibrated as ``request.calibration`` says; without either they are refused. ``force`` replaces an existing
    export directory (never anything else).
    """
    return _export_to(request, Path(out_dir), force=force, wait=False, reuse=None, model=model,
                      tokenizer=tokenizer, static=static)


def export_model(model: str | os.PathLike[str] | Any, scheme: KVQuantScheme | str, out_dir: str | os.PathLike[str],
                 *, flavor: str = "reference", dtype: str = "fp32", opset: int = DEFAULT_OPSET,
                 weights: WeightSpec | None = None, calibration: CalibrationSpec | None = None, force: bool = False,
                 static: StaticLike | None = None, tokenizer: Any = None) -> Path:
    """:func:`export` from loose arguments: ``model`` is a model spec or a loaded HF causal LM; returns ``out_dir``."""
    spec = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    request = ExportRequest(model=spec, scheme=scheme, flavor=flavor, weights=weights or WeightSpec(), dtype=dtype,
                            opset=opset, calibration=calibration)
    export(request, out_dir, force=force, model=None if spec else model, tokenizer=tokenizer, static=static)
    return Path(out_dir)


def ensure_export(request: ExportRequest, out_dir: str | os.PathLike[str], *, model: Any = None,
                  tokenizer: Any = None, static: StaticLike | None = None) -> Path:
    """``out_dir`` if it is an intact export this exact kvq source built from the same request, else a new one.

    The one rule for reusing an export (an automatic validation baseline, demo and benchmark exports): the
    manifest's ``build`` section must name this source's :func:`source_digest` and the same request (and static
    metadata), and its weights must match their checksums.
    """
    out = Path(out_dir)
    wanted = _build_record(request, static, model=model)

    def current() -> bool:
        try:
            manifest = Manifest.load(out)
            if manifest.build == wanted:
                verify_weights(out, manifest)
                logger.info("reusing %s", out)
                return True
        except KVQError as err:
            logger.info("not reusing %s: %s", out, err)
        return False

    if current():
        return out
    # concurrent callers (parallel validations sharing one baseline) wait for the first, then reuse its export
    _export_to(request, out, force=True, wait=True, reuse=current, model=model, tokenizer=tokenizer, static=static)
    return out


def cached_export_dir(request: ExportRequest, root: str | os.PathLike[str]) -> Path:
    """Where the demo and validation keep ``request``'s export.

    ``root/<model>-<digest>-<scheme>[-<flavor>][-<dtype>][-w<weights>]``: keyed by the model's content digest, so two
    models of one name, or a model edited in place, never share one, and by every weight setting that differs from
    the default, so exports of one model and scheme with other weights (a validation baseline with the export's
    int4 weights, its fp32-weight reference) live side by side instead of replacing each other.
    """
    parts = [Path(request.model or "model").name]
    parts += [model_digest(request.model)] if request.model else []
    parts += [(request.scheme.name or "custom") if request.scheme else request.plan.name or
              f"plan-{request.plan.budget:g}b"]
    parts += [str(request.flavor)] if request.flavor is not FlavorName.REFERENCE else []
    parts += [str(request.dtype)] if str(request.dtype) != "fp32" else []
    parts += [_weights_key(request.weights)] if request.weights != WeightSpec() else []
    return Path(root) / "-".join(parts)


def _weights_key(weights: WeightSpec) -> str:
    """``w<format>`` plus each setting that differs from the default: ``wint4-b64-asym-acc1``."""
    default = WeightSpec()
    parts = [f"w{weights.format}"]
    parts += [f"b{weights.block_size}"] if weights.block_size != default.block_size else []
    parts += ["asym"] if weights.symmetric != default.symmetric else []
    parts += [f"acc{weights.accuracy_level}"] if weights.accuracy_level != default.accuracy_level else []
    return "-".join(parts)


def _export_to(request: ExportRequest, out: Path, *, force: bool, wait: bool, reuse, model: Any, tokenizer: Any,
               static: StaticLike | None) -> Manifest:
    """Check ``out``, take its lock (or wait for it), then export unless ``reuse()`` says the result is there.

    A file system that refuses a write (full, read-only, ``/proc``) is one ExportError; the temporary
    directory and the lock are gone by then, and an existing export is untouched.
    """
    out = _output_dir(out)
    try:
        _check_target(out, force)
        with _target_lock(out, wait=wait):
            if reuse is not None and reuse():  # another process made it while we waited
                return Manifest.load(out)
            _clean_leftovers(out)
            _check_target(out, force)  # again, now that no other export can be changing it
            return _run(request, out, model=model, tokenizer=tokenizer, static=static)
    except OSError as err:
        reason = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        where = f" ({err.filename})" if err.filename and err.errno != errno.ENOSPC else ""
        raise ExportError(f"cannot write the export {out}: {reason}{where}; nothing was written or replaced"
                          ) from None


def _output_dir(out: Path) -> Path:
    """``out`` as an absolute path (``.``, ``..`` resolved); the current directory and its parents are refused.

    An export replaces its target directory as a whole, which the directory a process runs in must never be.
    """
    path = Path(os.path.abspath(out))
    with contextlib.suppress(OSError):  # a deleted current directory has no parents to protect
        here = Path.cwd()
        if path == here or path in here.parents:
            raise ExportError(f"export directory {out} is the current directory or one of its parents; "
                              "give a directory of its own for the export")
    return path


def _run(request: ExportRequest, out: Path, *, model: Any, tokenizer: Any, static: StaticLike | None) -> Manifest:
    """The pipeline, run while this process holds ``out``'s lock: plan, then compute, then write aside and swap."""
    start = time.perf_counter()
    source = load_source(request, model, tokenizer)
    planned = plan_budget(request, source, static=static) if request.plan is not None else None
    plan = plan_export(request, source, static=static, planned=planned)
    calibrated = calibrate(plan, source)
    graph, _ = build_graph(plan, source, calibrated.calibration)
    graph = quantize_weights(graph, plan.request.weights)
    logger.info("built the %s graph in %.1f s", plan.flavor.name, time.perf_counter() - start)
    tmp = temp_dir_beside(out)
    try:
        manifest = package(tmp, plan, source, graph, calibrated)
        seal_dir(tmp)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %s (%s, %s) to %s in %.1f s", plan.facts.model_type, plan.request.scheme.name or "custom",
                plan.flavor.name, out, time.perf_counter() - start)
    return manifest


def _build_record(request: ExportRequest, static: StaticLike | None, *, model: Any = None) -> BuildRecord:
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


# -- the export directory: what may be replaced, by whom, and how ---------------------------------------
def _check_target(out: Path, force: bool) -> None:
    """Refuse every ``out`` that is not ours to (re)place: only an export directory is replaced, with force."""
    if out.is_symlink():
        raise ExportError(f"{out} is a symbolic link; give the directory it points to, or another out_dir",
                          cli=f"{out} is a symbolic link; give the directory it points to, or another --out")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory; choose another out_dir",
                          cli=f"{out} exists and is not a directory; choose another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return  # nothing there, or an empty directory: nothing to lose
    if not (out / MANIFEST_NAME).is_file():
        not_ours = f"{out} is not a kvq export directory (no {MANIFEST_NAME}) and is not empty"
        raise ExportError(f"{not_ours}; force=True replaces only a kvq export: choose another out_dir",
                          cli=f"{not_ours}; --force replaces only a kvq export: choose another --out")
    if not force:
        raise ExportError(f"{out} already exists; pass force=True to replace it",
                          cli=f"{out} already exists; pass --force to replace it")


@contextmanager
def _target_lock(out: Path, *, wait: bool = False) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``out`` for the whole export.

    A second export of ``out`` fails at once, or with ``wait`` blocks until the first has finished. The lock is
    never a symbolic link (opening one would create or lock the file it points to) and never anything but a
    plain file of one link; a directory that cannot hold it is one ExportError.
    """
    import fcntl
    import stat

    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{aside_name(out.name)}.lock"
    while True:
        try:  # O_NONBLOCK: a FIFO or a device put there must not hang the open
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, file_mode())
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise ExportError(f"the lock file {lock} is a symbolic link; kvq never follows one: remove it "
                                  "if no kvq export is running") from None
            if err.errno == errno.EISDIR:
                raise ExportError(f"the lock file {lock} is a directory; remove it if no kvq export is running"
                                  ) from None
            raise ExportError(f"cannot create the lock file {lock} ({err.strerror}): the directory that holds "
                              "the export must be writable") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise ExportError(f"the lock file {lock} is not a plain file of its own; remove it if no kvq export "
                              "is running")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise ExportError(f"another kvq export is writing {out} right now; run again when it has finished"
                              ) from None
        try:  # the holder before us may have removed the file after we opened it: lock the current one
            if info.st_ino == os.lstat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _is_export(directory: Path) -> bool:
    return (directory / MANIFEST_NAME).is_file()


def _clean_leftovers(out: Path) -> None:
    """Remove what a killed export of ``out`` left (we hold the lock: their writer is gone)."""
    clean_leftovers(out, complete=_is_export)


def _move_into_place(new: Path, target: Path) -> None:
    """Put the complete export ``new`` at ``target`` (see :func:`kvq_export._atomic.move_dir_into_place`)."""
    try:
        move_dir_into_place(new, target, replaceable=_is_export)
    except FileExistsError:
        raise ExportError(f"{target} was created or filled by someone else while exporting (it is not a kvq "
                          "export); nothing was replaced") from None
