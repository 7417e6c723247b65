"""``compare_with_onnxruntime()``: a TensorRT engine against ONNX Runtime running the reference flavor.

Both sides go through Polygraphy's ``Comparator`` exactly like ``kvq compare`` (same feeds: a left-padded
prefill then single-token decode steps, the cache carried from one step to the next as a serving runtime
would; same outputs: ``logits`` and each layer's held cache decoded with only the manifest; same
per-output tolerances). The ONNX Runtime side is the reference flavor of the same model and scheme:
``reference_dir``, or re-exported from the manifest's model source when not given.

Without TensorRT this raises a one-line :class:`~kvq_export.errors.DependencyError`. Not run on these
machines (TensorRT is not installable here).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvq_export._lazy import require
from kvq_export.dtypes import DType
from kvq_export.errors import ExportError
from kvq_export.export.exporter import export
from kvq_export.flavors import FlavorName, get_flavor
from kvq_export.manifest import Manifest, load_static
from kvq_export.model_digest import recorded_source
from kvq_export.naming import present_name
from kvq_export.request import ExportRequest
from kvq_export.trt.engine import default_engine_path
from kvq_export.validate.compare import Tolerances, compare_feeds, decoded_cache, kvq_runner_class, run_comparison

if TYPE_CHECKING:
    from kvq_export.validate.compare import Comparison

logger = logging.getLogger(__name__)


def _trt_runner_class():
    from polygraphy.backend.base import BaseRunner
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.common import TensorMetadata

    class KVQTrtRunner(BaseRunner):
        """A Polygraphy runner over a kvq TensorRT engine that carries the cache between calls."""

        def __init__(self, export_dir: str | os.PathLike[str], engine: str | os.PathLike[str], name: str | None = None,
                     profile: int = 0) -> None:
            super().__init__(name=name or f"trt:{Path(export_dir).name}", prefix="kvq-trt-runner")
            self.export_dir, self.engine, self.profile = Path(export_dir), Path(engine), profile

        def activate_impl(self) -> None:
            self.manifest = Manifest.load(self.export_dir)
            self.static = load_static(self.export_dir, self.manifest)
            self.runner = TrtRunner(EngineFromBytes(self.engine.read_bytes()), optimization_profile=self.profile)
            self.runner.activate()
            self.cache = None

        def get_input_metadata_impl(self):
            return (TensorMetadata().add("input_ids", np.int64, (-1, -1))
                    .add("attention_mask", np.int64, (-1, -1)))

        def infer_impl(self, feed_dict):
            import time

            batch = feed_dict["input_ids"].shape[0]
            cache = self.cache if self.cache is not None else empty_cache(self.manifest, batch)
            start = time.perf_counter()
            outputs = self.runner.infer({**feed_dict, **cache})
            self.inference_time = time.perf_counter() - start
            self.cache = {t.name: np.asarray(outputs[present_name(t.name)]) for t in self.manifest.cache("past")}
            view = _ArraySession(self.manifest)
            return {"logits": np.asarray(outputs["logits"]), **decoded_cache(view, self.cache, self.static)}

        def deactivate_impl(self) -> None:
            self.runner.deactivate()
            del self.runner, self.cache

    return KVQTrtRunner


class _ArraySession:
    """The two things ``decoded_cache`` reads from a session, for a cache held as numpy arrays."""

    def __init__(self, manifest) -> None:
        self.manifest = manifest

    @staticmethod
    def cache_arrays(cache: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return cache


def empty_cache(manifest, batch: int) -> dict[str, np.ndarray]:
    """Every past cache tensor holding no token (fp8 codes as their uint8 bits)."""
    out = {}
    for t in manifest.cache("past"):
        shape = [batch if d == "batch" else (d if isinstance(d, int) else 0) for d in t.shape]
        out[t.name] = np.zeros(shape, DType.get(t.dtype).bits_numpy)
    return out


def _reference_export(export_dir: Path, workdir: Path) -> Path:
    """Export the reference flavor of the same model, scheme, dtype and calibration into ``workdir``."""
    manifest = Manifest.load(export_dir)
    source, _ = recorded_source(manifest)  # the weights the export was made from, or a one-line refusal
    request = ExportRequest(model=source, scheme=manifest.scheme, flavor=FlavorName.REFERENCE, dtype=manifest.dtype,
                            opset=manifest.opset)
    export(request, workdir / "reference", static=load_static(export_dir, manifest))
    return workdir / "reference"


def compare_with_onnxruntime(
    export_dir: str | os.PathLike[str],
    *,
    reference_dir: str | os.PathLike[str] | None = None,
    engine: str | os.PathLike[str] | None = None,
    tolerances=None,
    prompt_len: int = 48,
    batch: int = 2,
    steps: int = 4,
    seed: int = 0,
    providers: Sequence[str] | None = None,
    verbose: bool = True,
) -> Comparison:
    """Run the engine of ``export_dir`` and ONNX Runtime on the reference flavor; true when all outputs match.

    Returns a :class:`~kvq_export.validate.compare.Comparison` (each output's largest errors).
    ``engine`` defaults to ``DIR.engine`` beside the export (see :func:`kvq_export.trt.build_engine`);
    ``tolerances`` is a :class:`kvq_export.validate.compare.Tolerances`; ``providers``: the ONNX Runtime side's;
    ``verbose``: Polygraphy's per-output log.
    """
    require("tensorrt")

    export_dir = Path(export_dir)
    engine = Path(engine) if engine else default_engine_path(export_dir)
    if not engine.is_file():
        raise ExportError(f"no engine at {engine}; build it first (kvq build {export_dir})")
    if get_flavor(manifest_flavor(export_dir)).needs_plugins:
        require("tensorrt.plugin")
        from kvq_plugins.trt_plugin import register_for_export  # lazy: used only once tensorrt.plugin is present

        register_for_export(export_dir)  # the JIT implementation must be present to deserialize a JIT engine
    tol = tolerances or Tolerances()
    manifest = Manifest.load(export_dir)
    with tempfile.TemporaryDirectory(prefix="kvq-compare-") as work:
        reference = Path(reference_dir) if reference_dir else _reference_export(export_dir, Path(work))
        feeds = compare_feeds(manifest.model.vocab_size, prompt_len=prompt_len, batch=batch, steps=steps, seed=seed)
        runners = [kvq_runner_class()(reference, name=f"onnxrt:{reference.name}", providers=providers),
                   _trt_runner_class()(export_dir, engine)]
        return run_comparison(runners, feeds, tol, verbose=verbose)


def manifest_flavor(export_dir: str | os.PathLike[str]) -> str:
    """The flavor an export directory was made with."""
    return Manifest.load(export_dir).flavor
