"""The graph toolkit: ONNX decoder graphs built directly with ``onnx_ir`` (no tracing), for any flavour.

* :mod:`kvq_export.graph.builder` -- :class:`~kvq_export.graph.builder.GraphBuilder`, a thin layer over
  ``onnx_ir``, and :func:`~kvq_export.graph.builder.save`;
* :mod:`kvq_export.graph.rope` -- RoPE's cos/sin tables and their application;
* :mod:`kvq_export.graph.projections` -- state-dict weights read as MatMuls (fused or one per projection);
* :mod:`kvq_export.graph.codec` -- quantize / dequantize a cache stream in the graph, as the reference codec does;
* :mod:`kvq_export.graph.attention` -- attention over standard ONNX ops (the mask, grouped-query attention);
* :mod:`kvq_export.graph.weights` -- the weight storage rewrite of a built graph (fp16, int8 / int4 blocks);
* :mod:`kvq_export.graph.passes` -- graph rewrites as onnx_ir passes, and :func:`run_passes`.
"""
