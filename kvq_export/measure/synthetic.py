"""One synthetic cache: random valid data in a graph's exact stored layout, already holding the context.

A decode step's cost depends on the cache's shapes, not its values (a real chunked prefill gives the same step
times within noise), and a synthetic cache costs no O(context^2) prefill. Values come from
:func:`kvq_export.cache_layout.random_values`: codes are random bytes (fp8: finite e4m3 only), values N(0, 0.5),
scales in [0.005, 0.02].

* :func:`synthetic_cache`: a kvq export's cache (its layout's :meth:`~kvq_export.cache_layout.CacheLayout.arrays`,
  the split the reference cache and the memory model use);
* :func:`graph_cache`: the past tensors of a graph onnxruntime-genai loads (``[batch, kv_heads, tokens,
  head_dim]`` of the graph's own element type), such as the model builder's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvq_export.cache_layout import random_values
from kvq_export.dtypes import DType
from kvq_export.errors import KVQError

#: the past element types :func:`graph_cache` fills, by ONNX Runtime's type string
GRAPH_CACHE_TYPES = {DType.get(name).ort_type: DType.get(name).onnx for name in ("fp32", "fp16", "uint8", "int8")}


def synthetic_cache(session: Any, batch: int, length: int, *, capacity: int | None = None, seed: int = 0,
                    rng: np.random.Generator | None = None) -> Any:
    """A cache of ``length`` tokens per row in ``session``'s exact stored layout, filled with random data.

    ``capacity`` sizes a fixed-capacity layout (default ``length``); ``rng`` (default: seeded with ``seed``)
    draws the values.
    """
    rng = np.random.default_rng(seed) if rng is None else rng
    manifest = session.manifest
    arrays = session.layout.arrays(session.past, manifest.scheme, manifest.num_layers, batch, length,
                                   capacity=capacity, rng=rng)
    return session.cache_from_arrays(arrays)


def graph_cache(types: Mapping[str, str], shape: tuple[int, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random valid past tensors of ``shape``, one per name, each of its ONNX Runtime type (``tensor(uint8)``)."""
    out = {}
    for name, ort_type in types.items():
        onnx = GRAPH_CACHE_TYPES.get(ort_type)
        if onnx is None:
            raise KVQError(f"cache input {name} is {ort_type}; allowed: {', '.join(GRAPH_CACHE_TYPES)}")
        out[name] = random_values(onnx, shape, rng).astype(DType.get(onnx).numpy, copy=False)
    return out
