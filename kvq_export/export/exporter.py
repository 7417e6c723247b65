"""``export()``: an :class:`~kvq_export.request.ExportRequest` -> a deployable export directory.

The directory holds ``model.onnx`` (+ ``model.onnx.data``), the tokenizer files, the calibration file
for static-scale schemes, and ``kvq.json`` (the manifest). The export is a pipeline of small stages, each a
plain function a test or a tool can run alone (:mod:`kvq_export.export.stages`)::

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

Flavours are declared in :mod:`kvq_export.flavors`; the lock is :func:`kvq_export._atomic.target_lock`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq_export._atomic import clean_leftovers, move_dir_into_place, seal_dir, target_lock, temp_dir_beside
from kvq_export.calibration.artifact import StaticLike
from kvq_export.errors import ExportError, KVQError
from kvq_export.export.stages import (
    build_graph,
    build_record,
    calibrate,
    load_source,
    package,
    plan_budget,
    plan_export,
    quantize_weights,
)
from kvq_export.flavors import FlavorName
from kvq_export.manifest import MANIFEST_NAME, Manifest, verify_weights
from kvq_export.model_digest import model_digest
from kvq_export.request import (
    DEFAULT_OPSET,
    CalibrationSpec,
    ExportRequest,
    WeightSpec,
)
from kvq_export.scheme import KVQuantScheme

if TYPE_CHECKING:

    pass

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_OPSET", "cached_export_dir", "ensure_export", "export", "export_model"]


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
    wanted = build_record(request, static, model=model)

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
    parts += [weights_key(request.weights)] if request.weights != WeightSpec() else []
    return Path(root) / "-".join(parts)


def weights_key(weights: WeightSpec) -> str:
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
        with target_lock(out, wait=wait):
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
    graph = quantize_weights(graph, plan.request.weights, source)
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
