"""Running retrieval trials on one export: prefill the context, then score the gold answer token by token.

A trial is scored the way a deployer's greedy generation would read it, with no sampling to vary: the context is
prefilled in steps of ``chunk`` tokens aligned at multiples of ``chunk``, the question is a step of its own (so
it reads the whole context from the stored cache, as a later turn of a conversation does), and the gold answer is
then fed one token per step. At each answer position the step's logits give

* the gold token's log-probability, summed over the answer: a continuous score, usable where retrieval fails;
* whether the greedy token is the gold one: greedy decoding reproduces the answer exactly when every position
  agrees (teacher-forced argmax and free greedy decoding take the same tokens for as long as they agree).

The depths of one trial share their context up to the key needle. :func:`run_trials` prefills that shared part
once and copies the cache where the prompts part; each prompt's steps are the ones a run of its own takes (the
same chunks, from the same cache), so a result never depends on which other trials ran beside it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvq_export.validate.long_context.tasks import Case


@dataclass(frozen=True)
class Outcome:
    """One graph on one trial: exact match, the gold answer's log-probability, and what greedy said instead."""

    hit: bool
    logprob: float
    said: str  # greedy's tokens up to and including the first one that departs from the gold answer


def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    x = x - x.max()
    return x - math.log(np.exp(x).sum())


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def fork_point(case: Case, trunk: Case, chunk: int) -> int:
    """Tokens of ``case`` that the trunk's chunk-aligned prefill holds for it: whole chunks of the shared context."""
    return min(common_prefix(case.prompt, trunk.prompt), case.context) // chunk * chunk


class TrialRunner:
    """Runs trials on one session whose steps return the last position's logits (``last_logits=True``)."""

    def __init__(self, session, *, chunk: int, decode: Callable[[Sequence[int]], str],
                 advance: Callable[[int], None] = lambda n: None) -> None:
        self.session, self.chunk, self.decode, self.advance = session, chunk, decode, advance

    def _feed(self, tokens: Sequence[int], cache):
        logits, cache = self.session.step(np.asarray(tokens, dtype=np.int64)[None], None, cache)
        self.advance(len(tokens))
        return logits, cache

    def _fork(self, cache):
        """A copy of ``cache`` that later steps on either one leave alone (a buffer layout appends in place)."""
        return self.session.cache_from_arrays({k: v.copy() for k, v in self.session.cache_arrays(cache).items()})

    def finish(self, case: Case, cache, start: int) -> Outcome:
        """Feed ``case.prompt[start:]`` (the rest of the context in chunks, then the question), score the answer."""
        logits = None
        for begin in range(start, case.context, self.chunk):
            logits, cache = self._feed(case.prompt[begin:min(begin + self.chunk, case.context)], cache)
        if case.context < len(case.prompt):
            logits, cache = self._feed(case.prompt[case.context:], cache)
        logprob, said = 0.0, []
        for i, gold in enumerate(case.answer):
            scores = _log_softmax(logits[0, -1])
            logprob += float(scores[gold])
            said.append(int(scores.argmax()))
            if said[-1] != gold:
                break
            if i < len(case.answer) - 1:
                logits, cache = self._feed([gold], cache)
        hit = said == list(case.answer)
        if not hit:  # the rest of the gold answer's log-probability, teacher-forced
            logprob += self._rest(case, cache, len(said))
        return Outcome(hit, logprob, self.decode(said))

    def _rest(self, case: Case, cache, scored: int) -> float:
        """Log-probability of the gold answer's tokens after position ``scored`` (greedy left the answer there)."""
        total = 0.0
        for i in range(scored, len(case.answer)):
            logits, cache = self._feed([case.answer[i - 1]], cache)
            total += float(_log_softmax(logits[0, -1])[case.answer[i]])
        return total

    def run_group(self, cases: Sequence[Case]) -> list[Outcome]:
        """Outcomes of trials of one length that may share context: the shared part is prefilled once."""
        trunk = max(cases, key=lambda c: sum(common_prefix(c.prompt, o.prompt) for o in cases))
        order = sorted(range(len(cases)), key=lambda i: fork_point(cases[i], trunk, self.chunk))
        capacity = max(len(c.prompt) + len(c.answer) - 1 for c in cases)
        cache, held = self.session.empty_cache(1, capacity=capacity), 0
        out: dict[int, Outcome] = {}
        for n, i in enumerate(order):
            point = fork_point(cases[i], trunk, self.chunk)
            while held < point:
                _, cache = self._feed(trunk.prompt[held:held + self.chunk], cache)
                held += self.chunk
            out[i] = self.finish(cases[i], cache if n == len(order) - 1 else self._fork(cache), point)
        return [out[i] for i in range(len(cases))]


def run_trials(runner: TrialRunner, cases: Sequence[Case]) -> list[Outcome]:
    """Every case's outcome, in order; the depths of one task, length and trial share their prefill."""
    groups: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for i, case in enumerate(cases):
        groups[case.task, case.length, case.trial].append(i)
    out: list[Outcome | None] = [None] * len(cases)
    for members in groups.values():
        for i, outcome in zip(members, runner.run_group([cases[i] for i in members])):
            out[i] = outcome
    return out  # type: ignore[return-value]


def mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value of paired flips (``lost``: baseline right, export wrong; ``gained``: back)."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)
