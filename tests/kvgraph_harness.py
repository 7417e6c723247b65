"""Test harness: the in-graph quantized cache alone (no model), fed with given q/k/v."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
from tiny_models import attention_facts

from kvq_export.cache_layout import REGIONS
from kvq_export.dtypes import DType
from kvq_export.flavors.cache_graph import AttentionForm, AttentionInputs
from kvq_export.flavors.reference.graph import QuantizedCacheGraph
from kvq_export.graph.builder import GraphBuilder
from kvq_export.graph.decoder_spec import DecoderSpec
from kvq_export.model_facts import ModelFacts
from kvq_export.naming import present_name
from kvq_export.presets import PRESETS
from kvq_export.reference.cache import LayerCache, StreamCache
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Axis, Part, Role, ScaleMode


class CacheOnly:
    """One-layer cache graph: inputs q [B,Hq,t,D], k/v [B,Hkv,t,D], attention_mask [B,t] + past.

    ``facts``: a one-layer model's (:func:`tiny_models.attention_facts`): heads, head_dim, scaling and window.
    """

    def __init__(self, scheme, facts: ModelFacts, *, static=None):
        heads, kv_heads, head_dim = facts.num_heads, facts.num_kv_heads, facts.head_dim
        b = GraphBuilder(opset=23)
        q = b.input("q", ir.DataType.FLOAT, ["batch", heads, "seq", head_dim])
        k = b.input("k", ir.DataType.FLOAT, ["batch", kv_heads, "seq", head_dim])
        v = b.input("v", ir.DataType.FLOAT, ["batch", kv_heads, "seq", head_dim])
        mask = b.input("attention_mask", ir.DataType.INT64, ["batch", "seq"])
        cg = QuantizedCacheGraph(scheme, facts, static=static)
        call = cg.begin(b, attention_mask=mask, spec=DecoderSpec(facts, ir.DataType.FLOAT))
        attn = cg.attend(b, 0, AttentionInputs(AttentionForm.HEADS, call, q, k, v))
        b.output(attn, "attn", ir.DataType.FLOAT, ["batch", heads, "seq", head_dim])
        cg.end(b, call)
        model = ir.serde.serialize_model(b.build())
        self.session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.past = REGIONS.tensors(scheme, facts)

    def empty(self, batch: int) -> dict:
        from kvq_export.runtime.ort_setup import ort_value

        return {t.name: ort_value(np.zeros([batch if d == "batch" else (d if isinstance(d, int) else 0)
                                             for d in t.shape], DType.get(t.dtype).bits_numpy), t.dtype)
                for t in self.past}

    def step(self, q, k, v, mask, cache):
        """Run one call; return (attention output, new cache as OrtValues, cache as numpy)."""
        from kvq_export.runtime.ort_setup import ort_value

        feeds = {"q": ort_value(q, "float32"), "k": ort_value(k, "float32"), "v": ort_value(v, "float32"),
                 "attention_mask": ort_value(mask, "int64"), **cache}
        names = ["attn", *(present_name(t.name) for t in self.past)]
        outs = self.session.run_with_ort_values(names, feeds)
        new = {t.name: o for t, o in zip(self.past, outs[1:])}
        return outs[0].numpy(), new, {t.name: o.numpy() for t, o in zip(self.past, outs[1:])}


SMALL = {  # group 4, recent 8, sinks 2: every boundary is crossed within a few dozen tokens
    "int4-token+int2-channel": KVQuantScheme(
        key=TensorQuant(format="int", bits=4, group_size=8), value=TensorQuant(format="int", bits=2, axis="channel",
                                                                                group_size=4),
        residual_length=8, sink_tokens=2),
    "channel-keys-kivi-like": KVQuantScheme(
        key=TensorQuant(format="int", bits=2, axis="channel", group_size=4, clip=0.9),
        value=TensorQuant(format="int_sym", bits=4, group_size=8, scale_dtype="fp32"), residual_length=8),
    "fp8-sinks": KVQuantScheme(key=TensorQuant(format="fp8_e4m3", bits=8, group_size=8),
                               value=TensorQuant(format="int_sym", bits=8), sink_tokens=3),
    "static-sym4": KVQuantScheme(
        key=TensorQuant(format="int_sym", bits=4, axis="channel", scales="static", scale_dtype="fp32"),
        value=TensorQuant(format="int", bits=8, group_size=16, scales="static"), residual_length=3),
    "fp16": PRESETS["fp16"][0],
    "int6": KVQuantScheme(  # two planes: low nibbles, then the top two bits
        key=TensorQuant(format="int", bits=6, axis="channel", group_size=4),
        value=TensorQuant(format="int_sym", bits=6, group_size=8), residual_length=4),
    "int3": KVQuantScheme(  # two planes: low bit pairs, then the third bits; 8-bit channels beside 3-bit keys
        key=TensorQuant(format="int", bits=3, axis="channel", group_size=4, high_channels=8),
        value=TensorQuant(format="int", bits=3, group_size=8, clip=0.9), residual_length=4),
    "high-channels": KVQuantScheme(  # 8-bit channels inside 4-bit keys and 2-bit values
        key=TensorQuant(format="int", bits=4, axis="channel", group_size=4, high_channels=6),
        value=TensorQuant(format="int", bits=2, axis="channel", group_size=4, high_channels=4),
        residual_length=4, sink_tokens=1),
    "static-high-channels": KVQuantScheme(  # 8-bit channels with static scales; symmetric ones own an offset
        key=TensorQuant(format="int", bits=4, axis="channel", scales="static", scale_dtype="fp32", high_channels=6),
        value=TensorQuant(format="int_sym", bits=2, axis="channel", scales="static", high_channels=4),
        residual_length=2),
    "per-stream-windows": KVQuantScheme(  # keys keep the scheme's window, values their own longer one
        key=TensorQuant(format="int", bits=4, axis="channel", group_size=4),
        value=TensorQuant(format="int", bits=3, group_size=8, clip=0.9, residual_length=6),
        residual_length=4, sink_tokens=1),
}


def _static(scheme: KVQuantScheme, heads: int, dim: int):
    if not scheme.needs_calibration:
        return None
    rng = np.random.default_rng(0)
    out = {}
    for part, tq in zip(("key", "value"), scheme.for_layer(0)):
        if tq.high_channels:  # a different choice per head
            out[part] = {"high_channels": np.sort(np.stack([rng.choice(dim, tq.high_channels, replace=False)
                                                            for _ in range(heads)]), axis=1).astype(np.int32)}
        if tq.quantized and tq.scales == ScaleMode.STATIC:
            n = dim // tq.token_group(dim) if tq.axis == Axis.TOKEN else dim
            out.setdefault(part, {}).update(scales=(rng.random((heads, n)) * 0.3 + 0.1).astype(np.float32),
                                            zero_points=(-rng.random((heads, n)) * 3).astype(np.float32))
    return {0: out}


def _reference_streams(scheme, static):
    layer = []
    for part, tq in zip(("key", "value"), scheme.for_layer(0)):
        meta = (static or {}).get(0, {}).get(part, {})
        layer.append(StreamCache(tq, scheme, static_scales=_t(meta.get("scales")),
                                 static_zeros=_t(meta.get("zero_points")), high_channels=_t(meta.get("high_channels"))))
    return LayerCache(*layer)


def _t(a):
    return None if a is None else torch.from_numpy(a)


def _bits(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy()


def _check_state(arrays: dict, refs: list[LayerCache], scheme):
    """Row b's right-aligned valid entries of every present tensor equal the reference exactly."""
    for row, ref in enumerate(refs):
        assert arrays["past.seq_lengths"][row] == ref.key.length
        for part in Part:
            stream = getattr(ref, part)
            for role, tensor in stream.tensors().items():
                if role in (Role.SCALES, Role.ZERO_POINTS) and stream.tq.scales == ScaleMode.STATIC:
                    continue
                got = arrays[f"past.0.{part}.{role}"][row]
                want = _bits(tensor[0])
                n = want.shape[1]
                assert np.array_equal(got[:, got.shape[1] - n:], want), (row, part, role)


