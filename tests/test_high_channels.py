"""High channels: n channels per kv head at 8 bits inside a 2/4-bit per-channel stream.

The scheme field, the reference codec's arithmetic and byte layout (asymmetric and symmetric, dynamic and
static scales), the calibrated choice, its file, the fused kernel's layout and an export driven end to end
on ONNX Runtime (the in-graph bytes are compared with the reference bit for bit in tests/test_kv_graph.py,
and GroupQueryAttention's nibble split in tests/test_gqa_flavor.py).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvq_export.calibration import Calibration
from kvq_export.calibration.high_channels import choose_high_channels
from kvq_export.calibration.passes import AttentionSample
from kvq_export.errors import QuantizationError, SchemeError
from kvq_export.model_facts import Geometry
from kvq_export.reference.codec import (
    dequantize,
    dequantize_packed,
    pack,
    quantize,
    quantize_packed,
)
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Format, Part

HIGH = TensorQuant(format="int", bits=4, axis="channel", group_size=16, high_channels=6)
CHOSEN = torch.tensor([[0, 5, 10, 20, 40, 63], [1, 2, 3, 4, 5, 6], [58, 59, 60, 61, 62, 63]])
ONE_LAYER = SimpleNamespace(num_layers=1, num_kv_heads=3, head_dim=64)  # the geometry CHOSEN fits


def _keys(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 48, 64, generator=g) * torch.linspace(0.1, 5.0, 64)


def test_bits_per_element_counts_the_8_bit_channels():
    assert HIGH.packed_dim(64) == 6 + 58 // 2
    assert HIGH.effective_bits(64) == pytest.approx(4 + 6 * 4 / 64 + 32 / 16)
    assert "+6ch-int8" in HIGH.describe()
    assert HIGH.to_dict()["high_channels"] == 6
    assert "high_channels" not in dataclasses.replace(HIGH, high_channels=0).to_dict()  # older files read the same
    assert TensorQuant.from_dict(HIGH.to_dict()) == HIGH


@pytest.mark.parametrize(("change", "message"), [
    ({"axis": "token", "group_size": 32}, "allowed with high_channels > 0: 'channel'"),
    ({"format": "fp8_e4m3", "bits": 8}, "allowed with high_channels > 0: int, int_sym"),
    ({"rotation": "hadamard"}, "allowed with high_channels > 0: 'none'"),
    ({"bits": 8}, "allowed with high_channels > 0: 2, 3, 4"),
    ({"high_channels": -2}, "allowed: an integer >= 0"),
    ({"high_channels": True}, "allowed: an integer >= 0"),
])
def test_scheme_refuses_what_high_channels_cannot_mean(change, message):
    with pytest.raises(SchemeError, match=message):
        dataclasses.replace(HIGH, **change)


@pytest.mark.parametrize(("n", "bits"), [(64, 4), (5, 4), (2, 2)])
def test_scheme_refuses_a_count_the_head_cannot_pack(n, bits):
    with pytest.raises(SchemeError, match="high_channels"):
        KVQuantScheme(key=dataclasses.replace(HIGH, high_channels=n, bits=bits)).check_model(Geometry(1, 2, 64))


@pytest.mark.parametrize("bits", [2, 4])
def test_codec_is_8_bit_on_the_chosen_channels_and_low_bit_elsewhere(bits):
    tq = dataclasses.replace(HIGH, bits=bits, high_channels=4 if bits == 2 else 6)
    chosen = CHOSEN[:, : tq.high_channels] if bits == 4 else torch.tensor([[0, 1, 2, 3], [4, 9, 33, 63], [7, 8, 9, 10]])
    x = _keys()
    got = dequantize_packed(quantize_packed(x, tq, high_channels=chosen), tq, high_channels=chosen)
    plain8, plain = (dataclasses.replace(tq, bits=b, high_channels=0) for b in (8, bits))
    want8, want = (dequantize(quantize(x, t), t) for t in (plain8, plain))
    is_high = torch.zeros(3, 64, dtype=torch.bool).scatter_(1, chosen, True)[None, :, None, :]
    assert torch.equal(got, torch.where(is_high, want8, want))


STATIC_HIGH = {fmt: TensorQuant(format=fmt, bits=4, axis="channel", scales="static", scale_dtype="fp32",
                                high_channels=6) for fmt in ("int", "int_sym")}


@pytest.mark.parametrize("fmt", ["int", "int_sym"])
def test_static_codec_is_8_bit_on_the_chosen_channels_and_low_bit_elsewhere(fmt):
    from kvq_export.calibration.methods import stream_metadata

    tq, x = STATIC_HIGH[fmt], _keys(2)
    flat = x.transpose(0, 1).reshape(3, -1, 64)  # [H, B*T, D]: the calibration's view
    meta = {role: torch.from_numpy(a) for role, a in stream_metadata(flat, tq, "absmax", 99.9, CHOSEN).items()}
    plain8, plain = (dataclasses.replace(tq, bits=b, high_channels=0) for b in (8, 4))
    metas = {t: {role: torch.from_numpy(a) for role, a in stream_metadata(flat, t, "absmax", 99.9).items()}
             for t in (plain8, plain)}
    is_high = torch.zeros(3, 64, dtype=torch.bool).scatter_(1, CHOSEN, True)
    for role, got in meta.items():  # each channel's metadata is what its own bit width gives
        assert torch.equal(got, torch.where(is_high, metas[plain8][role], metas[plain][role])), role
    static = {"static_scales": meta["scales"], "static_zeros": meta.get("zero_points")}
    q = quantize(x, tq, high_channels=CHOSEN, **static)
    want = {t: dequantize(quantize(x, t, static_scales=m["scales"], static_zeros=m.get("zero_points")), t)
            for t, m in metas.items()}
    got = dequantize_packed(quantize_packed(x, tq, high_channels=CHOSEN, **static), tq, high_channels=CHOSEN)
    assert torch.equal(got, torch.where(is_high[None, :, None], want[plain8], want[plain]))
    codes = q.codes.permute(1, 0, 2, 3)  # [H, B, T, D]
    for head in range(3):
        high, low = codes[head][..., is_high[head]], codes[head][..., ~is_high[head]]
        assert int(low.max()) <= 15 < int(high.max())
        assert int(high.min()) >= (0 if fmt == "int" else 1)  # int_sym: -127..127 stored + 128
    with pytest.raises(QuantizationError, match="give the calibrated high_channels"):
        quantize(x, tq, **static)
    if fmt == "int_sym":  # its high channels' offset differs: decoding needs the choice too
        with pytest.raises(QuantizationError, match="give the calibrated high_channels"):
            dequantize(q, tq)


def test_static_high_channels_count_in_bits_per_element():
    tq = STATIC_HIGH["int_sym"]
    assert tq.effective_bits(64) == pytest.approx(4 + 6 * 4 / 64)
    assert tq.packed_dim(64) == 6 + 58 // 2


def test_stored_bytes_are_high_channels_first_then_the_rest_packed():
    x = _keys(1)
    q = quantize(x, HIGH, high_channels=CHOSEN)
    stored = quantize_packed(x, HIGH, high_channels=CHOSEN).codes
    assert stored.shape[-1] == HIGH.packed_dim(64)
    for head in range(3):
        rest = [c for c in range(64) if c not in CHOSEN[head].tolist()]
        assert torch.equal(stored[:, head, :, :6], q.codes[:, head][..., CHOSEN[head]])
        assert torch.equal(stored[:, head, :, 6:], pack(q.codes[:, head][..., rest], 4))
        assert int(q.codes[:, head][..., rest].max()) <= 15 < int(q.codes[:, head][..., CHOSEN[head]].max())


@pytest.mark.parametrize(("chosen", "message"), [
    (None, "give the calibrated high_channels"),
    (torch.tensor([[0, 1, 2, 3, 4, 5]] * 2), r"shape \[kv_heads=3, 6\]"),
    (torch.tensor([[0, 1, 2, 3, 5, 4]] * 3), "strictly ascending"),
    (torch.tensor([[0, 1, 2, 3, 4, 64]] * 3), r"in \[0, 64\)"),
    (torch.zeros(3, 6), "integer indices"),
])
def test_codec_refuses_a_missing_or_malformed_choice(chosen, message):
    with pytest.raises(QuantizationError, match=message):
        quantize(_keys(), HIGH, high_channels=chosen)


def _sample(keys: torch.Tensor, q: torch.Tensor) -> AttentionSample:
    return AttentionSample(q=q, positions=torch.arange(keys.shape[1] - q.shape[1], keys.shape[1]), keys=keys,
                           values=keys.clone(), scaling=keys.shape[-1] ** -0.5)


def test_keys_rank_channels_by_query_energy_times_range():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 32, 64, generator=g)
    keys[0, :, 7] *= 30.0  # wide, and queries read it: chosen
    keys[1, :, 50] *= 30.0  # wide, but no query reads it: not chosen
    q = torch.randn(4, 8, 64, generator=g) * 0.1  # 2 query heads per kv head
    q[:2, :, 7] = 3.0
    q[2:, :, 9] = 3.0  # read a lot, narrow: chosen for kv head 1 over the wide unread channel 50
    q[2:, :, 50] = 0.0
    chosen = choose_high_channels([_sample(keys, q)], Part.KEY, dataclasses.replace(HIGH, high_channels=2))
    assert chosen.dtype == np.int32 and chosen.shape == (2, 2)
    assert 7 in chosen[0] and 9 in chosen[1] and 50 not in chosen[1]
    assert (np.diff(chosen, axis=1) > 0).all()


def test_values_rank_channels_by_the_o_proj_columns_that_read_them():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 32, 64, generator=g)
    o_proj = torch.full((16, 2 * 64), 0.01)
    o_proj[:, 64 + 33] = 5.0  # query head 1 (kv head 0) sends channel 33 to the residual stream
    tq = dataclasses.replace(HIGH, high_channels=2)
    chosen = choose_high_channels([_sample(keys, torch.randn(2, 4, 64, generator=g))], Part.VALUE, tq, o_proj)
    assert 33 in chosen[0]


def test_calibration_file_keeps_the_choice_as_int32(tmp_path):
    scheme = KVQuantScheme(key=HIGH)
    static = {0: {"key": {"high_channels": CHOSEN.numpy().astype(np.int32)}}}
    Calibration.of(static).check(scheme, ONE_LAYER)
    back = Calibration.load(Calibration.of(static).save(tmp_path / "c.npz"))
    assert back[0]["key"]["high_channels"].dtype == np.int32
    assert np.array_equal(back[0]["key"]["high_channels"], CHOSEN.numpy())
    with pytest.raises(SchemeError, match="lacks high_channels"):
        Calibration.of({}).check(scheme, ONE_LAYER)
    with pytest.raises(SchemeError, match="calibration 0.key: high_channels must be strictly ascending"):
        Calibration.of({0: {"key": {"high_channels": CHOSEN.numpy()[:, ::-1].astype(np.int32)}}}).check(
            scheme, ONE_LAYER)
    assert scheme.needs_calibration and not scheme.has_static_scales


@pytest.mark.parametrize(("tq", "tag", "offset"), [(STATIC_HIGH["int"], "asymhc", 0.0),
                                                   (dataclasses.replace(HIGH, format="int_sym"), "symhc", 8.0)])
def test_fused_kernel_layout_holds_static_and_symmetric_high_channels(tq, tag, offset):
    from plugins.layout import StreamLayout, code_offsets

    layout = StreamLayout.of(tq, KVQuantScheme(key=tq), 64)
    assert layout.tag == tag and layout.roles[-1] == "channel_order"
    assert layout.high_levels == ((0, 255, 0) if tq.format == Format.INT else (-127, 127, 128))
    offsets = code_offsets(layout, CHOSEN)
    if tq.format == Format.INT:
        assert offsets == 0.0
    else:  # the symmetric high channels sit around 128, the others around 2**(bits-1)
        assert offsets.shape == (3, 1, 64) and offsets[0, 0, 5] == 128.0 and offsets[0, 0, 6] == offset


def test_fused_kernel_layout_carries_the_channel_order():
    from plugins.layout import StreamLayout

    layout = StreamLayout.of(HIGH, KVQuantScheme(key=HIGH), 64)
    assert layout.high == 6 and layout.roles[-1] == "channel_order" and layout.tag == "asymhc"
    assert layout.packed_dim == HIGH.packed_dim(64) == 6 + 58 // 2
    assert StreamLayout.from_attributes("key", {**layout.attributes("key"), "head_dim": 64, "sink_tokens": 0,
                                                "residual_length": 0, "hp_dtype": "fp16"}).high == 6


def test_export_without_a_calibration_names_what_is_missing(tmp_path):
    from tiny_models import tiny_model

    from kvq_export.errors import ExportError
    from kvq_export.export.exporter import export_model

    scheme = KVQuantScheme(key=dataclasses.replace(HIGH, group_size=8, high_channels=4))
    with pytest.raises(ExportError, match="uses calibrated high channels: calibrate first"):
        export_model(tiny_model("llama"), scheme, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_channel_levels_stay_on_the_device_of_the_choice():
    # a GPU cache (the fused kernel's prefill buffer, tools/bench_kernel.py) passes its channel choice on the
    # device; the per-channel levels must be built there, not on the CPU ("meta" stands in for a GPU here)
    from kvq_export.reference.codec import channel_levels

    levels = channel_levels(STATIC_HIGH["int_sym"], CHOSEN.to("meta"), 64)
    assert all(t.device.type == "meta" for t in levels)
