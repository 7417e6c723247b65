"""The demo behind ``make demo``.

Export the built-in model twice (fp16 and a quantized scheme), generate from one prompt with both, and
compare text, agreement and cache memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvq_export.presets import resolve_scheme

logger = logging.getLogger(__name__)

#: Long enough (about 130 tokens) that with the generated tokens the cache outgrows kivi's recent window.
DEMO_PROMPT = (
    "The lighthouse keeper had lived alone on the island for eleven years. Every evening he climbed the "
    "one hundred and twelve steps of the tower, cleaned the great lens, trimmed the wick and wrote the "
    "weather into a leather book that nobody ever read. Ships passed far out at sea, small as insects, and "
    "none of them ever stopped. Then one autumn morning, after a storm that had lasted three days and three "
    "nights, he walked down to the beach and found a wooden boat lying on its side in the sand. There was "
    "nobody in it, but under the seat he found a sealed glass bottle with a letter inside. He broke the "
    "seal, unfolded the paper and began to read."
)


@dataclass(frozen=True)
class DemoRow:
    """One scheme's generation."""

    scheme: str
    text: str
    tokens: list[int]
    agree_with_baseline: int  # leading tokens identical to the fp16 run
    cache_bytes: int
    prompt_tokens: int


def baseline_dir(model_spec: str, scheme_spec: str, workdir: Path) -> Path:
    """Where the demo and validation keep ``model_spec`` exported with ``scheme_spec``."""
    scheme = resolve_scheme(scheme_spec)
    return workdir / f"{Path(model_spec).name}-{scheme.name or 'custom'}"


def ensure_export(model_spec: str, scheme_spec: str, workdir: Path) -> Path:
    """``workdir/<model>-<scheme>``, reused while current (see :func:`kvq_export.export.exporter.ensure_export`)."""
    from kvq_export.export.exporter import ensure_export as ensure

    return ensure(model_spec, scheme_spec, baseline_dir(model_spec, scheme_spec, workdir))


def run_demo(model_spec: str, scheme_spec: str, prompt: str, max_new_tokens: int,
             workdir: str | os.PathLike[str] | None = None) -> list[DemoRow]:
    """Generate greedily from ``prompt`` with the fp16 baseline and ``scheme_spec``."""
    from kvq_export.model_source import cache_root
    from kvq_export.runtime.session import KVQSession

    root = Path(workdir) if workdir else cache_root() / "exports"
    rows: list[DemoRow] = []
    baseline: list[int] | None = None
    for spec in ("fp16", scheme_spec):
        session = KVQSession(ensure_export(model_spec, spec, root))
        result = session.generate([prompt], max_new_tokens)[0]
        if baseline is None:
            baseline = result.tokens
        agree = next((i for i, (a, b) in enumerate(zip(baseline, result.tokens)) if a != b),
                     min(len(baseline), len(result.tokens)))
        rows.append(DemoRow(session.manifest.scheme.name or spec, result.text or "", result.tokens, agree,
                            result.cache_bytes, len(result.prompt_tokens)))
    return rows
