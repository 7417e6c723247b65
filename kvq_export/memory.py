"""The memory model: exact bytes a scheme's cache holds after N tokens, and the bytes the weights beside it hold.

The cache prediction is derived from the scheme alone (no tensors are made) and must equal the ``nbytes`` of
the reference cache's stored tensors; the tests check that for many scheme x length cases. The weight prediction
(:func:`predict_weights`) is derived from the model's parameter shapes and the weight format alone, and must equal
the initializer bytes an export with those weights holds (:func:`kvq_export.weight_bytes.weight_bytes`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvq_export.dtypes import DType
from kvq_export.errors import KVQError, SchemeError
from kvq_export.model_facts import CacheGeometry
from kvq_export.region_split import split_lengths
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.weight_blocks import BITS, W8A8_TABLE_BITS, W8A8_TABLE_BLOCK

BREAKDOWN_KEYS = ("payload", "scales", "zero_points", "high_precision", "padding")


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
    tq: TensorQuant, scheme: KVQuantScheme, model: CacheGeometry, *, seq_len: int, batch: int
) -> dict[str, int]:
    """Bytes by breakdown key for one layer's keys or values of the model of ``model``."""
    out = dict.fromkeys(BREAKDOWN_KEYS, 0)
    if seq_len == 0:
        return out
    kv_heads, head_dim = model.num_kv_heads, model.head_dim
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
    scheme.check_model(model)
    totals = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for key, value in scheme.streams(model.num_layers):
        for tq in (key, value):
            part = stream_bytes(tq, scheme, model, seq_len=seq_len, batch=batch)
            for name, count in part.items():
                totals[name] += count
    fp16 = 2 * model.num_layers * batch * model.num_kv_heads * seq_len * model.head_dim * 2
    return MemoryReport(scheme.name or "custom", seq_len, batch, sum(totals.values()), fp16, totals)


def curve(
    scheme: KVQuantScheme, model: CacheGeometry, lengths: Sequence[int], batch: int = 1
) -> list[MemoryReport]:
    """:func:`predict` over several lengths (for tables and plots)."""
    return [predict(scheme, model, n, batch) for n in lengths]


# -- the weights beside the cache -------------------------------------------------------------------------------
WEIGHT_BREAKDOWN_KEYS = ("quantized", "scales", "zero_points", "unquantized")


class WeightStorage(Protocol):
    """How an export stores its weights (:class:`kvq_export.request.WeightSpec` satisfies it)."""

    format: str
    block_size: int
    symmetric: bool


@dataclass(frozen=True)
class WeightReport:
    """Predicted bytes of a model's weights stored as ``format`` in a graph computing in ``dtype``.

    ``breakdown``: ``quantized`` (MatMulNBits / GatherBlockQuantized codes), ``scales``, ``zero_points`` and
    ``unquantized`` (float weights, norms and biases); ``as_built_bytes``: every weight in ``dtype``.
    """

    format: str
    dtype: str
    parameters: int
    total_bytes: int
    as_built_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the ``weights`` keys of ``kvq memory --json``)."""
        return {"format": self.format, "dtype": self.dtype, "parameters": self.parameters,
                "total_bytes": self.total_bytes, "as_built_bytes": self.as_built_bytes,
                "breakdown": dict(self.breakdown)}


def predict_weights(shapes: Mapping[str, Sequence[int]], weights: WeightStorage, dtype: str = "fp32",
                    embedding: str | None = None) -> WeightReport:
    """Bytes an export's weights hold: ``shapes`` are the model's parameters (a tied one once), Hugging Face layout.

    Every 2-D parameter is a linear weight ``[out, in]`` or the embedding ``[vocab, hidden]``; both are stored as
    ``weights.format`` says, the rest (norms, biases) in the compute ``dtype``:

    * ``fp32``: as built, in ``dtype``; ``fp16``: float16;
    * ``int8`` / ``int4``: ONNX Runtime's MatMulNBits / GatherBlockQuantized layout: ``in`` is cut into
      ``ceil(in / block_size)`` blocks (the last one padded) of ``block_size * bits / 8`` bytes per output row,
      one ``dtype`` scale per block, and when not symmetric one zero point per block, packed ``8 / bits`` to a byte
      and padded to whole bytes per row;
    * ``w8a8``: one int8 code per element and one float32 scale per output row; the ``embedding`` (its name) is
      stored as int8 blocks of 32, as ``int8`` stores it.
    """
    fmt = str(weights.format)
    item = DType.get(dtype).itemsize
    parts = dict.fromkeys(WEIGHT_BREAKDOWN_KEYS, 0)
    count = 0
    for name, shape in shapes.items():
        elements = 1
        for size in shape:
            elements *= int(size)
        count += elements
        if len(shape) != 2 or fmt == "fp32":
            parts["unquantized"] += elements * item
        elif fmt == "fp16":
            parts["unquantized"] += elements * 2
        elif fmt in BITS or (fmt == "w8a8" and name == embedding):
            table = fmt == "w8a8"  # the w8a8 embedding: symmetric int8 blocks
            bits = W8A8_TABLE_BITS if table else BITS[fmt]
            block, (rows, cols) = W8A8_TABLE_BLOCK if table else weights.block_size, shape
            blocks = -(-int(cols) // block)
            parts["quantized"] += rows * blocks * block * bits // 8
            parts["scales"] += rows * blocks * item
            if not table and not weights.symmetric:
                per_byte = 8 // bits
                parts["zero_points"] += rows * -(-blocks // per_byte)
        elif fmt == "w8a8":  # an int8 code per element, a float32 scale per output row
            parts["quantized"] += elements
            parts["scales"] += int(shape[0]) * 4
        else:
            raise KVQError(f"unknown weight format {fmt!r} for {name}; allowed: fp32, fp16, int8, int4, w8a8")
    return WeightReport(fmt, dtype, count, sum(parts.values()), count * item, parts)


# -- what a run may allocate ------------------------------------------------------------------------------------
def available_bytes() -> int | None:
    """Memory this machine can give a new allocation: Linux's ``MemAvailable``, else physical memory, else None."""
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


def resident_bytes(status: str | os.PathLike[str] = "/proc/self/status") -> int | None:
    """A process's resident set, ``VmRSS`` of its ``/proc/PID/status`` (this process's by default).

    None where the file cannot be read (the process is gone, or the system has no ``/proc``) or has no ``VmRSS``
    line (a zombie).
    """
    try:
        with open(status) as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1024, "mB": 1024**2, "gB": 1024**3}.get(unit, 1)
    except (OSError, ValueError, IndexError):
        pass
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
