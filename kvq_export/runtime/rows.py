"""Cache rows for serving: a ``buffer``-layout export's cache as N independent rows, run in any contiguous range.

A ``--flavor ort-gqa`` export holds one buffer per layer and stream, ``[batch, kv_heads, capacity, packed
head_dim]``, and each row's tokens sit at ``[0, seq_lengths[b])`` of its own row. Rows never read each other, so a
server can give each sequence a row of one large buffer and run any contiguous range of rows ``[start, stop)``
through the graph by binding the range's slice of every buffer (its address and shape) as past input and present
output: a prompt chunk runs on its one row, a decode step on the range of running rows, and nothing is copied.

:class:`RowCache` owns those buffers (allocated once, on the session's device: host memory, or the GPU under
CUDAExecutionProvider), the host's copy of every row's length, and the runs. Its bytes are the memory model's
(:func:`kvq_export.memory.predict`) less the static scales, which live in the graph: :func:`rows_within` says how
many rows of ``capacity`` tokens a byte budget holds, and the tests check the allocation against it.

A **paged** cache (``paged=True``, host memory) maps its buffers as private anonymous memory and never touches them:
the system commits a page when a call first writes into it, so a row holds the whole pages its tokens reach
(:meth:`RowCache.held_bytes`, :func:`paged_bytes`), and emptying or cutting back a row gives its pages back.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvq_export.dtypes import DType
from kvq_export.errors import RuntimeInputError
from kvq_export.memory import predict
from kvq_export.naming import CacheTensor, present_name, tensor_name
from kvq_export.runtime.session import KVQSession
from kvq_export.vocab import Role

logger = logging.getLogger(__name__)

SEQ_LENGTHS = tensor_name("past", None, None, "seq_lengths")
CUDA = "CUDAExecutionProvider"
#: the operating system's page: a paged cache's memory is committed (and given back) in these
PAGE_BYTES = mmap.PAGESIZE
#: whether this platform maps private anonymous memory and takes pages back (``MADV_DONTNEED``): what paged rows need
PAGED_MEMORY = all(hasattr(mmap, name) for name in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_DONTNEED"))


def token_widths(session: KVQSession) -> dict[int, int]:
    """Bytes one token takes in one head's row of a buffer -> how many such head rows one cache row has."""
    widths: dict[int, int] = {}
    for spec in session.past:
        if session.layout.shared(spec):
            width = int(np.prod(spec.shape[3:])) * np.dtype(DType.get(spec.dtype).bits_numpy).itemsize
            widths[width] = widths.get(width, 0) + int(spec.shape[1])
    return widths


def paged_bytes(widths: Mapping[int, int], tokens: int | np.ndarray, page_bytes: int = PAGE_BYTES) -> np.ndarray:
    """Bytes a row holding ``tokens`` commits in a paged cache: each head row's tokens rounded up to whole pages."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return sum(count * -(-tokens * width // page_bytes) * page_bytes for width, count in widths.items())


def whole_pages(widths: Mapping[int, int], capacity: int, page_bytes: int = PAGE_BYTES) -> bool:
    """Whether every head row of ``capacity`` tokens is whole pages (what a paged cache needs to count exactly)."""
    return not any(capacity * width % page_bytes for width in widths)


@dataclass(frozen=True)
class _Buffer:
    """One layer and stream's buffer ``[rows, kv_heads, capacity, width]`` at ``address``; ``owner`` keeps it."""

    spec: CacheTensor
    address: int
    shape: tuple[int, ...]
    row_bytes: int
    dtype: np.dtype
    owner: object

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in one head's row."""
        return self.row_bytes // (self.shape[1] * self.shape[2])


@dataclass(frozen=True)
class RowBudget:
    """How many rows of ``capacity`` tokens a byte budget holds, by the memory model."""

    budget_bytes: int
    capacity: int
    rows: int
    #: one row's buffers (every layer's keys and values at ``capacity`` tokens)
    row_bytes: int
    #: the static scales and zero points the cache reads, held once (in the graph's constants)
    static_bytes: int

    @property
    def cache_bytes(self) -> int:
        """Bytes the rows' buffers hold."""
        return self.rows * self.row_bytes


