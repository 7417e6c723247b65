"""Memory model: prediction == reference cache nbytes; hand calculations for the presets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_export.memory import predict
from kvq_export.model_facts import Geometry
from kvq_export.presets import PRESETS, get_preset
from kvq_export.reference.cache import ReferenceCache
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Axis

SMOLLM2 = Geometry(num_layers=30, num_kv_heads=3, head_dim=64)


def _static(scheme: KVQuantScheme, layers: int, heads: int, dim: int):
    if not scheme.needs_calibration:
        return None
    out = {}
    for layer, streams in enumerate(scheme.streams(layers)):
        out[layer] = {}
        for part, tq in zip(("key", "value"), streams):
            n = dim // tq.token_group(dim) if tq.axis == Axis.TOKEN else dim
            out[layer][part] = {"scales": torch.full((heads, n), 0.01), "zero_points": torch.zeros(heads, n)}
            if tq.high_channels:
                out[layer][part]["high_channels"] = torch.arange(tq.high_channels).repeat(heads, 1)
    return out


@settings(max_examples=40, deadline=None)
@given(preset=st.sampled_from(sorted(PRESETS)), seq_len=st.integers(0, 300), batch=st.integers(1, 3),
       sinks=st.sampled_from([0, 4]), value_window=st.sampled_from([None, 0, 3]))
def test_prediction_equals_reference_nbytes(preset, seq_len, batch, sinks, value_window):
    import dataclasses

    scheme = dataclasses.replace(get_preset(preset), sink_tokens=sinks)
    if value_window is not None and scheme.value.quantized:  # the values' own window (whole flush units)
        value = dataclasses.replace(scheme.value, residual_length=value_window * scheme.value.flush_unit)
        scheme = dataclasses.replace(scheme, value=value)
    geo = Geometry(num_layers=2, num_kv_heads=2, head_dim=64)
    cache = ReferenceCache(scheme, geo.num_layers, _static(scheme, 2, 2, 64))
    x = torch.randn(batch, 2, seq_len, 64)
    for layer in range(geo.num_layers):
        cache.update(layer, x, x)
    report = predict(scheme, geo, seq_len, batch)
    assert report.total_bytes == cache.nbytes
    roles = cache.nbytes_by_role()
    assert report.breakdown["high_precision"] == roles["sinks"] + roles["recent"]
    assert report.breakdown["payload"] + report.breakdown["padding"] == roles["codes"]
    assert report.breakdown["scales"] == roles["scales"]
    assert report.breakdown["zero_points"] == roles["zero_points"]


def test_mixed_precision_overrides_are_counted():
    scheme = KVQuantScheme(key=TensorQuant(bits=2, group_size=16), value=TensorQuant(bits=4, group_size=16),
                           layer_overrides=(LayerOverride(layer=0, key=TensorQuant(bits=8, group_size=16)),))
    cache = ReferenceCache(scheme, 3)
    x = torch.randn(1, 2, 50, 32)
    for layer in range(3):
        cache.update(layer, x, x)
    assert predict(scheme, Geometry(3, 2, 32), 50).total_bytes == cache.nbytes


def test_q4_0_smollm2_4096_is_4_5_bits():
    r = predict(get_preset("int4-sym-g32"), SMOLLM2, 4096)
    elements = 2 * 30 * 3 * 4096 * 64
    assert r.fp16_bytes == elements * 2
    assert r.breakdown == {"payload": elements // 2, "scales": elements // 32 * 2, "zero_points": 0,
                           "high_precision": 0, "padding": 0}
    assert r.total_bytes == 26_542_080 and r.bits_per_element == 4.5


@pytest.mark.parametrize("preset, bits, total", [("kivi-2", 2, 20_090_880), ("kivi-4", 4, 31_518_720)])
def test_kivi_by_hand(preset, bits, total):
    n = 4096
    r = predict(get_preset(preset), SMOLLM2, n)
    rows = 30 * 3  # layers x kv heads (batch 1)
    # keys: channel groups of 32 -> (4096-128)//32*32 = 3968 quantized, 128 recent
    # values: token axis -> 3968 quantized, exactly 128 recent
    q, hp = 3968, 128
    payload = 2 * rows * q * 64 * bits // 8
    key_meta = rows * (q // 32) * 64 * 2  # fp16 scale per channel per group of 32 tokens
    value_meta = rows * q * (64 // 32) * 2  # fp16 scale per 32 channels per token
    high = 2 * rows * hp * 64 * 2
    assert r.breakdown == {"payload": payload, "scales": key_meta + value_meta,
                           "zero_points": key_meta + value_meta, "high_precision": high, "padding": 0}
    assert r.total_bytes == payload + 2 * (key_meta + value_meta) + high == total
    # one token more: keys still hold 129 recent (no full group yet), values quantize one more
    r2 = predict(get_preset(preset), SMOLLM2, n + 1)
    assert r2.breakdown["high_precision"] == rows * (129 + 128) * 64 * 2


@pytest.mark.parametrize("name, bits", [("fp16", 16), ("int8", 8.25), ("int8-sym-g32", 8.5), ("int4-g32", 5.0),
                                        ("fp8", 8.25)])
def test_presets_without_windows_by_hand(name, bits):
    r = predict(get_preset(name), SMOLLM2, 1024, batch=2)
    assert r.bits_per_element == pytest.approx(bits)
    assert r.ratio == pytest.approx(16 / bits)


@pytest.mark.parametrize("preset, bits", [("ort-int4", 4), ("ort-int8", 8)])
def test_static_presets_count_calibrated_scales_once(preset, bits):
    r = predict(get_preset(preset), SMOLLM2, 2048, batch=4)
    elements = 2 * 30 * 4 * 3 * 2048 * 64
    static = 2 * 30 * 3 * 64 * 4  # fp32 per (layer, K/V, kv head, channel), shared by the batch
    assert r.breakdown["payload"] == elements * bits // 8 and r.breakdown["scales"] == static
    assert r.total_bytes == elements * bits // 8 + static


def test_empty_cache_is_zero_bytes():
    assert predict(get_preset("kivi-4"), SMOLLM2, 0).total_bytes == 0
