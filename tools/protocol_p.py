#!/usr/bin/env python
"""Protocol P on kvq's reference cache in PyTorch: Δppl, KL and top-1 of schemes against the fp32 model.

SmolLM2 (``--model``), ``--windows`` non-overlapping windows of ``--window-len`` corpus tokens from token
``--offset`` (0 for P itself; another offset scores held-out text; model tokenizer, no BOS), each from an
empty cache, strict decode (one token per step; the current token is stored, and quantized when the scheme
says so, before attention reads it), every token but a window's first
scored. All windows are decoded together as one batch (equal lengths, no padding), on
:func:`kvq_export.reference.hf_cache.reference_hf_cache` — the arithmetic every exported graph is tested
bit-exact against. The baseline is one full fp32 forward per window (token by token agrees within 5e-5 per
token), so only the quantized side is decoded step by step: about half the work of ``kvq validate``, without
its attention analysis or latency.

``--weights int4`` (or ``int8``) scores the model with the weights ``kvq export --weights`` computes with (ONNX
Runtime's blocks of 32 dequantized, :func:`kvq_export.calibration.weights.dequantized_model`), against a baseline
with the same weights; static scales are measured on those weights too, or on the fp32 model with
``--calib-weights fp32``.

One JSON line per scheme (and jitter seed) is appended to ``OUT`` (bits/element at 512 and 4096 tokens from
the memory model).

``--query-q8_0`` reproduces one more piece of llama.cpp's CPU arithmetic, to compare with its figures like for
like: its flash attention multiplies a quantized K cache by the query converted to the K type's dot-product
type (``q8_0`` for q4_0/q5_0/q8_0 keys: blocks of 32, fp16 ``d = amax/127``; ``q8_1`` for q4_1/q5_1, the same
values plus a block sum), in the stored (rotated) basis. With the option, every layer whose keys use the ggml
quantizer quantizes its query the same way.

``--activations-q8`` reproduces the rest of llama.cpp's arithmetic that a K/V format comparison is sensitive
to: with quantized weights (SmolLM2's GGUF holds Q4_1 linears and a Q8_0 embedding/output matrix) every matmul
first converts its input activations to the weight type's dot-product type, ``q8_1`` / ``q8_0`` -- blocks of
32 along the input dimension, fp16 ``d = amax/127``, the same rounded values (q8_1 adds a block sum). With the
option every ``nn.Linear`` input takes that round trip, in the fp32 baseline as well, and Δppl is against that
baseline, as llama.cpp's figures are against its own.

``--jitter SEEDS`` (comma-separated; ``--jitter-scale``, default 1e-6) measures how far a figure moves under
float noise alone: each scheme is scored once per seed, every new key and value multiplied by
``1 + 1e-6·N(0, 1)`` from that seed before the cache stores it -- about the size of the rounding differences
between two runners of the same arithmetic (PyTorch and an exported graph).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

import torch

from kvq_export.calibration import calibrate_static_scales, calibration_windows
from kvq_export.calibration.weights import dequantized_model
from kvq_export.corpus import load_corpus, token_windows
from kvq_export.memory import predict
from kvq_export.model_source import load_model, model_facts
from kvq_export.presets import resolve_scheme
from kvq_export.reference.codec import dequantize, quantize
from kvq_export.reference.hf_cache import reference_hf_cache
from kvq_export.request import DEFAULT_CALIBRATION, CalibrationMethod, CalibrationSpec, WeightSpec
from kvq_export.rotation import rotate_torch, rotation_matrix
from kvq_export.scheme import TensorQuant
from kvq_export.vocab import Quantizer, WeightFormat

#: the values of ggml's ``vec_dot_type`` for every quantized K type llama.cpp caches in (q8_0; q8_1 adds a sum)
Q8_0 = TensorQuant(format="int_sym", bits=8, group_size=32, quantizer="ggml")


def q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to ggml's q8 blocks of 32 along its last axis (as float32)."""
    return dequantize(quantize(x, Q8_0), Q8_0)


