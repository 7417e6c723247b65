"""Calibration's model passes: the text it reads and the K/V (and queries) it measures.

:func:`calibration_windows` cuts calibration text the same way for every command. :func:`collect_kv` runs the
model once per window and returns the post-RoPE keys and values as they enter the cache (read from a
``transformers`` ``DynamicCache``), float32 over every token; :func:`collect_attention_samples` also hooks each
attention module for the model's own post-RoPE queries (:class:`AttentionSample`), which the ``attention`` method
and the high-channel choice score against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_export.calibration.artifact import PARTS
from kvq_export.corpus import load_corpus, token_windows
from kvq_export.errors import KVQError, ModelError
from kvq_export.progress import task
from kvq_export.rotation import rotate_torch
from kvq_export.vocab import Part

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

#: decode queries per window the ``attention`` method scores (evenly spaced positions)
ATTENTION_QUERIES = 128


def calibration_windows(tokenizer: Any, corpus: str, tokens: int, *, offset: int = 0) -> list[list[int]]:
    """About ``tokens`` calibration tokens of ``corpus`` from token ``offset`` on, in whole windows of <= 1024.

    ``kvq export``, ``kvq bench`` and ``kvq plan`` cut calibration text the same way, so the same options
    give the same scales.
    """
    window = min(1024, tokens)
    return token_windows(tokenizer, load_corpus(corpus), max(1, tokens // window), window, offset=offset)



def check_windows(token_windows: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Plain lists of ints; raise for no window, an empty window or an id outside the vocabulary."""
    windows = [[int(t) for t in window] for window in token_windows]
    if not windows:
        raise KVQError("no calibration token windows given: need at least one non-empty window of token ids")
    for i, window in enumerate(windows):
        if not window:
            raise KVQError(f"calibration token window {i} is empty")
        bad = [t for t in window if not 0 <= t < vocab_size]
        if bad:
            raise KVQError(
                f"calibration token window {i} has id {bad[0]} outside the vocabulary [0, {vocab_size})"
            )
    return windows


def collect_kv(
    model: PreTrainedModel, windows: list[list[int]], needed: set[tuple[int, Part]], num_layers: int,
    advance: Callable[[], None] | None = None,
) -> dict[tuple[int, Part], torch.Tensor]:
    """Run every window through ``model``; return the needed K/V streams as float32 ``[H, tokens, D]``.

    ``advance`` is called after each window.
    """
    import torch
    from transformers.cache_utils import DynamicCache

    from kvq_export.reference.codec import check_finite  # lazy: imports torch

    device = next(model.parameters()).device
    chunks: dict[tuple[int, Part], list[torch.Tensor]] = {key: [] for key in needed}
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for window in windows:
                # A config-less DynamicCache keeps every token in every layer (no sliding-window layers).
                cache = DynamicCache()
                ids = torch.tensor([window], dtype=torch.long, device=device)
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                if len(cache.layers) != num_layers:
                    raise ModelError(
                        f"the model filled {len(cache.layers)} cache layer(s), its config says {num_layers}"
                    )
                for layer, part in needed:
                    stored = cache.layers[layer].keys if part == Part.KEY else cache.layers[layer].values
                    if stored is None or stored.dim() != 4 or stored.shape[2] != len(window):
                        got = None if stored is None else list(stored.shape)
                        raise ModelError(
                            f"layer {layer} cached {part}s of shape {got} for a window of {len(window)} "
                            "tokens; calibration needs every token in the cache"
                        )
                    x = stored[0].to(device="cpu", dtype=torch.float32)
                    check_finite(x)
                    chunks[(layer, part)].append(x)
                if advance is not None:
                    advance()
    finally:
        model.train(was_training)
    return {key: torch.cat(parts, dim=1) for key, parts in chunks.items()}


