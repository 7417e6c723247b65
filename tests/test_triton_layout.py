"""The kernels' host-side helpers and plain-torch references against kvq's reference cache (no triton needed).

Random data comes from the suite's seed (``KVQ_TEST_SEED``, default 0), named in every failure message.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvq_plugins import get_kernel, get_reference
from kvq_plugins.attention import prefill_attention
from kvq_plugins.layout import dequantize_stream, take
from kvq_plugins.synthetic import random_layer_cache
from triton_harness import ALL, check_append, float64_attention, rel_err, row_lengths, seeded

from kvq_export.errors import KVQError
from kvq_export.model_facts import Geometry
from kvq_export.vocab import Part


@pytest.mark.parametrize("name", sorted(ALL))
def test_dequantize_stream_is_the_reference_cache(name):
    seed, gen = seeded()
    scheme = ALL[name]
    lengths = row_lengths(scheme, random.Random(seed)) + [0]
    case = random_layer_cache(scheme, lengths, Geometry(1, 2, 32), generator=gen)
    total = max(lengths)
    for part in Part:
        got = dequantize_stream(getattr(case, f"{part}_layout"), getattr(case, part), case.seq_lengths, total)
        for row, cache in enumerate(case.rows):
            n = lengths[row]
            want = getattr(cache, part).dequantized(basis="stored")[0] if n else torch.zeros(2, 0, 32)
            assert torch.equal(got[row, :, total - n:], want), (name, part, row, f"seed={seed}")
            assert not got[row, :, : total - n].any(), "left padding must be 0"


@pytest.mark.parametrize("name", sorted(ALL))
def test_registered_attention_reference_matches_the_cache(name):
    seed, gen = seeded()
    scheme = ALL[name]
    case = random_layer_cache(scheme, row_lengths(scheme, random.Random(seed)), Geometry(1, 2, 32),
                              generator=gen)
    q = torch.randn(3, 6, 3, 32, generator=gen)
    want = float64_attention(q, case, 32**-0.5, window=5)
    got = get_reference("decode_attention")(q, case.seq_lengths, case.key, case.value, case.key_layout,
                                            case.value_layout, scale=32**-0.5, window=5)
    assert rel_err(got, want) < 1e-12, f"seed={seed}"


@pytest.mark.parametrize("name", ["kivi-4", "int4-sym-g32", "fp8", "static-sym4", "sinks-int4tok-int2chan"])
def test_prefill_path_matches_the_reference(name):
    seed, gen = seeded()
    scheme = ALL[name]
    case = random_layer_cache(scheme, row_lengths(scheme, random.Random(seed)), Geometry(1, 2, 32),
                              generator=gen)
    q = torch.randn(3, 4, 20, 32, generator=gen)
    want = float64_attention(q, case, 0.2)
    got = prefill_attention(q, case.seq_lengths, case.key, case.value, case.key_layout, case.value_layout, scale=0.2)
    assert rel_err(got, want) < 2e-5, f"seed={seed}"


@pytest.mark.parametrize("name", sorted(ALL))
def test_append_reference_is_bit_exact(name):
    """The host-side region moves + codec quantizer give exactly the reference cache's stored tensors."""
    seed, gen = seeded()
    check_append(ALL[name], get_reference("append"), seed, gen)


def test_take_picks_right_aligned_runs():
    a = torch.arange(2 * 1 * 4 * 1, dtype=torch.float32).reshape(2, 1, 4, 1) + 1  # rows hold 3 and 1 valid
    b = torch.arange(2 * 1 * 2 * 1, dtype=torch.float32).reshape(2, 1, 2, 1) + 100  # rows hold 2 and 0
    out = take([(a, torch.tensor([3, 1])), (b, torch.tensor([2, 0]))], torch.tensor([1, 0]), torch.tensor([3, 1]), 4)
    assert out[0, 0, :, 0].tolist() == [0, 3, 4, 100]
    assert out[1, 0, :, 0].tolist() == [0, 0, 0, 8]


def test_registry_names_its_ops():
    with pytest.raises(KVQError, match="allowed: append, decode_attention, quantize"):
        get_kernel("nope")
    with pytest.raises(KVQError, match="unknown reference op"):
        get_reference("nope")
    assert callable(get_reference("quantize"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the benchmark would run")
def test_kernel_benchmark_refuses_without_a_gpu(capsys):
    from tool_harness import run_tool

    assert run_tool("bench_kernel", "--contexts", "4096", "--batches", "1") == 2
    out, err = capsys.readouterr()
    assert not out and "needs a CUDA GPU" in err and "no GPU number exists" in err
