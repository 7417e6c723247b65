"""Activation smoothing for w8a8 weights: move activation outliers into the weights, chosen by the logits.

w8a8 rounds each token's activations to int8 with one scale per row (:mod:`kvq_export.graph.qgemm`). A few input
channels of an LLM's linears carry values tens of times larger than the rest, and the row scale follows them, so
every other channel of that row loses most of its 8 bits. SmoothQuant's remedy, exact in real arithmetic: divide
input channel ``j`` by ``s_j`` and multiply the weight's row ``j`` by it,
``s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)``, with ``max|x_j|`` measured on calibration text. The division is
folded into what produces the input, so the graph gains no op:

* q/k/v read ``input_norm(h)``: the norm's weight is divided (the keys and values the cache stores do not move);
* gate/up read ``post_attention_norm(h)``: likewise;
* down reads ``act(gate) * up``: ``up``'s output row ``j`` (and its bias) is divided.

o_proj and an untied head keep ``s = 1`` (their inputs have no free factor to fold into), and a family whose
norms or projections cannot take the fold (a norm offset, fused projections) is left as it is, with a log line.
:func:`smoothed_model` chooses ``alpha`` among :data:`ALPHAS` by the quantity w8a8 protects: the mean KL of the
next-token distributions on the calibration windows, w8a8 emulated (weights per channel, activations per row)
against the model's own float logits.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvq_export.errors import KVQError
from kvq_export.weight_blocks import CHANNEL_CODE_MAX, dequantized_channels

logger = logging.getLogger(__name__)

#: the migration strengths tried (0: no smoothing is always among the candidates)
ALPHAS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: attribute of a model whose weights were smoothed here: its record (alpha, KL per alpha)
SMOOTHED = "_kvq_smoothing"


def smoothing_record(model: Any) -> dict[str, Any] | None:
    """What :func:`smoothed_model` did to ``model`` (None: not smoothed)."""
    return getattr(model, SMOOTHED, None)


def _groups(model: Any) -> list[tuple[str, list[str], list[str]]]:
    """(name, the linear weights reading one input, the parameters that input is divided through) per input.

    A divided parameter of two dimensions is ``up``'s weight ``[out, in]``: its output rows are divided.
    """
    from kvq_export.arch import get_arch

    arch = get_arch(model.config)
    if arch.norm_offset:
        logger.info("%s: its norms multiply by (offset + w); w8a8 activations are not smoothed", arch.model_type)
        return []
    groups = []
    for layer in range(arch.num_layers):
        names = arch.layer_names(layer)
        if any(p.rows is not None for p in (names.q, names.gate, names.up)):
            logger.info("%s: fused projections; w8a8 activations are not smoothed", arch.model_type)
            return []
        if names.input_norm is None or names.post_attention_norm is None:
            logger.info("%s: a layer without input norms; w8a8 activations are not smoothed", arch.model_type)
            return []
        groups += [
            (f"{layer}.attention", [names.q.weight, names.k.weight, names.v.weight], [names.input_norm]),
            (f"{layer}.mlp", [names.gate.weight, names.up.weight], [names.post_attention_norm]),
            (f"{layer}.down", [names.down.weight], [n for n in (names.up.weight, names.up.bias) if n]),
        ]
    return groups


@contextmanager
def _input_peaks(model: Any, groups) -> Iterator[dict[str, Any]]:
    """Max |x_j| per input channel of each group's first linear, over the forward passes run inside."""
    import torch

    modules = {name: model.get_submodule(weights[0].removesuffix(".weight")) for name, weights, _ in groups}
    peaks: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach().float().abs().reshape(-1, inputs[0].shape[-1]).amax(0)
            peaks[name] = x if name not in peaks else torch.maximum(peaks[name], x)
        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in modules.items()]
    try:
        yield peaks
    finally:
        for handle in handles:
            handle.remove()


def _smooth(model: Any, groups, peaks, alpha: float) -> Any:
    """A copy of ``model`` with every group smoothed at ``alpha`` (0: the model's own weights)."""
    import torch

    copied = copy.deepcopy(model)
    if alpha == 0:
        return copied
    with torch.no_grad():
        for name, weights, divided in groups:
            params = [copied.get_parameter(w) for w in weights]
            w_peak = torch.stack([p.float().abs().amax(0) for p in params]).amax(0).clamp_min(1e-5)
            s = (peaks[name].clamp_min(1e-5) ** alpha / w_peak ** (1 - alpha)).clamp(1e-2, 1e2)
            for param in params:
                param.mul_(s.to(param.dtype))
            for param in map(copied.get_parameter, divided):
                param.div_((s[:, None] if param.dim() == 2 else s).to(param.dtype))
    return copied


@contextmanager
def w8a8_emulated(model: Any) -> Iterator[None]:
    """Run ``model``'s linears as w8a8 computes them: weights per output channel, activations per row, int8."""
    import torch

    tied = model.get_output_embeddings() if model.config.tie_word_embeddings else None  # int8 blocks: near exact
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not tied]
    saved = [m.weight.data for m in linears]

    def round_rows(module, inputs):
        x = inputs[0]
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / CHANNEL_CODE_MAX
        return ((x / scale).round() * scale,)

    for m in linears:
        weight = m.weight.detach().float().numpy()
        m.weight.data = torch.from_numpy(dequantized_channels(weight.T).T.copy()).to(m.weight.dtype)
    handles = [m.register_forward_pre_hook(round_rows) for m in linears]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for m, weight in zip(linears, saved, strict=True):
            m.weight.data = weight


def _log_probs(model: Any, windows: Sequence[Sequence[int]]) -> list[Any]:
    import torch

    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([list(w)])).logits[0].float(), -1) for w in windows]


def _mean_kl(reference: Sequence[Any], got: Sequence[Any]) -> float:
    total = sum(float((ref.exp() * (ref - out)).sum()) for ref, out in zip(reference, got, strict=True))
    return total / sum(ref.shape[0] for ref in reference)


def smoothed_model(model: Any, windows: Sequence[Sequence[int]], alphas: Sequence[float] = ALPHAS, *,
                   text: dict[str, Any] | None = None) -> Any:
    """A copy of ``model`` smoothed for w8a8 at the ``alpha`` whose emulated logits are closest (see the module).

    The copy records what was done (:func:`smoothing_record`). ``windows``: calibration token ids; ``text``: where
    they came from (corpus, offset), recorded beside.
    """
    if not windows:
        raise KVQError("smoothing w8a8 activations needs calibration text: give at least one window")
    groups = _groups(model)
    with _input_peaks(model, groups) as peaks:  # the reference pass measures the inputs too
        reference = _log_probs(model, windows)
    kl = {}
    for alpha in (alphas if groups else (0.0,)):
        candidate = _smooth(model, groups, peaks, alpha)
        with w8a8_emulated(candidate):
            kl[alpha] = _mean_kl(reference, _log_probs(candidate, windows))
    best = min(kl, key=lambda a: (kl[a], a))
    chosen = _smooth(model, groups, peaks, best)
    setattr(chosen, SMOOTHED, {"alpha": best, "logit_kl": {str(a): round(v, 6) for a, v in kl.items()},
                               "tokens": sum(len(w) for w in windows), **(text or {})})
    logger.info("w8a8 smoothing: alpha %s (emulated logit KL %s)", best,
                ", ".join(f"{a}: {v:.4g}" for a, v in kl.items()))
    return chosen
