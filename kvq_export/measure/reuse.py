"""Prefix reuse under load: what a server says it reused, and what the workload allowed.

A server reports reuse one of three ways, declared per server (:class:`ReuseSource`), never probed:

* ``metrics``: ``kvq serve``'s Prometheus counters :data:`PREFIX_QUERIES` (prompt tokens looked up in the prefix
  cache) and :data:`PREFIX_HITS` (of those, tokens reused), read before and after the load;
* ``timings``: llama-server's ``timings`` block on each final answer, ``cache_n`` (prompt tokens taken from the
  cache) and ``prompt_n`` (prompt tokens computed), summed over the load (``result_timings::to_json`` in
  llama.cpp's ``tools/server/server-task.cpp``, filled from the slot's ``n_prompt_tokens_cache`` and
  ``n_prompt_tokens_processed``);
* ``none``: no reuse to report (og.Engine has no prefix cache on CPU).

A hit rate that cannot be read is None, never 0. What the workload allows (:func:`allowed_reuse`) is counted on
token ids: for each request in the order it was sent, its longest common prefix with any earlier request's prompt
followed by that request's answer, capped at its prompt length - 1 (a server always computes the last prompt
token, whose logits give the first answer token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

#: ``kvq serve``'s counter of prompt tokens looked up in its prefix cache (Prometheus adds ``_total``)
PREFIX_QUERIES = "kvq_prefix_cache_queries_total"
#: ``kvq serve``'s counter of prompt tokens reused from its prefix cache
PREFIX_HITS = "kvq_prefix_cache_hits_total"


class ReuseSource(StrEnum):
    """Where a server's prefix reuse is read from."""

    METRICS = "metrics"
    TIMINGS = "timings"
    NONE = "none"


@dataclass
class PrefixReuse:
    """A loaded point's prompt tokens, what a perfect prefix cache could have reused, and what the server reused.

    ``looked_up`` / ``reused``: the server's own token counts over the load (None when it does not say).
    """

    prompt_tokens: int
    allowed_tokens: int
    source: ReuseSource = ReuseSource.NONE
    looked_up: float | None = None
    reused: float | None = None

    @property
    def hit_rate(self) -> float | None:
        """Tokens reused / tokens looked up, as the server counts them; None when it does not say."""
        if self.looked_up is None or self.reused is None or self.looked_up <= 0:
            return None
        return self.reused / self.looked_up

    @property
    def allowed(self) -> float | None:
        """The fraction of prompt tokens a perfect prefix cache could reuse."""
        return self.allowed_tokens / self.prompt_tokens if self.prompt_tokens > 0 else None

    @property
    def of_allowed(self) -> float | None:
        """The hit rate as a fraction of what the workload allowed."""
        hit, allowed = self.hit_rate, self.allowed
        return None if hit is None or not allowed else hit / allowed

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"prompt_tokens": self.prompt_tokens, "allowed_tokens": self.allowed_tokens,
                "source": str(self.source), "looked_up": self.looked_up, "reused": self.reused,
                "hit_rate": self.hit_rate, "allowed": self.allowed, "of_allowed": self.of_allowed}


def allowed_reuse(sent: Iterable[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int]:
    """(prompt tokens, reusable tokens) of ``(prompt ids, answer ids)`` pairs in the order they were sent.

    A request's reusable tokens: its longest common prefix with any earlier prompt followed by that prompt's
    answer, at most its length - 1. Exact (a trie of every earlier sequence), linear in the tokens.
    """
    trie: dict[int, dict] = {}
    total = reusable = 0
    for prompt, answer in sent:
        node, common = trie, 0
        for token in prompt:
            node = node.get(token)
            if node is None:
                break
            common += 1
        total += len(prompt)
        reusable += max(0, min(common, len(prompt) - 1))
        node = trie
        for token in (*prompt, *answer):
            node = node.setdefault(token, {})
    return total, reusable


def prefix_counters(text: str) -> tuple[float, float] | None:
    """(:data:`PREFIX_QUERIES`, :data:`PREFIX_HITS`) from a Prometheus text page; None unless it has both."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (PREFIX_QUERIES, PREFIX_HITS):
                    found[sample.name] = found.get(sample.name, 0.0) + sample.value
    except ValueError:
        return None
    return (found[PREFIX_QUERIES], found[PREFIX_HITS]) if len(found) == 2 else None


def counter_change(before: tuple[float, float] | None,
                   after: tuple[float, float] | None) -> tuple[float | None, float | None]:
    """(tokens looked up, tokens reused) between two :func:`prefix_counters` reads; (None, None) without both."""
    if before is None or after is None:
        return None, None
    return after[0] - before[0], after[1] - before[1]


def timings_totals(timings: Iterable[tuple[int | None, int | None]]) -> tuple[int | None, int | None]:
    """(tokens looked up, tokens reused) from llama-server's ``(cache_n, prompt_n)`` per answer.

    Answers without timings are left out; (None, None) when none had them.
    """
    pairs = [(cache, computed) for cache, computed in timings if cache is not None and computed is not None]
    if not pairs:
        return None, None
    return sum(c + p for c, p in pairs), sum(c for c, _ in pairs)
