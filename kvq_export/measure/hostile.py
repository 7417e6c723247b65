"""A hostile client: bad requests in a loop, beside the normal clients, each expected to get a 4xx.

The requests a server should refuse before it spends anything on them: ``max_tokens`` far beyond any context, a
prompt longer than the context, an unknown field, a body that is not JSON, a model not served, a negative
temperature and, when the server has an API key, none or a wrong one. A 4xx is a refusal; anything else (a 200, a
5xx, a timeout, a dropped connection) is a failure, counted per case with what came back.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: seconds one hostile request may take before it counts as a failure (a timeout)
HOSTILE_TIMEOUT = 20.0
#: seconds between two hostile requests (refusals are fast: without a pause the loop would take a core)
HOSTILE_PAUSE = 0.25


@dataclass(frozen=True)
class HostileCase:
    """One bad request: its name, the raw body and whether it carries the right API key."""

    name: str
    body: bytes
    key: str = "right"  # "right", "none" or "wrong"


def hostile_cases(model: str, prompt: str, context_tokens: int, *, api_key: str | None = None) -> list[HostileCase]:
    """The bad requests for a server of ``model`` with ``context_tokens`` positions (and ``api_key``, if it has one).

    The long prompt repeats a one-token word ``context_tokens + 64`` times: longer than the context in any
    tokenizer that spends at least one token on a word.
    """
    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}).encode()

    cases = [
        HostileCase("max_tokens 10**9", body(max_tokens=10**9)),
        HostileCase("prompt beyond the context", body(prompt=" the" * (context_tokens + 64))),
        HostileCase("unknown field", body(frobnicate_level=3)),
        HostileCase("bad JSON", body()[:-7]),
        HostileCase("wrong model", body(model=f"{model}-not-served")),
        HostileCase("negative temperature", body(temperature=-1.0)),
    ]
    if api_key is not None:
        cases += [HostileCase("no API key", body(), key="none"), HostileCase("wrong API key", body(), key="wrong")]
    return cases


@dataclass
class HostileResult:
    """What the hostile requests got: how many were sent and refused with a 4xx, and each failure by case."""

    sent: int = 0
    refused: int = 0
    failures: Counter = field(default_factory=Counter)  # "case: what came back" -> count

    @property
    def failed(self) -> int:
        """Requests that did not get a 4xx."""
        return self.sent - self.refused

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"sent": self.sent, "refused_4xx": self.refused, "failed": self.failed,
                "failures": dict(self.failures)}


async def send_case(client, url: str, case: HostileCase, api_key: str | None, timeout: float) -> str | None:
    """Post ``case`` to ``url``: None when it got a 4xx, else what came back instead."""
    import httpx

    headers = {"Content-Type": "application/json"}
    key = {"right": api_key, "none": None, "wrong": f"{api_key}-wrong"}[case.key]
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with asyncio.timeout(timeout):
            reply = await client.post(url, content=case.body, headers=headers)
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except httpx.HTTPError as err:
        return type(err).__name__
    return None if 400 <= reply.status_code < 500 else f"HTTP {reply.status_code}"


async def hostile_loop(base_url: str, cases: list[HostileCase], api_key: str | None, stop: asyncio.Event,
                       result: HostileResult, timeout: float = HOSTILE_TIMEOUT, pause: float = HOSTILE_PAUSE) -> None:
    """Send ``cases`` one after another, ``pause`` s apart, until ``stop`` is set (the request in flight finishes).

    ``base_url`` ends in ``/v1``. Each request is bounded by ``timeout``.
    """
    import httpx

    url = f"{base_url}/completions"
    async with httpx.AsyncClient(timeout=timeout + 5.0) as client:
        index = 0
        while not stop.is_set():
            case = cases[index % len(cases)]
            index += 1
            failure = await send_case(client, url, case, api_key, timeout)
            result.sent += 1
            if failure is None:
                result.refused += 1
            else:
                result.failures[f"{case.name}: {failure}"] += 1
                logger.debug("hostile %s got %s", case.name, failure)
            try:
                await asyncio.wait_for(stop.wait(), pause)
            except TimeoutError:
                pass
