"""``export()``: a model + a scheme -> a deployable export directory.

The directory holds ``model.onnx`` (+ ``model.onnx.data``), the tokenizer files, the calibration file
for static-scale schemes, and ``kvq.json`` (the manifest). It is written into a hidden temporary
directory beside the target and swapped into place at the end, so a half-written export never looks
complete and a crash leaves the old export or the new one. A lock file beside the target lets one export
of a directory run at a time; ``force`` replaces only a directory that holds a kvq manifest. The manifest
records sha256 checksums of the weight files, and the graph carries its scheme, so a loader can refuse
corrupted weights and an edited manifest.

Flavours are registered: each maps a scheme + model geometry to a
:class:`~kvq_export.export.decoder.CacheGraph`; ``reference`` (standard ONNX ops only) is built in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import glob
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvq_export._atomic import aside_name, dir_mode, exchange, file_mode, rename_noreplace
from kvq_export.calibrate import DEFAULT_CALIB_TOKENS
from kvq_export.errors import ExportError
from kvq_export.manifest import (
    CALIBRATION_NAME,
    COMPUTE_DTYPES,
    MANIFEST_NAME,
    MODEL_NAME,
    Manifest,
    graph_metadata,
    verify_weights,
    weight_checksums,
)
from kvq_export.model_facts import ModelFacts
from kvq_export.scheme import KVQuantScheme

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 23
DTYPES = COMPUTE_DTYPES

FlavorFactory = Callable[..., Any]
FLAVORS: dict[str, FlavorFactory] = {}
#: flavours registered by their own module, imported only when asked for (they may need extra stacks)
FLAVOR_MODULES = {
    "ort-gqa": "kvq_export.export.gqa_flavor",
    "trt": "kvq_export.export.trt_flavor",
}


def register_flavor(name: str) -> Callable[[FlavorFactory], FlavorFactory]:
    """Register a factory ``(scheme, *, num_layers, kv_heads, head_dim, static) -> CacheGraph``."""

    def wrap(factory: FlavorFactory) -> FlavorFactory:
        FLAVORS[name] = factory
        return factory

    return wrap


@register_flavor("reference")
def _reference_flavor(scheme: KVQuantScheme, **geometry):
    from kvq_export.export.kv_graph import QuantizedCacheGraph

    return QuantizedCacheGraph(scheme, **geometry)


def flavor_names() -> list[str]:
    """Every flavour kvq knows, registered or importable."""
    return sorted(set(FLAVORS) | {name for name, module in FLAVOR_MODULES.items() if _module_exists(module)})


def _module_exists(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


def get_flavor(name: str) -> FlavorFactory:
    """The factory of flavour ``name``, importing its module on first use."""
    if name not in FLAVORS and name in FLAVOR_MODULES and _module_exists(FLAVOR_MODULES[name]):
        import importlib

        importlib.import_module(FLAVOR_MODULES[name])  # registers itself with @register_flavor
    if name not in FLAVORS:
        raise ExportError(f"unknown flavor {name!r}; allowed: {', '.join(flavor_names())}")
    return FLAVORS[name]


MIN_OPSET = 18


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


def _tokenizer_facts(tokenizer, config) -> dict[str, Any]:
    eos = getattr(config, "eos_token_id", None)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
    return {"eos_token_id": eos, "bos_token_id": getattr(config, "bos_token_id", None),
            "pad_token_id": getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None,
            "files": tokenizer is not None}


def export(
    model: str | os.PathLike[str] | Any,
    scheme: KVQuantScheme | str,
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "fp32",
    opset: int = DEFAULT_OPSET,
    flavor: str = "reference",
    force: bool = False,
    static: Mapping | None = None,
    tokenizer: Any = None,
    calib_corpus: str | None = None,
    calib_tokens: int = DEFAULT_CALIB_TOKENS,
    calib_method: str = "absmax",
    calib_percentile: float = 99.9,
    calib_offset: int = 0,
) -> Path:
    """Export ``model`` (a model spec, or a loaded HF causal LM) with ``scheme`` into ``out_dir``.

    Static-scale schemes need calibrated scales: pass ``static`` (see :mod:`kvq_export.calibrate`)
    or ``calib_corpus`` (a corpus name or text file, of which ``calib_tokens`` tokens from token
    ``calib_offset`` on are used);
    without either they are refused. Returns the export directory.
    """
    from kvq_export.presets import resolve_scheme

    scheme = resolve_scheme(scheme)
    get_flavor(flavor)
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    check_opset(opset)
    return _export_to(model, scheme, Path(out_dir), force=force, wait=False, reuse=None, dtype=dtype, opset=opset,
                      flavor=flavor, static=static, tokenizer=tokenizer, calib_corpus=calib_corpus,
                      calib_tokens=calib_tokens, calib_method=calib_method, calib_percentile=calib_percentile,
                      calib_offset=calib_offset)


def _export_to(model, scheme: KVQuantScheme, out: Path, *, force: bool, wait: bool,
               reuse: Callable[[], bool] | None, **options) -> Path:
    """Check ``out``, take its lock (or wait for it), then export unless ``reuse()`` says the result is there.

    A file system that refuses a write (full, read-only, ``/proc``) is one ExportError; the temporary
    directory and the lock are gone by then, and an existing export is untouched.
    """
    out = _output_dir(out)
    try:
        _check_target(out, force)
        with _target_lock(out, wait=wait):
            if reuse is not None and reuse():  # another process made it while we waited
                return out
            _clean_leftovers(out)
            _check_target(out, force)  # again, now that no other export can be changing it
            return _export_locked(model, scheme, out, **options)
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


def _export_locked(model, scheme: KVQuantScheme, out: Path, *, dtype: str, opset: int, flavor: str, static,
                   tokenizer, calib_corpus, calib_tokens: int, calib_method: str, calib_percentile: float,
                   calib_offset: int) -> Path:
    """The body of :func:`export`, run while this process holds ``out``'s lock."""
    import kvq_export
    from kvq_export.export.arch import get_arch
    from kvq_export.export.builder import save
    from kvq_export.export.decoder import build_decoder

    request = _request(model, scheme, flavor=flavor, dtype=dtype, opset=opset, static=static,
                       calib_corpus=calib_corpus, calib_tokens=calib_tokens, calib_method=calib_method,
                       calib_percentile=calib_percentile, calib_offset=calib_offset)
    start = time.perf_counter()
    source = None
    if isinstance(model, (str, os.PathLike)):
        from kvq_export.model_source import canonical_spec, load_model

        source = canonical_spec(model)  # absolute: the manifest names the same model from any directory
        model, tokenizer = load_model(source)
    config = model.config
    arch = get_arch(config)
    scheme.check_model(arch.num_layers, arch.head_dim)
    provenance: dict[str, Any] = {"source": "given"}  # how the static scales were chosen, for the manifest
    if scheme.needs_calibration and static is None:
        if calib_corpus is None:
            needs = "static scales" if scheme.has_static_scales else "calibrated high channels"
            raise ExportError(f"scheme {scheme.name or 'custom'} uses {needs}: calibrate first (give --calib-corpus; "
                              "kvq never guesses a scale or a channel)")
        static, used = _calibrate(model, tokenizer, scheme, calib_corpus, calib_tokens, calib_method,
                                  calib_percentile, calib_offset)
        provenance = {"source": "calibrated", "corpus": str(calib_corpus), "tokens": used,
                      "offset": calib_offset, "method": calib_method,
                      **({"percentile": calib_percentile} if calib_method == "percentile" else {})}
    cache = get_flavor(flavor)(scheme, num_layers=arch.num_layers, kv_heads=arch.num_kv_heads,
                            head_dim=arch.head_dim, static=static)
    graph = build_decoder(model, arch, cache, dtype=dtype, opset=opset)
    logger.info("built the %s graph in %.1f s", flavor, time.perf_counter() - start)
    facts = ModelFacts.from_config(config, arch, source=source)
    calibration_digest = None
    if static is not None and scheme.needs_calibration:
        from kvq_export.calibrate import calibration_digest as digest_of

        calibration_digest = digest_of(static)
    # the graph carries what it fixes (scheme, model facts, flavour, layout, dtype, embedded scales): a loader
    # compares it with the manifest, so an edited kvq.json or calibration file is refused
    graph.metadata_props.update(graph_metadata(scheme, facts, flavor=flavor, layout=cache.layout.name, dtype=dtype,
                                               calibration_digest=calibration_digest))

    tmp = Path(tempfile.mkdtemp(prefix=f".{aside_name(out.name)}.tmp-", dir=out.parent))
    try:
        save(graph, tmp / MODEL_NAME)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        calibration = None
        if calibration_digest is not None:
            from kvq_export.calibrate import save_calibration

            save_calibration(static, tmp / CALIBRATION_NAME)
            calibration = {"file": CALIBRATION_NAME, "digest": calibration_digest, **provenance}
        manifest = Manifest(
            scheme=scheme, model=facts, flavor=flavor, opset=opset,
            dtype=dtype, layout=cache.layout.name,
            kvq_version=kvq_export.__version__,
            inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
                    {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"],
                     "meaning": "1 = real token, 0 = left padding of this call's tokens"}],
            outputs=[{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", arch.vocab_size]}],
            tokenizer=_tokenizer_facts(tokenizer, config), calibration=calibration,
            build={"kvq_code": source_digest(), "request": request},
        )
        manifest = _write_runtime_files(tmp, manifest)
        # checksums last, once: they cover the graphs the runtime files add (hashing the weights is the slow part)
        manifest = dataclasses.replace(manifest, weights=weight_checksums(tmp))
        manifest.save(tmp)  # last: a directory with kvq.json is complete
        os.chmod(tmp, dir_mode())  # mkdtemp makes it 0700; the files inside follow the umask, so does it
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %s (%s, %s) to %s in %.1f s", arch.model_type, scheme.name or "custom", flavor, out,
                time.perf_counter() - start)
    return out