def quantize_queries_like_llama_cpp(model, scheme, head_dim: int) -> None:
    """Route ``model``'s attention through a q8_0 round trip of the query for ggml-quantized key layers."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    keys = [key for key, _ in scheme.streams(model.config.num_hidden_layers)]

    def attention(module, query, key, value, attention_mask, **kwargs):
        tq = keys[module.layer_idx]
        if tq.quantized and tq.quantizer == Quantizer.GGML:
            matrix = rotation_matrix(tq.rotation, head_dim)
            stored = rotate_torch(query, matrix)  # the basis the keys are stored (and dotted) in
            stored = q8_round_trip(stored)
            query = rotate_torch(stored, matrix, inverse=True).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvq_query_q8_0", attention)
    model.set_attn_implementation("kvq_query_q8_0")


def quantize_activations_like_llama_cpp(model) -> None:
    """Round every ``nn.Linear`` input of ``model`` through q8 blocks of 32 (llama.cpp's quantized matmuls)."""

    def round_trip(module, args):
        (x, *rest) = args
        return (q8_round_trip(x).to(x.dtype), *rest)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_trip)


def jitter_cache(ref, seed: int, scale: float = 1e-6) -> None:
    """Multiply every K/V entering ``ref`` (a ReferenceCache) by ``1 + scale·N(0, 1)`` from one seeded stream."""
    gen = torch.Generator().manual_seed(seed)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x * (1 + scale * torch.randn(x.shape, generator=gen, dtype=torch.float64)).to(x.dtype)

    for layer in ref.layers:
        def update(k, v, dtype=None, _inner=layer.update):
            return _inner(noisy(k), noisy(v), dtype)
        layer.update = update


def strict_decode_scores(model, ids: torch.Tensor, base: torch.Tensor, cache) -> tuple[float, float, float]:
    """Decode ``ids`` [windows, T] one token per step on ``cache``: (ppl, mean KL from ``base``, top-1 agreement).

    ``base`` holds the baseline's log-probabilities [windows, T, vocab]; every token but the first is scored.
    """
    rows, targets = torch.arange(ids.shape[0]), ids[:, 1:]
    nll, kl, top1 = [], [], []
    with torch.no_grad():
        for t in range(ids.shape[1] - 1):
            lq = model(ids[:, t:t + 1], cache=cache).logits[:, -1].float().log_softmax(-1)
            lb = base[:, t]
            nll.append(-lq[rows, targets[:, t]].double())
            kl.append((lb.exp() * (lb - lq)).sum(-1).double())
            top1.append((lq.argmax(-1) == lb.argmax(-1)).double())
    return (math.exp(float(torch.stack(nll).mean())), float(torch.stack(kl).mean()),
            float(torch.stack(top1).mean()))


