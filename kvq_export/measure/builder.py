"""onnxruntime-genai's model builder as a peer: its build of a model, on kvq's scales or its own calibrator's.

The builder runs offline on a Hugging Face directory (:func:`model_hf_dir`: kvq's cached fp32 conversion of a
GGUF model). A build is kept in its folder with a stamp of what made it (``peer_stamp.json``) and reused while the
stamp matches.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvq_export.errors import KVQError

logger = logging.getLogger(__name__)

STAMP_FILE = "peer_stamp.json"
#: The builder's cache scheme for kvq's ``ort-int8`` scales.
INT8_CACHE = "int8_per_channel"


def model_hf_dir(model: str) -> Path:
    """The Hugging Face directory the builder reads (kvq's cached fp32 conversion for a GGUF model)."""
    from kvq_export.model_source import _ensure_fp32_cache, resolve_spec

    source = resolve_spec(model)
    return source.path if source.kind == "hf_dir" else _ensure_fp32_cache(source.path)


def stamp_matches(out: Path, stamp: dict[str, Any]) -> bool:
    """Whether ``out`` was built with exactly ``stamp`` (written beside the build as ``peer_stamp.json``)."""
    path = out / STAMP_FILE
    return path.is_file() and json.loads(path.read_text()) == stamp


def write_stamp(out: Path, stamp: dict[str, Any]) -> None:
    """Record what built ``out`` (:func:`stamp_matches` reads it)."""
    (out / STAMP_FILE).write_text(json.dumps(stamp))


def build_with_builder(hf: Path, out: Path, quant: str | None = None, scale_file: Path | None = None,
                       precision: str = "fp32") -> Path:
    """``python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu`` (+ a quantized cache).

    ``quant`` is the builder's ``kv_cache_quant_scheme`` (``int8_per_channel`` ...), read with ``scale_file``.
    The builder's log goes beside ``out`` (``OUT.log``); its own cache of downloads to ``OUT/../builder-cache``.
    """
    stamp: dict[str, Any] = {"quant": quant, "scales": scale_file.read_text() if scale_file else None}
    if precision != "fp32":  # (builds made before the precision was a choice are fp32 and keep their stamp)
        stamp["precision"] = precision
    if stamp_matches(out, stamp):
        return out
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", precision,
           "-e", "cpu", "-c", str(out.parent / "builder-cache")]
    if quant:
        cmd += ["--extra_options", f"kv_cache_quant_scheme={quant}", f"kv_cache_scale_file={scale_file}"]
    logger.info("builder: %s", " ".join(cmd))
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.name}.log"
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise KVQError(f"onnxruntime-genai's builder failed (exit {done.returncode}); its log: {log_path}")
    write_stamp(out, stamp)
    return out


def builder_calibration(baseline: Path, hf: Path, out: Path, quant: str) -> Path:
    """The builder's own calibrator, its defaults, on the unquantized build: the builder's default scale file.

    Its defaults: the 99.99th percentile, a RoPE pair envelope for keys, 24 x 512 tokens of its built-in corpus.
    """
    from onnxruntime_genai.models.quantization.kv_cache_calibration import calibrate_kv_scales

    if not out.is_file():
        calibrate_kv_scales(str(baseline / "model.onnx"), str(hf), str(out), quant_type=quant)
    return out


def int4_int8_cache_build(model: str, work: Path) -> Path:
    """The builder's CPU default (``-p int4``) with an ``int8_per_channel`` cache on kvq's scales, built once.

    The scales are ``kvq calibrate --scheme ort-int8 --format genai-scales --weights int4`` (kvq's default
    calibration, measured on the int4 weights the build computes with), kept in ``work`` beside the build.
    """
    from kvq_export.request import DEFAULT_CALIBRATION, WeightSpec
    from kvq_export.runtime.genai import calibrate_to_file

    work.mkdir(parents=True, exist_ok=True)
    scales = work / "kvq-scales-int8_per_channel-w-int4.json"
    if not scales.is_file():
        logger.info("calibrating kvq's ort-int8 scales on %s's int4 weights into %s", model, scales)
        spec = DEFAULT_CALIBRATION
        calibrate_to_file(model, "ort-int8", scales, corpus=spec.corpus, tokens=spec.tokens, offset=spec.offset,
                          method=str(spec.method), percentile=spec.percentile, weights=WeightSpec("int4"))
    return build_with_builder(model_hf_dir(model), work / "builder-int4-int8_per_channel", INT8_CACHE, scales,
                              precision="int4")
