"""Integration on the real SmolLM2-135M: export kivi-4 and fp16, generate 64 greedy tokens.

Marked slow (still run by `make test`): the first run converts the GGUF once (~25 s) into the kvq cache.
"""

from __future__ import annotations

import logging
import time

import pytest

from kvq_export.export.exporter import export_model
from kvq_export.runtime.session import KVQSession

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "In a small village at the foot of the mountains, there lived an old clockmaker who",
]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    from kvq_export.model_source import load_model

    model, tokenizer = load_model("smollm2")
    out = {}
    for scheme in ("fp16", "kivi-4"):
        start = time.perf_counter()
        directory = export_model(model, scheme, tmp_path_factory.mktemp("smollm2") / scheme, tokenizer=tokenizer)
        logger.warning("export smollm2 %s: %.1f s", scheme, time.perf_counter() - start)
        out[scheme] = KVQSession(directory)
    return out


@pytest.fixture(scope="module")
def batches(sessions):
    """Each export's 64 greedy tokens after every prompt, the prompts left-padded into one batch."""
    return {name: session.generate(PROMPTS, 64, stop_at_eos=False) for name, session in sessions.items()}


def _agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_fp16_export_reproduces_the_known_greedy_text(sessions):
    result = sessions["fp16"].generate([PROMPTS[0]], 16)[0]
    assert result.text.startswith(", the city of Nova Haven was a thriving metropolis")


def test_left_padded_batch_equals_each_prompt_alone(sessions, batches):
    for name, batch in batches.items():
        for prompt, result in zip(PROMPTS, batch):
            alone = sessions[name].generate([prompt], 64, stop_at_eos=False)[0]
            assert alone.tokens == result.tokens, (name, prompt)


def test_kivi4_vs_fp16_greedy_agreement(batches):
    base, quant = batches["fp16"], batches["kivi-4"]
    agree = [_agreement(b.tokens, q.tokens) for b, q in zip(base, quant)]
    logger.warning("kivi-4 vs fp16, tokens before first divergence (64 max): %s", agree)
    # prompts + 64 tokens stay inside kivi's 128-token recent window, so nothing is quantized yet:
    assert agree == [64, 64, 64]
    assert quant[0].cache_bytes == base[0].cache_bytes


def test_kivi4_long_context_quantizes_and_stays_close(sessions):
    from kvq_export.corpus import load_corpus, token_windows

    tok = sessions["fp16"].tokenizer
    prompt = token_windows(tok, load_corpus("britannica"), 1, 400, offset=2000)[0]
    base = sessions["fp16"].generate([prompt], 64, stop_at_eos=False)[0]
    quant = sessions["kivi-4"].generate([prompt], 64, stop_at_eos=False)[0]
    agree = _agreement(base.tokens, quant.tokens)
    logger.warning("kivi-4 vs fp16 after a 400-token prompt: %d tokens agree; cache %d vs %d bytes",
                   agree, quant.cache_bytes, base.cache_bytes)
    assert quant.cache_bytes < 0.6 * base.cache_bytes
    assert agree >= 1
