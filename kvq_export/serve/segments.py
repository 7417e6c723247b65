"""Cache memory in proportion to tokens: rows of several capacities, allocated in segments within one byte budget.

ONNX Runtime's GroupQueryAttention on CPU reads one contiguous ``[rows, kv_heads, capacity, head_dim]`` buffer per
layer and stream and has no block table, so a call runs rows of one capacity lying side by side. The cache is
therefore cut into **segments**: a :class:`Segment` is a :class:`~kvq_export.runtime.rows.RowCache` of a few rows of
one capacity (its **class**), allocated when a class needs a row and the budget has room, and freed when none of its
rows holds anything. The classes step by about sqrt(2) (:func:`capacity_classes`: 256, 384, 512, 768, ... up to the
context), so a sequence holds at most about 1.41x the tokens it needs, plus the rows its class's last segment has
not handed out yet (a class's first segment is :data:`SEGMENTS_PER_BUDGET`-th of the budget or one row, and each
further one doubles the class's rows, up to :data:`ROWS_PER_CALL` rows or an eighth of the budget). A sequence that
outgrows its row moves into a row of the next class: its codes are copied (host memory, the held tokens only).

A **paged** sizing (:meth:`Sizing.paged_rows`, the server's default on a CPU) is one segment of rows of the whole
context whose memory the system commits page by page (:class:`~kvq_export.runtime.rows.RowCache` with ``paged``):
no classes, no moves, and a row holds the whole pages of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvq_export.runtime.rows import PAGE_BYTES, RowCache, copy_prefix, paged_bytes, rows_within, token_widths
from kvq_export.runtime.session import KVQSession

#: the smallest row, in tokens
SMALLEST_CLASS = 256
#: a class's first segment is this fraction of the budget (or one row; the smallest class's is its largest); each
#: further one has as many rows as the class has already (doubling it), up to :data:`ROWS_PER_CALL` rows or a
#: :data:`MOST_PER_SEGMENT`-th of the budget:
#: sequences decode in one call per segment, and a call's fixed cost (reading the weights) is several rows' worth, so
#: a class in demand gets large segments and a rare one small segments
SEGMENTS_PER_BUDGET = 32
ROWS_PER_CALL = 64
MOST_PER_SEGMENT = 8


class RowState(Enum):
    """What a row holds: nothing, a cached prefix with no sequence (idle), or a running sequence."""

    FREE = "free"
    IDLE = "idle"
    BUSY = "busy"


def capacity_classes(context: int, smallest: int = SMALLEST_CLASS) -> tuple[int, ...]:
    """Row capacities from ``smallest`` up to ``context``, each about sqrt(2) times the last (multiples of 128)."""
    classes, size = [], smallest
    while size < context:
        classes.append(size)
        half = size // 2 if size & (size - 1) == 0 else size // 3  # 256 -> 384 -> 512 -> 768 -> 1024 ...
        size += half
    return (*classes, context)


@dataclass(eq=False)
class Segment:
    """Rows of one capacity side by side: a :class:`RowCache`, what each row holds and its state."""

    cache: RowCache
    tokens: np.ndarray  # [rows, capacity] int32: the token at each held position
    state: list[RowState]

    @classmethod
    def allocate(cls, session: KVQSession, rows: int, capacity: int, *, paged: bool = False,
                 page_bytes: int = PAGE_BYTES) -> Segment:
        cache = RowCache(session, rows, capacity, paged=paged, page_bytes=page_bytes)
        return cls(cache, np.zeros((rows, capacity), dtype=np.int32), [RowState.FREE] * rows)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def rows(self) -> int:
        return self.cache.rows

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def free_row(self) -> int:
        """The lowest free row, or -1."""
        return next((row for row, state in enumerate(self.state) if state is RowState.FREE), -1)

    def unused(self) -> bool:
        """Whether no row holds anything."""
        return all(state is RowState.FREE for state in self.state)


@dataclass(eq=False)
class Slot:
    """Where a sequence's codes are: a row of a segment (the pool changes both when it moves the sequence)."""

    segment: Segment
    row: int

    @property
    def length(self) -> int:
        """Tokens the row holds."""
        return int(self.segment.cache.lengths[self.row])

    @property
    def capacity(self) -> int:
        return self.segment.capacity


