"""The start-up self-checks: whether a row's answer depends on what else is in the batch, or on a reused prefix.

A continuously batched server runs each sequence's decode step beside whatever else is running, at any row of
the cache and in a batch of any size. Whether a row's logits then equal its logits alone depends on the CPU's
kernels (a matrix multiply may sum in another order for another number of rows). :func:`check_batch_invariance`
runs short prompts alone, then in batches of several sizes at other rows with an empty row among them, and
compares every decode step's logits bit for bit. The server batches only when they are equal, or when told to
accept the difference; otherwise it decodes each row in a call of its own, which is every sequence alone.

:func:`check_prefix_reuse` runs one prompt whole, then continued from its first tokens copied into another row
and from a row cut back to them, in chunks of other sizes, and compares logits and decode steps bit for bit: the
server reuses prefixes only where they are equal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvq_export.runtime.rows import RowCache, copy_prefix

logger = logging.getLogger(__name__)

#: prompt lengths of the check (tokens); short, so the check costs little beside loading the model
PROMPT_LENGTHS = (5, 11, 17)
#: decode steps compared per prompt
STEPS = 3


@dataclass(frozen=True)
class InvarianceCheck:
    """What the self-check compared and found."""

    invariant: bool
    #: batch sizes (rows per decode call) compared with each prompt alone
    batch_sizes: tuple[int, ...]
    #: largest absolute difference of a logit between a row in a batch and the same sequence alone
    max_abs_diff: float
    seconds: float

    def to_dict(self) -> dict:
        """JSON form (``/health``)."""
        return asdict(self)


def batch_sizes(rows: int) -> tuple[int, ...]:
    """The batch sizes checked: small ones, a middling one and every row at once."""
    return tuple(sorted({size for size in (2, 3, 8, 32, rows) if 2 <= size <= rows}))


def check_batch_invariance(cache: RowCache, *, seed: int = 0) -> InvarianceCheck:
    """Decode :data:`PROMPT_LENGTHS` prompts alone and batched (at other rows, an empty row among them); compare.

    Leaves every row of ``cache`` empty.
    """
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    lengths = [n for n in PROMPT_LENGTHS if n + STEPS < cache.capacity] or [1]
    prompts = [rng.integers(0, cache.vocab, n) for n in lengths]
    solo = [_alone(cache, prompt) for prompt in prompts]
    sizes = batch_sizes(cache.rows)
    worst = 0.0
    for size in sizes:
        worst = max(worst, _batched(cache, prompts, solo, size))
        if worst:
            break
    for row in range(cache.rows):
        cache.clear(row)
    result = InvarianceCheck(worst == 0.0, sizes, worst, time.perf_counter() - start)
    logger.info("batch self-check: %s (batches of %s rows, largest logit difference %.3g, %.1f s)",
                "every row equals its sequence alone" if result.invariant else "rows differ from alone",
                ", ".join(map(str, sizes)), worst, result.seconds)
    return result


def _alone(cache: RowCache, prompt: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    """The greedy tokens fed after ``prompt`` and the logits of each decode step, run in row 0 alone."""
    cache.clear(0)
    logits = cache.run(0, prompt[None])
    fed, seen = [], []
    for _ in range(STEPS):
        fed.append(int(np.argmax(logits[0])))
        logits = cache.run(0, np.array([[fed[-1]]]))
        seen.append(logits[0].copy())
    cache.clear(0)
    return fed, seen


def _batched(cache: RowCache, prompts, solo, size: int) -> float:
    """Largest logit difference of rows ``[0, size)`` decoding together (row 1 empty when size > 2) vs alone."""
    which = {row: (row + size) % len(prompts) for row in range(size) if not (size > 2 and row == 1)}
    for row in range(size):
        cache.clear(row)
    first: dict[int, int] = {}  # prompt -> the row it was prefilled in
    for row, i in which.items():  # each prompt prefilled once, then copied (where the cache is in host memory)
        if cache.device == "cpu" and i in first:
            cache.copy_row(first[i], row)
        else:
            cache.run(row, prompts[i][None])
            first.setdefault(i, row)
    worst = 0.0
    for step in range(STEPS):
        ids = np.zeros((size, 1), dtype=np.int64)
        mask = np.zeros((size, 1), dtype=np.int64)
        for row, i in which.items():
            ids[row, 0], mask[row, 0] = solo[i][0][step], 1
        logits = cache.run(0, ids, mask)
        for row, i in which.items():
            if not np.array_equal(logits[row], solo[i][1][step]):
                diff = float(np.abs(logits[row] - solo[i][1][step]).max())
                worst = max(worst, diff if diff > 0 else float("inf"))  # NaN where alone is finite: inf
    return worst


#: the prefix check's prompt: its length, and where reuse cuts and chunks split it
PREFIX_PROMPT, PREFIX_CUT, PREFIX_SPLIT = 29, 13, 21


def check_prefix_reuse(cache: RowCache, *, seed: int = 1) -> float:
    """The largest logit difference between a prompt run whole and continued from a reused prefix (0: none).

    In row 0 the prompt runs in one call, then decodes :data:`STEPS` greedy tokens. Row 1 gets its first
    :data:`PREFIX_CUT` tokens copied from row 0 and the rest in two calls; row 0, cut back to the same tokens, gets
    the rest in one call; each then feeds the same tokens. Needs two rows; leaves every row empty.
    """
    if cache.rows < 2 or PREFIX_PROMPT + STEPS >= cache.capacity:
        return 0.0
    prompt = np.random.default_rng(seed).integers(0, cache.vocab, PREFIX_PROMPT)
    cache.clear(0)
    whole = [cache.run(0, prompt[None])[0].copy()]
    fed = []
    for _ in range(STEPS):
        fed.append(int(np.argmax(whole[-1])))
        whole.append(cache.run(0, np.array([[fed[-1]]]))[0].copy())

    def continued(row: int, pieces: list[np.ndarray]) -> float:
        seen = [cache.run(row, piece[None])[0].copy() for piece in pieces][-1:]
        seen += [cache.run(row, np.array([[token]]))[0].copy() for token in fed]
        return max(_difference(got, want) for got, want in zip(seen, whole))

    copy_prefix(cache, 0, cache, 1, PREFIX_CUT)
    worst = continued(1, [prompt[PREFIX_CUT:PREFIX_SPLIT], prompt[PREFIX_SPLIT:]])
    cache.truncate(0, PREFIX_CUT)
    worst = max(worst, continued(0, [prompt[PREFIX_CUT:]]))
    for row in (0, 1):
        cache.clear(row)
    logger.info("prefix self-check: %s", "a reused prefix gives what the whole prompt gives" if not worst else
                f"a reused prefix changes the logits by up to {worst:.3g}")
    return worst


def _difference(got: np.ndarray, want: np.ndarray) -> float:
    """0 when bit-equal, else the largest absolute difference (inf where it is 0 or NaN yet the bits differ)."""
    if np.array_equal(got, want):
        return 0.0
    diff = float(np.abs(got - want).max())
    return diff if diff > 0 else float("inf")
