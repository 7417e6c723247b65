"""Build ONNX decoder graphs directly from a model's weights (no tracing).

* :mod:`kvq_export.export.builder` -- :class:`GraphBuilder`, a thin layer over ``onnx_ir``, and :func:`save`.
* :mod:`kvq_export.export.arch` -- the architecture registry: each family's weights, RoPE, windows.
* :mod:`kvq_export.export.decoder` -- the model body; the KV cache is plugged in through ``CacheGraph``.
"""
