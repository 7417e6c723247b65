"""``export()``: a model + a scheme -> a deployable export directory.

The directory holds ``model.onnx`` (+ ``model.onnx.data``), the tokenizer files, the calibration file
for static-scale schemes, and ``kvq.json`` (the manifest). It is written into a hidden temporary
directory beside the target and renamed into place at the end, so a half-written export never looks
complete.

Flavours are registered: each maps a scheme + model geometry to a
:class:`~kvq_export.export.decoder.CacheGraph`. This issue ships ``reference`` (standard ONNX ops only).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvq_export.calibrate import DEFAULT_CALIB_TOKENS
from kvq_export.errors import ExportError
from kvq_export.manifest import CALIBRATION_NAME, MODEL_NAME, Manifest
from kvq_export.scheme import KVQuantScheme

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 23
DTYPES = ("fp32", "fp16")

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


def _model_facts(arch, config) -> dict[str, Any]:
    rope = arch.rope()
    return {
        "model_type": arch.model_type,
        "num_layers": arch.num_layers,
        "num_heads": arch.num_heads,
        "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_size": arch.hidden_size,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_positions,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "scaling": float(arch.scaling),
        "sliding_windows": [arch.layer_window(i) for i in range(arch.num_layers)],
        "rope": {"type": rope.rope_type, "attention_scaling": float(rope.attention_scaling),
                 "parameters": {k: v for k, v in arch.rope_parameters().items() if _jsonable(v)}},
    }


def _jsonable(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool, type(None), list, dict))


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
) -> Path:
    """Export ``model`` (a model spec, or a loaded HF causal LM) with ``scheme`` into ``out_dir``.

    Static-scale schemes need calibrated scales: pass ``static`` (see :mod:`kvq_export.calibrate`)
    or ``calib_corpus`` (a corpus name or text file, of which ``calib_tokens`` tokens are used);
    without either they are refused. Returns the export directory.
    """
    import kvq_export
    from kvq_export.export.arch import get_arch
    from kvq_export.export.builder import save
    from kvq_export.export.decoder import build_decoder
    from kvq_export.presets import resolve_scheme

    scheme = resolve_scheme(scheme)
    get_flavor(flavor)
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; pass --force (force=True) to replace it")

    start = time.perf_counter()
    source = None
    if isinstance(model, (str, os.PathLike)):
        from kvq_export.model_source import load_model

        source = str(model)
        model, tokenizer = load_model(model)
    config = model.config
    arch = get_arch(config)
    scheme.check_model(arch.num_layers, arch.head_dim)
    provenance: dict[str, Any] = {"source": "given"}  # how the static scales were chosen, for the manifest
    if scheme.has_static_scales and static is None:
        if calib_corpus is None:
            raise ExportError(
                f"scheme {scheme.name or 'custom'} uses static scales: calibrate first (give --calib-corpus; "
                "kvq never guesses a scale)"
            )
        static, used = _calibrate(model, tokenizer, scheme, calib_corpus, calib_tokens, calib_method,
                                  calib_percentile)
        provenance = {"source": "calibrated", "corpus": str(calib_corpus), "tokens": used,
                      "method": calib_method,
                      **({"percentile": calib_percentile} if calib_method == "percentile" else {})}
    cache = get_flavor(flavor)(scheme, num_layers=arch.num_layers, kv_heads=arch.num_kv_heads,
                            head_dim=arch.head_dim, static=static)
    graph = build_decoder(model, arch, cache, dtype=dtype, opset=opset)
    logger.info("built the %s graph in %.1f s", flavor, time.perf_counter() - start)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save(graph, tmp / MODEL_NAME)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        calibration = None
        if static is not None and scheme.has_static_scales:
            from kvq_export.calibrate import calibration_digest, save_calibration

            save_calibration(static, tmp / CALIBRATION_NAME)
            calibration = {"file": CALIBRATION_NAME, "digest": calibration_digest(static), **provenance}
        manifest = Manifest(
            scheme=scheme, model={**_model_facts(arch, config), "source": source}, flavor=flavor, opset=opset,
            dtype=dtype,
            kvq_version=kvq_export.__version__,
            inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
                    {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"],
                     "meaning": "1 = real token, 0 = left padding of this call's tokens"}],
            outputs=[{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", arch.vocab_size]}],
            tokenizer=_tokenizer_facts(tokenizer, config), calibration=calibration,
        )
        manifest = _write_runtime_files(tmp, manifest)
        manifest.save(tmp)  # last: a directory with kvq.json is complete
        os.chmod(tmp, 0o755)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %s (%s, %s) to %s in %.1f s", arch.model_type, scheme.name or "custom", flavor, out,
                time.perf_counter() - start)
    return out


def _write_runtime_files(directory: Path, manifest: Manifest) -> Manifest:
    """Add what other runtimes read (onnxruntime-genai's config and graph) and record it in the manifest."""
    from dataclasses import replace

    from kvq_export.runtime.genai import RUNTIME, write_genai_files

    return replace(manifest, runtimes={**manifest.runtimes, RUNTIME: write_genai_files(directory, manifest)})


def _calibrate(model, tokenizer, scheme, corpus: str, tokens: int, method: str, percentile: float):
    """(static scales, tokens used) from about ``tokens`` tokens of ``corpus`` (whole windows of <= 1024 tokens)."""
    from kvq_export.calibrate import calibrate_static_scales
    from kvq_export.corpus import load_corpus, token_windows

    if tokenizer is None:
        raise ExportError("calibrating from a corpus needs the model's tokenizer")
    window = min(1024, tokens)
    windows = token_windows(tokenizer, load_corpus(corpus), max(1, tokens // window), window)
    static = calibrate_static_scales(model, scheme, windows, method=method, percentile=percentile)
    return static, sum(len(w) for w in windows)


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``; an existing target is swapped out first, then removed."""
    if target.exists():
        trash = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, trash)
        os.replace(new, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(new, target)
