"""kvq_plugins: the fused grouped-dequant attention kernel (Triton) and its TensorRT plugin.

Modules (none imports triton or tensorrt at import time; kernels are jitted at their first launch):

* :mod:`kvq_plugins.layout` — :class:`StreamLayout`, the kernel's view of a scheme's stored stream, and
  torch helpers on the stored layout (``take``, ``dequantize_stream``);
* :mod:`kvq_plugins.triton_kernels` — the Triton sources (fused decode attention, split reduction,
  quantize-and-pack), jitted by ``build()``;
* :mod:`kvq_plugins.attention` — ``decode_attention`` (fused kernel), ``prefill_attention`` (dequantized
  temporary buffer + standard attention), ``attention`` (picks one);
* :mod:`kvq_plugins.quantize` / :mod:`kvq_plugins.cache_update` — quantize-and-append, bit-exact with the
  reference cache (Triton quantizes, host-side torch moves regions);
* :mod:`kvq_plugins.reference` — plain-torch references of every op, registered by op name;
* :mod:`kvq_plugins.registry` — op name -> kernel / reference;
* :mod:`kvq_plugins.trt_plugin` — the TensorRT Python plugin (``tensorrt.plugin``), registered from
  :func:`kvq_export.flavors.trt.signature.plugin_signature`.
"""

from __future__ import annotations

from kvq_plugins.layout import StreamLayout
from kvq_plugins.registry import get_kernel, get_reference

__all__ = ["StreamLayout", "get_kernel", "get_reference"]
