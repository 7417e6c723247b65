"""What the export-vs-reference tests share: left-padded batches, teacher-forced steps, stored roles side by side."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from schedules import crossing_steps
from tiny_models import VOCAB

from kvq_export.calibration import Calibration, calibrate_static_scales
from kvq_export.manifest import decode_cache, load_static
from kvq_export.reference.hf_cache import reference_hf_cache
from kvq_export.runtime.session import KVQSession
from kvq_export.vocab import Part, Role, ScaleMode


def left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ids and mask."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return ids, mask


def teacher_force(session, prompts: list[list[int]], stream: np.ndarray, cache=None) -> tuple[list[np.ndarray], dict]:
    """Prefill the left-padded ``prompts``, then feed ``stream[step]`` ([rows] tokens) one step at a time.

    Returns every step's logits (prefill first) and the session's cache.
    """
    ids, mask = left_pad(prompts)
    logits, cache = session.step(ids, mask, cache)
    got = [logits]
    for tokens in stream:
        logits, cache = session.step(tokens[:, None], None, cache)
        got.append(logits)
    return got, cache


def teacher_forced_logits(session, tokens: list[int], prompt_len: int) -> np.ndarray:
    """One row's logits: a prefill of ``prompt_len`` tokens, then one decode step per remaining token, concatenated."""
    steps, _ = teacher_force(session, [list(tokens[:prompt_len])], np.asarray(tokens[prompt_len:])[:, None])
    return np.concatenate([logits[0] for logits in steps])


def stored_roles(arrays: dict, row: int, ref) -> Iterator[tuple[int, str, object, str, torch.Tensor, np.ndarray]]:
    """(layer, part, reference stream, role, its tensor, the export's row) for every stored role of one row.

    The reference cache holds that row alone (its tensors' row 0); the export's row is cut to the same
    right-aligned valid entries. Static metadata (model constants, not cache state) is skipped.
    """
    for layer, layer_cache in enumerate(ref.layers):
        for part in Part:
            stream = getattr(layer_cache, part)
            for role, tensor in stream.tensors().items():
                if role in (Role.SCALES, Role.ZERO_POINTS) and stream.tq.scales == ScaleMode.STATIC:
                    continue
                want = tensor[0]
                got = arrays[f"past.{layer}.{part}.{role}"][row]
                yield layer, part, stream, role, want, got[:, got.shape[1] - want.shape[1]:]


def calibrated_static(model, scheme):
    if not scheme.needs_calibration:
        return None
    rng = np.random.default_rng(3)
    windows = [list(rng.integers(0, VOCAB, 64)) for _ in range(4)]
    return calibrate_static_scales(model, scheme, windows)


def reference_run(model, scheme, static, prompt, stream):
    """Logits per call (prefill, then one per streamed token) and the final reference cache."""
    cache, ref = reference_hf_cache(scheme, model.config.num_hidden_layers,
                                    Calibration.of(static).to_torch() if static else None)
    logits = []
    with torch.no_grad():
        logits.append(model(torch.tensor([prompt]), cache=cache).logits[0].numpy())
        for token in stream:
            logits.append(model(torch.tensor([[token]]), cache=cache).logits[0].numpy())
    return logits, ref