@dataclass(frozen=True)
class Sizing:
    """How one budget is cut: the classes, each class's rows in a first and in the largest segment, bytes per row.

    ``budget_bytes``: what the rows may hold (the budget less the static scales, which the graph holds once).
    """

    budget_bytes: int
    classes: tuple[int, ...]
    first_rows: dict[int, int]
    most_rows: dict[int, int]
    row_bytes: dict[int, int]
    #: one segment of rows of the whole context whose memory the system commits page by page (:meth:`paged`)
    paged: bool = False
    #: the pages a paged cache counts in (the system's, unless a test asks for finer)
    page_bytes: int = PAGE_BYTES

    @classmethod
    def of(cls, session: KVQSession, budget_bytes: int, context: int, smallest: int = SMALLEST_CLASS) -> Sizing:
        """The sizing of ``budget_bytes`` for rows of ``smallest`` up to ``context`` tokens.

        Bytes per row are the memory model's (:func:`~kvq_export.runtime.rows.rows_within`).
        """
        classes = capacity_classes(context, smallest)
        fits = {capacity: rows_within(session, budget_bytes, capacity) for capacity in classes}
        row_bytes = {capacity: fit.row_bytes for capacity, fit in fits.items()}
        cache_bytes = budget_bytes - fits[classes[0]].static_bytes  # the static scales live in the graph
        most = {capacity: max(1, cache_bytes // SEGMENTS_PER_BUDGET // size,
                              min(ROWS_PER_CALL, cache_bytes // MOST_PER_SEGMENT // size))
                for capacity, size in row_bytes.items()}
        first = {capacity: max(1, cache_bytes // SEGMENTS_PER_BUDGET // size) for capacity, size in row_bytes.items()}
        first[classes[0]] = most[classes[0]]  # short requests are the many: the smallest rows come in one large segment
        return cls(cache_bytes, classes, first, most, row_bytes)

    @classmethod
    def paged_rows(cls, session: KVQSession, budget_bytes: int, context: int, smallest: int = SMALLEST_CLASS,
                   page_bytes: int = PAGE_BYTES) -> Sizing:
        """Rows of the whole ``context`` in one segment, each holding whole pages of its tokens (:meth:`paged`).

        As many rows as the budget holds sequences of ``smallest`` tokens: their address space is reserved, their
        memory is not.
        """
        fits = rows_within(session, budget_bytes, context)
        cache_bytes = budget_bytes - fits.static_bytes
        rows = max(1, cache_bytes // int(paged_bytes(token_widths(session), min(smallest, context), page_bytes)))
        return cls(cache_bytes, (context,), {context: rows}, {context: rows}, {context: fits.row_bytes}, paged=True,
                   page_bytes=page_bytes)

    def class_for(self, tokens: int) -> int:
        """The smallest class holding ``tokens`` (the largest class for more)."""
        return next((capacity for capacity in self.classes if capacity >= tokens), self.classes[-1])

    def segment_rows(self, capacity: int, rows_now: int) -> int:
        """Rows of a new segment of ``capacity`` where the class has ``rows_now`` rows already."""
        return min(max(self.first_rows[capacity], rows_now), self.most_rows[capacity])

    def token_bytes(self) -> float:
        """Bytes one cached token holds (every layer's keys and values)."""
        smallest = self.classes[0]
        return self.row_bytes[smallest] / smallest


def copy_codes(source: Slot, target: Slot, tokens: int) -> None:
    """Make ``target``'s row hold the first ``tokens`` of ``source``'s (codes and the tokens they stand for)."""
    copy_prefix(source.segment.cache, source.row, target.segment.cache, target.row, tokens)
    target.segment.tokens[target.row, :tokens] = source.segment.tokens[source.row, :tokens]
