"""How much of its cache budget a server's running sequences take under load, beside the memory model's number.

``kvq serve``'s metrics page (:mod:`kvq_export.serve.metrics`) says at each moment how many sequences run
(:data:`RUNNING`), how many requests wait (:data:`WAITING`), how many tokens the running sequences hold
(:data:`TOKENS`) and how many cache bytes it counts as used (:data:`BYTES_USED`); it counts preemptions
(:data:`PREEMPTIONS`). A :class:`~kvq_export.measure.watch.MetricsWatch` samples :data:`WATCHED` once a second
during the load, and the counter is read before and after it.

The memory model's number: at a sample where ``running`` sequences hold ``tokens`` tokens, the budget
(``budget_bytes``, ``cache_budget_bytes`` of the server's ``/health``) holds ``budget_bytes / (tokens / running *
bytes_per_token)`` sequences of their average size (``bytes_per_token``: :func:`bytes_per_token`, from the export's
scheme), and ``running`` over that is ``tokens * bytes_per_token / budget_bytes``: the share of the budget the held
tokens would fill if the cache cost exactly what the model says per token. It is fair only while the budget is what
keeps more sequences out, so :attr:`CacheUse.utilization` averages the samples where requests were waiting (and a
sequence ran): a server whose memory follows its tokens comes near 1 there; one that reserves a row of fixed
capacity per sequence stays near ``tokens held / capacity``. :attr:`CacheUse.utilization_running` averages every
sample with a running sequence, for a load too light to fill the budget.

A figure the server does not give (llama-server and og.Engine have none of these names, nor the budget) is None,
never 0.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvq_export.errors import KVQError

if TYPE_CHECKING:
    from kvq_export.model_facts import CacheGeometry
    from kvq_export.scheme import KVQuantScheme

logger = logging.getLogger(__name__)

#: kvq serve's gauges: sequences generating, requests waiting, tokens the running sequences hold, cache bytes used
RUNNING = "kvq_sequences_running"
WAITING = "kvq_sequences_waiting"
TOKENS = "kvq_cache_tokens"
BYTES_USED = "kvq_cache_bytes_used"
#: kvq serve's counter of sequences preempted (their rows given to others; Prometheus adds ``_total``)
PREEMPTIONS = "kvq_preemptions_total"
WATCHED = (RUNNING, WAITING, TOKENS, BYTES_USED, PREEMPTIONS)
#: the fields of kvq serve's ``/health`` that give its cache budget in bytes and the most sequences it runs at once
BUDGET_FIELD = "cache_budget_bytes"
MAX_SEQS_FIELD = "max_seqs"
#: two lengths whose predicted cache bytes differ by the per-token cost (multiples of any token group in use)
PER_TOKEN_LENGTHS = (2048, 4096)


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class CacheModel:
    """What the memory model needs of a server, None where it does not say.

    ``budget_bytes`` and ``max_seqs`` from its ``/health``; ``bytes_per_token`` from its export
    (:func:`bytes_per_token`).
    """

    budget_bytes: int | None = None
    bytes_per_token: float | None = None
    max_seqs: int | None = None

    @classmethod
    def from_health(cls, health: Mapping[str, Any] | None, bytes_per_token: float | None = None) -> CacheModel:
        """:data:`BUDGET_FIELD` and :data:`MAX_SEQS_FIELD` of a ``/health`` body where they are positive integers."""
        health = health or {}
        return cls(_positive_int(health.get(BUDGET_FIELD)), bytes_per_token, _positive_int(health.get(MAX_SEQS_FIELD)))


@dataclass(frozen=True)
class CacheUse:
    """A loaded point's cache occupancy: gauge means and maxima, preemptions, and the memory model's share.

    ``samples``: scrapes that had :data:`RUNNING`; ``waiting_samples``: of those, the ones with a sequence running
    and a request waiting (what :attr:`utilization` and :attr:`bytes_used_share` average); ``at_max_seqs``: of
    those, the ones where ``max_seqs`` sequences ran: there the sequence count, not the budget, kept requests out.
    """

    samples: int = 0
    running_mean: float | None = None
    running_max: float | None = None
    tokens_mean: float | None = None
    tokens_max: float | None = None
    bytes_used_mean: float | None = None
    bytes_used_max: float | None = None
    preemptions: float | None = None  # the counter's change over the load
    budget_bytes: int | None = None
    bytes_per_token: float | None = None
    waiting_samples: int = 0
    max_seqs: int | None = None
    at_max_seqs: int | None = None
    #: tokens held x bytes per token / budget, mean over the waiting samples
    utilization: float | None = None
    #: the same, mean over every sample with a sequence running
    utilization_running: float | None = None
    #: the server's own bytes used / budget, mean over the waiting samples
    bytes_used_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def token_bytes(scheme: KVQuantScheme, model: CacheGeometry) -> float:
    """Cache bytes one more token of one sequence costs, by the memory model (:func:`~kvq_export.memory.predict`).

    The difference between two lengths (:data:`PER_TOKEN_LENGTHS`) at one sequence, per token, as
    :func:`~kvq_export.runtime.rows.rows_within` costs a row by a difference: static scales cancel out, and so do a
    scheme's fixed high-precision spans (sinks, recent window), which a sequence holds whatever its length.
    """
    from kvq_export.memory import predict

    short, long = PER_TOKEN_LENGTHS
    grown = predict(scheme, model, long, 1).total_bytes - predict(scheme, model, short, 1).total_bytes
    return grown / (long - short)


def bytes_per_token(export_dir: str | os.PathLike[str]) -> float | None:
    """:func:`token_bytes` of a kvq export's scheme and model; None (and a warning) when its manifest is unreadable."""
    from kvq_export.manifest import Manifest

    try:
        manifest = Manifest.load(export_dir)
    except KVQError as err:
        logger.warning("no bytes per token for %s: %s", export_dir, err)
        return None
    return token_bytes(manifest.scheme, manifest.model)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_cache_use(samples: Sequence[Mapping[str, float]], model: CacheModel = CacheModel(), *,
                        before: Mapping[str, float] | None = None,
                        after: Mapping[str, float] | None = None) -> CacheUse:
    """:class:`CacheUse` of the load's samples (``{name: value}`` each) and the counter read before and after it."""
    budget_bytes, per_token, max_seqs = model.budget_bytes, model.bytes_per_token, model.max_seqs
    running = [s for s in samples if RUNNING in s]

    def column(name: str, among: Sequence[Mapping[str, float]] = running) -> list[float]:
        return [s[name] for s in among if name in s]

    busy = [s for s in running if s[RUNNING] >= 1]
    waiting = [s for s in busy if s.get(WAITING, 0) > 0]

    def share(among: Sequence[Mapping[str, float]], name: str, scale: float | None) -> float | None:
        if not budget_bytes or scale is None:
            return None
        return _mean([value * scale / budget_bytes for value in column(name, among)])

    tokens, used = column(TOKENS), column(BYTES_USED)
    preemptions = None
    if before is not None and after is not None and PREEMPTIONS in before and PREEMPTIONS in after:
        preemptions = after[PREEMPTIONS] - before[PREEMPTIONS]
    return CacheUse(samples=len(running), running_mean=_mean(column(RUNNING)), running_max=max(column(RUNNING),
                    default=None), tokens_mean=_mean(tokens), tokens_max=max(tokens, default=None),
                    bytes_used_mean=_mean(used), bytes_used_max=max(used, default=None), preemptions=preemptions,
                    budget_bytes=budget_bytes, bytes_per_token=per_token, waiting_samples=len(waiting),
                    max_seqs=max_seqs, at_max_seqs=None if max_seqs is None else sum(s[RUNNING] >= max_seqs
                                                                                    for s in waiting),
                    utilization=share(waiting, TOKENS, per_token), utilization_running=share(busy, TOKENS, per_token),
                    bytes_used_share=share(waiting, BYTES_USED, 1.0))


async def read_health(url: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """A server's ``/health`` body (a JSON object) when it answers 200; None (and a warning) otherwise."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            reply = await client.get(url)
        body = reply.json() if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as err:
        logger.warning("health %s: %s", url, err)
        return None
    return body if isinstance(body, dict) else None
