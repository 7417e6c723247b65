"""A calibration compared with the graph built from it: the graph is the source of truth.

:func:`compare_with_graph` takes a :class:`~kvq_export.calibration.artifact.Calibration` and the constants a graph
computes with (its initializers named by :func:`~kvq_export.calibration.artifact.static_name`, as read from the
ONNX file; :func:`reads_graph_constant` says which a loader reads) and refuses, in one line, the first constant
that disagrees with what the calibration's arrays make of it, whatever digests were recomputed. Forms compared:
kvq's own ``[H, n]`` metadata in ``scale_dtype``, and GroupQueryAttention's scales, offsets and high-channel
constants (how that flavour lays them out: docs/design/ort-gqa.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from kvq_export.calibration.artifact import PARTS, ROLES, static_name
from kvq_export.dtypes import DType
from kvq_export.errors import KVQError
from kvq_export.vocab import Part

if TYPE_CHECKING:
    from kvq_export.calibration.artifact import Calibration
    from kvq_export.model_facts import CacheGeometry
    from kvq_export.scheme import KVQuantScheme, TensorQuant

#: the graph constants :func:`compare_with_graph` compares (by the last part of their :func:`static_name`)
GRAPH_ROLES = ("scales", "zero_points", "offset", "channel_order", "high_channels.top", "high_channels.centre")


def reads_graph_constant(name: str) -> bool:
    """Whether :func:`compare_with_graph` compares the graph constant ``name`` (what a loader reads of a graph)."""
    return name.startswith("static.") and any(name.endswith("." + role) for role in GRAPH_ROLES)


def compare_with_graph(calibration: Calibration, constants: Mapping[str, np.ndarray], scheme: KVQuantScheme,
                facts: CacheGeometry, *, error: type[KVQError] = KVQError) -> int:
    """Refuse a calibration that disagrees with the constants a graph holds; return how many were compared.

    ``constants``: the graph's initializers named by :func:`static_name` (as read from the ONNX file). Each
    form a flavour writes is compared with what the calibration's arrays make of it: ``scales`` /
    ``zero_points`` ``[H, n]`` in ``scale_dtype`` (the reference and TensorRT graphs), GroupQueryAttention's
    per-channel ``[1, H, 1, W]`` or per-tensor ``[1]`` scales (head widened by the high channels), the offset an
    asymmetric stream subtracts before that node (in its packed or widened row), a high-channel stream's
    ``channel_order`` and the 8-bit channels its ``high_channels.top`` levels mark. The first mismatch is one
    ``error`` line naming the tensor.
    """
    compared = 0
    streams = [(layer, part, tq) for layer, pair in enumerate(scheme.streams(facts.num_layers))
               for part, tq in zip(PARTS, pair, strict=True) if tq.quantized]
    for layer, part, tq in streams:
        for name, got, want in _graph_forms(calibration, layer, part, tq, constants, facts):
            compared += 1
            if got.shape != want.shape or not np.array_equal(got, want.astype(got.dtype)):
                raise error(f"graph constant {name} disagrees with calibration {layer}.{part}: the calibration "
                            "file does not hold the scales the graph computes with; export again")
    return compared


def _graph_forms(calibration: Calibration, layer: int, part: Part, tq: TensorQuant,
                 constants: Mapping[str, np.ndarray],
                 facts: CacheGeometry) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(constant name, graph array, the array the calibration makes of it) for one stream's constants."""
    heads, head_dim = facts.num_kv_heads, facts.head_dim
    scales, zeros, high = (calibration.arrays.get(f"{layer}.{part}.{role}") for role in ROLES)
    const = {role: constants.get(static_name(layer, part, role)) for role in
             ("scales", "zero_points", "offset", "channel_order", "high_channels.top")}
    if scales is not None and const["scales"] is not None:
        got = const["scales"]
        if got.shape == scales.shape:  # kvq's own [H, n], stored in scale_dtype
            yield static_name(layer, part, "scales"), got, _rounded(tq, scales)
        elif got.ndim == 4 or got.size == 1:  # GroupQueryAttention's per-channel or per-tensor scale
            want = _node_scales(tq, scales, high, head_dim)
            if got.size == 1:
                want = want[:1] if np.all(want == want[0]) else want
            yield static_name(layer, part, "scales"), got.reshape(-1), want
    if zeros is not None and const["zero_points"] is not None:
        yield static_name(layer, part, "zero_points"), const["zero_points"], _rounded(tq, zeros)
    if zeros is not None and scales is not None:
        # what an asymmetric stream subtracts before GroupQueryAttention's symmetric codes, per channel
        offset = (_per_channel(tq, zeros, head_dim) + np.float32(1 << (tq.bits - 1))
                  * _per_channel(tq, scales, head_dim)).reshape(-1)
        if high is None and const["offset"] is not None:
            yield static_name(layer, part, "offset"), const["offset"].reshape(-1), offset
        packed = constants.get(static_name(layer, "packed", "offset"))
        if high is None and packed is not None and packed.size >= 2 * offset.size:  # q | k | v: this stream's
            end = packed.size - (offset.size if part == Part.KEY else 0)
            yield static_name(layer, "packed", "offset"), packed.reshape(-1)[end - offset.size:end], offset
        centre = constants.get(static_name(layer, "kv", "high_channels.centre"))
        width = heads * (head_dim + (0 if high is None else high.shape[1]))
        if high is not None and centre is not None and centre.size >= 2 * width:
            # q | k | v rows widened by the high channels: the offset sits in each head's own low channels
            end = centre.size - (width if part == Part.KEY else 0)
            row = centre.reshape(-1)[end - width:end].reshape(heads, -1)[:, :head_dim]
            low = np.ones((heads, head_dim), bool)
            np.put_along_axis(low, high.astype(np.int64), False, axis=1)
            yield (static_name(layer, "kv", "high_channels.centre"), row[low],
                   offset.reshape(heads, head_dim)[low])
    if high is not None:
        if const["channel_order"] is not None:
            rest = [np.setdiff1d(np.arange(head_dim), row) for row in high]
            order = np.concatenate([high, np.stack(rest)], axis=1).astype(np.int32)
            yield static_name(layer, part, "channel_order"), const["channel_order"], order
        top = const["high_channels.top"]
        if top is not None and top.size == heads * head_dim:  # the 8-bit channels have the highest top level
            levels = top.reshape(heads, head_dim)
            marked = (levels == levels.max(axis=1, keepdims=True)).astype(np.int32)
            want = np.zeros((heads, head_dim), np.int32)
            np.put_along_axis(want, high.astype(np.int64), 1, axis=1)
            yield static_name(layer, part, "high_channels.top"), marked, want


