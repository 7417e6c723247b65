"""Decode-attention benchmark on a GPU: the fused quantized-cache kernel vs torch SDPA on an fp16 cache.

No GPU number exists for this kernel yet: it has only run in Triton's CPU interpreter (correctness) and
been compiled for sm_80/sm_90 on CPU. Run this on a CUDA GPU and commit the table with its date and device.

For every scheme x context (4k-128k by default) x batch (1-32 by default), one layer, one query token:

* latency of :func:`kvq_plugins.attention.decode_attention` over the stored cache (codes + scales +
  zero points + sinks + recent window, built by kvq's reference cache) and of
  ``torch.nn.functional.scaled_dot_product_attention`` over an fp16 K/V cache of the same length (GQA);
  CUDA-event timing after warm-up, median and p10/p90 over the iterations;
* bytes each one reads (stored cache + q + output; fp16 K/V + q + output), checked against the memory
  model's prediction (:func:`kvq_export.memory.predict`);
* achieved bandwidth = bytes / median time, as a fraction of the device's measured copy bandwidth
  (device-to-device ``copy_`` of 1 GiB, read + write bytes / time);
* peak memory of each call.

Usage::

    python tools/bench_kernel.py                                 # kivi-4, 4k..128k, batch 1..32
    python tools/bench_kernel.py --scheme q4_0 --scheme fp8 --contexts 4096,32768 --batches 1,8 --json out.json

Without a CUDA GPU it refuses (exit code 2) instead of printing numbers that would mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

from kvq_plugins.attention import decode_attention
from kvq_plugins.synthetic import random_layer_cache

from kvq_export.memory import predict
from kvq_export.model_facts import Geometry
from kvq_export.presets import resolve_scheme
from kvq_export.validate.report import write_json
from kvq_export.vocab import Role

REFUSAL = ("bench_kernel needs a CUDA GPU (torch.cuda.is_available() is False here); no GPU number exists for "
           "this kernel yet. Correctness on CPU is covered by tests/test_triton_kernels.py (Triton interpreter).")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def time_cuda(fn, *, warmup: int, iters: int) -> dict[str, float]:
    """Median / p10 / p90 milliseconds of ``fn()`` with CUDA events, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "p10_ms": _percentile(times, 0.1), "p90_ms": _percentile(times, 0.9)}


def copy_bandwidth(gib: float = 1.0, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write), the reference for achieved bandwidth."""
    import torch

    src = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    timing = time_cuda(lambda: dst.copy_(src), warmup=3, iters=iters)
    return 2 * src.numel() / (timing["median_ms"] / 1e3)


def build_case(scheme, context: int, batch: int, kv_heads: int, head_dim: int):
    """A batch of identical rows of ``context`` random tokens stored by kvq's reference cache (on the GPU)."""
    import torch

    one = random_layer_cache(scheme, [context], Geometry(1, kv_heads, head_dim), device="cuda")

    def widen(tensors, layout):
        out = {}
        for role, t in tensors.items():
            static = layout.static and role in (Role.SCALES, Role.ZERO_POINTS)
            out[role] = t if static else t.repeat(batch, 1, 1, 1).contiguous()
        return out

    key, value = widen(one.key, one.key_layout), widen(one.value, one.value_layout)
    lengths = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    return one.key_layout, one.value_layout, key, value, lengths


