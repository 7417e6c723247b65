"""Build ONNX decoder graphs directly from a model's weights (no tracing).

* :mod:`kvq_export.export.builder` -- :class:`GraphBuilder`, a thin layer over ``onnx_ir``, and :func:`save`.
* :mod:`kvq_export.export.arch` -- the architecture registry: each family's weights, RoPE, windows.
* :mod:`kvq_export.export.rope` -- RoPE frequencies (transformers' own) and the graph's cos/sin tables.
* :mod:`kvq_export.export.projections` -- state-dict weights read as MatMuls (fused or one per projection).
* :mod:`kvq_export.export.cache_graph` -- ``CacheGraph``, the contract a flavour's KV cache fulfils.
* :mod:`kvq_export.export.decoder` -- the model body; the KV cache is plugged in through ``CacheGraph``.
"""
