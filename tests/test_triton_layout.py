"""The kernels' host-side helpers and plain-torch references against kvq's reference cache (no triton needed).

Random data is fresh on every run; the seed is logged and named in every failure message.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from kvq_plugins import get_kernel, get_reference
from kvq_plugins.attention import prefill_attention
from kvq_plugins.cache_update import empty_stream
from kvq_plugins.layout import StreamLayout, dequantize_stream, take
from kvq_plugins.synthetic import random_layer_cache, static_metadata, widest_channels
from schedules import crossing_steps, longest_unit, longest_window
from tiny_models import fit_head_dim

from kvq_export.dtypes import DType
from kvq_export.errors import KVQError
from kvq_export.presets import PRESETS
from kvq_export.reference.cache import StreamCache
from kvq_export.reference.codec import channel_order
from kvq_export.scheme import KVQuantScheme, TensorQuant

logger = logging.getLogger(__name__)

SMALL = {  # group 4, recent 8, sinks 2/3: every boundary is crossed within a few dozen tokens
    "sinks-int4tok-int2chan": KVQuantScheme(
        key=TensorQuant(format="int", bits=4, group_size=8),
        value=TensorQuant(format="int", bits=2, axis="channel", group_size=4), residual_length=8, sink_tokens=2),
    "chan-keys-clip": KVQuantScheme(
        key=TensorQuant(format="int", bits=2, axis="channel", group_size=4, clip=0.9),
        value=TensorQuant(format="int_sym", bits=4, group_size=8, scale_dtype="fp32", clip=0.8), residual_length=8),
    "fp8-sinks": KVQuantScheme(key=TensorQuant(format="fp8_e4m3", bits=8, group_size=8),
                               value=TensorQuant(format="int_sym", bits=8), sink_tokens=3),
    "fp8-chan-fp32": KVQuantScheme(
        key=TensorQuant(format="fp8_e4m3", bits=8, axis="channel", group_size=4),
        value=TensorQuant(format="int", bits=8, group_size=8, scale_dtype="fp32"), residual_length=4, sink_tokens=1),
    "static-sym4": KVQuantScheme(
        key=TensorQuant(format="int_sym", bits=4, axis="channel", scales="static", scale_dtype="fp32"),
        value=TensorQuant(format="int", bits=8, group_size=16, scales="static"), residual_length=3),
    "int6": KVQuantScheme(key=TensorQuant(format="int", bits=6, axis="channel", group_size=4),
                          value=TensorQuant(format="int_sym", bits=6, group_size=8), residual_length=4, sink_tokens=1),
    "int3-high-channels": KVQuantScheme(
        key=TensorQuant(format="int", bits=3, axis="channel", group_size=4, high_channels=8),
        value=TensorQuant(format="int", bits=3, group_size=8, clip=0.9), residual_length=4, sink_tokens=1),
    "high-channels": KVQuantScheme(
        key=TensorQuant(format="int", bits=4, axis="channel", group_size=4, high_channels=4),
        value=TensorQuant(format="int", bits=2, axis="channel", group_size=4, high_channels=4, clip=0.9),
        residual_length=8),
    "static-high-channels": KVQuantScheme(  # the fast path's streams: zero-point keys, symmetric values
        key=TensorQuant(format="int", bits=4, axis="channel", scales="static", scale_dtype="fp32", high_channels=4),
        value=TensorQuant(format="int_sym", bits=4, axis="channel", scales="static", scale_dtype="fp32",
                          high_channels=8), residual_length=3, sink_tokens=1),
    "sym-high-channels": KVQuantScheme(
        key=TensorQuant(format="int_sym", bits=4, axis="channel", group_size=4, high_channels=4),
        value=TensorQuant(format="int_sym", bits=2, axis="channel", group_size=4, high_channels=8, clip=0.9),
        residual_length=4),
    "per-stream-windows": KVQuantScheme(  # values keep their own window; keys none
        key=TensorQuant(format="int", bits=4, axis="channel", group_size=4),
        value=TensorQuant(format="int", bits=3, group_size=8, clip=0.9, residual_length=5), sink_tokens=1),
    "fp16-keys": KVQuantScheme(key=TensorQuant.fp16(),
                               value=TensorQuant(format="int", bits=4, axis="channel", group_size=4),
                               residual_length=4),
}


#: Every preset the kernels see as such. A rotated preset reaches the kernels as its unrotated twin in the stored
#: basis (the graph rotates q/k and folds the value rotation around the plugin), so its kernel case is that twin's;
#: tests/test_rotation.py runs the kernels on rotated caches end to end.
#: The kernel cases here use head_dim 32, so a preset with token groups of 64 runs as its groups-of-32 twin.
ALL = {**{name: fit_head_dim(scheme, 32) for name, (scheme, _) in PRESETS.items()
          if scheme.key.rotation == "none" and scheme.value.rotation == "none"}, **SMALL}


def seeded() -> tuple[int, torch.Generator]:
    """A fresh seed (logged) and a generator seeded with it."""
    seed = random.SystemRandom().randrange(2**31)
    logger.info("random seed %d", seed)
    return seed, torch.Generator().manual_seed(seed)


def row_lengths(scheme: KVQuantScheme, rng: random.Random, rows: int = 3) -> list[int]:
    """Row lengths ending mid-group (past the window), inside the recent window, and one more."""
    unit = longest_unit(scheme)
    window = scheme.sink_tokens + longest_window(scheme)
    mid = window + unit * rng.randint(1, 2) + (rng.randint(1, unit - 1) if unit > 1 else rng.randint(0, 5))
    inside = rng.randint(1, window) if window else rng.randint(1, 9)
    out = [mid, inside, rng.randint(1, mid + unit)]
    return out[:rows]


def float64_attention(q: torch.Tensor, case, scale: float, window=None) -> torch.Tensor:
    """Ground truth: attention over each row's ``LayerCache.dequantized()``, in float64."""
    batch, heads, t, dim = q.shape
    out = torch.zeros(batch, heads, t, dim, dtype=torch.float64)
    for row, cache in enumerate(case.rows):
        n = int(case.seq_lengths[row])
        if n == 0:
            continue
        k = cache.key.dequantized().double()[0]
        v = cache.value.dequantized().double()[0]
        g = heads // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        scores = q[row].double() @ k.transpose(1, 2) * scale
        qpos = (n - t + torch.arange(t)).clamp(min=0)
        allowed = torch.arange(n)[None, :] <= qpos[:, None]
        if window:
            allowed &= torch.arange(n)[None, :] > qpos[:, None] - window
        out[row] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    return float((out.double().cpu() - ref).norm() / ref.norm().clamp(min=1e-30))


