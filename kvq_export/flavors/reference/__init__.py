"""The ``reference`` flavour: the quantized cache in standard ONNX ops, for any ONNX Runtime and TensorRT.

:mod:`kvq_export.flavors.reference.graph` -- :class:`QuantizedCacheGraph`, its cache graph and what it can hold.
"""
