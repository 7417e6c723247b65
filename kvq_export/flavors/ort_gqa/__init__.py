"""The ``ort-gqa`` flavour: ONNX Runtime's fused GroupQueryAttention over a static int8 / int4 cache buffer.

* :mod:`kvq_export.flavors.ort_gqa.graph` -- :class:`GQACacheGraph` (RoPE in the node) and
  :class:`GQABodyRopeCacheGraph` (RoPE in the body), its cache graphs;
* :mod:`kvq_export.flavors.ort_gqa.call` -- what the graph computes once per call, before the layers;
* :mod:`kvq_export.flavors.ort_gqa.capability` -- which schemes one GroupQueryAttention node holds;
* :mod:`kvq_export.flavors.ort_gqa.plan` -- each layer's node settings (scales, offsets, high channels);
* :mod:`kvq_export.flavors.ort_gqa.genai` -- the onnxruntime-genai package of its exports.
"""
