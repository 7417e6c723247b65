"""What the export-vs-reference tests share: left-padded batches, teacher-forced steps, stored roles side by side."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


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
        for part in ("key", "value"):
            stream = getattr(layer_cache, part)
            for role, tensor in stream.tensors().items():
                if role in ("scales", "zero_points") and stream.tq.scales == "static":
                    continue
                want = tensor[0]
                got = arrays[f"past.{layer}.{part}.{role}"][row]
                yield layer, part, stream, role, want, got[:, got.shape[1] - want.shape[1]:]
