"""Reference quantized cache: layout semantics and chunking invariance at every length."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq_export.calibration.methods import fit_metadata
from kvq_export.presets import PRESETS
from kvq_export.reference.cache import LayerCache, ReferenceCache, StreamCache
from kvq_export.reference.codec import dequantize_packed, quantize_packed
from kvq_export.region_split import split_lengths
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Axis, ScaleMode

GROUP, RESIDUAL, HEAD_DIM = 4, 8, 16

SMALL_STREAMS = {
    "int4-token": TensorQuant(format="int", bits=4, group_size=GROUP),
    "int2-channel": TensorQuant(format="int", bits=2, axis="channel", group_size=GROUP),
    "sym8-channel": TensorQuant(format="int_sym", bits=8, axis="channel", group_size=GROUP, scale_dtype="fp32"),
    "sym4-whole": TensorQuant(format="int_sym", bits=4),
    "fp8-token": TensorQuant(format="fp8_e4m3", bits=8, group_size=GROUP),
    "static-sym4": TensorQuant(format="int_sym", bits=4, axis="channel", scales="static", scale_dtype="fp32"),
    "static-int8-token": TensorQuant(format="int", bits=8, group_size=GROUP, scales="static"),
    "fp16": TensorQuant.fp16(),
}


def _static_for(tq: TensorQuant, heads: int) -> dict:
    if not tq.quantized or tq.scales != ScaleMode.STATIC:
        return {}
    n = HEAD_DIM // tq.token_group(HEAD_DIM) if tq.axis == Axis.TOKEN else HEAD_DIM
    gen = torch.Generator().manual_seed(1)
    out = {"static_scales": torch.rand(heads, n, generator=gen) * 0.5 + 0.05}
    if tq.has_zero_point:
        out["static_zeros"] = -torch.rand(heads, n, generator=gen) * 2
    return out


def _state(stream: StreamCache) -> dict[str, torch.Tensor]:
    return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v) for k, v in stream.tensors().items()}


def _chunks(draw_sizes, total):
    sizes, left = [], total
    for size in draw_sizes:
        if left == 0:
            break
        take = min(size, left)
        sizes.append(take)
        left -= take
    if left:
        sizes.append(left)
    return sizes


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(SMALL_STREAMS)),
    sinks=st.sampled_from([0, 2]),
    residual=st.sampled_from([0, RESIDUAL]),
    total=st.integers(0, 3 * GROUP + RESIDUAL + 2 + 2),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
)
def test_one_token_at_a_time_equals_random_chunks(name, sinks, residual, total, sizes, seed):
    tq = SMALL_STREAMS[name]
    scheme = KVQuantScheme(key=tq, value=tq, residual_length=residual, sink_tokens=sinks)
    x = torch.randn(2, 3, total, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    one, chunked = StreamCache(tq, scheme, **_static_for(tq, 3)), StreamCache(tq, scheme, **_static_for(tq, 3))
    one.append(x[:, :, :0])  # an empty append is a no-op on the state
    for t in range(total):
        one.append(x[:, :, t:t + 1])
    start = 0
    for size in _chunks(sizes, total):
        chunked.append(x[:, :, start:start + size])
        start += size
    a, b = _state(one), _state(chunked)
    assert a.keys() == b.keys()
    for role in a:
        assert torch.equal(a[role], b[role]), role
    if total:
        assert torch.equal(one.dequantized(), chunked.dequantized())
        assert one.length == total


@pytest.mark.parametrize("name", sorted(SMALL_STREAMS))
@pytest.mark.parametrize("sinks", [0, 3])
def test_layout_follows_the_scheme_at_every_length(name, sinks):
    tq = SMALL_STREAMS[name]
    scheme = KVQuantScheme(key=tq, value=tq, residual_length=RESIDUAL, sink_tokens=sinks)
    stream = StreamCache(tq, scheme, **_static_for(tq, 2))
    x = torch.randn(1, 2, 3 * GROUP + RESIDUAL + sinks + 2, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    for t in range(x.shape[2]):
        stream.append(x[:, :, t:t + 1])
        total = t + 1
        s, q, r = split_lengths(tq, scheme, total)
        assert (s, q, r) == (stream.sinks.shape[2], stream.quantized_length, stream.recent.shape[2])
        if not tq.quantized:
            assert (s, q, r) == (0, 0, total)
            continue
        assert s == min(sinks, total)
        if tq.axis == Axis.TOKEN or tq.scales == ScaleMode.STATIC:
            assert r == min(RESIDUAL, total - s)  # exactly R in high precision
        else:
            assert q % GROUP == 0 and (r < RESIDUAL or RESIDUAL <= r < RESIDUAL + GROUP)
        # what attention sees: hp-rounded sinks/recent exactly, the quantized region as the codec gives it
        seen = stream.dequantized()
        hp = x[:, :, :total].half().float()
        assert torch.equal(seen[:, :, :s], hp[:, :, :s])
        assert torch.equal(seen[:, :, s + q:], hp[:, :, s + q:total])
        if q:
            static = _static_for(tq, 2)
            expect = dequantize_packed(quantize_packed(hp[:, :, s:s + q], tq, **static), tq)
            assert torch.equal(seen[:, :, s:s + q], expect)


def test_model_level_cache_follows_layer_overrides():
    from kvq_export.scheme import LayerOverride

    scheme = KVQuantScheme(key=TensorQuant(bits=4, group_size=8), value=TensorQuant(bits=4, group_size=8),
                           layer_overrides=(LayerOverride(layer=1, key=TensorQuant.fp16()),))
    cache = ReferenceCache(scheme, num_layers=2)
    x = torch.randn(1, 2, 5, HEAD_DIM)
    k0, _ = cache.update(0, x, x)
    k1, _ = cache.update(1, x, x)
    assert cache.seq_length == 5
    assert "codes" in cache[0].key.tensors() and set(cache[1].key.tensors()) == {"recent"}
    assert torch.equal(k1, x.half().float()) and not torch.equal(k0, x.half().float())
    roles = cache.nbytes_by_role()
    assert sum(roles.values()) == cache.nbytes


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_run_through_the_cache(preset):
    scheme = PRESETS[preset][0]
    x = torch.randn(1, 2, 200, 64)
    static = None
    if scheme.needs_calibration:  # absmax calibration on the data itself, with the codec's arithmetic
        static = {0: {}}
        for part, tq in zip(("key", "value"), (scheme.key, scheme.value)):
            meta = static[0].setdefault(part, {})
            if tq.high_channels:  # each head's widest channels
                widest = (x.amax(dim=(0, 2)) - x.amin(dim=(0, 2))).topk(tq.high_channels, dim=-1).indices
                meta["high_channels"] = widest.sort(dim=-1).values
            if tq.quantized and tq.scales == ScaleMode.STATIC:
                stats = (x.amin(dim=(0, 2)), x.amax(dim=(0, 2))) if tq.has_zero_point else (x.abs().amax(dim=(0, 2)),)
                meta.update({role: t.float() for role, t in
                             fit_metadata(tq, stats, meta.get("high_channels")).items()})
    cache = ReferenceCache(scheme, num_layers=1, static=static)
    k, v = cache.update(0, x, x)
    assert k.shape == x.shape and bool(torch.isfinite(k).all())
    rel = float((k - x).norm() / x.norm())
    assert rel < {"kivi-2": 0.5, "ort-int4": 0.5, "ort-int4-asymk": 0.5, "k-int3-v-int3-rot": 0.3}.get(preset, 0.2)


def test_values_keep_their_own_window_beside_the_keys():
    key = TensorQuant(format="int", bits=4, axis="channel", group_size=GROUP)
    value = TensorQuant(format="int", bits=3, group_size=8, residual_length=5)
    scheme = KVQuantScheme(key=key, value=value, residual_length=GROUP, sink_tokens=1)
    cache = LayerCache(StreamCache(key, scheme), StreamCache(value, scheme))
    x = torch.randn(1, 2, 3 * GROUP + 9, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    for t in range(x.shape[2]):
        cache.update(x[:, :, t:t + 1], x[:, :, t:t + 1])
        total = t + 1
        assert cache.value.recent.shape[2] == min(5, total - 1)  # the values' own window, exactly
        assert split_lengths(key, scheme, total)[2] == cache.key.recent.shape[2] >= min(GROUP, total - 1)
    seen = cache.value.dequantized()
    assert torch.equal(seen[:, :, -5:], x[:, :, -5:].half().float())
    assert not torch.equal(seen[:, :, -6], x[:, :, -6].half().float())