def compare_state(arrays, row, ref, scheme, static):
    """Row's right-aligned valid entries vs the reference cache (tolerances in the module docstring)."""
    code_mismatch = code_total = 0
    for layer, part, stream, role, want, got in stored_roles(arrays, row, ref):
        if role == Role.CODES and stream.tq.is_int:
            from kvq_export.reference.codec import unpack_stream

            high = (static or {}).get(layer, {}).get(part, {}).get("high_channels")
            high = None if high is None else torch.as_tensor(high)
            a = unpack_stream(torch.from_numpy(got)[None], stream.tq, high)[0].numpy().astype(int)
            b = unpack_stream(want[None], stream.tq, high)[0].numpy().astype(int)
            assert np.abs(a - b).max(initial=0) <= 1, (layer, part)
            code_mismatch += int((a != b).sum())
            code_total += a.size
        else:
            w = (want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
            w = w.numpy()
            if got.dtype == np.uint8:  # fp8 codes: compare as values, one e4m3 step apart at most
                import ml_dtypes

                g32 = got.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                w32 = w.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                assert np.allclose(g32, w32, rtol=2**-3, atol=2**-9), (layer, part, role)
            else:
                w32 = w.astype(np.float32)
                atol = 2**-12 * float(np.abs(w32).max(initial=0))  # upstream fp32 noise, absolute
                assert np.allclose(got.astype(np.float32), w32, rtol=2**-10, atol=atol), (layer, part, role)
    assert code_mismatch <= max(1, code_total // 1000), (code_mismatch, code_total)
    return code_mismatch


#: a prompt alone, and a left-padded batch of two
REFERENCE_PROMPTS = {"solo": [[5, 17, 99, 3, 42, 8, 77]],
                     "padded": [[11, 12, 13, 14, 15], [60, 61, 2, 9, 100, 4, 4, 7, 1]]}


def check_against_reference(directory, model, scheme, prompts: list[list[int]], *, label: str,
                            units: int = 3) -> None:
    """The export against ``model`` on kvq's reference cache, teacher-forced past every flush boundary.

    ``prompts`` go through the export left-padded and through the model one at a time: logits, stored state
    and the manifest-decoded cache agree (tolerances: tests/test_export_runtime.py); a single prompt's bytes
    held equal the memory model's prediction. The decode steps flush ``units`` units out of the recent window.
    """
    session = KVQSession(directory)
    static = load_static(directory, session.manifest)
    rng = np.random.default_rng(len(prompts))
    stream = rng.integers(0, VOCAB, (crossing_steps(scheme, least_unit=4, units=units), len(prompts)))

    width = max(map(len, prompts))
    onnx_logits, cache = teacher_force(session, prompts, stream)
    arrays = session.cache_arrays(cache)
    decoded = decode_cache(session.manifest, arrays, direction="past", static=static)
    worst, scale, flipped = 0.0, 0.0, 0
    for row, prompt in enumerate(prompts):
        ref_logits, ref = reference_run(model, scheme, static, prompt, stream[:, row])
        worst = max(worst, float(np.abs(onnx_logits[0][row, width - len(prompt):] - ref_logits[0]).max()))
        for step, want in enumerate(ref_logits[1:], start=1):
            worst = max(worst, float(np.abs(onnx_logits[step][row] - want).max()))
        scale = max(scale, float(np.abs(ref_logits[-1]).max()))
        row_flips = compare_state(arrays, row, ref, scheme, static)
        flipped += row_flips
        for layer, (k, v) in enumerate(decoded[row]):  # the manifest alone decodes the cache
            # decode_cache returns the stored basis (rotated for a rotated stream), as the graph holds it; a code
            # that float noise moved by one step (counted above) moves its one element by a step, which for a
            # 4-bit channel can exceed the tolerance
            for got, part in ((k, ref[layer].key), (v, ref[layer].value)):
                want = part.dequantized(basis="stored")[0].numpy()
                off = int((~np.isclose(got, want, atol=0.05, rtol=0.05)).sum())
                assert off <= row_flips, (layer, off, row_flips)
    if not flipped:  # the graph stored exactly the reference's codes
        assert worst <= 1e-4, f"{label}: max |Δlogits| {worst:.2e}"
    else:  # float noise upstream moved a few codes by one step (bounded above): their effect, not a bug's
        assert worst <= 1e-3 * scale, f"{label}: max |Δlogits| {worst:.2e}, {flipped} codes moved"
    if len(prompts) == 1:  # measured bytes held == the memory model's prediction (static scales live in the graph)
        from kvq_export.memory import predict
        from kvq_export.model_facts import Geometry

        geo = Geometry(model.config.num_hidden_layers, model.config.num_key_value_heads, 32)
        report = predict(scheme, geo, len(prompts[0]) + len(stream))
        static_bytes = report.breakdown["scales"] + report.breakdown["zero_points"] if scheme.has_static_scales else 0
        assert session.cache_nbytes(cache) == report.total_bytes - static_bytes
