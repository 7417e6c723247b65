"""The memory model: exact bytes a scheme's cache holds after N tokens.

The prediction is derived from the scheme alone (no tensors are made) and must equal the ``nbytes`` of
the reference cache's stored tensors; the tests check that for many scheme x length cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvq_export.cache_layout import split_lengths
from kvq_export.dtypes import DType
from kvq_export.errors import KVQError, SchemeError
from kvq_export.scheme import KVQuantScheme, TensorQuant

BREAKDOWN_KEYS = ("payload", "scales", "zero_points", "high_precision", "padding")


class CacheGeometry(Protocol):
    """What the memory model needs to know about a model (``ModelFacts`` satisfies it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Geometry:
    """A plain :class:`CacheGeometry` (for tests and quick calculations)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MemoryReport:
    """Predicted cache bytes for one (scheme, model, length, batch)."""

    scheme: str
    seq_len: int
    batch: int
    total_bytes: int
    fp16_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def elements(self) -> int:
        """K and V elements the cache represents."""
        return self.fp16_bytes // 2

    @property
    def ratio(self) -> float:
        """fp16 bytes / stored bytes (how many times smaller)."""
        return self.fp16_bytes / self.total_bytes if self.total_bytes else 1.0

    @property
    def bits_per_element(self) -> float:
        """Stored bits per cached element, everything included."""
        return 8.0 * self.total_bytes / self.elements if self.elements else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the keys ``kvq memory --json`` prints)."""
        return {
            "scheme": self.scheme,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "total_bytes": self.total_bytes,
            "fp16_bytes": self.fp16_bytes,
            "ratio": self.ratio,
            "bits_per_element": self.bits_per_element,
            "breakdown": dict(self.breakdown),
        }


def stream_bytes(
    tq: TensorQuant, scheme: KVQuantScheme, *, seq_len: int, batch: int, kv_heads: int, head_dim: int
) -> dict[str, int]:
    """Bytes by breakdown key for one layer's keys or values."""
    out = dict.fromkeys(BREAKDOWN_KEYS, 0)
    if seq_len == 0:
        return out
    sinks, quantized, recent = split_lengths(tq, scheme, seq_len)
    rows = batch * kv_heads
    out["high_precision"] = rows * (sinks + recent) * head_dim * DType.get(scheme.hp_dtype).itemsize
    if not tq.quantized:
        return out
    exact_bits = rows * quantized * head_dim * tq.bits
    out["payload"] = exact_bits // 8
    out["padding"] = rows * quantized * tq.packed_dim(head_dim) - out["payload"]
    kind, entries = tq.metadata_shape(head_dim)
    if kind == "per_token":
        count = rows * quantized * entries
    elif kind == "per_group_of_tokens":
        count = rows * (quantized // tq.group_size) * entries
    else:  # static: one set per layer and kv head, shared by the batch
        count = kv_heads * entries
    meta = count * DType.get(tq.scale_dtype).itemsize
    out["scales"] = meta
    out["zero_points"] = meta if tq.has_zero_point else 0
    return out


def predict(scheme: KVQuantScheme, model: CacheGeometry, seq_len: int, batch: int = 1) -> MemoryReport:
    """Bytes of the whole model's cache after ``seq_len`` tokens for ``batch`` sequences."""
    if seq_len < 0 or batch < 1:
        raise SchemeError(f"invalid seq_len={seq_len}/batch={batch}: need seq_len >= 0 and batch >= 1")
    scheme.check_model(model.num_layers, model.head_dim)
    totals = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for key, value in scheme.streams(model.num_layers):
        for tq in (key, value):
            part = stream_bytes(tq, scheme, seq_len=seq_len, batch=batch,
                                kv_heads=model.num_kv_heads, head_dim=model.head_dim)
            for name, count in part.items():
                totals[name] += count
    fp16 = 2 * model.num_layers * batch * model.num_kv_heads * seq_len * model.head_dim * 2
    return MemoryReport(scheme.name or "custom", seq_len, batch, sum(totals.values()), fp16, totals)


def curve(
    scheme: KVQuantScheme, model: CacheGeometry, lengths: Sequence[int], batch: int = 1
) -> list[MemoryReport]:
    """:func:`predict` over several lengths (for tables and plots)."""
    return [predict(scheme, model, n, batch) for n in lengths]


# -- what a run may allocate ------------------------------------------------------------------------------------
def available_bytes() -> int | None:
    """Memory this machine can give a new allocation: Linux's ``MemAvailable``, else physical memory, else None."""
    import os

    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(needed: int, what: str, advice: str) -> None:
    """Refuse up front a run whose estimated allocation (``needed`` bytes) exceeds the memory available."""
    available = available_bytes()
    if available is not None and needed > available:
        gib = 1 << 30
        raise KVQError(f"{what} needs at least {needed / gib:.1f} GiB, more than the {available / gib:.1f} GiB "
                       f"of memory available; {advice}")


def check_positions(lengths: Sequence[int], max_positions: int, what: str, advice: str) -> None:
    """Refuse lengths past the model's positions (its RoPE table and its config state no more)."""
    beyond = sorted({n for n in lengths if n > max_positions})
    if beyond:
        raise KVQError(f"{what} {beyond[0]} is beyond the model's {max_positions} positions; {advice}")


def high_precision_tokens(scheme: KVQuantScheme, model: CacheGeometry, limit: int) -> int:
    """Tokens a row holds before the first one is stored quantized (its sink / recent-window / partial-group span).

    0 for a scheme that quantizes from the first token; ``limit`` when nothing up to ``limit`` tokens is
    quantized (an unquantized scheme). A comparison or validation whose rows never exceed this number never
    reads a quantized token: it can only report a perfect match.
    """
    if not scheme.quantized or predict(scheme, model, limit).breakdown["payload"] == 0:
        return limit
    low, high = 0, limit  # payload(low) == 0, payload(high) > 0; payload only grows with length
    while high - low > 1:
        mid = (low + high) // 2
        if predict(scheme, model, mid).breakdown["payload"] > 0:
            high = mid
        else:
            low = mid
    return low
