"""Rotated caches (``rotation: hadamard``): the matrices, the algebra, and every place that honours them.

* the matrices are orthonormal, symmetric and their own inverse, also block-diagonal for head dims that are
  not a power of two; an odd head_dim and unknown kinds are refused with one clear line;
* in float64 (no fp32 anywhere), rotating q/k after RoPE and folding the value rotation into v_proj/o_proj
  leaves a layer's attention output unchanged (the decoder's own folding function);
* exported graphs (reference and ort-gqa flavours) with rotated but unquantized streams give the logits
  of the unrotated export; with quantized rotated streams their stored codes equal the reference cache's
  (the tolerances of tests/test_export_runtime.py and tests/test_gqa_flavor.py), and the cache-only graph
  is bit-exact with the reference fed the same tokens;
* decode_cache, the memory model, static calibration and the in-graph fallback honour the rotation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gqa_harness import PROMPTS, calibration, compare, sequences
from kvgraph_harness import CacheOnly
from state_harness import compare_state, reference_run
from tiny_models import COMMON, VOCAB, attention_facts, tiny_model

from kvq_export.errors import ExportError, QuantizationError, RuntimeInputError, SchemeError
from kvq_export.export.exporter import export_model
from kvq_export.graph.projections import fold_rotation
from kvq_export.manifest import Manifest, decode_cache, load_static
from kvq_export.memory import predict
from kvq_export.model_facts import Geometry
from kvq_export.presets import PRESETS
from kvq_export.reference.cache import LayerCache, StreamCache
from kvq_export.rotation import hadamard, hadamard_blocks, rotate_torch, rotation_matrix
from kvq_export.runtime.session import KVQSession
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import Basis, Part, Rotation

FP32 = TensorQuant(format="fp16", bits=16)


def rotated(scheme: KVQuantScheme, key: str = "hadamard", value: str = "hadamard", **changes) -> KVQuantScheme:
    """``scheme`` with the given rotations on its key and value streams."""
    return dataclasses.replace(scheme, key=dataclasses.replace(scheme.key, rotation=key),
                               value=dataclasses.replace(scheme.value, rotation=value), **changes)


UNQUANTIZED = KVQuantScheme(key=FP32, value=FP32, hp_dtype="fp32")
Q4_TOKEN = KVQuantScheme(key=TensorQuant(format="int_sym", bits=4, group_size=16),
                         value=TensorQuant(format="int", bits=4, group_size=16))
KIVI_R0 = KVQuantScheme(key=TensorQuant(format="int", bits=4, axis="channel", group_size=4),
                        value=TensorQuant(format="int", bits=4, group_size=32))


# -- the matrices and the scheme field ---------------------------------------------------------------------
@pytest.mark.parametrize("dim", [2, 8, 32, 64, 128, 48, 80, 96, 6])
def test_hadamard_is_orthonormal_symmetric_and_involutory(dim):
    r = rotation_matrix("hadamard", dim)
    assert r.shape == (dim, dim)
    assert np.allclose(r @ r.T, np.eye(dim), atol=1e-14)
    assert np.array_equal(r, r.T)
    assert sum(hadamard_blocks(dim)) == dim
    assert hadamard_blocks(dim)[0] == 1 << (dim.bit_length() - 1)
    if dim & (dim - 1) == 0:  # a power of two: one dense block of +-1/sqrt(dim)
        assert np.allclose(np.abs(r), dim**-0.5)
    assert rotation_matrix("none", dim) is None


def test_sylvester_construction():
    h2 = np.array([[1, 1], [1, -1]]) / np.sqrt(2)
    assert np.allclose(hadamard(4), np.kron(h2, h2))
    with pytest.raises(SchemeError, match="power of two"):
        hadamard(12)


def test_rotation_field_is_validated_serialised_and_described():
    with pytest.raises(SchemeError, match=r"invalid rotation='givens': allowed: none, hadamard"):
        TensorQuant(rotation="givens")
    with pytest.raises(SchemeError, match=r"key.rotation.*head_dim=63 is odd"):
        KVQuantScheme(key=TensorQuant(rotation="hadamard")).check_model(Geometry(2, 2, 63))
    KVQuantScheme(key=TensorQuant(rotation="hadamard", group_size=16)).check_model(Geometry(2, 2, 48))
    scheme = rotated(Q4_TOKEN, value="none")
    again = KVQuantScheme.from_json(scheme.to_json())
    assert again == scheme and again.key.rotation == Rotation.HADAMARD and again.value.rotation == Rotation.NONE
    assert "rot-hadamard" in scheme.key.describe() and "rot-" not in scheme.value.describe()
    assert KVQuantScheme.from_dict({"key": {"format": "int", "bits": 4}}).key.rotation == Rotation.NONE  # older JSON
    assert scheme != Q4_TOKEN


def test_rotation_costs_no_bytes():
    geo = Geometry(3, 2, 64)
    for scheme in (Q4_TOKEN, KIVI_R0, PRESETS["kivi-4"][0]):
        assert predict(rotated(scheme), geo, 300).total_bytes == predict(scheme, geo, 300).total_bytes
        assert rotated(scheme).effective_bits(64) == scheme.effective_bits(64)


# -- float64 algebra ------------------------------------------------------------------------------------------
def _attention64(q, k, v, groups):
    k, v = np.repeat(k, groups, axis=0), np.repeat(v, groups, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    scores += np.triu(np.full(scores.shape[-2:], -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("dim", [32, 48])
def test_rotated_attention_equals_unrotated_in_float64(dim):
    """q/k rotated after RoPE and V folded into v_proj/o_proj (the decoder's folding): same layer output."""
    rng = np.random.default_rng(dim)
    heads, kv_heads, hidden, t = 4, 2, 40, 9
    x = rng.standard_normal((t, hidden))
    wv = rng.standard_normal((kv_heads * dim, hidden))  # HF [out, in]
    bv = rng.standard_normal(kv_heads * dim)
    wo = rng.standard_normal((hidden, heads * dim))
    q = rng.standard_normal((heads, t, dim))  # post-RoPE
    k = rng.standard_normal((kv_heads, t, dim)) * rng.gamma(0.5, 4, dim)  # outlier channels
    r = rotation_matrix("hadamard", dim)

    def heads_of(y, n):
        return y.reshape(t, n, dim).transpose(1, 0, 2)

    v = heads_of(x @ wv.T + bv, kv_heads)
    want = _attention64(q, k, v, heads // kv_heads).transpose(1, 0, 2).reshape(t, -1) @ wo.T

    wv_t = fold_rotation(wv.T, r, None)  # [in, out], outputs rotated per kv head
    bv_r = fold_rotation(bv[None], r, None)[0]
    wo_t = fold_rotation(wo.T, None, r)  # inputs un-rotated per query head
    v_stored = heads_of(x @ wv_t + bv_r, kv_heads)
    assert np.allclose(v_stored, v @ r, atol=1e-12)
    out = _attention64(q @ r, k @ r, v_stored, heads // kv_heads).transpose(1, 0, 2).reshape(t, -1) @ wo_t
    assert np.allclose(out, want, rtol=1e-12, atol=1e-11)
    assert np.allclose((q @ r) @ (k @ r).transpose(0, 2, 1)[[0, 0, 1, 1]], q @ k.transpose(0, 2, 1)[[0, 0, 1, 1]],
                       atol=1e-10)  # scores unchanged


def test_reference_cache_stores_the_rotated_basis():
    """Stored rows are x @ R (float32, then hp); attention reads them back in the model basis."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 11, 64, generator=gen)
    scheme = rotated(KVQuantScheme(key=FP32, value=TensorQuant(format="int", bits=8, group_size=32)),
                     hp_dtype="fp32")
    cache = LayerCache(StreamCache(scheme.key, scheme), StreamCache(scheme.value, scheme))
    keys, values = cache.update(k, k)
    r = rotation_matrix("hadamard", 64)
    assert torch.equal(cache.key.tensors()["recent"], rotate_torch(k, r))
    assert torch.allclose(keys, k, atol=1e-6)  # model basis, unquantized
    assert torch.allclose(cache.key.dequantized(basis="stored"), rotate_torch(k, r))
    assert torch.allclose(values, k, atol=0.05)  # 8-bit in the rotated basis, read back un-rotated
    again = StreamCache(scheme.value, scheme)
    again.append(rotate_torch(k, r), basis="stored")
    assert torch.equal(again.codes, cache.value.codes)


def test_an_unknown_basis_is_refused_naming_the_allowed_ones():
    cache = StreamCache(FP32, KVQuantScheme(key=FP32, value=FP32))
    with pytest.raises(QuantizationError, match=r"^invalid basis='rotated': allowed: model, stored$"):
        cache.append(torch.zeros(1, 1, 1, 64), basis="rotated")
    cache.append(torch.ones(1, 1, 1, 64), basis=Basis.STORED)
    with pytest.raises(QuantizationError, match=r"^invalid basis='rotated': allowed: model, stored$"):
        cache.dequantized(basis="rotated")
    assert torch.equal(cache.dequantized(basis=Basis.STORED), torch.ones(1, 1, 1, 64))


# -- exported graphs ------------------------------------------------------------------------------------------
def _logits(directory, prompts=PROMPTS["padded"], steps=6, verify_weights=True):
    session = KVQSession(directory, verify_weights=verify_weights)
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    logits, cache = session.step(ids, mask)
    out = [logits[:, -1]]
    for token in np.random.default_rng(0).integers(0, VOCAB, (steps, len(prompts))):
        logits, cache = session.step(token[:, None], None, cache)
        out.append(logits[:, -1])
    return np.stack(out)


@pytest.mark.parametrize("flavor", ["reference", "ort-gqa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: v_proj bias rotated too
def test_unquantized_rotated_export_equals_unrotated(tmp_path, arch, flavor):
    model = tiny_model(arch)
    plain = _logits(export_model(model, UNQUANTIZED, tmp_path / "plain", flavor=flavor))
    for name, key, value in (("kv", "hadamard", "hadamard"), ("v", "none", "hadamard")):
        scheme = rotated(UNQUANTIZED, key, value)
        got = _logits(export_model(model, scheme, tmp_path / name, flavor=flavor))
        assert np.abs(got - plain).max() <= 1e-5 * max(1.0, float(np.abs(plain).max())), (name, flavor)


def test_gqa_rotated_keys_unfuse_rope_and_name_probes(tmp_path):
    from kvq_export.flavors.ort_gqa.graph import GQACacheGraph

    model = tiny_model("llama")
    with pytest.raises(ExportError, match="RoPE cannot be fused"):
        GQACacheGraph(rotated(UNQUANTIZED), Geometry(num_layers=2, num_kv_heads=2, head_dim=32))
    import onnx

    for name, key in (("keys", "hadamard"), ("values", "none")):
        out = export_model(model, rotated(UNQUANTIZED, key, "hadamard"), tmp_path / name, flavor="ort-gqa")
        graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
        do_rotary = {a.i for n in graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
                     if a.name == "do_rotary"}
        assert do_rotary == ({0} if key == "hadamard" else {1}), name  # value rotation keeps fused RoPE
        manifest = Manifest.load(out)
        rule = manifest.to_dict()["cache"]["rotation"]
        assert "x @ R" in rule["rule"] and rule["layers"][0]["value"] == "hadamard 32x32"


def test_non_power_of_two_head_dim_export(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(**{**COMMON, "head_dim": 48, "num_attention_heads": 4, "tie_word_embeddings": False})
    model = LlamaForCausalLM(config).eval()
    plain = _logits(export_model(model, UNQUANTIZED, tmp_path / "plain"))
    out = export_model(model, rotated(UNQUANTIZED), tmp_path / "rot")
    assert np.abs(_logits(out) - plain).max() <= 1e-5 * max(1.0, float(np.abs(plain).max()))
    assert Manifest.load(out).to_dict()["cache"]["rotation"]["layers"][0]["key"] == \
        "block-diagonal hadamard (32 + 16)"


def test_value_rotation_in_graph_when_the_arch_cannot_fold(tmp_path):
    """An architecture that cannot fold the value rotation rotates v and the output in the graph instead."""
    import onnx_ir as ir

    from kvq_export.arch import get_arch
    from kvq_export.export.decoder import build_decoder
    from kvq_export.flavors.reference.graph import QuantizedCacheGraph
    from kvq_export.graph.builder import save

    model = tiny_model("qwen2")
    scheme = rotated(Q4_TOKEN)
    folded = _logits(export_model(model, scheme, tmp_path / "folded"))
    arch = get_arch(model.config)
    arch.folds_value_rotation = False
    cache = QuantizedCacheGraph(scheme, Geometry(num_layers=2, num_kv_heads=2, head_dim=32))
    graph = build_decoder(model, arch, cache)
    assert sum(1 for n in graph.graph if n.op_type == "MatMul" and any(
        i is not None and i.name.startswith("rotation.") for i in n.inputs)) == 2 * 2 + 2 * 2  # q,k + v,out
    directory = tmp_path / "in-graph"
    directory.mkdir()
    save(graph, directory / "model.onnx")
    (directory / "kvq.json").write_text((tmp_path / "folded" / "kvq.json").read_text())
    assert isinstance(graph, ir.Model)
    # the graph was swapped in under the folded export's manifest, whose weight checksums it cannot match
    assert np.abs(_logits(directory, verify_weights=False) - folded).max() <= 1e-4


@pytest.mark.parametrize("scheme", [rotated(Q4_TOKEN), rotated(KIVI_R0, key="none"), rotated(KIVI_R0)],
                         ids=["q4-token", "kivi-r0-values", "kivi-r0-both"])
def test_quantized_rotated_export_tracks_the_reference_cache(tmp_path, scheme):
    """Codes equal the reference cache's (tests/test_export_runtime.py tolerances); logits within 1e-4."""
    model = tiny_model("llama")
    directory = export_model(model, scheme, tmp_path / "e")
    session = KVQSession(directory)
    prompt = PROMPTS["solo"][0]
    stream = np.random.default_rng(1).integers(0, VOCAB, 20)
    logits, cache = session.step(np.array([prompt]))
    got = [logits[0]]
    for token in stream:
        logits, cache = session.step(np.array([[token]]), None, cache)
        got.append(logits[0])
    want, ref = reference_run(model, scheme, None, prompt, stream)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) <= 1e-4
    arrays = session.cache_arrays(cache)
    compare_state(arrays, 0, ref, scheme, None)
    stored = decode_cache(session.manifest, arrays, direction="past")
    model_basis = decode_cache(session.manifest, arrays, direction="past", basis="model")
    with pytest.raises(RuntimeInputError, match=r"^invalid basis='rotated': allowed: model, stored$"):
        decode_cache(session.manifest, arrays, direction="past", basis="rotated")
    for layer, layer_cache in enumerate(ref.layers):
        for index, part in enumerate(("key", "value")):
            stream_ref = getattr(layer_cache, part)
            assert np.allclose(stored[0][layer][index], stream_ref.dequantized(basis="stored")[0].numpy(),
                               atol=0.05, rtol=0.05)
            assert np.allclose(model_basis[0][layer][index], stream_ref.dequantized()[0].numpy(),
                               atol=0.05, rtol=0.05)


def test_gqa_static_rotated_codes_equal_the_reference_cache(tmp_path_factory):
    """ort-gqa int8 with rotated keys and values: calibrated in the rotated basis, codes as the reference's."""
    scheme = rotated(dataclasses.replace(PRESETS["ort-int8"][0], hp_dtype="fp32"), name="ort-int8-rot")
    prompts = PROMPTS["padded"]
    static = calibration("llama", scheme, covering=sequences(prompts, 10))
    out = tmp_path_factory.mktemp("gqa") / "rot"
    session = KVQSession(export_model(tiny_model("llama"), scheme, out, static=static, flavor="ort-gqa"))
    c = compare(session, "llama", scheme, static, prompts, steps=10)
    assert c.logits <= 1e-4, c
    assert c.saturated == 0 and c.worse == 0 and c.off_by_one <= max(1, c.codes // 500), c
    assert load_static(out, session.manifest) is not None


def test_static_calibration_measures_the_rotated_basis():
    from kvq_export.calibration import calibrate_static_scales
    from kvq_export.calibration.passes import collect_kv
    from kvq_export.calibration.positions import KeyPositions

    model = tiny_model("llama")
    tq = TensorQuant(format="int_sym", bits=8, axis="channel", scales="static", scale_dtype="fp32")
    windows = [list(range(1, 40))]
    plain = calibrate_static_scales(model, KVQuantScheme(key=tq, value=tq), windows)
    rot = calibrate_static_scales(model, rotated(KVQuantScheme(key=tq, value=tq)), windows)
    keys = collect_kv(model, windows, {(0, "key")}, 2)[(0, "key")]
    keys = KeyPositions.of(model.config, model.config.max_position_embeddings).keys(0, keys, [len(windows[0])])
    r = rotation_matrix("hadamard", 32)
    want = (rotate_torch(keys, r).abs().amax(dim=1) / 127).numpy()
    assert np.allclose(rot[0]["key"]["scales"], want, rtol=1e-6)
    assert not np.allclose(plain[0]["key"]["scales"], want, rtol=1e-3)


@pytest.mark.parametrize("scheme", [rotated(Q4_TOKEN), rotated(KIVI_R0, key="none")], ids=["q4", "kivi"])
def test_cache_graph_is_bit_exact_with_the_reference_on_rotated_tokens(scheme):
    """The graph gets the body's rotated tokens; the reference rotates the same tokens itself: same bits."""
    rk, rv = (rotation_matrix(tq.rotation, 32) for tq in (scheme.key, scheme.value))
    graph = CacheOnly(scheme, attention_facts(num_heads=4, num_kv_heads=2, head_dim=32))
    ref = LayerCache(StreamCache(scheme.key, scheme), StreamCache(scheme.value, scheme))
    gen = torch.Generator().manual_seed(2)
    cache = graph.empty(1)
    for t in (7, 1, 1, 5, 1):
        k, v = torch.randn(1, 2, t, 32, generator=gen) * 3, torch.randn(1, 2, t, 32, generator=gen)
        q = torch.randn(1, 4, t, 32, generator=gen)
        kr, vr = rotate_torch(k, rk).float(), rotate_torch(v, rv).float()
        _, cache, arrays = graph.step(rotate_torch(q, rk).float().numpy(), kr.numpy(), vr.numpy(),
                                      np.ones((1, t), np.int64), cache)
        ref.update(k, v)
    for part in Part:
        for role, want in getattr(ref, part).tensors().items():
            got = arrays[f"past.0.{part}.{role}"]
            assert np.array_equal(got[:, :, got.shape[2] - want.shape[2]:], want.numpy()), (part, role)