def _rounded(tq: TensorQuant, meta: np.ndarray) -> np.ndarray:
    """Static metadata as the graph stores it: rounded to the stream's ``scale_dtype``."""
    return np.asarray(meta, np.float32).astype(DType.get(tq.scale_dtype).numpy)


def _per_channel(tq: TensorQuant, meta: np.ndarray, head_dim: int) -> np.ndarray:
    """``[H, n]`` metadata rounded to ``scale_dtype`` as float32 ``[H, head_dim]`` (token groups repeated)."""
    m = _rounded(tq, meta).astype(np.float32)
    return np.repeat(m, tq.token_group(head_dim), axis=1) if tq.axis == "token" else m


def _node_scales(tq: TensorQuant, scales: np.ndarray, high: np.ndarray | None, head_dim: int) -> np.ndarray:
    """Flat float32 GroupQueryAttention scales per channel (a node head widened by high channels).

    A high channel's place holds 16x its scale and the extra channel after the head the scale itself.
    """
    s = _per_channel(tq, scales, head_dim)
    if high is None:
        return s.reshape(-1)
    index = high.astype(np.int64)
    picked = np.take_along_axis(s, index, axis=1)
    s = s.copy()
    np.put_along_axis(s, index, np.float32(16) * picked, axis=1)
    return np.concatenate([s, picked], axis=1).reshape(-1)