def seed_list(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (argparse type of ``--jitter``)."""
    try:
        return [int(seed) for seed in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seeds {text!r}: allowed: comma-separated integers") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point (torch's thread count is restored on return, so a caller's process keeps its own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON-lines file to append results to")
    parser.add_argument("schemes", nargs="+", help="preset names or scheme .json files")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="britannica")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--offset", type=int, default=0, help="corpus token the first window starts at")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calib-method", default=str(DEFAULT_CALIBRATION.method),
                        help="static-scale schemes: absmax, percentile, attention")
    parser.add_argument("--percentile", type=float, default=DEFAULT_CALIBRATION.percentile,
                        help="for --calib-method percentile")
    parser.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIBRATION.tokens,
                        help="static-scale schemes: calibration tokens")
    parser.add_argument("--calib-offset", type=int, default=DEFAULT_CALIBRATION.offset,
                        help="static-scale schemes: corpus token the calibration text starts at (apart from P's)")
    parser.add_argument("--weights", choices=[str(f) for f in WeightFormat], default=str(WeightFormat.FP32),
                        help="the weights scored and calibrated on: int8/int4 are ONNX Runtime's blocks of 32 "
                             "(symmetric) dequantized, what `kvq export --weights` computes with; the baseline has "
                             "the same weights")
    parser.add_argument("--calib-weights", choices=("same", "fp32"), default="same",
                        help="static scales measured on the scored weights (same, as `kvq export` does) or on the "
                             "model's fp32 weights")
    parser.add_argument("--query-q8_0", action="store_true",
                        help="quantize the query to q8_0 before the key dot product in layers with ggml-quantized "
                             "keys, as llama.cpp's CPU flash attention does")
    parser.add_argument("--activations-q8", action="store_true",
                        help="round every linear layer's input through q8 blocks of 32, as llama.cpp's matmuls with "
                             "quantized weights do (the baseline too)")
    parser.add_argument("--jitter", metavar="SEEDS", type=seed_list,
                        help="comma-separated seeds: score each scheme once per seed, each new K/V multiplied by "
                             "1 + SCALE·N(0,1) from that seed (the spread float noise alone gives a figure)")
    parser.add_argument("--jitter-scale", type=float, default=1e-6, metavar="SCALE", help="for --jitter")
    args = parser.parse_args(argv)
    previous = torch.get_num_threads()
    try:
        _score(args)
    finally:
        torch.set_num_threads(previous)
    return 0


def _score(args: argparse.Namespace) -> None:
    """Score every scheme ``args`` names, appending one JSON line per scheme (and jitter seed) to ``args.out``."""
    calibration = CalibrationSpec(corpus=args.corpus, tokens=args.calib_tokens, offset=args.calib_offset,
                                  method=args.calib_method, percentile=args.percentile)

    torch.set_num_threads(args.threads)
    fp32_model, tokenizer = load_model(args.model)
    fp32_model.eval()
    weights = WeightSpec(args.weights)
    model = dequantized_model(fp32_model, weights)  # the model itself for fp32 / fp16
    calibrated_weights = None if args.calib_weights == "fp32" else weights  # calibration dequantizes them itself
    if args.activations_q8:
        quantize_activations_like_llama_cpp(model)
    facts = model_facts(model.config)
    ids = torch.tensor(token_windows(tokenizer, load_corpus(args.corpus), args.windows, args.window_len,
                                       offset=args.offset))
    with torch.no_grad():
        base = torch.stack([model(ids[w:w + 1]).logits[0].float().log_softmax(-1) for w in range(args.windows)])
    targets = ids[:, 1:]
    base_ppl = math.exp(float(-base[:, :-1].gather(-1, targets[..., None]).double().mean()))
    print(f"unquantized-cache baseline ({args.weights} weights) ppl {base_ppl:.4f} over {targets.numel()} tokens",
          flush=True)

    seeds = [None] if args.jitter is None else args.jitter
    for spec in args.schemes:
        scheme = resolve_scheme(spec)
        static = None
        if scheme.needs_calibration:  # calibrated on held-out text, as ``kvq export`` would
            calib = calibration_windows(tokenizer, calibration.corpus, calibration.tokens, offset=calibration.offset)
            static = calibrate_static_scales(fp32_model, scheme, calib, method=calibration.method,
                                             percentile=calibration.percentile, weights=calibrated_weights).to_torch()
        if args.query_q8_0:
            quantize_queries_like_llama_cpp(model, scheme, facts.head_dim)
        bits = {tokens: predict(scheme, facts, tokens).bits_per_element for tokens in (512, 4096)}
        for seed in seeds:
            start = time.time()
            cache, ref = reference_hf_cache(scheme, facts.num_layers, static)
            if seed is not None:
                jitter_cache(ref, seed, args.jitter_scale)
            ppl, kl, top1 = strict_decode_scores(model, ids, base, cache)
            result = {
                "scheme": spec, "ppl": ppl, "baseline_ppl": base_ppl, "delta_pct": 100 * (ppl / base_ppl - 1),
                "mean_kl": kl, "top1": top1,
                "bits_512": bits[512], "bits_4096": bits[4096],
                "windows": args.windows, "window_len": args.window_len, "offset": args.offset,
                "scored": int(targets.numel()), "weights": args.weights,
                **({"query": "q8_0"} if args.query_q8_0 else {}),
                **({"activations": "q8"} if args.activations_q8 else {}),
                **({"jitter": {"seed": seed, "scale": args.jitter_scale}} if seed is not None else {}),
                **({"calibration": {"method": str(calibration.method), "tokens": calibration.tokens,
                                    "offset": calibration.offset, "weights": args.weights
                                    if args.calib_weights == "same" else "fp32",
                                    **({"percentile": calibration.percentile}
                                       if calibration.method == CalibrationMethod.PERCENTILE else {})}}
                   if static is not None else {}),
                "seconds": round(time.time() - start),
            }
            print(json.dumps(result), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    sys.exit(main())
