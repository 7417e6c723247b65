"""How much quantizing a layer's keys and/or values hurts: ``kvq plan``'s ``attention`` and ``kl`` metrics.

``attention`` carries each candidate's attention-output error through the layer's ``o_proj`` into the residual
stream (:func:`attention_damages`, one model pass in all); ``kl`` runs the model once per layer, stream and
candidate with only that stream quantized (:func:`measure_kl`). See :mod:`kvq_export.plan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_export.calibration.artifact import Calibration
from kvq_export.plan.candidates import CandidateSet
from kvq_export.progress import task
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Part

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from kvq_export.calibration.passes import AttentionSample


@dataclass(frozen=True)
class Damage:
    """Measured damage of one (layer, key, value) choice; ``None`` streams are left unquantized."""

    layer: int
    key: TensorQuant | None
    value: TensorQuant | None
    damage: float
    key_induced: float = 0.0
    value_induced: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"layer": self.layer, "key": self.key.describe() if self.key else None,
                "value": self.value.describe() if self.value else None, "damage": self.damage,
                "key_induced": self.key_induced, "value_induced": self.value_induced}


def _layer_static(static_by: Mapping, layer: int, key: TensorQuant | None, value: TensorQuant | None) -> dict:
    out: dict[str, Any] = {}
    for part, tq in zip(Part, (key, value)):
        if tq is not None and tq in static_by:
            out[part] = static_by[tq][layer][part]
    return out


def reference_dequant(x: torch.Tensor, tq: TensorQuant, meta: Mapping | None, sink_tokens: int = 0) -> torch.Tensor:
    """What attention reads for ``x`` [H, T, D] after kvq's reference cache stores it (no recent window).

    The first ``sink_tokens`` tokens stay in high precision.
    """
    import torch

    from kvq_export.reference.cache import StreamCache  # lazy: imports torch

    metadata = {k: torch.as_tensor(np.asarray(v)) for k, v in (meta or {}).items()}
    stream = StreamCache(tq, KVQuantScheme(key=tq, value=tq, hp_dtype="fp32", sink_tokens=sink_tokens),
                         static_scales=metadata.get("scales"), static_zeros=metadata.get("zero_points"),
                         high_channels=metadata.get("high_channels"))
    stream.append(x[None])
    return stream.dequantized(torch.float32)[0]


def _older(weights: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
    """Attention weights on the tokens older than each query's exact window (which reads values exactly)."""
    return weights if window is None else weights.masked_fill(window, 0.0)


def attention_damage(
    samples: Sequence[AttentionSample], o_proj: torch.Tensor, key: TensorQuant | None, value: TensorQuant | None,
    meta: Mapping[str, Mapping] | None = None, sink_tokens: int = 0,
) -> tuple[float, float, float]:
    """(residual damage, key-induced, value-induced) of quantizing one layer's key and/or value.

    ``o_proj`` is the layer's output projection weight ``[hidden, Hq * D]``. The damage is the mean over
    sampled queries of ``|o_proj(ô - o)|² / |h|²`` (``h`` the residual stream entering the layer); the
    key-/value-induced errors are ``|(A' - A) V| / |o|`` and ``|A (V̂ - V)| / |o|`` averaged over query
    heads and queries (the quantities ``kvq validate`` reports). The first ``sink_tokens`` tokens stay exact,
    and so do the newest ``residual_length`` tokens of a stream that sets one, as seen from each query.
    """
    return attention_damages(samples, o_proj, [(key, value, meta or {})], sink_tokens)[0]


#: attention weights ([configs, Hkv, G * P, T] elements) one batch of configurations may hold at once
BATCH_ELEMENTS = 1 << 23