def rows_within(session: KVQSession, budget_bytes: int, capacity: int) -> RowBudget:
    """The rows of ``capacity`` tokens whose cache (:func:`~kvq_export.memory.predict`) fits ``budget_bytes``."""
    scheme, model = session.manifest.scheme, session.manifest.model
    one, two = predict(scheme, model, capacity, 1), predict(scheme, model, capacity, 2)
    row = two.total_bytes - one.total_bytes  # the per-sequence part; the rest is static metadata
    static = one.total_bytes - row
    rows = max(0, (budget_bytes - static) // row) if row else 0
    return RowBudget(budget_bytes, capacity, int(rows), int(row), int(static))


class RowCache:
    """``rows`` cache rows of ``capacity`` tokens each for one ``buffer``-layout export, on the session's device.

    :meth:`run` feeds new tokens to a contiguous range of rows and returns each row's last logits; :meth:`clear`
    empties a row for its next sequence and :meth:`truncate` keeps its first tokens (:func:`copy_prefix` copies them
    into a row of any host-memory cache). Not thread-safe: one thread (the server's scheduler) owns it.

    A row's first tokens can serve another sequence exactly where the session attends over stored codes on every
    call (``KVQSession(stored_prefill=True)``): what a row holds then follows from its tokens alone.

    ``paged``: host memory the system commits page by page as calls write into it (else held from the start);
    every head row must be whole pages of ``page_bytes``, the size :meth:`held_bytes` counts in (the system's page;
    a test may count in finer ones, while pages go back to the system whole).
    """

    def __init__(self, session: KVQSession, rows: int, capacity: int, *, paged: bool = False,
                 page_bytes: int = PAGE_BYTES) -> None:
        import onnxruntime as ort

        layout = session.layout
        if not layout.shares_buffers:
            raise RuntimeInputError(f"{session.directory}: rows of one shared cache need the buffer layout (an "
                                    f"--flavor ort-gqa export); this export's layout is {layout.name}")
        if not 1 <= capacity <= session.max_positions:
            raise RuntimeInputError(f"invalid capacity {capacity}: allowed: 1 .. {session.max_positions} (the "
                                    "export's positions)")
        if rows < 1:
            raise RuntimeInputError(f"invalid rows {rows}: allowed: an integer >= 1")
        self.session, self.rows, self.capacity = session, rows, capacity
        self.vocab = session.manifest.model.vocab_size
        providers = session.session.get_providers()
        self.device = "cuda" if providers and providers[0] == CUDA else "cpu"
        if paged and self.device != "cpu":
            raise RuntimeInputError(f"paged cache rows need host memory; this session's cache is on {self.device}")
        if paged and not PAGED_MEMORY:
            raise RuntimeInputError("paged cache rows need private anonymous memory whose pages can be given back "
                                    "(mmap's MAP_ANONYMOUS and MADV_DONTNEED), which this platform lacks")
        #: memory is committed page by page as rows fill, and given back as they empty (else held from the start)
        self.paged, self.page_bytes = paged, page_bytes
        self.widths = token_widths(session)
        if paged and not whole_pages(self.widths, capacity, page_bytes):
            raise RuntimeInputError(f"paged rows of {capacity} tokens do not end on {page_bytes}-byte pages (tokens of "
                                    f"{sorted(self.widths)} bytes a head): allowed: a capacity whose head rows are "
                                    "whole pages")
        self.buffers: list[_Buffer] = []
        for spec in session.past:
            if not layout.shared(spec):
                if spec.role != Role.SEQ_LENGTHS:
                    raise RuntimeInputError(f"{session.directory}: cache tensor {spec.name} is neither a shared "
                                            "buffer nor seq_lengths; rows cannot hold it")
                continue
            shape = (rows, *(capacity if dim == "capacity" else dim for dim in spec.shape[1:]))
            dtype = np.dtype(DType.get(spec.dtype).bits_numpy)
            row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
            if paged:  # private anonymous pages: untouched ones hold no memory, MADV_DONTNEED gives them back
                owner = mmap.mmap(-1, rows * row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                address = ctypes.addressof(ctypes.c_char.from_buffer(owner))
            else:
                owner = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, 0)
                address = owner.data_ptr()
                if self.device == "cpu":  # touch every page now: the memory is held from the start
                    ctypes.memset(address, 0, rows * row_bytes)
            self.buffers.append(_Buffer(spec, address, shape, row_bytes, dtype, owner))
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._logits = np.empty(0, dtype=np.float32)
        logger.debug("cache rows: %d x %d tokens, %.1f MiB on %s%s", rows, capacity, self.nbytes / 2**20, self.device,
                     " (paged: committed as rows fill)" if paged else "")

    @property
    def row_bytes(self) -> int:
        """Bytes one row's buffers hold."""
        return sum(buffer.row_bytes for buffer in self.buffers)

    @property
    def nbytes(self) -> int:
        """Bytes every row's buffers hold."""
        return self.rows * self.row_bytes

    def copy_row(self, source: int, target: int) -> None:
        """Make ``target`` hold what ``source`` holds (host memory only; on a GPU, prefill the row instead)."""
        copy_prefix(self, source, self, target, int(self.lengths[source]))

    def held_bytes(self, tokens: int | np.ndarray) -> np.ndarray:
        """Bytes a row holding ``tokens`` holds: whole pages of them where paged, else the whole row."""
        if self.paged:
            return paged_bytes(self.widths, tokens, self.page_bytes)
        return np.full(np.shape(tokens), self.row_bytes, dtype=np.int64)

    def truncate(self, row: int, tokens: int) -> None:
        """Keep the first ``tokens`` that ``row`` holds (what lies past a row's length is never read).

        Paged, the pages past them go back to the system.
        """
        if not 0 <= tokens <= self.lengths[row]:
            raise RuntimeInputError(f"row {row} holds {int(self.lengths[row])} tokens, not {tokens}")
        self.lengths[row] = tokens
        self._give_back(row, tokens)

    def clear(self, row: int) -> None:
        """Empty ``row`` (its buffer contents beyond the length are never read; paged, its pages go back)."""
        self.lengths[row] = 0
        self._give_back(row, 0)

    def _give_back(self, row: int, tokens: int) -> None:
        """Paged: give back every whole system page of ``row``'s head rows past their first ``tokens``."""
        if not self.paged:
            return
        for buffer in self.buffers:
            width = buffer.token_bytes
            spans = [(0, buffer.row_bytes)] if tokens == 0 else \
                [(head * self.capacity * width + tokens * width, (head + 1) * self.capacity * width)
                 for head in range(buffer.shape[1])]
            for low, high in spans:
                low = -(-(row * buffer.row_bytes + low) // PAGE_BYTES) * PAGE_BYTES
                high = (row * buffer.row_bytes + high) // PAGE_BYTES * PAGE_BYTES
                if high > low:
                    buffer.owner.madvise(mmap.MADV_DONTNEED, low, high - low)

    def run(self, start: int, input_ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Feed ``input_ids [k, t]`` (left-padded, ``mask`` 0 = padding) to rows ``[start, start + k)``.

        Returns the last position's logits ``[k, vocab]`` (a view, valid until the next run). A row whose mask is all
        zeros stores nothing and its logits are meaningless; every row needs room for ``t`` more tokens, as
        GroupQueryAttention checks (a row feeding padding too).
        """
        k, t = input_ids.shape
        stop = start + k
        if not (0 <= start and stop <= self.rows):
            raise RuntimeInputError(f"rows [{start}, {stop}) are outside the cache's {self.rows} rows")
        mask = np.ones_like(input_ids) if mask is None else mask
        need = self.lengths[start:stop] + t  # GroupQueryAttention wants room for the call's t in every row
        if int(need.max()) > self.capacity:
            row = start + int(np.argmax(need))
            raise RuntimeInputError(f"row {row} holds {int(self.lengths[row])} tokens: a call of {t} more is beyond "
                                    f"the cache rows' capacity of {self.capacity} (a row feeding padding too)")
        binding = self.session.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask, dtype=np.int64))
        binding.bind_cpu_input(SEQ_LENGTHS, self.lengths[start:stop].copy())
        lengths = np.empty(k, dtype=np.int64)
        binding.bind_output(present_name(SEQ_LENGTHS), "cpu", 0, np.int64, [k], lengths.ctypes.data)
        positions = 1 if self.session.last_logits else t
        logits = self._logits_buffer(k * positions).reshape(k, positions, self.vocab)
        binding.bind_output("logits", "cpu", 0, np.float32, [k, positions, self.vocab], logits.ctypes.data)
        for buffer in self.buffers:
            shape, address = [k, *buffer.shape[1:]], buffer.address + start * buffer.row_bytes
            binding.bind_input(buffer.spec.name, self.device, 0, buffer.dtype, shape, address)
            binding.bind_output(present_name(buffer.spec.name), self.device, 0, buffer.dtype, shape, address)
        self.session.session.run_with_iobinding(binding)
        self.lengths[start:stop] = lengths
        return logits[:, -1]

    def _logits_buffer(self, positions: int) -> np.ndarray:
        """A float32 buffer for ``positions`` rows of logits, reused between runs (grown when a run needs more)."""
        if self._logits.size < positions * self.vocab:
            self._logits = np.empty(positions * self.vocab, dtype=np.float32)
        return self._logits[:positions * self.vocab]


def copy_prefix(source: RowCache, source_row: int, target: RowCache, target_row: int, tokens: int) -> None:
    """Make ``target_row`` of ``target`` hold the first ``tokens`` that ``source_row`` of ``source`` holds.

    The two caches may have other capacities (the same export's buffers); host memory only. Per layer, stream and
    kv head the held tokens' bytes are contiguous, so a copy is ``kv_heads`` moves per buffer.
    """
    if source.device != "cpu" or target.device != "cpu":
        raise RuntimeInputError(f"copy_prefix works on host memory; these caches are on {source.device} and "
                                f"{target.device}")
    if not 0 <= tokens <= min(source.lengths[source_row], target.capacity):
        raise RuntimeInputError(f"row {source_row} holds {int(source.lengths[source_row])} tokens and the target "
                                f"row {target.capacity}: cannot copy {tokens}")
    for buffer, other in zip(source.buffers, target.buffers):
        heads, capacity = buffer.shape[1:3]
        token_bytes = buffer.token_bytes
        for head in range(heads):  # [rows, heads, capacity, width]
            ctypes.memmove(other.address + target_row * other.row_bytes + head * other.shape[2] * token_bytes,
                           buffer.address + source_row * buffer.row_bytes + head * capacity * token_bytes,
                           tokens * token_bytes)
    target.lengths[target_row] = tokens

