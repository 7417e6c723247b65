"""Synthetic stored caches for kernel tests and benchmarks, built by kvq's reference cache.

:func:`random_layer_cache` draws random keys/values for each row, feeds them through one reference
``LayerCache`` per row (the ground truth) and stacks the stored tensors into the batch layout the exported
graph keeps (regions right-aligned per row). Keys get a per-channel offset so channel-axis groups matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvq_plugins.layout import StreamLayout, stack_streams

from kvq_export.errors import KVQError
from kvq_export.scheme import KVQuantScheme, TensorQuant

if TYPE_CHECKING:
    import torch

    from kvq_export.model_facts import CacheGeometry


@dataclass
class LayerCase:
    """One layer's stored cache for a batch, with the reference caches that produced it."""

    key_layout: StreamLayout
    value_layout: StreamLayout
    key: dict[str, torch.Tensor]
    value: dict[str, torch.Tensor]
    seq_lengths: torch.Tensor
    rows: list  # one kvq_export.reference.cache.LayerCache per row

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor (what one attention call reads, at most)."""
        return sum(t.numel() * t.element_size() for s in (self.key, self.value) for t in s.values())


def static_metadata(tq: TensorQuant, sample: torch.Tensor) -> dict[str, torch.Tensor]:
    """Calibration-like static ``[H, n]`` scales (and minimums) covering ``sample [1, H, T, D]``.

    A stream with high channels also gets its ``high_channels`` (:func:`widest_channels`), whose scales span
    their range with 8-bit levels (:func:`kvq_export.calibration.methods.fit_metadata`, as calibration fits them).
    """
    from kvq_export.calibration.methods import absmax_stats, fit_metadata, static_groups

    high = widest_channels(tq, sample) if tq.high_channels else None
    out = fit_metadata(tq, absmax_stats(static_groups(sample[0].float(), tq), tq), high)
    if high is not None:
        out["high_channels"] = high
    return out


def widest_channels(tq: TensorQuant, sample: torch.Tensor) -> torch.Tensor:
    """A calibration-like ``[H, n]`` high-channel choice: each head's ``n`` widest channels in ``sample``, ascending."""
    x = sample[0].float()  # [H, T, D]
    spread = x.amax(dim=1) - x.amin(dim=1)
    return spread.topk(tq.high_channels, dim=-1).indices.sort(dim=-1).values


def random_layer_cache(
    scheme: KVQuantScheme,
    lengths: Sequence[int],
    geometry: CacheGeometry,
    *,
    layer: int = 0,
    generator: torch.Generator | None = None,
    device=None,
) -> LayerCase:
    """A batch whose row ``b`` holds ``lengths[b]`` random tokens of ``layer``, stored by the reference cache.

    ``geometry``: the model's cache geometry (:class:`kvq_export.model_facts.ModelFacts`, or a plain
    :class:`~kvq_export.model_facts.Geometry`); its kv heads and head size shape each token.
    """
    import torch

    from kvq_export.reference.cache import LayerCache, StreamCache

    if not 0 <= layer < geometry.num_layers:
        raise KVQError(f"layer {layer} outside the geometry's {geometry.num_layers} layer(s)")
    kv_heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    key_tq, value_tq = scheme.for_layer(layer)
    longest = max(lengths)
    where = device if generator is None else None  # a CPU generator draws on the CPU; else draw (and quantize) there
    data = []
    for n in lengths:
        k = torch.randn(1, kv_heads, n, head_dim, generator=generator, device=where) * 2 \
            + torch.randn(1, kv_heads, 1, head_dim, generator=generator, device=where)
        v = torch.randn(1, kv_heads, n, head_dim, generator=generator, device=where)
        data.append((k, v))
    static = {}
    for part, tq, index in (("key", key_tq, 0), ("value", value_tq, 1)):
        if tq.quantized and (tq.scales == "static" or tq.high_channels):
            sample = torch.cat([d[index] for d in data if d[index].shape[2]], dim=2) if longest else \
                torch.randn(1, kv_heads, 1, head_dim, generator=generator, device=where)
            static[part] = static_metadata(tq, sample) if tq.scales == "static" else \
                {"high_channels": widest_channels(tq, sample)}
    rows = []
    for k, v in data:
        streams = []
        for part, tq in (("key", key_tq), ("value", value_tq)):
            meta = static.get(part, {})
            streams.append(StreamCache(tq, scheme, static_scales=meta.get("scales"),
                                       static_zeros=meta.get("zero_points"), high_channels=meta.get("high_channels")))
        cache = LayerCache(*streams)
        cache.key.append(k)
        cache.value.append(v)
        rows.append(cache)
    key = stack_streams([r.key for r in rows], device=device)
    value = stack_streams([r.value for r in rows], device=device)
    return LayerCase(StreamLayout.of(key_tq, scheme, head_dim), StreamLayout.of(value_tq, scheme, head_dim), key,
                     value, torch.tensor(list(lengths), dtype=torch.int64, device=device), rows)
