"""Shared pieces of the ort-gqa tests: schemes, exports, and a teacher-forced run against the reference cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from state_harness import left_pad, teacher_force
from tiny_models import VOCAB, tiny_model

from kvq_export.cache_layout import buffer_codes_to_kvq
from kvq_export.calibration import HIGH_CHANNELS, Calibration, calibrate_static_scales
from kvq_export.manifest import decode_cache
from kvq_export.presets import PRESETS
from kvq_export.reference.codec import channel_levels, unpack_stream
from kvq_export.reference.hf_cache import reference_hf_cache
from kvq_export.runtime.session import KVQSession
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Part


def _hp32(name: str):
    return dataclasses.replace(PRESETS[name][0], hp_dtype="fp32", name=f"{name}/hp-fp32")


#: The presets GQA holds, and the same with fp32 high precision (the reference then quantizes the fp32 K/V,
#: exactly what GQA does, so codes must agree up to the saturation convention).
SCHEMES = {
    "fp16": PRESETS["fp16"][0],
    "ort-int8": PRESETS["ort-int8"][0],
    "ort-int4": PRESETS["ort-int4"][0],
    "ort-int4-asymk": PRESETS["ort-int4-asymk"][0],
    "fp32": _hp32("fp16"),
    "ort-int8/hp-fp32": _hp32("ort-int8"),
    "ort-int4/hp-fp32": _hp32("ort-int4"),
    "ort-int4-asymk/hp-fp32": _hp32("ort-int4-asymk"),
    # zero points on the values only: RoPE stays fused and the offset is taken from GQA's packed q|k|v
    "int8-asymv/hp-fp32": dataclasses.replace(
        PRESETS["ort-int8"][0], value=dataclasses.replace(PRESETS["ort-int8"][0].value, format="int"),
        hp_dtype="fp32", name="int8-asymv/hp-fp32"),
    # 8 channels per head at 8 bits, split over two nibbles of a node head of head_dim + 8 (RoPE in the body)
    "int4-high/hp-fp32": KVQuantScheme(
        key=TensorQuant(format="int", bits=4, axis="channel", scales="static", scale_dtype="fp32", high_channels=8),
        value=TensorQuant(format="int_sym", bits=4, axis="channel", scales="static", scale_dtype="fp32",
                          high_channels=8), hp_dtype="fp32", name="int4-high/hp-fp32"),
}
PROMPTS = {"solo": [[5, 17, 99, 3, 42, 8, 77]], "padded": [[11, 12, 13, 14, 15], [60, 61, 2, 9, 100, 4, 4, 7, 1]]}
#: decode steps after the prompt: past the tiny mistral's 48-token sliding window
STEPS = 50


def token_stream(prompts: list[list[int]], steps: int = STEPS) -> np.ndarray:
    """The teacher-forced tokens after the prompts, ``[steps, batch]`` (seeded by the batch size)."""
    return np.random.default_rng(len(prompts)).integers(0, VOCAB, (steps, len(prompts)))


def editable(static) -> dict:
    """A calibration as nested dicts a test may change (a :class:`Calibration` is read-only)."""
    return {layer: {part: dict(meta) for part, meta in parts.items()} for layer, parts in static.items()}


def calibration(arch: str, scheme, *, covering: list[list[int]] | None = None):
    """Static scales (None for schemes without static streams).

    By default measured on four random 64-token windows, so later tokens can exceed the calibrated range
    and saturate. With ``covering`` (the test's own sequences) the scales are measured on exactly the
    tokens the test runs and widened by 5%: no code saturates.
    """
    if not scheme.needs_calibration:
        return None
    if covering is None:
        rng = np.random.default_rng(3)
        windows = [list(rng.integers(0, VOCAB, 64)) for _ in range(4)]
        return calibrate_static_scales(tiny_model(arch), scheme, windows)
    static = calibrate_static_scales(tiny_model(arch), scheme, covering)
    return Calibration.of({layer: {part: _widened(meta, scheme.for_layer(layer)[0 if part == Part.KEY else 1])
                                   for part, meta in parts.items()}
                           for layer, parts in static.items()})


def _widened(meta: dict, tq) -> dict:
    """Scales 5% wider; zero points (a range's low end) moved so the range grows about its middle."""
    high = {HIGH_CHANNELS: meta[HIGH_CHANNELS]} if HIGH_CHANNELS in meta else {}
    scale = meta["scales"] * np.float32(1.05)
    if "zero_points" not in meta:
        return {"scales": scale, **high}
    levels = np.float32((1 << tq.bits) - 1)
    if high:  # each channel's own code steps
        low, top, _ = channel_levels(tq, torch.as_tensor(meta[HIGH_CHANNELS]).long(), scale.shape[-1])
        levels = (top - low).numpy()
    middle = meta["zero_points"] + meta["scales"] * levels / 2
    return {"scales": scale, "zero_points": (middle - scale * levels / 2).astype(np.float32), **high}


def sequences(prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    """Each row's whole token sequence (prompt + stream)."""
    stream = token_stream(prompts, steps)
    return [list(p) + [int(t) for t in stream[:, row]] for row, p in enumerate(prompts)]


@dataclass
class Comparison:
    """What one teacher-forced run measured (worst cases over rows, steps, layers)."""

    logits: float = 0.0  # max |Δlogits| vs the reference cache
    logits_scale: float = 0.0  # max |logits|
    codes: int = 0  # quantized codes compared
    saturated: int = 0  # GQA at -2^(b-1) where the reference clamps to -(2^(b-1) - 1)
    off_by_one: int = 0  # other codes differing by exactly 1
    worse: int = 0  # codes differing by more than 1
    hp: float = 0.0  # unquantized buffers: max |Δ| relative to the tensor's max magnitude
    decoded: float = 0.0  # manifest-only decode vs the reference's dequantized K/V, max |Δ|
    alone: list[np.ndarray] = field(default_factory=list, repr=False)


def compare(session: KVQSession, arch: str, scheme, static, prompts, *, steps: int = STEPS,
            capacity: int = 16, exact_prefill: bool = True, split: int | None = None) -> Comparison:
    """Teacher-force prompts + random tokens through ``session`` and the PyTorch reference cache.

    ``exact_prefill``: the reference's prompt attends over its exact K/V (the ort-gqa export's prefill rule);
    False: over its codes (an export with ``fast_prefill=False``). ``split``: the left-padded prompts go in two
    chunks, the columns before ``split`` and the rest (each row's piece of the prompt goes to the reference
    likewise, so no row may get one token after a past: one call decides exact or not for all its rows).
    """
    model = tiny_model(arch)
    stream = token_stream(prompts, steps)
    ids, mask = left_pad(prompts)
    cache = session.empty_cache(len(prompts), capacity=capacity)
    if split is None:
        got, cache = teacher_force(session, prompts, stream, cache)
    else:
        first, cache = session.step(ids[:, :split], mask[:, :split], cache)
        got, cache = teacher_force(session, [list(row[split:]) for row in ids], stream, cache)
        got[0] = np.concatenate([first, got[0]], axis=1)
    arrays = session.cache_arrays(cache)
    decoded = decode_cache(session.manifest, arrays, direction="past", static=static)
    out = Comparison()
    width = ids.shape[1]
    for row, prompt in enumerate(prompts):
        cache_hf, ref = reference_hf_cache(scheme, model.config.num_hidden_layers,
                                           Calibration.of(static).to_torch() if static else None,
                                           exact_prefill=exact_prefill)
        cut = None if split is None else max(split - (width - len(prompt)), 0)  # the row's tokens before split
        pieces = [prompt] if cut is None else [p for p in (prompt[:cut], prompt[cut:]) if p]
        with torch.no_grad():
            want = [np.concatenate([model(torch.tensor([p]), cache=cache_hf).logits[0].numpy() for p in pieces])]
            for token in stream[:, row]:
                want.append(model(torch.tensor([[token]]), cache=cache_hf).logits[0].numpy())
        mine = [got[0][row, width - len(prompt):]] + [g[row] for g in got[1:]]
        out.alone.append(np.concatenate(mine))
        for a, b in zip(mine, want):
            out.logits = max(out.logits, float(np.abs(a - b).max()))
            out.logits_scale = max(out.logits_scale, float(np.abs(b).max()))
        n = int(session.seq_lengths(cache)[row])
        assert n == len(prompt) + steps
        for layer, layer_cache in enumerate(ref.layers):
            for part in Part:
                stream_ref = getattr(layer_cache, part)
                stored = arrays[f"past.{layer}.{part}.buffer"][row][:, :n]
                if stream_ref.tq.quantized:
                    tq, high = stream_ref.tq, stream_ref.high_channels
                    kvq = torch.from_numpy(buffer_codes_to_kvq(tq, stored, None if high is None else high.numpy()))
                    a = unpack_stream(kvq, tq, high).numpy().astype(int)
                    b = unpack_stream(stream_ref.tensors()["codes"][0], tq, high).numpy().astype(int)
                    diff = a - b
                    sat = (a == 0) & (b == 1)
                    out.codes += a.size
                    out.saturated += int(sat.sum())
                    out.off_by_one += int(((np.abs(diff) == 1) & ~sat).sum())
                    out.worse += int((np.abs(diff) > 1).sum())
                else:
                    want_hp = stream_ref.tensors()["recent"][0].float().numpy()
                    scale = max(float(np.abs(want_hp).max()), 1e-30)
                    out.hp = max(out.hp, float(np.abs(stored.astype(np.float32) - want_hp).max()) / scale)
                k_or_v = decoded[row][layer][0 if part == Part.KEY else 1]
                want_kv = stream_ref.dequantized(basis="stored")[0].numpy()  # decode_cache's default basis
                out.decoded = max(out.decoded, float(np.abs(k_or_v - want_kv).max()))
    return out


def step_nodes(graph) -> list:
    """Each layer's GroupQueryAttention node of a decode step, in order.

    A quantized layer's is in its If's step branch, beside the prefill branch's unquantized node.
    """
    nodes = []
    for node in graph.node:
        if node.op_type == "If":
            step = next(a.g for a in node.attribute if a.name == "else_branch")
            nodes += [n for n in step.node if n.op_type == "GroupQueryAttention"]
        elif node.op_type == "GroupQueryAttention":
            nodes.append(node)
    return nodes
