"""Expose attention's inputs (post-RoPE q, this call's k/v) of a real exported graph as outputs.

The graph names them ``probe.<layer>.{q,key,value}`` (:func:`kvq_export.naming.probe_name`). A probed
session loads ``model.onnx`` with those values added as outputs, from memory; the weights stay in the
export's external data file, read in place (nothing is written into the export, which may be read-only).

A graph whose attention kernel applies RoPE itself (``--flavor ort-gqa``) never holds post-RoPE q/k; it
names the raw projections instead (``probe.<layer>.<which>.projected``, ``[B, t, H*D]``), and the probed
session rotates them with the graph's own cos/sin tables at each token's position, so every consumer sees
the same ``[B, H, t, D]`` post-RoPE probes whatever the flavour.

A graph whose kernel reads q, k and v packed after the body's RoPE names that one value instead
(``probe.<layer>.qkv``, :func:`kvq_export.naming.packed_probe_name`); the probed session splits it.

A rotated stream (``rotation`` of the scheme) is probed in its stored basis: q and k after the rotation
that follows RoPE, v as the folded ``v_proj`` yields it (``v @ R``). Decode the cache with
``decode_cache(..., basis="stored")`` to compare with them.
"""

from __future__ import annotations

import os
import re

import numpy as np

from kvq_export.errors import RuntimeInputError
from kvq_export.manifest import MODEL_NAME
from kvq_export.naming import PROBES, packed_probe_name, probe_name
from kvq_export.runtime.session import CacheState, KVQSession


def token_positions(seq_lengths: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Position of every new token ``[B, t]``: row ``b`` continues at ``seq_lengths[b]``; left pads get 0.

    The same rule as the exported graph (left-padded inputs, a row's real tokens are its last ``m_b`` columns).
    """
    t = mask.shape[1]
    new = mask.sum(axis=1, keepdims=True)
    cols = np.arange(t)[None, :]
    return np.maximum(seq_lengths[:, None].astype(np.int64) + cols - (t - new), 0)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """RoPE (half-split, Hugging Face ``rotate_half`` layout) of ``x [B, H, t, D]`` with tables ``[P, R/2]``.

    The first ``R`` channels rotate (``R = D`` for full rotary, less for partial rotary) and the rest pass
    through, as in Hugging Face models and ONNX Runtime's fused rotary.
    """
    c = cos[positions][:, None].astype(np.float32)  # [B, 1, t, R/2]
    s = sin[positions][:, None].astype(np.float32)
    rot = 2 * cos.shape[-1]
    x32 = x.astype(np.float32)
    x1, x2 = np.split(x32[..., :rot], 2, axis=-1)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x32[..., rot:]], axis=-1).astype(x.dtype)


def layer_rotary_tables(graph, directory) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer, the cos/sin tables its fused attention node reads (layers may differ: Gemma3's local RoPE).

    Read from the graph's own wiring: each layer's ``GroupQueryAttention`` node (named in the ``gqa<layer>``
    scope) takes the tables as its cos_cache/sin_cache inputs.
    """
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    arrays: dict[str, np.ndarray] = {}
    out = {}
    for node in graph.node:
        match = re.search(r"(?:^|/)gqa(\d+)/", node.name)
        if node.op_type != "GroupQueryAttention" or match is None or len(node.input) < 9:
            continue
        names = node.input[7], node.input[8]  # cos_cache, sin_cache
        if not all(n in initializers for n in names):
            continue
        for n in names:
            if n not in arrays:
                arrays[n] = numpy_helper.to_array(initializers[n], base_dir=str(directory))
        out[int(match.group(1))] = (arrays[names[0]], arrays[names[1]])
    return out


class ProbedSession(KVQSession):
    """A :class:`KVQSession` whose every step also returns the post-RoPE probes (``last_extra[probe_name(...)]``)."""

    def __init__(self, directory: str | os.PathLike[str], **kwargs) -> None:
        import onnx
        import onnxruntime as ort

        from kvq_export.runtime.session import choose_providers, session_options

        super().__init__(directory, **kwargs)
        model = onnx.load(str(self.directory / MODEL_NAME), load_external_data=False)
        layers = self.manifest.num_layers
        produced = {out for node in model.graph.node for out in node.output}
        names = [probe_name(layer, which) for layer in range(layers) for which in PROBES]
        self._rotary: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
        self._packed = False
        packed = [packed_probe_name(layer) for layer in range(layers)]
        if not all(n in produced for n in names) and all(n in produced for n in packed):
            self._packed, names = True, packed
        elif not all(n in produced for n in names):
            projected = [probe_name(layer, which, projected=True) for layer in range(layers) for which in PROBES]
            tables = layer_rotary_tables(model.graph, self.directory)
            missing = [n for n in names if n not in produced]
            if not all(n in produced for n in projected) or sorted(tables) != list(range(layers)):
                raise RuntimeInputError(f"{self.directory}: the graph has no {missing[0]} (exported by an older kvq?)")
            self._rotary = tables
            names = projected
        model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
        # loaded from memory, its external weights read from the export: nothing is written into the export
        options = session_options(kwargs.get("threads"), spinning=kwargs.get("spinning", False))
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(self.directory.resolve()))
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=choose_providers(kwargs.get("providers")))
        self.extra_outputs = tuple(names)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
             cache: CacheState | None = None) -> tuple[np.ndarray, CacheState]:
        """:meth:`KVQSession.step`, then put the probes in post-RoPE ``[B, H, t, D]`` form."""
        if self._packed:
            logits, cache = super().step(input_ids, attention_mask, cache)
            self.last_extra = self._split_packed()
            return logits, cache
        if self._rotary is None:
            return super().step(input_ids, attention_mask, cache)
        ids = np.asarray(input_ids)
        mask = np.ones(ids.shape, np.int64) if attention_mask is None else np.asarray(attention_mask, np.int64)
        before = np.zeros(ids.shape[0], np.int64) if cache is None else self.seq_lengths(cache).copy()
        logits, cache = super().step(input_ids, attention_mask, cache)
        positions = token_positions(before, mask)
        model = self.manifest.model
        head_dim = model.head_dim
        probes = {}
        for layer in range(self.manifest.num_layers):
            for which in PROBES:
                raw = self.last_extra[probe_name(layer, which, projected=True)]
                heads = model.num_heads if which == "q" else model.num_kv_heads
                x = raw.reshape(raw.shape[0], raw.shape[1], heads, head_dim).transpose(0, 2, 1, 3)
                probes[probe_name(layer, which)] = x if which == "value" else rotate(x, *self._rotary[layer],
                                                                                     positions)
        self.last_extra = probes
        return logits, cache


    def _split_packed(self) -> dict[str, np.ndarray]:
        """The per-part probes of each layer's packed q|k|v (:func:`packed_probe_name`)."""
        model = self.manifest.model
        d, hq, hkv = model.head_dim, model.num_heads, model.num_kv_heads
        probes = {}
        for layer in range(self.manifest.num_layers):
            qkv = self.last_extra[packed_probe_name(layer)]
            parts = np.split(qkv, [hq * d, (hq + hkv) * d], axis=-1)
            for which, x, heads in zip(PROBES, parts, (hq, hkv, hkv)):
                probes[probe_name(layer, which)] = x.reshape(x.shape[0], x.shape[1], heads, d).transpose(0, 2, 1, 3)
        return probes


def probed_session(directory: str | os.PathLike[str], **kwargs) -> ProbedSession:
    """A session whose every step also returns the probes (in ``session.last_extra``)."""
    return ProbedSession(directory, **kwargs)
