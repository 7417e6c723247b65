"""The Triton kernels against their references: fused decode attention and quantize-and-append.

Without CUDA the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set only while this
module builds them (Triton decides at jit time) and restored right after, so no other test or
subprocess sees it. With CUDA they are compiled and the same checks run on the GPU, plus the ``gpu``
tests at real sizes. Random data is fresh on every run; the seed is logged and named in failures.
"""

from __future__ import annotations

import os
import random
from importlib.util import find_spec

import pytest
import torch

if find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install 'kvq[triton]')", allow_module_level=True)

from kvq_plugins import get_kernel, get_reference  # noqa: E402
from kvq_plugins.synthetic import random_layer_cache  # noqa: E402
from triton_harness import ALL, SMALL, check_append, float64_attention, rel_err, row_lengths, seeded  # noqa: E402
from triton_kernel_harness import (  # noqa: E402
    DEVICE,
    INTERPRET_BEFORE,
    PRESETS,
    TOLERANCE,
    gpu,
    needs_cuda,
    run_attention,
)

from kvq_export.errors import QuantizationError  # noqa: E402
from kvq_export.model_facts import Geometry  # noqa: E402


@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_attention_every_preset(preset, gqa):
    """One decode token (3 splits) and three query tokens (1 split): rows end mid-group / inside the window."""
    seed, gen = seeded()
    scheme = ALL[preset]
    lengths = row_lengths(scheme, random.Random(seed), rows=2)
    case = random_layer_cache(scheme, lengths, Geometry(1, 2, 64), generator=gen, device=DEVICE)
    for t, splits in ((1, 3), (3, 1)):
        q = torch.randn(2, 2 * gqa, t, 64, generator=gen).to(DEVICE)
        out, ref = run_attention(case, q, scale=0.125, num_splits=splits)
        err = rel_err(out, ref)
        assert err <= TOLERANCE, f"{preset} gqa={gqa} t={t} lengths={lengths}: {err:.2e} (seed={seed})"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_decode_attention_sinks_windows_and_empty_rows(name):
    """Sink regions, a sliding window, a row with no token, several splits and an fp16 query."""
    seed, gen = seeded()
    scheme = SMALL[name]
    lengths = row_lengths(scheme, random.Random(seed)) + [0]
    case = random_layer_cache(scheme, lengths, Geometry(1, 2, 32), generator=gen, device=DEVICE)
    for window, splits, dtype in ((None, 2, torch.float32), (5, 3, torch.float32), (None, 1, torch.float16)):
        q = torch.randn(4, 6, 2, 32, generator=gen).to(DEVICE, dtype)
        out, ref = run_attention(case, q, scale=32**-0.5, window=window, num_splits=splits)
        assert out.dtype == dtype
        assert not out[3].any(), "a row holding no token attends to nothing"
        err = rel_err(out, ref)
        assert err <= TOLERANCE, f"{name} window={window} {dtype}: {err:.2e} (seed={seed})"


@pytest.mark.parametrize("preset", ["q4_0", "kivi-4", "int8"])
def test_decode_attention_rotated_streams(preset):
    """Rotated keys and values: the kernel attends in the stored basis (q @ R, rows x @ R).

    Its output rotated back (@ R.T) is float64 attention in the model basis, and it matches the stored-basis
    reference.
    """
    import dataclasses

    from kvq_export.rotation import rotate_torch, rotation_matrix

    seed, gen = seeded()
    base = ALL[preset]
    scheme = dataclasses.replace(base, key=dataclasses.replace(base.key, rotation="hadamard"),
                                 value=dataclasses.replace(base.value, rotation="hadamard"))
    lengths = row_lengths(scheme, random.Random(seed), rows=2)
    case = random_layer_cache(scheme, lengths, Geometry(1, 2, 64), generator=gen, device=DEVICE)
    r = rotation_matrix("hadamard", 64)
    q = torch.randn(2, 6, 1, 64, generator=gen)
    q_stored = rotate_torch(q, r).to(DEVICE)
    out = torch.full_like(q_stored, float("nan"))
    get_kernel("decode_attention")(q_stored, case.seq_lengths, case.key, case.value, case.key_layout,
                                   case.value_layout, scale=0.125, num_splits=2, out=out)
    want = float64_attention(q, case, 0.125)  # the rows' dequantized() K/V: model basis
    err = rel_err(rotate_torch(out.cpu(), r, inverse=True).double(), want)
    assert err <= TOLERANCE, f"{preset} lengths={lengths}: {err:.2e} (seed={seed})"
    ref = get_reference("decode_attention")(q_stored, case.seq_lengths, case.key, case.value, case.key_layout,
                                            case.value_layout, scale=0.125)
    assert rel_err(out.cpu().double(), ref.cpu().double()) <= TOLERANCE, f"{preset} (seed={seed})"


