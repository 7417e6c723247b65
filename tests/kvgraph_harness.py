"""Test harness: the in-graph quantized cache alone (no model), fed with given q/k/v."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from kvq_export.cache_layout import REGIONS
from kvq_export.export.builder import GraphBuilder
from kvq_export.export.kv_graph import QuantizedCacheGraph
from kvq_export.naming import present_name

NP = {"int64": np.int64, "uint8": np.uint8, "float16": np.float16, "float32": np.float32, "float8e4m3fn": np.uint8}


@dataclass(frozen=True)
class Facts:
    """The few decoder facts the cache graph reads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: ir.DataType = ir.DataType.FLOAT
    sliding_window: int | None = None

    def window(self, layer: int) -> int | None:
        return self.sliding_window


class CacheOnly:
    """One-layer cache graph: inputs q [B,Hq,t,D], k/v [B,Hkv,t,D], attention_mask [B,t] + past."""

    def __init__(self, scheme, *, heads: int, kv_heads: int, head_dim: int, static=None, window=None):
        self.scheme, self.kv_heads, self.head_dim = scheme, kv_heads, head_dim
        b = GraphBuilder(opset=23)
        q = b.input("q", ir.DataType.FLOAT, ["batch", heads, "seq", head_dim])
        k = b.input("k", ir.DataType.FLOAT, ["batch", kv_heads, "seq", head_dim])
        v = b.input("v", ir.DataType.FLOAT, ["batch", kv_heads, "seq", head_dim])
        mask = b.input("attention_mask", ir.DataType.INT64, ["batch", "seq"])
        cg = QuantizedCacheGraph(scheme, num_layers=1, kv_heads=kv_heads, head_dim=head_dim, static=static)
        cg.begin(b, attention_mask=mask, facts=Facts(heads, kv_heads, head_dim, head_dim**-0.5,
                                                     sliding_window=window))
        b.output(cg.attend(b, 0, q, k, v), "attn", ir.DataType.FLOAT, ["batch", heads, "seq", head_dim])
        cg.end(b)
        model = ir.serde.serialize_model(b.build())
        self.session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.past = REGIONS.tensors(scheme, num_layers=1, kv_heads=kv_heads, head_dim=head_dim)

    def empty(self, batch: int) -> dict:
        from kvq_export.runtime.session import _ort_value

        return {t.name: _ort_value(np.zeros([batch if d == "batch" else (d if isinstance(d, int) else 0)
                                             for d in t.shape], NP[t.dtype]), t.dtype) for t in self.past}

    def step(self, q, k, v, mask, cache):
        """Run one call; return (attention output, new cache as OrtValues, cache as numpy)."""
        from kvq_export.runtime.session import _ort_value

        feeds = {"q": _ort_value(q, "float32"), "k": _ort_value(k, "float32"), "v": _ort_value(v, "float32"),
                 "attention_mask": _ort_value(mask, "int64"), **cache}
        names = ["attn", *(present_name(t.name) for t in self.past)]
        outs = self.session.run_with_ort_values(names, feeds)
        new = {t.name: o for t, o in zip(self.past, outs[1:])}
        return outs[0].numpy(), new, {t.name: o.numpy() for t, o in zip(self.past, outs[1:])}