@dataclass
class AttentionSample:
    """One calibration window of one layer: sampled post-RoPE queries and every cached K/V (float32).

    ``q`` [Hq, P, D] at token positions ``positions`` [P]; ``keys``/``values`` [Hkv, T, D]; ``scaling``
    the softmax scale.
    """

    q: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    residual_norm: torch.Tensor | None = None  # [P]: |residual stream| entering the layer (for planning)
    offset: int = 0  # positions the window was shifted by (:func:`.positions.shifted`); 0: where the model ran it

    def rotated(self, matrix: np.ndarray | None) -> AttentionSample:
        """The same window in a rotated basis (q, K and V times ``matrix``).

        Scores and errors are unchanged in exact arithmetic, but a rotated stream is quantized in that basis.
        """
        if matrix is None:
            return self
        return replace(self, q=rotate_torch(self.q, matrix), keys=rotate_torch(self.keys, matrix),
                                   values=rotate_torch(self.values, matrix))

    def attention(self) -> torch.Tensor:
        """Exact causal attention weights ``[Hkv, G * P, T]`` (each kv head's query heads stacked)."""
        return self.attention_with(self.keys)

    def grouped_queries(self) -> torch.Tensor:
        """Queries by kv head ``[Hkv, G * P, D]`` (query head ``h`` reads kv head ``h // G``)."""
        hkv = self.keys.shape[0]
        hq, p, d = self.q.shape
        return self.q.reshape(hkv, (hq // hkv) * p, d)

    def scores(self, keys: torch.Tensor) -> torch.Tensor:
        """Scaled scores ``[Hkv, G * P, T]`` of the sampled queries over ``keys`` [Hkv, T, D], unmasked."""
        import torch

        return torch.bmm(self.grouped_queries(), keys.transpose(1, 2)) * self.scaling

    def attention_with(self, keys: torch.Tensor, recent: int = 0,
                       exact_scores: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention weights of the sampled queries over ``keys`` [Hkv, T, D].

        ``recent`` > 0: each query reads its ``recent`` newest keys (its own included) from the exact
        ``self.keys`` instead, as a cache with that high-precision window does. ``exact_scores``: those
        keys' :meth:`scores`, when the caller already has them.
        """
        import torch

        scores = self.scores(keys)
        if recent:
            exact = self.scores(self.keys) if exact_scores is None else exact_scores
            scores = torch.where(self.recent_mask(recent)[None], exact, scores)
        return self.softmax(scores)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Causal attention weights from :meth:`scores` (the future masked out)."""
        import torch

        return torch.softmax(scores.masked_fill(self._key_offsets()[None] > 0, float("-inf")), dim=-1)

    def recent_mask(self, recent: int) -> torch.Tensor:
        """``[G * P, T]`` bool: key ``j`` is among the ``recent`` newest tokens a query at its position holds."""
        return self._key_offsets() > -recent

    def _key_offsets(self) -> torch.Tensor:
        """``[G * P, T]``: each key's position minus its query's (> 0: the future; rows as in ``grouped_queries``)."""
        import torch

        groups = self.q.shape[0] // self.keys.shape[0]
        return torch.arange(self.keys.shape[1])[None, :] - self.positions.repeat(groups)[:, None]


def stream_samples(samples: Sequence[AttentionSample], part: Part) -> list[AttentionSample]:
    """The samples a stream is measured on: keys at every offset (:func:`.positions.shifted`), values once.

    A shift leaves the values, and the attention over them, as they were: their copies would only repeat them.
    """
    return list(samples) if part == Part.KEY else [s for s in samples if s.offset == 0]


def collect_attention_samples(
    model: PreTrainedModel, windows: list[list[int]], layers: list[int], num_layers: int
) -> dict[int, list[AttentionSample]]:
    """K/V from the cache and post-RoPE queries (hooked on each attention module) for every window.

    Queries are taken at :data:`ATTENTION_QUERIES` evenly spaced positions of each window (all of them
    when the window is shorter). RoPE is applied with the module's own ``position_embeddings`` and
    ``transformers``' Llama ``apply_rotary_pos_emb`` (the Llama family's convention).
    """
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    try:
        modules = {layer: model.model.layers[layer].self_attn for layer in layers}
    except (AttributeError, IndexError) as err:
        raise ModelError(f"the attention calibration needs a Llama-family model (model.layers[i].self_attn): {err}") \
            from None
    captured: dict[int, torch.Tensor] = {}
    residual: dict[int, torch.Tensor] = {}

    def stream_hook(layer: int):
        def run(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            residual[layer] = hidden[0].to(device="cpu", dtype=torch.float32).norm(dim=-1)
        return run

    def hook(layer: int):
        def run(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            batch, tokens, _ = hidden.shape
            q = module.q_proj(hidden).view(batch, tokens, -1, module.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            captured[layer] = q[0].to(device="cpu", dtype=torch.float32)
        return run

    handles = [modules[layer].register_forward_pre_hook(hook(layer), with_kwargs=True) for layer in layers]
    handles += [model.model.layers[layer].register_forward_pre_hook(stream_hook(layer), with_kwargs=True)
                for layer in layers]
    samples: dict[int, list[AttentionSample]] = {layer: [] for layer in layers}
    try:
        with task("attention samples: forward passes", total=len(windows)) as advance:
            for window in windows:
                captured.clear()
                kv = collect_kv(model, [window], {(layer, part) for layer in layers for part in PARTS}, num_layers)
                n = len(window)
                positions = torch.unique(torch.linspace(0, n - 1, min(n, ATTENTION_QUERIES)).round().long())
                for layer in layers:
                    module = modules[layer]
                    scaling = float(getattr(module, "scaling", module.head_dim ** -0.5))
                    samples[layer].append(AttentionSample(captured[layer][:, positions].contiguous(), positions,
                                                          kv[(layer, Part.KEY)], kv[(layer, Part.VALUE)], scaling,
                                                          residual[layer][positions].contiguous()))
                advance()
    finally:
        for handle in handles:
            handle.remove()
    return samples

