"""Expose attention's inputs (post-RoPE q, this call's k/v) of a real exported graph as outputs.

The graph names them ``probe.<layer>.{q,key,value}`` (:func:`kvq_export.naming.probe_name`). A probed
session loads ``model.onnx`` with those values added as outputs, from memory; the weights stay in the
export's external data file, read in place (nothing is written into the export, which may be read-only).

A graph whose attention kernel applies RoPE itself (``--flavor ort-gqa``) never holds post-RoPE q/k; it
names the raw projections instead (``probe.<layer>.<which>.projected``, ``[B, t, H*D]``), and the probed
session rotates them with the graph's own cos/sin tables at each token's position, so every consumer sees
the same ``[B, H, t, D]`` post-RoPE probes whatever the flavour.

A graph whose kernel reads q, k and v packed names that one value instead (``probe.<layer>.qkv`` after the
body's RoPE, ``probe.<layer>.qkv.projected`` before a fused kernel's, :func:`kvq_export.naming.packed_probe_name`):
splitting it in the graph would cost a node at every step. The probed session splits it.

A rotated stream (``rotation`` of the scheme) is probed in its stored basis: q and k after the rotation
that follows RoPE, v as the folded ``v_proj`` yields it (``v @ R``). Decode the cache with
``decode_cache(..., basis="stored")`` to compare with them.
"""

from __future__ import annotations

import os
import re

import numpy as np

from kvq_export.errors import RuntimeInputError
from kvq_export.manifest import MODEL_NAME, check_same_export
from kvq_export.naming import PROBES, packed_probe_name, probe_name
from kvq_export.runtime.ort_setup import choose_providers, session_options
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
    scope, in the graph or in an ``If`` branch: a quantized layer's prefill and step) takes the tables as its
    cos_cache/sin_cache inputs.
    """
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    arrays: dict[str, np.ndarray] = {}
    out = {}
    for node in _nodes(graph):
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


def _nodes(graph):
    """The graph's nodes and those of its subgraphs (``If`` branches), depth first."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _nodes(sub)


def _probe_names(layers: int, packed: bool, projected: bool) -> list[str]:
    """Every probe a graph of ``layers`` layers names in one form (see the module docstring)."""
    if packed:
        return [packed_probe_name(layer, projected=projected) for layer in range(layers)]
    return [probe_name(layer, which, projected=projected) for layer in range(layers) for which in PROBES]


class ProbedSession(KVQSession):
    """A :class:`KVQSession` whose every step also returns the post-RoPE probes (``last_extra[probe_name(...)]``)."""

    def __init__(self, directory: str | os.PathLike[str], **kwargs) -> None:
        import onnx
        import onnxruntime as ort

        super().__init__(directory, **kwargs)
        model = onnx.load(str(self.directory / MODEL_NAME), load_external_data=False)
        layers = self.manifest.num_layers
        produced = {out for node in model.graph.node for out in node.output}
        # the forms a graph names its probes in, most direct first: (packed q|k|v, raw projections before RoPE)
        forms = ((False, False), (True, False), (False, True), (True, True))
        form = next((f for f in forms if all(n in produced for n in _probe_names(layers, *f))), None)
        if form is None:
            raise RuntimeInputError(f"{self.directory}: the graph has no {probe_name(0, 'q')} "
                                    "(exported by an older kvq?)")
        self._packed, self._projected = form
        names = _probe_names(layers, *form)
        self._rotary: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
        if self._projected:
            self._rotary = layer_rotary_tables(model.graph, self.directory)
            if sorted(self._rotary) != list(range(layers)):
                raise RuntimeInputError(f"{self.directory}: the graph names raw projections as probes but not every "
                                        "layer's rotary tables")
        model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
        # loaded from memory, its external weights read from the export: nothing is written into the export
        options = session_options(kwargs.get("threads"), spinning=kwargs.get("spinning", False))
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(self.directory.resolve()))
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=choose_providers(kwargs.get("providers")))
        self.extra_outputs = tuple(names)
        check_same_export(self.directory, self._opened, "while this session opened it")  # the graph was read again

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
             cache: CacheState | None = None) -> tuple[np.ndarray, CacheState]:
        """:meth:`KVQSession.step`, then put the probes in post-RoPE ``[B, H, t, D]`` form."""
        if not (self._packed or self._projected):
            return super().step(input_ids, attention_mask, cache)
        ids = np.asarray(input_ids)
        mask = np.ones(ids.shape, np.int64) if attention_mask is None else np.asarray(attention_mask, np.int64)
        before = np.zeros(ids.shape[0], np.int64) if cache is None else self.seq_lengths(cache).copy()
        logits, cache = super().step(input_ids, attention_mask, cache)
        positions = token_positions(before, mask)
        model = self.manifest.model
        d, heads = model.head_dim, {"q": model.num_heads, "key": model.num_kv_heads, "value": model.num_kv_heads}
        probes = {}
        for layer in range(self.manifest.num_layers):
            if self._packed:
                qkv = self.last_extra[packed_probe_name(layer, projected=self._projected)]
                parts = dict(zip(PROBES, np.split(qkv, np.cumsum([heads["q"] * d, heads["key"] * d]), axis=-1)))
            else:
                parts = {which: self.last_extra[probe_name(layer, which, projected=self._projected)]
                         for which in PROBES}
            for which, raw in parts.items():
                x = raw.reshape(raw.shape[0], raw.shape[1], heads[which], d).transpose(0, 2, 1, 3)
                if self._projected and which != "value":
                    x = rotate(x, *self._rotary[layer], positions)
                probes[probe_name(layer, which)] = x
        self.last_extra = probes
        return logits, cache


def probed_session(directory: str | os.PathLike[str], **kwargs) -> ProbedSession:
    """A session whose every step also returns the probes (in ``session.last_extra``)."""
    return ProbedSession(directory, **kwargs)
