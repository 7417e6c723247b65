"""Ops by name: each has a Triton kernel launcher and a plain-torch reference that tests compare it with.

Both are registered by their own modules (``@register_kernel`` / ``@register_reference``); the kernel
modules are imported only when a kernel is asked for, so this module (and ``import kvq_plugins``) never
imports triton.

* ``decode_attention``: :func:`kvq_plugins.attention.decode_attention` /
  :func:`kvq_plugins.reference.decode_attention_reference`
* ``quantize``: :func:`kvq_plugins.quantize.quantize_block` / :func:`kvq_plugins.reference.quantize_reference`
* ``append``: :func:`kvq_plugins.quantize.append` / :func:`kvq_plugins.reference.append_reference`
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kvq_export.errors import KVQError

KERNELS: dict[str, Callable] = {}
REFERENCES: dict[str, Callable] = {}
#: op -> module that registers its kernel (imported on first use)
KERNEL_MODULES = {
    "decode_attention": "kvq_plugins.attention",
    "quantize": "kvq_plugins.quantize",
    "append": "kvq_plugins.quantize",
}
REFERENCE_MODULE = "kvq_plugins.reference"


def register_kernel(op: str) -> Callable[[Callable], Callable]:
    """Register the Triton launcher of ``op``."""

    def wrap(fn: Callable) -> Callable:
        KERNELS[op] = fn
        return fn

    return wrap


def register_reference(op: str) -> Callable[[Callable], Callable]:
    """Register the plain-torch reference of ``op``."""

    def wrap(fn: Callable) -> Callable:
        REFERENCES[op] = fn
        return fn

    return wrap


def get_kernel(op: str) -> Callable:
    """The Triton launcher of ``op`` (its module is imported here; triton itself only at the first launch)."""
    if op not in KERNELS and op in KERNEL_MODULES:
        importlib.import_module(KERNEL_MODULES[op])
    if op not in KERNELS:
        raise KVQError(f"unknown kernel op {op!r}; allowed: {', '.join(sorted(KERNEL_MODULES))}")
    return KERNELS[op]


def get_reference(op: str) -> Callable:
    """The plain-torch reference of ``op``."""
    if op not in REFERENCES:
        importlib.import_module(REFERENCE_MODULE)
    if op not in REFERENCES:
        raise KVQError(f"unknown reference op {op!r}; allowed: {', '.join(sorted(REFERENCES))}")
    return REFERENCES[op]