def _write_runtime_files(directory: Path, manifest: Manifest) -> Manifest:
    """Add what other runtimes read (onnxruntime-genai's config and graph) and record it in the manifest."""
    from dataclasses import replace

    from kvq_export.export.genai_package import RUNTIME, write_genai_files

    return replace(manifest, runtimes={**manifest.runtimes, RUNTIME: write_genai_files(directory, manifest)})


def _calibrate(model, tokenizer, scheme, corpus: str, tokens: int, method: str, percentile: float, offset: int = 0):
    """(static scales, tokens used) from about ``tokens`` tokens of ``corpus`` from token ``offset`` on."""
    from kvq_export.calibrate import calibrate_static_scales, calibration_windows

    if tokenizer is None:
        raise ExportError("calibrating from a corpus needs the model's tokenizer")
    windows = calibration_windows(tokenizer, corpus, tokens, offset=offset)
    static = calibrate_static_scales(model, scheme, windows, method=method, percentile=percentile)
    return static, sum(len(w) for w in windows)


def source_digest() -> str:
    """Digest of kvq_export's source: which code built an export (finer than the version number)."""
    return _source_digest()


@functools.cache
def _source_digest() -> str:
    import kvq_export

    h = hashlib.sha256()
    root = Path(kvq_export.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _request(model, scheme: KVQuantScheme, *, flavor: str, dtype: str, opset: int, static, calib_corpus,
             calib_tokens: int, calib_method: str, calib_percentile: float, calib_offset: int) -> dict[str, Any]:
    """Everything that shapes an export, as JSON: two equal requests from one kvq source give one export.

    The model is named by its content (:func:`~kvq_export.model_source.model_identity`), so a reused export is
    never one of another model that had the same name or path; ``source_digest`` is what validation's automatic
    baseline checks the source against later (:func:`~kvq_export.model_digest.recorded_source`).
    """
    from kvq_export.model_digest import model_digest
    from kvq_export.model_source import model_identity

    spec = isinstance(model, (str, os.PathLike))
    request: dict[str, Any] = {"source": model_identity(model),
                               "source_digest": model_digest(model) if spec else None,
                               "scheme": {**scheme.to_dict(), "name": None}, "flavor": flavor, "dtype": dtype,
                               "opset": opset}
    if scheme.needs_calibration:
        if static is not None:
            from kvq_export.calibrate import calibration_digest

            request["static"] = calibration_digest(static)
        else:
            request["calibration"] = {"corpus": str(calib_corpus), "tokens": calib_tokens, "method": calib_method,
                                      "percentile": calib_percentile, "offset": calib_offset}
    return request


def ensure_export(model: str | os.PathLike[str] | Any, scheme: KVQuantScheme | str,
                  out_dir: str | os.PathLike[str], **options) -> Path:
    """``out_dir`` if it is an intact export this exact kvq source built from the same request, else a new one.

    The one rule for reusing an export (an automatic validation baseline, benchmark exports): the manifest's
    ``build`` section must name this source's :func:`source_digest` and the same model, scheme, flavour, dtype,
    opset and calibration, and its weights must match their checksums. ``options`` are :func:`export`'s.
    """
    from kvq_export.errors import KVQError
    from kvq_export.presets import resolve_scheme

    scheme = resolve_scheme(scheme)
    out = Path(out_dir)
    unknown = sorted(set(options) - set(_REQUEST_DEFAULTS) - {"static", "tokenizer"})
    if unknown:
        raise ExportError(f"unknown export option(s) {', '.join(unknown)}")
    wanted = {key: options.get(key, default) for key, default in _REQUEST_DEFAULTS.items()}
    get_flavor(wanted["flavor"])
    if wanted["dtype"] not in DTYPES:
        raise ExportError(f"unknown dtype {wanted['dtype']!r}; allowed: {', '.join(DTYPES)}")
    check_opset(wanted["opset"])
    request = _request(model, scheme, static=options.get("static"), **wanted)

    def current() -> bool:
        try:
            manifest = Manifest.load(out)
            if manifest.build == {"kvq_code": source_digest(), "request": request}:
                verify_weights(out, manifest)
                logger.info("reusing %s", out)
                return True
        except KVQError as err:
            logger.info("not reusing %s: %s", out, err)
        return False

    if current():
        return out
    # concurrent callers (parallel validations sharing one baseline) wait for the first, then reuse its export
    return _export_to(model, scheme, out, force=True, wait=True, reuse=current, static=options.get("static"),
                      tokenizer=options.get("tokenizer"), **wanted)


_REQUEST_DEFAULTS = {"flavor": "reference", "dtype": "fp32", "opset": DEFAULT_OPSET, "calib_corpus": None,
                     "calib_tokens": DEFAULT_CALIB_TOKENS, "calib_method": "absmax", "calib_percentile": 99.9,
                     "calib_offset": 0}


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


def _clean_leftovers(out: Path) -> None:
    """Remove what a killed export of ``out`` left (we hold the lock: their writer is gone).

    An old export swapped aside (``.<name>.old-*``) while ``out`` is missing is put back first: a crash
    between the two renames of the fallback swap then costs nothing.
    """
    name = glob.escape(aside_name(out.name))  # a name like "run[1]" is not a pattern
    for old in sorted(out.parent.glob(f".{name}.old-*")):
        if not os.path.lexists(out) and (old / MANIFEST_NAME).is_file():
            logger.warning("restoring %s from %s (an export was interrupted while replacing it)", out, old.name)
            os.rename(old, out)
        else:
            logger.info("removing %s, left by an interrupted export", old)
            shutil.rmtree(old, ignore_errors=True)
    for tmp in out.parent.glob(f".{name}.tmp-*"):
        logger.info("removing %s, left by an interrupted export", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(new: Path, target: Path) -> None:
    """Put the complete export ``new`` at ``target``: at every instant ``target`` is the old or the new export.

    An existing export is swapped with ``new`` in one atomic exchange, then removed; where the platform has
    no exchange, two renames with the old one kept aside (``.<name>.old-<pid>``) until the new one is in place,
    and restored by the next export if this one dies in between. A ``target`` that appeared meanwhile is
    never replaced.
    """
    if target.is_dir() and any(target.iterdir()):
        if not (target / MANIFEST_NAME).is_file():
            raise ExportError(f"{target} was filled by someone else while exporting (it is not a kvq export); "
                              "nothing was replaced")
        if exchange(new, target):
            shutil.rmtree(new, ignore_errors=True)  # ``new`` now names the old export
            return
        trash = target.with_name(f".{aside_name(target.name)}.old-{os.getpid()}")
        os.replace(target, trash)
        os.replace(new, target)
        shutil.rmtree(trash, ignore_errors=True)
        return
    if target.is_dir():
        target.rmdir()  # empty: nothing to lose
    try:
        rename_noreplace(new, target)
    except FileExistsError:
        raise ExportError(f"{target} was created by someone else while exporting; nothing was replaced") from None
