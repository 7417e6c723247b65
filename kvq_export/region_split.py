"""The split rule of a ``regions`` stream: :class:`RegionSplit` (sinks, quantized and recent tokens).

The one place that splits a stream's tokens into sinks, quantized and recent: the reference cache
(:mod:`kvq_export.reference.cache`), the cache layouts (:mod:`kvq_export.cache_layout`), the memory model,
the in-graph bookkeeping, the kernels and the TensorRT profiles all evaluate it (on ints, numpy arrays, torch
tensors or graph values). It depends on the scheme alone, so every one of them imports it one way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Role

#: Roles of a ``regions`` stream, in token order of the regions they hold (codes and metadata: quantized).
REGION_ROLES = (Role.SINKS, Role.CODES, Role.SCALES, Role.ZERO_POINTS, Role.RECENT)
REGION_NAMES = ("sinks", "quantized", "recent")


class _Arithmetic:
    """:meth:`RegionSplit.lengths` on Python ints, numpy arrays and torch tensors."""

    @staticmethod
    def minimum(x, bound: int):
        return min(x, bound) if isinstance(x, int) else x.clip(max=bound)

    @staticmethod
    def maximum(x, bound: int):
        return max(x, bound) if isinstance(x, int) else x.clip(min=bound)

    @staticmethod
    def sub(x, y):
        return x - y

    @staticmethod
    def floor_to(x, unit: int):
        return x // unit * unit

    @staticmethod
    def zero(x):
        return x * 0


@dataclass(frozen=True)
class RegionSplit:
    """How a stream of ``n`` tokens divides into sinks, quantized and recent tokens.

    ``sinks = min(sink_tokens, n)``; the rest enter the recent window, and whatever is older than the
    ``residual_length`` newest tokens (the stream's own when it sets one, else the scheme's) leaves it in
    whole flush units (1 token, or a channel-axis group)
    and is quantized. An unquantized stream keeps every token in ``recent``.
    """

    sink_tokens: int
    residual_length: int
    unit: int
    quantized: bool = True

    #: The same rule in words, for the manifest's readers.
    RULE: ClassVar[str] = (
        "sinks = min(sink_tokens, n); rest = n - sinks; quantized = floor(max(0, rest - residual_length) / unit) "
        "* unit (unit = group_size for channel-axis dynamic streams, else 1); recent = rest - quantized "
        "(an unquantized stream keeps all n in recent); residual_length is the stream's own when its description "
        "sets one, else the scheme's")

    @classmethod
    def of(cls, tq: TensorQuant, scheme: KVQuantScheme) -> RegionSplit:
        """The split of stream ``tq`` of ``scheme``."""
        return cls(scheme.sink_tokens, scheme.residual_for(tq), tq.flush_unit, tq.quantized)

    def lengths(self, n, ops: Any = _Arithmetic):
        """(sinks, quantized, recent) for ``n`` tokens (an int, a numpy/torch vector, or a graph value with ``ops``).

        ``ops`` supplies ``minimum``, ``maximum``, ``sub``, ``floor_to`` and ``zero`` (see :class:`_Arithmetic`);
        the graph exporter passes ONNX-op versions so the graph computes exactly this rule.
        """
        if not self.quantized:
            zero = ops.zero(n)
            return zero, zero, n
        sinks = ops.minimum(n, self.sink_tokens)
        rest = ops.sub(n, sinks)
        quantized = ops.floor_to(ops.maximum(ops.sub(rest, self.residual_length), 0), self.unit)
        return sinks, quantized, ops.sub(rest, quantized)

    def flush(self, recent: int) -> int:
        """Tokens that leave a recent window holding ``recent`` tokens (a multiple of the unit)."""
        return max(0, recent - self.residual_length) // self.unit * self.unit

    def longest_recent(self, total: int) -> int:
        """Most tokens the recent window holds at any point of a row growing to ``total`` tokens."""
        if not self.quantized:
            return total
        return min(total, self.residual_length + self.unit - 1)


def split_lengths(tq: TensorQuant, scheme: KVQuantScheme, total: int) -> tuple[int, int, int]:
    """(sinks, quantized, recent) token counts of a stream holding ``total`` tokens."""
    return RegionSplit.of(tq, scheme).lengths(int(total))
