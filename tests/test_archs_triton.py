"""The Triton kernels at the geometry of Gemma/Gemma3: one KV head shared by every query head, head_dim 256.

Same checks as tests/test_triton_kernels.py (CPU interpreter without CUDA; tests/triton_kernel_harness.py
builds the kernels): fused decode attention against float64 attention over the reference cache, and
quantize-and-append bit-exact with the reference cache.
"""

from __future__ import annotations

import random
from importlib.util import find_spec

import pytest
import torch

if find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install 'kvq[triton]')", allow_module_level=True)

from kvq_plugins import get_kernel  # noqa: E402
from kvq_plugins.synthetic import random_layer_cache  # noqa: E402
from triton_harness import ALL, check_append, rel_err, row_lengths, seeded  # noqa: E402
from triton_kernel_harness import DEVICE, TOLERANCE, run_attention  # noqa: E402

from kvq_export.model_facts import Geometry  # noqa: E402

HEAD_DIM, HEADS = 256, 4  # MQA: 4 query heads on 1 KV head


@pytest.mark.parametrize("preset", ["kivi-4", "q4_0", "fp8", "ort-int8", "fp16"])
def test_decode_attention_one_kv_head_head_dim_256(preset):
    """One decode token (2 splits) and two query tokens with a sliding window, rows mid-group / in the window."""
    seed, gen = seeded()
    scheme = ALL[preset]
    lengths = row_lengths(scheme, random.Random(seed), rows=2)
    case = random_layer_cache(scheme, lengths, Geometry(1, 1, HEAD_DIM), generator=gen, device=DEVICE)
    for t, splits, window in ((1, 2, None), (2, 1, 5)):
        q = torch.randn(2, HEADS, t, HEAD_DIM, generator=gen).to(DEVICE)
        out, ref = run_attention(case, q, scale=HEAD_DIM**-0.5, window=window, num_splits=splits)
        err = rel_err(out, ref)
        assert err <= TOLERANCE, f"{preset} t={t} window={window} lengths={lengths}: {err:.2e} (seed={seed})"


@pytest.mark.parametrize("preset", ["kivi-2", "q4_1", "fp8"])
def test_append_one_kv_head_head_dim_256_is_bit_exact(preset):
    seed, gen = seeded()
    check_append(ALL[preset], get_kernel("append"), seed, gen, heads=1, dim=HEAD_DIM, device=DEVICE)
