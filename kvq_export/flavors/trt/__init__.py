"""The ``trt`` flavour: the cache kept and attended by kvq's TensorRT plugin nodes.

* :mod:`kvq_export.flavors.trt.graph` -- :class:`TrtCacheGraph`, its cache graph;
* :mod:`kvq_export.flavors.trt.signature` -- each plugin node's signature, read by the plugin and the engine build.
"""