def _measure(fn, args) -> dict[str, float]:
    """Timing and peak memory above the current allocation for ``fn``."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    timing = time_cuda(fn, warmup=args.warmup, iters=args.iters)
    return {**timing, "peak_bytes": torch.cuda.max_memory_allocated() - base}


def _fused(scheme, context: int, batch: int, q, args) -> tuple[dict[str, float], int]:
    """(timing, stored bytes) of the fused kernel over a freshly built quantized cache."""
    import torch

    key_layout, value_layout, key, value, lengths = build_case(scheme, context, batch, args.kv_heads, args.head_dim)
    out = torch.empty_like(q)
    stored = sum(t.numel() * t.element_size() for s in (key, value) for t in s.values())

    def run():
        decode_attention(q, lengths, key, value, key_layout, value_layout, scale=args.head_dim ** -0.5, out=out)

    return _measure(run, args), stored


def _sdpa(context: int, batch: int, q, args) -> tuple[dict[str, float], int]:
    """(timing, K+V bytes) of torch SDPA over an fp16 cache of the same length (GQA)."""
    import torch

    k = torch.randn(batch, args.kv_heads, context, args.head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=args.head_dim ** -0.5, enable_gqa=True)

    return _measure(run, args), 2 * k.numel() * k.element_size()


def bench_one(scheme, context: int, batch: int, args, copy_bw: float) -> dict:
    """One table row."""
    import torch

    q = torch.randn(batch, args.heads, 1, args.head_dim, device="cuda", dtype=torch.float16)
    io = 2 * q.numel() * q.element_size()  # q read + output written
    fused, stored = _fused(scheme, context, batch, q, args)
    sdpa, fp16_bytes = _sdpa(context, batch, q, args)
    predicted = predict(scheme, Geometry(1, args.kv_heads, args.head_dim), context, batch).total_bytes
    for timing, moved in ((fused, stored + io), (sdpa, fp16_bytes + io)):
        bandwidth = moved / (timing["median_ms"] / 1e3)
        timing.update(bytes=moved, GB_per_s=bandwidth / 1e9, copy_fraction=bandwidth / copy_bw)
    return {"scheme": scheme.name, "context": context, "batch": batch, "stored_bytes": stored,
            "predicted_bytes": predicted, "fp16_bytes": fp16_bytes, "fused": fused, "sdpa_fp16": sdpa,
            "speedup": sdpa["median_ms"] / fused["median_ms"]}


def main(argv: list[str] | None = None) -> int:
    """Parse options, refuse without a GPU, run the grid, print the table (and JSON if asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", action="append", help="preset or scheme JSON (repeatable; default kivi-4)")
    parser.add_argument("--contexts", default="4096,16384,32768,65536,131072")
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--max-gib", type=float, default=60.0, help="skip cases whose fp16 cache exceeds this")
    parser.add_argument("--json", dest="json_path", help="also write the rows as JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(REFUSAL, file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench_kernel: unset TRITON_INTERPRET (interpreted kernels would be timed)", file=sys.stderr)
        return 2

    schemes = [resolve_scheme(s) for s in (args.scheme or ["kivi-4"])]
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(f"# kvq decode attention, {datetime.date.today()} on {device}; torch {torch.__version__}; "
          f"measured copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"# heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, one query token, one layer")
    header = f"{'scheme':>8} {'context':>7} {'batch':>5} | {'fused µs':>9} {'GB/s':>6} {'%copy':>6} | " \
             f"{'sdpa µs':>9} {'GB/s':>6} {'%copy':>6} | {'speedup':>7} {'bytes/pred':>10}"
    print(header)
    rows = []
    for scheme in schemes:
        for context in contexts:
            for batch in batches:
                if 4 * batch * args.kv_heads * context * args.head_dim / (1 << 30) > args.max_gib:
                    continue
                row = bench_one(scheme, context, batch, args, copy_bw)
                rows.append(row)
                f, s = row["fused"], row["sdpa_fp16"]
                print(f"{row['scheme']:>8} {context:>7} {batch:>5} | {1e3 * f['median_ms']:>9.1f} "
                      f"{f['GB_per_s']:>6.0f} {100 * f['copy_fraction']:>5.1f}% | {1e3 * s['median_ms']:>9.1f} "
                      f"{s['GB_per_s']:>6.0f} {100 * s['copy_fraction']:>5.1f}% | {row['speedup']:>6.2f}x "
                      f"{row['stored_bytes'] / row['predicted_bytes']:>10.3f}", flush=True)
                torch.cuda.empty_cache()
    if args.json_path:
        write_json({"date": str(datetime.date.today()), "device": device, "copy_GB_per_s": copy_bw / 1e9,
                    "rows": rows}, args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
