"""The newer families (Qwen3, Gemma, Gemma2, Gemma3, Phi3, OLMo2) on every flavour, against transformers.

Tiny random models (``tests/tiny_models.py``, 2 layers, O(1) activations): Gemma and Gemma3 have one KV head
and head_dim 256, Gemma2 soft-caps attention scores and logits and alternates sliding/full layers, Gemma3's
local and global layers use their own RoPE, Phi3 has fused projections and half-width RoPE, Qwen3 and Gemma3
normalize each q/k head, OLMo2 the whole q/k projections.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import NEW_ARCHS, VOCAB, tiny_model

from kvq_export.export.exporter import export
from kvq_export.presets import resolve_scheme
from kvq_export.runtime.session import KVQSession

logger = logging.getLogger(__name__)

FP32_CACHE = resolve_scheme(str(Path(__file__).resolve().parents[1] / "tools" / "schemes" / "fp32-cache.json"))
PROMPT = [5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 9]
DECODE = 8


def _teacher_forced(session: KVQSession, tokens: list[int], prompt_len: int) -> np.ndarray:
    """Logits of a prefill of ``prompt_len`` tokens, then one decode step per remaining token."""
    logits, cache = session.step(np.array([tokens[:prompt_len]]))
    steps = [logits[0]]
    for token in tokens[prompt_len:]:
        logits, cache = session.step(np.array([[token]]), None, cache)
        steps.append(logits[0])
    return np.concatenate(steps)


@pytest.mark.parametrize("flavor", ["reference", "ort-gqa"])
@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_fp32_logits_match_transformers(tmp_path, arch, flavor):
    """fp32 body + fp32 cache: a prefill and 8 decode steps equal transformers' eager logits to 1e-4."""
    model = tiny_model(arch)
    rng = np.random.default_rng(7)
    tokens = PROMPT + [int(t) for t in rng.integers(0, VOCAB, DECODE)]
    session = KVQSession(export(model, FP32_CACHE, tmp_path / f"{arch}-{flavor}", flavor=flavor))
    got = _teacher_forced(session, tokens, len(PROMPT))
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy()
    err = float(np.abs(got - want).max())
    logger.warning("%s/%s: max |logits - transformers| = %.2e (max |logit| %.2f)", arch, flavor, err,
                   float(np.abs(want).max()))
    assert got.shape == want.shape
    assert err <= 1e-4, f"{arch}/{flavor}: max |Δlogits| {err:.2e}"
