"""ggml block formats: codes and stored scales bit-exact with a plain transcription of ggml's reference C quantizers.

The transcription below follows ``quantize_row_q{4_0,4_1,5_0,5_1,8_0}_ref`` statement by statement on
numpy float32 scalars (each C float operation rounds to float32; ``(int)`` truncates; ``roundf`` rounds
half away from zero, computed in float64 where ``|x| + 0.5`` is exact for any float32 ``x``). It shares
nothing with kvq's vectorized codec or the ONNX graph.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvgraph_harness import CacheOnly
from tiny_models import attention_facts

from kvq_export.errors import QuantizationError, SchemeError
from kvq_export.flavors.ort_gqa.capability import unsupported
from kvq_export.memory import predict
from kvq_export.model_facts import Geometry
from kvq_export.presets import PRESETS, get_preset
from kvq_export.reference.cache import LayerCache, StreamCache
from kvq_export.reference.codec import dequantize_packed, pack, quantize, quantize_packed, unpack
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Part

KINDS = {"q4_0": ("int_sym", 4), "q4_1": ("int", 4), "q5_0": ("int_sym", 5), "q5_1": ("int", 5), "q8_0": ("int_sym", 8)}
F = np.float32


def ggml_tq(kind: str) -> TensorQuant:
    fmt, bits = KINDS[kind]
    return TensorQuant(format=fmt, bits=bits, group_size=32, quantizer="ggml")


# -- transcription of ggml's reference quantizers (one block of 32 floats) ----------
def _inverse(d):
    """The block's ``id = d ? 1.0f/d : 0.0f``, as ggml computes it.

    Where 1/d overflows ggml's C goes on to convert NaN/inf to an integer (undefined behaviour); kvq's
    documented choice there is id = 0, so the transcription takes it too.
    """
    if d == 0:
        return F(0.0)
    with np.errstate(over="ignore"):
        inv = F(F(1.0) / d)
    return inv if np.isfinite(inv) else F(0.0)


def _ref_x_0(block, nmax: int, top: int):  # q4_0 (nmax 8, top 15) / q5_0 (16, 31)
    amax, vmax = F(0.0), F(0.0)
    for v in block:
        if amax < abs(v):
            amax, vmax = abs(v), v
    d = F(vmax / F(-nmax))
    inv = _inverse(d)
    codes = [min(top, int(F(F(v * inv) + F(nmax + 0.5)))) for v in block]
    return codes, np.float16(d), None


def _ref_x_1(block, top: int):  # q4_1 (top 15) / q5_1 (top 31, no MIN in C: a no-op there)
    mn, mx = F(np.finfo(F).max), F(-np.finfo(F).max)
    for v in block:
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    d = F(F(mx - mn) / F(top))
    inv = _inverse(d)
    codes = [min(top, int(F(F(F(v - mn) * inv) + F(0.5)))) for v in block]
    return codes, np.float16(d), np.float16(mn)


def _ref_8_0(block):
    amax = F(0.0)
    for v in block:
        amax = max(amax, abs(v))
    d = F(amax / F(127))
    inv = _inverse(d)
    codes = []
    for v in block:
        y = float(F(v * inv))
        codes.append(int(math.copysign(math.floor(abs(y) + 0.5), y)) + 128)  # roundf, stored + 128
    return codes, np.float16(d), None


def ggml_reference(kind: str, row: np.ndarray):
    """Ggml's quantize_row_*_ref on one row (length a multiple of 32) -> (codes, d, m) with kvq's code offsets."""
    codes, ds, ms = [], [], []
    for start in range(0, row.size, 32):
        block = [F(v) for v in row[start:start + 32]]
        if kind == "q8_0":
            c, d, m = _ref_8_0(block)
        elif kind in ("q4_0", "q5_0"):
            c, d, m = _ref_x_0(block, 8 if kind == "q4_0" else 16, 15 if kind == "q4_0" else 31)
        else:
            c, d, m = _ref_x_1(block, 15 if kind == "q4_1" else 31)
        codes += c
        ds.append(d)
        ms.append(m)
    return np.array(codes, np.uint8), np.array(ds, np.float16), (None if ms[0] is None else np.array(ms, np.float16))


def _h(a) -> np.ndarray:
    return np.asarray(a, np.float16).view(np.uint16)


def check_row(kind: str, row: np.ndarray) -> None:
    want_codes, want_d, want_m = ggml_reference(kind, row)
    try:
        q = quantize(torch.from_numpy(row.reshape(1, 1, 1, -1)), ggml_tq(kind))
    except QuantizationError:  # kvq refuses a scale that overflows fp16; ggml would store inf
        assert not np.isfinite(want_d.astype(np.float32)).all() or (
            want_m is not None and not np.isfinite(want_m.astype(np.float32)).all())
        return
    np.testing.assert_array_equal(q.codes.numpy().reshape(-1), want_codes)
    np.testing.assert_array_equal(_h(q.scales.numpy().reshape(-1)), _h(want_d))  # bits: -0.0 != +0.0
    if want_m is not None:
        np.testing.assert_array_equal(_h(q.zeros.numpy().reshape(-1)), _h(want_m))
    else:
        assert q.zeros is None


# -- adversarial inputs ----------
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 0.49999997, -0.49999997, 1e-30, -1e-30, 1e-45, 6e4, -6e4, 3.0, -3.0,
           7.5, 8.0, -8.0, 1.5, 2.5, 0.1, 1 / 3]


def _adversarial(rng: np.random.Generator) -> list[np.ndarray]:
    rows = [
        np.zeros(64, F),
        -np.zeros(64, F),
        np.concatenate([[-0.0, 0.0], np.zeros(30)]).astype(F),
        np.concatenate([[3.0, -3.0], rng.uniform(-1, 1, 30)]).astype(F),  # magnitude tie: first wins
        np.concatenate([[-3.0, 3.0], rng.uniform(-1, 1, 30)]).astype(F),
        np.full(32, 2.5, F),  # zero range for q4_1: d = 0, id = 0
        np.concatenate([np.zeros(31), [6e-43]]).astype(F),  # a subnormal block: 1/d overflows, id = 0
        np.full(32, 1e-45, F),
        np.arange(-16, 16, dtype=F),  # every q*_0 code exactly on a level / half level
        (np.arange(32, dtype=F) - 15.5),
        np.array([127 * (i - 16) / 16 + 0.5 for i in range(32)], F),  # q8_0 ties
        rng.choice(np.array(SPECIAL, F), 96),
        (rng.standard_normal(128) * 10 ** rng.uniform(-6, 4, 128)).astype(F),
    ]
    for _ in range(20):
        scale = F(10 ** rng.uniform(-4, 3))
        rows.append((rng.standard_normal(64) * scale).astype(F))
        rows.append((rng.integers(-16, 16, 64) * scale / 2).astype(F))  # values on (half) levels of a grid
    return rows


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_codes_and_scales_match_ggml_on_adversarial_rows(kind):
    for row in _adversarial(np.random.default_rng(7)):
        check_row(kind, row)


_floats = st.one_of(st.floats(-1e4, 1e4, width=32, allow_subnormal=True), st.sampled_from(SPECIAL),
                    st.integers(-16, 16).map(lambda i: i / 2))


@example(kind="q4_0", values=[0.0] * 31 + [5.941505488737224e-43], blocks=1, shift=0.0)  # 1/d overflows
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(KINDS)), values=st.lists(_floats, min_size=32, max_size=32),
       blocks=st.integers(1, 2), shift=st.floats(-100, 100, width=32))
def test_codes_and_scales_match_ggml_property(kind, values, blocks, shift):
    row = np.array(values * blocks, F)
    if blocks == 2:
        row[32:] = row[32:] + F(shift)
    check_row(kind, row)


# -- dequantization and packing ----------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dequantize_is_ggml_dequantize(kind):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, 5, 64)) * 3).astype(F)
    tq = ggml_tq(kind)
    q = quantize_packed(torch.from_numpy(x), tq)
    assert q.codes.shape[-1] == tq.packed_dim(64)
    got = dequantize_packed(q, tq).numpy().reshape(-1, 32)
    codes, d, m = ggml_reference(kind, x.reshape(-1))
    offset = 0 if m is not None else 1 << (tq.bits - 1)
    want = (codes.reshape(-1, 32).astype(F) - F(offset)) * d.astype(F)[:, None]
    if m is not None:
        want = want + m.astype(F)[:, None]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits", [1, 2, 4, 5, 8])
def test_pack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (2, 3, 4, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


def test_five_bit_layout_is_nibbles_then_high_plane():
    codes = torch.arange(32, dtype=torch.uint8).repeat(2).reshape(1, 64)
    packed = pack(codes, 5)[0].tolist()
    assert packed[0] == 0x10 and packed[1] == 0x32  # elements 0,1 and 2,3: low nibbles, even element low
    assert packed[32:40] == [0, 0, 0xFF, 0xFF, 0, 0, 0xFF, 0xFF]  # fifth bits: codes 16..31 of each run of 32


# -- the scheme, presets, memory and flavours ----------
@pytest.mark.parametrize("kwargs, needle", [
    (dict(format="int", bits=8, group_size=32, quantizer="ggml"), "allowed with quantizer ggml"),
    (dict(format="int_sym", bits=4, group_size=64, quantizer="ggml"), "group_size=64"),
    (dict(format="int_sym", bits=4, group_size=32, axis="channel", quantizer="ggml"), "axis='channel'"),
    (dict(format="int_sym", bits=4, group_size=32, scale_dtype="fp32", quantizer="ggml"), "scale_dtype"),
    (dict(format="int_sym", bits=4, group_size=32, clip=0.9, quantizer="ggml"), "clip"),
    (dict(format="int", bits=5, group_size=32), "5 bits: quantizer ggml"),
    (dict(format="int", bits=4, quantizer="llama"), "allowed: kvq, ggml"),
])
def test_scheme_refuses_meaningless_ggml_combinations(kwargs, needle):
    with pytest.raises(SchemeError, match=None) as err:
        TensorQuant(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_ggml_presets_are_the_exact_formats_and_round_trip_json():
    for kind in KINDS:
        scheme = get_preset(kind)
        assert scheme.key == ggml_tq(kind) and scheme.value == ggml_tq(kind)
        assert KVQuantScheme.from_json(scheme.to_json()) == scheme
        assert scheme.key.describe() == f"ggml {kind}"
    mixed = get_preset("k-q8_0-v-q4_0")
    assert mixed.key == ggml_tq("q8_0") and mixed.value == ggml_tq("q4_0")
    assert get_preset("int4-sym-g32").key == TensorQuant(format="int_sym", bits=4, group_size=32)


@pytest.mark.parametrize("name, bits", [("q4_0", 4.5), ("q4_1", 5.0), ("q5_0", 5.5), ("q5_1", 6.0), ("q8_0", 8.5),
                                        ("k-q8_0-v-q4_0", 6.5), ("kivi-4-r0", 5.0), ("kivi-4-r0-g64", 4.5),
                                        ("k8v4-r0-g64", 6.5)])
def test_memory_model_bits_match_the_reference_cache(name, bits):
    scheme = get_preset(name)
    assert predict(scheme, Geometry(30, 3, 64), 4096).bits_per_element == bits
    geometry = Geometry(1, 2, 64)
    for n in (0, 1, 31, 64, 100):
        layer = LayerCache(StreamCache(scheme.key, scheme), StreamCache(scheme.value, scheme))
        if n:
            x = torch.randn(1, 2, n, 64)
            layer.update(x, x * 0.5)
        stored = sum(t.numel() * t.element_size() for s in (layer.key, layer.value) for t in s.tensors().values())
        assert stored == predict(scheme, geometry, n).total_bytes, (name, n)


def test_ort_gqa_refuses_ggml_formats():
    reasons = unsupported(get_preset("q8_0"), 2)
    assert any("ggml" in r for r in reasons)


# -- the reference flavour's graph: present cache bit-exact with the reference cache ----------
def _graph_vs_reference(scheme: KVQuantScheme, k_rows: list[np.ndarray], *, kv_heads=2, dim=64):
    """Feed K rows one token at a time (V = -K / 3) and compare every present tensor with the reference cache."""
    graph = CacheOnly(scheme, attention_facts(num_heads=kv_heads * 2, num_kv_heads=kv_heads, head_dim=dim))
    key_tq, value_tq = scheme.for_layer(0)
    ref = LayerCache(StreamCache(key_tq, scheme), StreamCache(value_tq, scheme))
    cache = graph.empty(1)
    rng = np.random.default_rng(0)
    for k in k_rows:
        k = k.reshape(1, kv_heads, 1, dim).astype(F)
        v = (-k / F(3)).astype(F)
        q = rng.standard_normal((1, kv_heads * 2, 1, dim)).astype(F)
        _, cache, arrays = graph.step(q, k, v, np.ones((1, 1), np.int64), cache)
        ref.update(torch.from_numpy(k), torch.from_numpy(v))
    for part in Part:
        for role, tensor in getattr(ref, part).tensors().items():
            got, want = arrays[f"past.0.{part}.{role}"][0], tensor[0].numpy()
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"{part}.{role}")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_graph_codes_bit_exact_on_adversarial_tokens(kind):
    rng = np.random.default_rng(3)
    rows = [r[:64] if r.size >= 64 else np.resize(r, 64) for r in _adversarial(rng) if r.size >= 32]
    rows = [np.resize(r, 128) for r in rows if np.isfinite(r).all() and np.abs(r).max() < 1e4]
    _graph_vs_reference(KVQuantScheme(key=ggml_tq(kind), value=ggml_tq(kind)), rows)


def test_graph_mixed_key_value_formats():
    """Keys ggml q5_1, values kvq per-channel int4 in one layer; then a layer override swapping in q8_0 keys."""
    scheme = KVQuantScheme(key=ggml_tq("q5_1"), value=TensorQuant(format="int", bits=4, axis="channel", group_size=4))
    rng = np.random.default_rng(5)
    _graph_vs_reference(scheme, [rng.standard_normal(128) * 4 for _ in range(9)])
    overridden = KVQuantScheme(key=ggml_tq("q4_0"), value=ggml_tq("q4_1"),
                               layer_overrides=(LayerOverride(0, key=ggml_tq("q8_0")),))
    _graph_vs_reference(overridden, [rng.standard_normal(128) * 4 for _ in range(3)])


def test_export_with_per_layer_mixed_formats_matches_torch_reference(tmp_path, monkeypatch):
    """A tiny 2-layer model exported with per-layer ggml / kvq formats: logits and cache vs the torch reference."""
    from state_harness import REFERENCE_PROMPTS, check_against_reference
    from tiny_models import tiny_model

    from kvq_export.export.exporter import export_model

    scheme = KVQuantScheme(
        key=ggml_tq("q8_0"), value=ggml_tq("q4_0"),
        layer_overrides=(LayerOverride(1, key=TensorQuant(format="int", bits=4, axis="channel", group_size=4),
                                       value=ggml_tq("q5_0")),),
        name="mixed-layers")
    model = tiny_model("llama")
    assert model.config.num_hidden_layers >= 2
    monkeypatch.setitem(PRESETS, "mixed-layers", (scheme, "test"))
    directory = export_model(model, scheme, tmp_path / "mixed")

    check_against_reference(directory, model, scheme, REFERENCE_PROMPTS["padded"], label="llama/mixed-layers/padded")


def test_schemes_command_prints_bits_at_512_and_4096():
    from click.testing import CliRunner

    from kvq_export.cli import cli

    result = CliRunner().invoke(cli, ["schemes"], catch_exceptions=False, terminal_width=250)
    assert result.exit_code == 0
    for name, at512, at4096 in [("kivi-4", "7.750", "5.344"), ("kivi-2", "6.250", "3.406"), ("q5_0", "5.500", "5.500"),
                                ("kivi-4-r0-g64", "4.500", "4.500"), ("ort-int4", "4.062", "4.008")]:
        line = next(row for row in result.output.splitlines() if f" {name} " in row)
        assert f" {at512} " in line and f" {at4096} " in line, line
