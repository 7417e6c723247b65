"""``build_engine()``: a TensorRT engine from an export directory, with the kvq plugin loaded.

The export's ``model.onnx`` is parsed by TensorRT's ONNX parser (through Polygraphy's loaders) after the
plugins its manifest needs are registered (:func:`kvq_plugins.trt_plugin.register_for_export`), with two
optimization profiles over every dynamic axis the manifest names:

* profile 0, ``prefill``: ``seq`` from 1 to ``max_prefill`` (optimized for a prompt into an empty cache);
* profile 1, ``decode``: ``seq`` = 1 (optimized for a long held cache).

Cache region lengths range over what the scheme can hold at ``max_context`` tokens
(:class:`kvq_export.region_split.RegionSplit`): sinks up to ``sink_tokens``, the recent window up to
``residual_length + flush unit - 1``, the quantized region (and its groups) up to the rest.

Nothing here imports TensorRT until :func:`build_engine` runs; without TensorRT it raises a one-line
:class:`~kvq_export.errors.DependencyError`. Not run on these machines (TensorRT is not installable here).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from kvq_export._atomic import atomic_write
from kvq_export._lazy import require
from kvq_export.errors import ExportError
from kvq_export.flavors import Runtime, get_flavor
from kvq_export.manifest import MODEL_NAME, Manifest, check_output_path
from kvq_export.region_split import RegionSplit
from kvq_export.vocab import Part

logger = logging.getLogger(__name__)

ENGINE_NAME = "model.engine"


def default_engine_path(export_dir: str | os.PathLike[str]) -> Path:
    """``DIR.engine`` beside the export: an export directory holds only its checksummed files."""
    directory = Path(export_dir).resolve()
    return directory.with_name(f"{directory.name}.engine")

Shape = tuple[int, ...]
ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)

_REGION_AXIS = re.compile(r"^past\.(?P<layer>\d+)\.(?P<part>key|value)\.(?P<region>sinks|quantized|recent)_"
                          r"(?P<unit>tokens|groups)$")


def _region_bounds(manifest, axis: str, max_context: int) -> tuple[int, int] | None:
    """(largest, typical) length of a cache region axis at ``max_context`` tokens; None if not a region axis."""
    match = _REGION_AXIS.match(axis)
    if match is None:
        return None
    scheme = manifest.scheme
    tq = scheme.for_layer(int(match["layer"]))[0 if match["part"] == Part.KEY else 1]
    split = RegionSplit.of(tq, scheme)
    sinks, quantized, _ = split.lengths(max_context)
    if match["region"] == "sinks":
        return sinks, sinks
    if match["region"] == "recent":
        largest = split.longest_recent(max_context)
        return largest, min(largest, split.residual_length)
    groups = split.unit if match["unit"] == "groups" else 1
    return quantized // groups, quantized // groups // 2


def engine_profiles(manifest, *, max_batch: int = 8, max_context: int = 4096, max_prefill: int | None = None,
                    opt_batch: int | None = None) -> dict[str, ProfileShapes]:
    """``{"prefill": shapes, "decode": shapes}``: (min, opt, max) of every graph input, from the manifest."""
    if max_batch < 1 or max_context < 1:
        raise ExportError("max_batch and max_context must be >= 1")
    max_prefill = min(max_prefill or max_context, max_context)
    opt_batch = opt_batch or max(1, max_batch // 2)
    inputs = [(value.name, tuple(value.shape)) for value in manifest.inputs]
    inputs += [(t.name, tuple(t.shape)) for t in manifest.cache("past")]
    out: dict[str, ProfileShapes] = {}
    for profile in ("prefill", "decode"):
        shapes: ProfileShapes = {}
        for name, dims in inputs:
            lo, opt, hi = [], [], []
            for dim in dims:
                if isinstance(dim, int):
                    bounds = (dim, dim, dim)
                elif dim == "batch":
                    bounds = (1, opt_batch, max_batch)
                elif dim == "seq":
                    bounds = (1, min(max_prefill, 256), max_prefill) if profile == "prefill" else (1, 1, 1)
                else:
                    region = _region_bounds(manifest, dim, max_context)
                    if region is None:  # another symbolic axis (e.g. a buffer capacity): up to max_context
                        region = (max_context, max_context // 2)
                    largest, typical = region
                    bounds = (0, 0 if profile == "prefill" else typical, largest)
                lo.append(bounds[0])
                opt.append(bounds[1])
                hi.append(bounds[2])
            shapes[name] = (tuple(lo), tuple(opt), tuple(hi))
        out[profile] = shapes
    return out


def build_engine(
    export_dir: str | os.PathLike[str],
    *,
    fp16: bool = False,
    max_batch: int = 8,
    max_context: int = 4096,
    max_prefill: int | None = None,
    output: str | os.PathLike[str] | None = None,
    workspace_gib: float | None = None,
    optimization_level: int | None = None,
) -> Path:
    """Build a TensorRT engine for an export directory; return the engine file (default: :func:`default_engine_path`).

    The network is strongly typed (types come from the export; ``kvq export --dtype fp16`` for an fp16
    engine). ``fp16=True`` on an fp32 export builds a weakly typed network with TensorRT's FP16 flag
    instead. The kvq plugins are registered first when the export uses them (``--flavor trt``).
    """
    trt = require("tensorrt")
    manifest = Manifest.load(export_dir)
    flavor = get_flavor(manifest.flavor)
    if not flavor.serves(Runtime.TENSORRT):
        raise ExportError(f"the {flavor.name} flavor uses ops TensorRT does not have; "
                          "export with --flavor trt (or reference)")
    if flavor.needs_plugins:
        require("tensorrt.plugin")
        from kvq_plugins.trt_plugin import register_for_export  # lazy: used only once tensorrt.plugin is present

        register_for_export(export_dir)
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    weak_fp16 = fp16 and manifest.dtype != "fp16"
    if weak_fp16:
        logger.warning("fp16 engine from an fp32 export: weakly typed network with the FP16 flag "
                       "(an fp16 export, kvq export --dtype fp16, builds a strongly typed fp16 engine)")
    network = NetworkFromOnnxPath(str(Path(export_dir) / MODEL_NAME), strongly_typed=not weak_fp16)
    profiles = []
    for name, shapes in engine_profiles(manifest, max_batch=max_batch, max_context=max_context,
                                        max_prefill=max_prefill).items():
        profile = Profile()
        for tensor, (lo, opt, hi) in shapes.items():
            profile.add(tensor, min=lo, opt=opt, max=hi)
        profiles.append(profile)
        logger.info("optimization profile %d: %s", len(profiles) - 1, name)
    pools = {trt.MemoryPoolType.WORKSPACE: int(workspace_gib * (1 << 30))} if workspace_gib else None
    config = CreateConfig(fp16=weak_fp16 or None, profiles=profiles, memory_pool_limits=pools,
                          builder_optimization_level=optimization_level)
    start = time.perf_counter()
    engine = EngineBytesFromNetwork(network, config=config)()
    if engine is None:
        raise ExportError(f"TensorRT could not build an engine for {export_dir} (see the TensorRT log above)")
    target = check_output_path(output, "the engine") if output else default_engine_path(export_dir)
    atomic_write(target, bytes(engine))
    logger.info("built %s in %.1f s", target, time.perf_counter() - start)
    return target