@pytest.mark.parametrize("name", sorted(ALL))
def test_append_kernel_is_bit_exact(name):
    """Quantize-and-append with the Triton quantizer stores exactly what the reference cache stores."""
    seed, gen = seeded()
    check_append(ALL[name], get_kernel("append"), seed, gen, device=DEVICE)


def test_quantize_kernel_matches_its_reference():
    seed, gen = seeded()
    case = random_layer_cache(ALL["kivi-2"], [3], Geometry(1, 2, 64), generator=gen)
    x = torch.randn(3, 2, 64, 64, generator=gen) * 3
    counts = torch.tensor([64, 0, 32])
    for layout in (case.key_layout, case.value_layout):
        got = get_kernel("quantize")(x.to(DEVICE), counts, layout)
        want = get_reference("quantize")(x, counts, layout)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w), f"seed={seed}"


@pytest.mark.parametrize("preset", ["q4_0", "q4_1", "q5_0", "q8_0"])
def test_ggml_quantize_kernel_where_the_block_inverse_overflows(preset):
    # blocks of tiny subnormals: 1/d overflows, where ggml's C is undefined and kvq takes id = 0
    case = random_layer_cache(ALL[preset], [1], Geometry(1, 1, 32))
    x = torch.zeros(1, 1, 2, 32)
    x[0, 0, 0, 31] = 6e-43
    x[0, 0, 1] = 1e-45
    for layout in (case.key_layout, case.value_layout):
        got = get_kernel("quantize")(x.to(DEVICE), torch.tensor([2]), layout)
        want = get_reference("quantize")(x, torch.tensor([2]), layout)
        for g, w in zip(got, want):
            assert g is None and w is None or torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))


def test_kernels_refuse_tensors_on_the_wrong_device():
    case = random_layer_cache(ALL["int4-sym-g32"], [5], Geometry(1, 1, 32))
    other = "cuda" if DEVICE == "cpu" else "cpu"
    if other == "cuda":
        q = torch.zeros(1, 1, 1, 32).to("meta")  # any non-CPU tensor is refused before launching
    else:
        q = torch.zeros(1, 1, 1, 32)
    with pytest.raises(QuantizationError, match="tensors are on"):
        get_kernel("decode_attention")(q, case.seq_lengths, case.key, case.value, case.key_layout,
                                       case.value_layout, scale=1.0)


# ------------------------------------------------------------------------------------------ GPU, real sizes
@gpu
@needs_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_decode_attention_real_sizes(preset):
    seed, gen = seeded()
    scheme = ALL[preset]
    lengths = [4096 + 37, 1500, 8000 + 5, 129]
    case = random_layer_cache(scheme, lengths, Geometry(1, 8, 128), generator=gen, device=DEVICE)
    for t in (1, 4):
        q = torch.randn(4, 32, t, 128, generator=gen).to(DEVICE, torch.float16)
        out, ref = run_attention(case, q, scale=128**-0.5)
        err = rel_err(out, ref)
        assert err <= TOLERANCE, f"{preset} t={t}: {err:.2e} (seed={seed})"


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["kivi-4", "kivi-2", "int4-sym-g32", "fp8", "int8"])
def test_gpu_append_real_sizes(name):
    seed, gen = seeded()
    check_append(ALL[name], get_kernel("append"), seed, gen, heads=8, dim=128, device=DEVICE)


def test_interpreter_setting_does_not_leak():
    """TRITON_INTERPRET is set only around interpreted launches, never left for other tests or subprocesses."""
    assert os.environ.get("TRITON_INTERPRET") == INTERPRET_BEFORE
