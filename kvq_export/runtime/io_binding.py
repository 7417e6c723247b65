"""The IO binding a :class:`~kvq_export.runtime.session.KVQSession` keeps across steps.

Exports in a layout that shares buffers (``buffer``: ``--flavor ort-gqa``) bind the same OrtValue as ``past.*``
input and ``present.*`` output, so the kernel appends in place; the binding is kept from one step to the next while
the cache still holds the very buffers it bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvq_export.cache_layout import CacheLayout
from kvq_export.naming import CacheTensor, present_name

CacheState = dict  # past tensor name -> onnxruntime.OrtValue


class Owner(Protocol):
    """What a binding reads of the session that owns it (a :class:`~kvq_export.runtime.session.KVQSession`)."""

    session: Any  # onnxruntime.InferenceSession
    extra_outputs: Sequence[str]
    past: Sequence[CacheTensor]
    layout: CacheLayout


class Binding:
    """One IO binding kept across steps: the shared cache buffers stay bound as past input and present output.

    The cache a step returns carries it (:class:`BoundCache`), so it lives exactly as long as that cache. It
    serves the next step only when that step's cache still holds the very buffers it bound, for the same session
    object, batch and extra outputs; anything else (a grown cache, a plain dict, another session) binds afresh.
    """

    def __init__(self, owner: Owner, cache: CacheState, batch: int) -> None:
        self.session, self.batch, self.extra = owner.session, batch, tuple(owner.extra_outputs)
        self.binding = owner.session.io_binding()
        self.shared = {spec.name: cache[spec.name] for spec in owner.past if owner.layout.shared(spec)}
        #: past tensors bound again every step (not shared with the present: a new value each step)
        self.rebound = [spec for spec in owner.past if spec.name not in self.shared]
        self.binding.bind_output("logits")
        for name, value in self.shared.items():
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(present_name(name), value)
        # get_outputs() follows the order outputs were first bound
        self.names = ["logits", *(present_name(n) for n in self.shared), *(present_name(s.name) for s in self.rebound),
                      *self.extra]
        shapes = {name: value.shape() for name, value in self.shared.items()}
        #: tokens per row the bound buffers hold (None: a layout without a capacity)
        self.capacity = owner.layout.capacity_of(shapes) if owner.layout.has_capacity and shapes else None
        #: whether a run's outputs are read back from the binding (some have no shape known before the run)
        self.reads_outputs = bool(self.extra) or any(self.fixed_shape(spec) is None for spec in self.rebound)

    def fixed_shape(self, spec: CacheTensor) -> tuple[int, ...] | None:
        """The shape of ``spec``'s present tensor when the batch alone fixes it (``seq_lengths``), else None."""
        shape = tuple(self.batch if dim == "batch" else dim for dim in spec.shape)
        return shape if all(isinstance(dim, int) for dim in shape) else None

    def holds(self, owner: Owner, cache: CacheState, batch: int) -> bool:
        """Whether a step of ``owner`` on ``cache`` with ``batch`` rows can run on this binding."""
        return (owner.session is self.session and batch == self.batch and tuple(owner.extra_outputs) == self.extra
                and isinstance(cache, dict) and all(cache.get(name) is value for name, value in self.shared.items()))


class BoundCache(dict):
    """A cache dict as :meth:`KVQSession.step` returns it: also carries the step's IO binding to the next step."""

    def __init__(self, values: CacheState, binding: Binding) -> None:
        super().__init__(values)
        self.binding = binding
