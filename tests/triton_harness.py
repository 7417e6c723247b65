"""What the Triton-kernel tests share: schemes, seeded random caches, ragged schedules and float64 references.

No triton needed: the kernels' plain-torch references and host-side helpers run on any machine.
"""

from __future__ import annotations

import logging
import random

import torch
from kvq_plugins.cache_update import empty_stream
from kvq_plugins.layout import StreamLayout
from kvq_plugins.synthetic import static_metadata, widest_channels
from schedules import crossing_steps, longest_unit, longest_window
from seeds import base_seed
from tiny_models import fit_head_dim

from kvq_export.dtypes import DType
from kvq_export.presets import PRESETS
from kvq_export.reference.cache import StreamCache
from kvq_export.reference.codec import channel_order
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Role, Rotation

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
          if scheme.key.rotation == Rotation.NONE and scheme.value.rotation == Rotation.NONE}, **SMALL}


def seeded() -> tuple[int, torch.Generator]:
    """The suite's seed (``KVQ_TEST_SEED``, logged) and a generator seeded with it."""
    seed = base_seed()
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


def check_append(scheme: KVQuantScheme, append, seed: int, gen: torch.Generator, *, heads: int = 2, dim: int = 32,
                 device: str = "cpu") -> None:
    """Drive ``append`` with a left-padded ragged schedule; compare every stored tensor with StreamCache."""
    rng = random.Random(seed)
    rows = 3
    schedule = [[rng.randint(0, 9) for _ in range(rows)],
                [rng.randint(0, crossing_steps(scheme, units=2)) for _ in range(rows)]]  # up to two groups at once
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
                    if layout.static and role in (Role.SCALES, Role.ZERO_POINTS):
                        continue
                    got = _bits(state[role][row].cpu())
                    length = want.shape[2]
                    where = (part, role, row, f"step={step}", f"seed={seed}")
                    assert torch.equal(got[:, got.shape[1] - length:], _bits(want[0])), where
                    assert not got[:, : got.shape[1] - length].any(), ("padding must be 0", *where)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
