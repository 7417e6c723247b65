"""What ``kvq validate --long-context`` runs: the retrieval grid, the perplexity windows and the distance groups."""

from __future__ import annotations

from dataclasses import dataclass

from kvq_export.errors import KVQError
from kvq_export.validate.long_context.tasks import TASKS, get_task


@dataclass(frozen=True)
class LongContextConfig:
    """The grid and the windows; empty ``lengths`` / ``ppl_windows`` take the export's positions (see :meth:`for_`).

    ``lengths``: tokens of each trial (prompt and gold answer). ``depths``: key-needle depths per length, evenly
    spaced over [0, 1]. ``chunk``: context tokens per prefill step (the question is a step of its own, so it and
    the answer read the whole context from the stored cache). ``ppl_windows``: corpus windows scored token by
    token against the baseline, ``ppl_chunk`` tokens per step, grouped by position at ``group_edges``.
    """

    tasks: tuple[str, ...] = tuple(TASKS)
    lengths: tuple[int, ...] = ()
    depths: int = 5
    trials: int = 1
    seed: int = 0
    chunk: int = 512
    corpus: str = "britannica"
    offset: int = 0
    ppl_windows: tuple[int, ...] = ()
    ppl_chunk: int = 64
    group_edges: tuple[int, ...] = (512, 2048, 4096)

    def __post_init__(self) -> None:
        for name in self.tasks:
            get_task(name)  # one line naming the allowed tasks
        for field, low in (("depths", 1), ("trials", 1), ("chunk", 1), ("ppl_chunk", 1), ("seed", 0),
                           ("offset", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise KVQError(f"invalid {field}={value!r}: allowed: an integer >= {low}")
        for field in ("lengths", "ppl_windows", "group_edges"):
            values = getattr(self, field)
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in values):
                raise KVQError(f"invalid {field}={values!r}: allowed: integers >= 2")
        if list(self.group_edges) != sorted(set(self.group_edges)):
            raise KVQError(f"invalid group_edges={self.group_edges!r}: allowed: increasing positions")

    @property
    def depth_values(self) -> tuple[float, ...]:
        """The key needle's depths: 0 (first in the context) to 1 (right before the question)."""
        if self.depths == 1:
            return (0.5,)
        return tuple(round(i / (self.depths - 1), 4) for i in range(self.depths))

    def for_(self, max_positions: int) -> LongContextConfig:
        """The grid for an export of ``max_positions``: defaults filled in, anything longer refused in one line."""
        from dataclasses import replace

        lengths = self.lengths or tuple(sorted({min(n, max_positions) for n in (1024, 2048, 4096, max_positions)}))
        windows = self.ppl_windows or tuple(sorted({min(n, max_positions) for n in (2048, 4096, max_positions)}))
        for what, values in (("--lengths", lengths), ("--ppl-windows", windows)):
            if max(values) > max_positions:
                raise KVQError(f"{what} {max(values)} exceeds the {max_positions} positions this export supports "
                               f"(max_position_embeddings): use at most {max_positions}")
        return replace(self, lengths=lengths, ppl_windows=windows)

    def groups(self, longest: int) -> tuple[tuple[int, int], ...]:
        """Position groups ``[start, end)`` of the scored tokens, up to ``longest``."""
        edges = [0, *(e for e in self.group_edges if e < longest), longest]
        return tuple(zip(edges[:-1], edges[1:]))
