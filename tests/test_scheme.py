"""KVQuantScheme: validation, JSON round-trip, equality/hashing, presets."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvq_export.errors import SchemeError
from kvq_export.model_facts import Geometry
from kvq_export.presets import PRESETS, get_preset, resolve_scheme
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Axis, Format, Quantizer, Rotation, ScaleMode


def tensor_quants():
    """Valid TensorQuant values (head_dim 64 compatible)."""
    ints = st.builds(
        TensorQuant,
        format=st.sampled_from(["int", "int_sym"]),
        bits=st.sampled_from([2, 4, 8]),
        axis=st.just("token"),
        group_size=st.sampled_from([None, 8, 16, 32, 64]),
        scale_dtype=st.sampled_from(["fp16", "fp32"]),
        clip=st.floats(0.05, 1.0),
        residual_length=st.one_of(st.none(), st.integers(0, 40)),
    )
    channel = st.builds(
        TensorQuant, format=st.sampled_from(["int", "int_sym"]), bits=st.sampled_from([2, 4, 8]),
        axis=st.just("channel"), group_size=st.sampled_from([4, 8, 32]),
    )
    fp8 = st.builds(TensorQuant, format=st.just("fp8_e4m3"), bits=st.just(8), group_size=st.sampled_from([None, 16]))
    return st.one_of(ints, channel, fp8, st.just(TensorQuant.fp16()))


@st.composite
def schemes(draw):
    key, value = draw(tensor_quants()), draw(tensor_quants())
    units = [t.flush_unit for t in (key, value) if t.quantized]
    lcm = 32 if units and max(units) > 1 else 1
    residual = draw(st.integers(0, 4)) * lcm
    overrides = ()
    if draw(st.booleans()):
        overrides = (LayerOverride(layer=draw(st.integers(0, 3)), key=TensorQuant(bits=8)),)
    return KVQuantScheme(key=key, value=value, residual_length=residual,
                         sink_tokens=draw(st.integers(0, 4)), layer_overrides=overrides)


@given(schemes())
def test_json_round_trip_is_exact(scheme):
    again = KVQuantScheme.from_json(scheme.to_json())
    assert again == scheme
    assert hash(again) == hash(scheme)
    assert again.to_dict() == scheme.to_dict()


def test_name_is_a_label_not_part_of_equality():
    a = get_preset("int4-sym-g32")
    assert a.with_name("other") == a
    assert {a, a.with_name("x")} == {a}


@pytest.mark.parametrize("kwargs, field", [
    (dict(bits=7), "bits=7"),
    (dict(format="int5"), "format='int5'"),
    (dict(axis="head"), "axis='head'"),
    (dict(scale_dtype="bf16"), "scale_dtype='bf16'"),
    (dict(clip=0.0), "clip=0.0"),
    (dict(clip=1.5), "clip=1.5"),
    (dict(scales="learned"), "scales='learned'"),
    (dict(group_size=0), "group_size=0"),
    (dict(axis="channel", group_size=None), "group_size=None"),
    (dict(format="fp8_e4m3", bits=4), "bits=4"),
    (dict(residual_length=-1), "residual_length=-1"),
    (dict(residual_length=True), "residual_length=True"),
    (dict(residual_length="8"), "residual_length='8'"),
])
def test_invalid_tensor_quant_names_field_and_allowed(kwargs, field):
    with pytest.raises(SchemeError) as err:
        TensorQuant(**kwargs)
    assert field in str(err.value)
    assert "allowed" in str(err.value)
    assert "\n" not in str(err.value)


def test_parsed_fields_hold_members_and_json_keeps_plain_strings():
    data = {"format": "int_sym", "bits": 4, "axis": "channel", "scales": "static", "quantizer": "kvq",
            "rotation": "none"}
    tq = TensorQuant.from_dict(data)
    assert (tq.format, tq.axis, tq.scales, tq.quantizer, tq.rotation) == (
        Format.INT_SYM, Axis.CHANNEL, ScaleMode.STATIC, Quantizer.KVQ, Rotation.NONE)
    assert all(type(getattr(tq, name)) is kind for name, kind in (
        ("format", Format), ("axis", Axis), ("scales", ScaleMode), ("quantizer", Quantizer), ("rotation", Rotation)))
    out = tq.to_dict()
    assert all(type(out[name]) is str for name in ("format", "axis", "scales", "quantizer", "rotation"))  # not members
    assert json.loads(json.dumps(out)) == {**data, "group_size": None, "scale_dtype": "fp16", "clip": 1.0}
    scheme = KVQuantScheme(key=tq, value=TensorQuant(format=Format.INT, bits=8, rotation=Rotation.HADAMARD))
    assert KVQuantScheme.from_json(scheme.to_json()) == scheme
    assert '"format": "int"' in scheme.to_json() and '"rotation": "hadamard"' in scheme.to_json()


@pytest.mark.parametrize("field, kind", [("format", Format), ("axis", Axis), ("scales", ScaleMode),
                                         ("quantizer", Quantizer), ("rotation", Rotation)])
def test_an_unknown_word_lists_every_allowed_member(field, kind):
    with pytest.raises(SchemeError) as err:
        TensorQuant.from_dict({field: "bogus"})
    assert str(err.value) == f"tensor: invalid {field}='bogus': allowed: {', '.join(kind)}"


def test_group_must_divide_head_dim():
    scheme = KVQuantScheme(key=TensorQuant(group_size=24), value=TensorQuant())
    with pytest.raises(SchemeError, match=r"key.group_size=24.*divide head_dim=64.*32"):
        scheme.check_model(Geometry(num_layers=2, num_kv_heads=2, head_dim=64))


def test_channel_residual_must_be_multiple_of_group():
    with pytest.raises(SchemeError, match=r"residual_length=100.*multiple of group_size=32"):
        KVQuantScheme(key=TensorQuant(axis="channel", group_size=32), value=TensorQuant(), residual_length=100)
    # token-axis streams accept any residual length
    KVQuantScheme(key=TensorQuant(group_size=32), value=TensorQuant(), residual_length=100)


def test_a_stream_may_keep_its_own_window():
    key = TensorQuant(axis="channel", group_size=32)
    value = TensorQuant(group_size=32, residual_length=16)
    scheme = KVQuantScheme(key=key, value=value, residual_length=64)
    assert (scheme.residual_for(key), scheme.residual_for(value)) == (64, 16)
    assert "recent16" in value.describe() and "residual_length" not in key.to_dict()
    assert KVQuantScheme.from_json(scheme.to_json()) == scheme
    with pytest.raises(SchemeError, match=r"key.residual_length=48.*multiple of group_size=32"):
        KVQuantScheme(key=TensorQuant(axis="channel", group_size=32, residual_length=48), value=value)
    with pytest.raises(SchemeError, match=r"residual_length=8: format fp16 is not quantized"):
        TensorQuant(format="fp16", bits=16, residual_length=8)
    # 0 is a window of its own (none), not "the scheme's"
    assert KVQuantScheme(key=key, value=TensorQuant(residual_length=0), residual_length=32).residual_for(
        TensorQuant(residual_length=0)) == 0


def test_override_layer_out_of_range():
    scheme = KVQuantScheme(key=TensorQuant(), value=TensorQuant(),
                           layer_overrides=(LayerOverride(layer=5, key=TensorQuant(bits=8)),))
    with pytest.raises(SchemeError, match=r"layers 0..3"):
        scheme.check_model(Geometry(num_layers=4, num_kv_heads=2, head_dim=64))
    assert scheme.for_layer(5)[0].bits == 8 and scheme.for_layer(4)[0].bits == 4


def test_unknown_json_field_is_named():
    data = get_preset("kivi-4").to_dict()
    data["key"]["gruop_size"] = 4
    with pytest.raises(SchemeError, match=r"gruop_size.*allowed: format"):
        KVQuantScheme.from_dict(data)


def test_unknown_preset_lists_allowed():
    with pytest.raises(SchemeError, match=r"unknown scheme preset 'q3'.*fp16, int8"):
        get_preset("q3")


def test_resolve_scheme_from_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(get_preset("kivi-2").with_name(None).to_json())
    scheme = resolve_scheme(str(path))
    assert scheme == get_preset("kivi-2") and scheme.name == "mine"
    with pytest.raises(SchemeError, match="does not exist"):
        resolve_scheme(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("name, bits", [
    ("fp16", 16), ("int8", 8.25), ("int8-sym-g32", 8.5), ("int4-sym-g32", 4.5), ("int4-g32", 5.0),
    ("kivi-4", 5.0), ("kivi-2", 3.0), ("fp8", 8.25), ("ort-int8", 8), ("ort-int4", 4),
])
def test_preset_effective_bits_by_hand(name, bits):
    # head_dim 64: whole-head groups carry one fp16 scale per 64 elements (+0.25 bit)
    assert get_preset(name).effective_bits(64) == pytest.approx(bits)


def test_presets_table_is_complete_and_valid():
    assert list(PRESETS) == ["fp16", "int8", "int8-sym-g32", "int8-sym-g32-rot", "int4-sym-g32", "int4-g32",
                             "q8_0", "q5_1", "q5_0",
                             "q4_1", "q4_0", "k-q8_0-v-q4_0", "q8_0-rot", "q5_1-rot", "q5_0-rot",
                             "q4_1-rot", "q4_0-rot", "k-q8_0-v-q4_0-rot", "kivi-4-r0", "kivi-4-r0-g64", "k8v4-r0-g64",
                             "k-int4-hc4-v-q4_0-rot", "k-int6-v-int6-rot", "k-int3-v-int3-rot", "k-int4-v-int2-rot-r64",
                             "kivi-4", "kivi-2", "fp8", "ort-int8", "ort-int8-asymv", "ort-int4", "ort-int4-asymk",
                                 "ort-int4-hc16"]
    for name, (scheme, about) in PRESETS.items():
        assert scheme.name == name and about
        scheme.check_model(Geometry(num_layers=30, num_kv_heads=2, head_dim=64))
        json.loads(scheme.to_json())
    kivi = get_preset("kivi-4")
    assert (kivi.key.axis, kivi.value.axis, kivi.residual_length) == ("channel", "token", 128)
    assert get_preset("ort-int4").needs_calibration and not get_preset("int4-sym-g32").needs_calibration
    assert get_preset("k-int4-hc4-v-q4_0-rot").needs_calibration  # the high channels are model data
    assert get_preset("ort-int4-hc16").needs_calibration