def attention_damages(
    samples: Sequence[AttentionSample], o_proj: torch.Tensor,
    configs: Sequence[tuple[TensorQuant | None, TensorQuant | None, Mapping[str, Mapping]]], sink_tokens: int = 0,
) -> list[tuple[float, float, float]]:
    """:func:`attention_damage` of several (key, value, metadata) configurations of one layer.

    The exact attention of each sample is computed once and shared by every configuration; each distinct
    (stream, metadata) is stored and read back once per sample, and configurations are measured in batches
    (one matmul / softmax for a batch, the same per-configuration arithmetic).
    """
    import torch

    totals = np.zeros((len(configs), 3))
    with torch.inference_mode():
        for sample in samples:
            exact = _ExactAttention(sample)
            read = _StoredReads(sample, sink_tokens)
            batch = max(1, BATCH_ELEMENTS // max(1, exact.a.numel()))
            for start in range(0, len(configs), batch):
                chunk = configs[start:start + batch]
                totals[start:start + len(chunk)] += _batch_damages(exact, read, o_proj, chunk)
    return [tuple(float(x) for x in row / len(samples)) for row in totals]


class _ExactAttention:
    """One sample's unquantized attention: scores, weights ``a``, output ``o`` and the norms damage divides by."""

    def __init__(self, sample: AttentionSample) -> None:
        import torch

        self.sample = sample
        self.scores = sample.scores(sample.keys)
        self.a = sample.softmax(self.scores)
        self.o = torch.bmm(self.a, sample.values)
        self.norm_o = self.o.norm(dim=-1).clamp_min(1e-30)
        p = sample.q.shape[1]
        self.residual = sample.residual_norm.clamp_min(1e-30) if sample.residual_norm is not None else torch.ones(p)


class _StoredReads:
    """What attention reads for each (part, stream, metadata) of one sample, stored and read back once."""

    def __init__(self, sample: AttentionSample, sink_tokens: int) -> None:
        self.sample, self.sink_tokens = sample, sink_tokens
        self.cache: dict[tuple[Part, TensorQuant, int], torch.Tensor] = {}
        self.held: list[Mapping | None] = []  # keeps each metadata object (and so its id) alive

    def __call__(self, part: Part, tq: TensorQuant, meta: Mapping | None) -> torch.Tensor:
        key = (part, tq, id(meta))
        if key not in self.cache:
            x = self.sample.keys if part == Part.KEY else self.sample.values
            self.cache[key] = reference_dequant(x, tq, meta, self.sink_tokens)
            self.held.append(meta)
        return self.cache[key]


def _batch_damages(exact: _ExactAttention, read: _StoredReads, o_proj: torch.Tensor,
                   configs: Sequence[tuple[TensorQuant | None, TensorQuant | None, Mapping[str, Mapping]]],
                   ) -> np.ndarray:
    """``[len(configs), 3]``: one sample's (damage, key-induced, value-induced) of each configuration."""
    import torch

    sample, a, v = exact.sample, exact.a, exact.sample.values
    out = np.zeros((len(configs), 3))
    err = exact.o.new_zeros((len(configs), *exact.o.shape))  # [C, Hkv, G*P, D]: ô - o
    weights = {}  # config -> its attention weights where its key is quantized (else the exact ones)
    keyed = [i for i, (key, _, _) in enumerate(configs) if key is not None]
    if keyed:
        k_hat = torch.stack([read(Part.KEY, configs[i][0], configs[i][2].get(Part.KEY)) for i in keyed])
        scores = torch.matmul(sample.grouped_queries(), k_hat.transpose(-1, -2)) * sample.scaling
        for row, i in enumerate(keyed):
            recent = configs[i][0].residual_length or 0
            if recent:  # the newest keys of each query are read exactly
                scores[row] = torch.where(sample.recent_mask(recent)[None], exact.scores, scores[row])
        a_hat = sample.softmax(scores)
        err[keyed] = torch.matmul(a_hat, v) - exact.o
        key_induced = err[keyed].norm(dim=-1) / exact.norm_o
        for row, i in enumerate(keyed):
            weights[i] = a_hat[row]
            out[i, 1] = float(key_induced[row].mean())
    # value errors, read through each configuration's weights on the tokens older than its value window
    valued = [i for i, (_, value, _) in enumerate(configs) if value is not None]
    if valued:
        v_err = torch.stack([read(Part.VALUE, configs[i][1], configs[i][2].get(Part.VALUE)) - v for i in valued])
        windows = [sample.recent_mask(configs[i][1].residual_length)[None] if configs[i][1].residual_length
                   else None for i in valued]
        induced = torch.matmul(torch.stack([_older(a, w) for w in windows]), v_err)  # A (V̂ - V) on older tokens
        through = induced.clone()  # the same through each configuration's own weights (the exact ones: as above)
        rows = [row for row, i in enumerate(valued) if i in weights]
        if rows:
            through[rows] = torch.matmul(torch.stack([_older(weights[valued[row]], windows[row]) for row in rows]),
                                       v_err[rows])
        err[valued] += through
        value_induced = induced.norm(dim=-1) / exact.norm_o
        for row, i in enumerate(valued):
            out[i, 2] = float(value_induced[row].mean())
    hq, p, d = sample.q.shape
    per_head = err.reshape(len(configs), hq, p, d).permute(0, 2, 1, 3).reshape(len(configs), p, hq * d)
    moved = torch.matmul(per_head, o_proj.T)  # [C, P, hidden]
    energy = moved.pow(2).sum(dim=-1) / exact.residual.pow(2)
    for i in range(len(configs)):
        out[i, 0] = float(energy[i].mean())
    return out


def o_proj_weight(model: PreTrainedModel, layer: int) -> torch.Tensor:
    """The layer's attention output projection ``[hidden, Hq * D]`` as float32 (Llama-family layout)."""
    import torch

    return model.model.layers[layer].self_attn.o_proj.weight.detach().to(device="cpu", dtype=torch.float32)


def measure_attention(
    model: PreTrainedModel, samples: Mapping[int, Sequence[AttentionSample]], cset: CandidateSet,
    static_by: Mapping, num_layers: int, sink_tokens: int = 0,
) -> list[Damage]:
    """Damage of every candidate of every layer by the ``attention`` metric."""
    out = []
    with task("plan: measuring attention damage", total=num_layers) as advance:
        for layer in range(num_layers):
            configs = [(key, value, _layer_static(static_by, layer, key, value))
                       for key, value in _measured_configs(cset)]
            damages = attention_damages(samples[layer], o_proj_weight(model, layer), configs, sink_tokens)
            out += [Damage(layer, key, value, *damage) for (key, value, _), damage in zip(configs, damages)]
            advance()
    return out


def _measured_configs(cset: CandidateSet) -> list[tuple[TensorQuant | None, TensorQuant | None]]:
    """Tied: each pair at once; untied: each key alone, then each value alone (damages add up)."""
    if cset.tied:
        return [(k if k.quantized else None, v if v.quantized else None) for k, v in cset.pairs]
    return [(k if k.quantized else None, None) for k in cset.keys] + \
        [(None, v if v.quantized else None) for v in cset.values]


def measure_kl(
    model: PreTrainedModel, windows: Sequence[Sequence[int]], cset: CandidateSet, static_by: Mapping,
    num_layers: int, sink_tokens: int = 0,
) -> list[Damage]:
    """Damage of every candidate of every layer as the logit KL from the unquantized model (mean per token)."""
    import torch

    from kvq_export.reference.hf_cache import reference_hf_cache  # lazy: imports torch and transformers

    configs = [(layer, k, v) for layer in range(num_layers) for k, v in _measured_configs(cset)]
    totals = np.zeros(len(configs))
    tokens = 0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), task("plan: measuring logit KL", total=len(windows) * len(configs)) as advance:
            for window in windows:
                ids = torch.tensor([list(window)], dtype=torch.long, device=device)
                base = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
                p = base.exp()
                for i, (layer, key, value) in enumerate(configs):
                    override = LayerOverride(layer, key=key or TensorQuant.fp16(), value=value or TensorQuant.fp16())
                    scheme = KVQuantScheme(hp_dtype="fp32", layer_overrides=(override,), sink_tokens=sink_tokens)
                    static = Calibration.of({layer: _layer_static(static_by, layer, key, value)}).to_torch()
                    cache, _ = reference_hf_cache(scheme, num_layers, static)
                    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0].float()
                    quant = torch.log_softmax(logits, dim=-1)
                    totals[i] += float((p * (base - quant)).sum())
                    advance()
                tokens += len(window)
    finally:
        model.train(was_training)
    return [Damage(layer, k, v, max(float(t) / tokens, 0.0)) for (layer, k, v), t in zip(configs, totals)]