def _check_manifest_decoder(scheme, arrays, refs, static, kv_heads, dim):
    """decode_cache, reading only the manifest, rebuilds exactly what the reference attends to."""
    from kvq_export.manifest import Manifest, decode_cache

    model = attention_facts(num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=dim)
    manifest = Manifest(scheme=scheme, model=model,
                        flavor="reference", opset=23, dtype="fp32", kvq_version="test", inputs=[], outputs=[])
    decoded = decode_cache(manifest, arrays, direction="past", static=static)
    for row, ref in enumerate(refs):
        k, v = decoded[row][0]
        assert np.array_equal(k, ref.key.dequantized()[0].numpy())
        assert np.array_equal(v, ref.value.dequantized()[0].numpy())


def _attention_reference(q: np.ndarray, ref: LayerCache, positions: np.ndarray, window=None) -> np.ndarray:
    """float64 attention of q [Hq, t, D] over the reference's dequantized K/V (GQA, causal)."""
    k = ref.key.dequantized().double()[0]
    v = ref.value.dequantized().double()[0]
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = torch.from_numpy(q).double() @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    key_pos = torch.arange(k.shape[1])
    allowed = key_pos[None, :] <= torch.from_numpy(positions)[:, None]
    if window:
        allowed &= key_pos[None, :] > torch.from_numpy(positions)[:, None] - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).numpy()


def run_schedule(scheme, schedule, *, heads=4, kv_heads=2, dim=32, seed=0, window=None):
    """Feed per-row token counts ``schedule`` ([steps][rows]); check state + attention every step."""
    static = _static(scheme, kv_heads, dim)
    facts = attention_facts(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, window=window)
    graph = CacheOnly(scheme, facts, static=static)
    rows = len(schedule[0])
    refs = [_reference_streams(scheme, static) for _ in range(rows)]
    rng = np.random.default_rng(seed)
    cache = graph.empty(rows)
    worst = 0.0
    for counts in schedule:
        t = max(max(counts), 1)
        q = rng.standard_normal((rows, heads, t, dim)).astype(np.float32)
        k = (rng.standard_normal((rows, kv_heads, t, dim)) * 2 + rng.standard_normal((1, kv_heads, 1, dim))
             ).astype(np.float32)
        v = rng.standard_normal((rows, kv_heads, t, dim)).astype(np.float32)
        mask = np.zeros((rows, t), np.int64)
        for row, c in enumerate(counts):
            mask[row, t - c:] = 1
            k[row, :, : t - c] = 1e4  # padding garbage must never reach a stored value
            v[row, :, : t - c] = -1e4
        out, cache, arrays = graph.step(q, k, v, mask, cache)
        for row, c in enumerate(counts):
            before = refs[row].key.length
            refs[row].update(torch.from_numpy(k[row:row + 1, :, t - c:]), torch.from_numpy(v[row:row + 1, :, t - c:]))
            if c:
                want = _attention_reference(q[row, :, t - c:], refs[row], np.arange(before, before + c), window)
                got = out[row, :, t - c:]
                worst = max(worst, float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9)))
        _check_state(arrays, refs, scheme)
    _check_manifest_decoder(scheme, arrays, refs, static, kv_heads, dim)
    assert worst < 2e-5, worst
    return worst