@pytest.mark.parametrize("name", sorted(ALL))
def test_dequantize_stream_is_the_reference_cache(name):
    seed, gen = seeded()
    scheme = ALL[name]
    lengths = row_lengths(scheme, random.Random(seed)) + [0]
    case = random_layer_cache(scheme, lengths, kv_heads=2, head_dim=32, generator=gen)
    total = max(lengths)
    for part in ("key", "value"):
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
    case = random_layer_cache(scheme, row_lengths(scheme, random.Random(seed)), kv_heads=2, head_dim=32,
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
    case = random_layer_cache(scheme, row_lengths(scheme, random.Random(seed)), kv_heads=2, head_dim=32,
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


def check_append(scheme: KVQuantScheme, append, seed: int, gen: torch.Generator, *, heads: int = 2, dim: int = 32,
                 device: str = "cpu") -> None:
    """Drive ``append`` with a left-padded ragged schedule; compare every stored tensor with StreamCache."""
    rng = random.Random(seed)
    rows = 3
    schedule = [[rng.randint(0, 9) for _ in range(rows)],
                [rng.randint(0, crossing_steps(scheme)) for _ in range(rows)]]
    schedule += [[rng.randint(0, 3) for _ in range(rows)] for _ in range(3)] + [[1] * rows] * 2
    for part, tq in zip(("key", "value"), scheme.for_layer(0)):
        layout = StreamLayout.of(tq, scheme, dim)
        static, stored, high = None, {}, None
        if layout.static:
            static = static_metadata(tq, torch.randn(1, heads, 64, dim, generator=gen))
            high = static.pop("high_channels", None)
            stored = {k: v.to(device=device, dtype=DType.get(tq.scale_dtype).torch) for k, v in static.items()}
        if layout.high:
            if high is None:
                high = widest_channels(tq, torch.randn(1, heads, 16, dim, generator=gen))
            stored["channel_order"] = channel_order(high, dim).to(device=device, dtype=torch.int32)
        refs = [StreamCache(tq, scheme, static_scales=(static or {}).get("scales"),
                            static_zeros=(static or {}).get("zero_points"), high_channels=high) for _ in range(rows)]
        state = empty_stream(layout, rows, heads, static=stored, device=device)
        n = torch.zeros(rows, dtype=torch.int64, device=device)
        for step, counts in enumerate(schedule):
            t = max(max(counts), 1)
            x = torch.randn(rows, heads, t, dim, generator=gen) * 2
            for row, c in enumerate(counts):
                x[row, :, : t - c] = 1e4  # left padding must never reach a stored value
                refs[row].append(x[row:row + 1, :, t - c:])
            state, n = append(layout, state, n, x.to(device), torch.tensor(counts, device=device))
            for row, ref in enumerate(refs):
                assert int(n[row]) == ref.length
                for role, want in ref.tensors().items():
                    if layout.static and role in ("scales", "zero_points"):
                        continue
                    got = _bits(state[role][row].cpu())
                    length = want.shape[2]
                    where = (part, role, row, f"step={step}", f"seed={seed}")
                    assert torch.equal(got[:, got.shape[1] - length:], _bits(want[0])), where
                    assert not got[:, : got.shape[1] - length].any(), ("padding must be 0", *where)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


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
def test_kernel_benchmark_refuses_without_a_gpu():
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "bench_kernel.py"
    proc = subprocess.run([sys.executable, str(tool), "--contexts", "4096", "--batches", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and not proc.stdout
    assert "needs a CUDA GPU" in proc.stderr and "no GPU number exists" in proc.stderr
