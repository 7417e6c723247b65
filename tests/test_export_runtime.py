"""Exported graphs on ONNX Runtime vs the PyTorch model running kvq's reference quantized cache.

Each case teacher-forces the same token stream through both sides: a prefill, then enough single-token
decode steps that every flush boundary (3 groups + the recent window) is crossed, for batch 1 and for
a left-padded batch of 2 on llama (a single row flushes one group); the other architectures' left-padded
batches flush one group. The PyTorch side runs each prompt alone.

Tolerances (documented): logits max |Δ| <= 1e-4 (fp32). Cache state: ONNX Runtime and torch sum
matmuls in different orders, so a K/V value sitting on an fp16 rounding boundary can land one fp16
ulp apart before it is stored; hence high-precision windows are compared to 1 fp16 ulp (plus 2^-12 of
the tensor's largest magnitude for values near zero, where fp32 noise exceeds an ulp) and codes may
differ by ±1 in at most 0.1% of entries. The cache logic itself is bit-exact: tests/test_kv_graph.py
feeds both sides identical K/V and requires identical state.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from state_harness import (
    REFERENCE_PROMPTS,
    calibrated_static,
    check_against_reference,
)
from tiny_models import ARCHS, VOCAB, fit_head_dim, tiny_model

from kvq_export.errors import ExportError, ModelError, RuntimeInputError
from kvq_export.export.exporter import export_model
from kvq_export.manifest import Manifest
from kvq_export.presets import PRESETS
from kvq_export.runtime.session import KVQSession
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.vocab import FinishReason

#: schemes beyond the presets that the export must carry end to end
EXTRA = {
    "high-channel-keys": KVQuantScheme(  # 8-bit channels inside 4-bit per-channel keys and 2-bit values
        key=TensorQuant(format="int", bits=4, axis="channel", group_size=8, high_channels=4),
        value=TensorQuant(format="int", bits=2, axis="channel", group_size=8, high_channels=8),
        residual_length=8, name="high-channel-keys"),
    "int6-rotated-values": KVQuantScheme(  # 6-bit codes in two planes; values in the Hadamard basis
        key=TensorQuant(format="int", bits=6, axis="channel", group_size=8),
        value=TensorQuant(format="int_sym", bits=6, group_size=16, rotation="hadamard"), name="int6-rotated-values"),
    "int3-high-channels": KVQuantScheme(  # 3-bit codes in two planes beside 8-bit channels; clipped rotated values
        key=TensorQuant(format="int", bits=3, axis="channel", group_size=8, high_channels=8),
        value=TensorQuant(format="int", bits=3, group_size=16, clip=0.85, rotation="hadamard"),
        name="int3-high-channels"),
    "recent-values": KVQuantScheme(  # the values' own exact window beside per-channel keys without one
        key=TensorQuant(format="int", bits=3, axis="channel", group_size=8),
        value=TensorQuant(format="int", bits=3, group_size=16, clip=0.9, rotation="hadamard", residual_length=5),
        name="recent-values"),
}


def _case(name: str):
    """A preset or an :data:`EXTRA` scheme by name."""
    return EXTRA[name] if name in EXTRA else PRESETS[name][0]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    made = {}

    def get(arch: str, preset: str):
        if (arch, preset) not in made:
            model, scheme = tiny_model(arch), fit_head_dim(_case(preset), 32)
            out = tmp_path_factory.mktemp("exports") / f"{arch}-{preset}"
            made[arch, preset] = export_model(model, scheme, out, static=calibrated_static(model, scheme))
        return made[arch, preset]

    return get


def _check_case(exports, arch, preset, batch, units=3):
    model, scheme = tiny_model(arch), fit_head_dim(_case(preset), 32)
    check_against_reference(exports(arch, preset), model, scheme, REFERENCE_PROMPTS[batch],
                            label=f"{arch}/{preset}/{batch}", units=units)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("batch", ["solo", "padded"])
def test_llama_every_preset(exports, preset, batch):
    # the left-padded batch flushes three groups; a single row, whose cache logic is the batch's, one
    _check_case(exports, "llama", preset, batch, units=3 if batch == "padded" else 1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_other_architectures_every_preset_left_padded(exports, arch, preset):
    # One unit flushed, not three: what these add to llama's cases is the decoder body around one cache graph,
    # and the cache graph is the same for every architecture (every later flush is llama's and test_kv_graph's).
    _check_case(exports, arch, preset, "padded", units=1)


@pytest.mark.parametrize("batch", ["solo", "padded"])
@pytest.mark.parametrize("scheme", sorted(EXTRA))
def test_llama_extra_schemes(exports, scheme, batch):
    _check_case(exports, "llama", scheme, batch)


def _plain_hf_vs_export(directory, model, tokens):
    session = KVQSession(directory)
    logits, cache = session.step(np.array([tokens[:6]]))
    steps = [logits[0]]
    for t in tokens[6:]:
        logits, cache = session.step(np.array([[t]]), None, cache)
        steps.append(logits[0])
    with torch.no_grad():
        full = model(torch.tensor([tokens])).logits[0].numpy()
    return float(np.abs(np.concatenate(steps) - full).max()), float(np.abs(full).max()), session


def test_fp16_export_matches_plain_hf_model(exports, tmp_path):
    import dataclasses

    model = tiny_model("llama")
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    # fp32 storage of the same unquantized path: equal to the plain model
    fp32 = export_model(model, dataclasses.replace(PRESETS["fp16"][0], hp_dtype="fp32"), tmp_path / "fp32")
    diff32, _, _ = _plain_hf_vs_export(fp32, model, tokens)
    assert diff32 <= 1e-4
    # fp16 storage: attention reads fp16-rounded K/V, so logits move by fp16 rounding only
    diff16, scale, session = _plain_hf_vs_export(exports("llama", "fp16"), model, tokens)
    assert diff16 <= 2e-3 * scale
    gens = session.generate([tokens], max_new_tokens=12)
    with torch.no_grad():
        hf = model.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False)[0, len(tokens):].tolist()
    assert gens[0].tokens == hf


def test_manifest_describes_every_cache_tensor(exports):
    directory = exports("qwen2", "kivi-2")
    manifest = Manifest.load(directory)
    import json

    data = json.loads((directory / "kvq.json").read_text())
    assert data["flavor"] == "reference" and data["opset"] == 23 and data["model"]["num_kv_heads"] == 2
    codes = next(t for t in data["cache"]["past"] if t["name"] == "past.1.key.codes")
    assert codes == {**codes, "layer": 1, "part": "key", "role": "codes", "dtype": "uint8", "group_axis": "channel",
                     "group_size": 32, "bits": 2, "shape": ["batch", 2, "past.1.key.quantized_tokens", 8]}
    assert "lowest bits first" in codes["packing"]
    assert manifest.scheme == PRESETS["kivi-2"][0]


def test_generate_sampling_is_seeded_and_top_k_1_is_greedy(exports):
    from kvq_export.runtime.sampling import SamplingConfig

    session = KVQSession(exports("llama", "int4-sym-g32"))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    greedy = [g.tokens for g in session.generate(prompts, 10)]
    top1 = [g.tokens for g in session.generate(prompts, 10, SamplingConfig(temperature=0.7, top_k=1, seed=1))]
    a = [g.tokens for g in session.generate(prompts, 10, SamplingConfig(temperature=1.0, top_p=0.9, seed=5))]
    b = [g.tokens for g in session.generate(prompts, 10, SamplingConfig(temperature=1.0, top_p=0.9, seed=5))]
    assert greedy == top1 and a == b and all(len(t) == 10 for t in a)


def test_generate_stops_at_eos(exports, tmp_path):
    session = KVQSession(exports("llama", "int8"))
    first = session.generate([[1, 2, 3]], 5)[0].tokens
    tokenizer = dataclasses.replace(session.manifest.tokenizer, eos_token_id=first[2])
    session.manifest = dataclasses.replace(session.manifest, tokenizer=tokenizer)
    out = session.generate([[1, 2, 3], [9, 9]], 5)
    assert out[0].tokens == first[:3] and out[0].finish_reason == FinishReason.EOS


def test_runtime_checks_inputs(exports):
    session = KVQSession(exports("llama", "kivi-4"))
    _, cache = session.step(np.array([[1, 2, 3]]))
    broken = dict(cache)
    del broken["past.1.value.scales"]
    with pytest.raises(RuntimeInputError, match="past.1.value.scales is missing"):
        session.step(np.array([[4]]), None, broken)
    wrong = dict(cache, **{"past.0.key.codes": session.empty_cache(1)["past.0.key.recent"]})
    with pytest.raises(RuntimeInputError, match=r"past.0.key.codes: expected tensor\(uint8\), got tensor\(float16\)"):
        session.step(np.array([[4]]), None, wrong)
    with pytest.raises(RuntimeInputError, match=r"past.seq_lengths: expected shape \[2\], got \[1\]"):
        session.step(np.array([[4], [5]]), None, cache)
    from kvq_export.runtime.ort_setup import ort_value

    narrow = dict(cache, **{"past.0.key.codes": ort_value(np.zeros((1, 2, 0, 31), np.uint8), "uint8")})
    with pytest.raises(RuntimeInputError, match=r"past.0.key.codes: expected shape \[1, 2, 'past.0.key.quantized_tokens"
                                                r"', 16\], got \[1, 2, 0, 31\]"):
        session.step(np.array([[4]]), None, narrow)


def test_manifest_that_does_not_match_graph_is_refused(exports, tmp_path):
    import dataclasses
    import json
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(exports("llama", "int4-sym-g32"), copy)
    # q4_1 adds zero_points inputs that the q4_0 graph does not have
    data = dataclasses.replace(Manifest.load(copy), scheme=PRESETS["int4-g32"][0]).to_dict()
    (copy / "kvq.json").write_text(json.dumps(data))
    with pytest.raises(RuntimeInputError, match="manifest input past.0.key.zero_points is missing from the graph"):
        KVQSession(copy)
    data["cache"]["past"] = data["cache"]["past"][:-1]
    (copy / "kvq.json").write_text(json.dumps(data))
    with pytest.raises(RuntimeInputError, match="cache section does not match its scheme"):
        KVQSession(copy)


def test_export_refusals(tmp_path, exports):
    model = tiny_model("llama")
    with pytest.raises(ExportError, match="already exists"):
        export_model(model, "int4-sym-g32", exports("llama", "int4-sym-g32"))
    with pytest.raises(ExportError, match="static scales: calibrate first"):
        export_model(model, "ort-int8", tmp_path / "x")
    with pytest.raises(ExportError, match=r"unknown flavor 'nope'; allowed: (ort-gqa, )?reference(, trt)?"):
        export_model(model, "int4-sym-g32", tmp_path / "y", flavor="nope")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".*tmp*"))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ModelError, match="unsupported model_type 'gpt2'; supported: gemma, gemma2, gemma3_text, "
                                         "llama, mistral, olmo2, phi3, qwen2, qwen3$"):
        export_model(gpt2, "int4-sym-g32", tmp_path / "z")


def test_force_replaces_an_existing_export(tmp_path):
    model = tiny_model("llama")
    first = export_model(model, "int4-sym-g32", tmp_path / "out")
    export_model(model, "kivi-4", first, force=True)
    assert Manifest.load(first).scheme == PRESETS["kivi-4"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_fp16_compute_graph_tracks_the_fp32_graph(tmp_path):
    """--dtype fp16: the body and attention run in fp16 (softmax in fp32); the cache format is unchanged."""
    model = tiny_model("mistral")
    fp32 = KVQSession(export_model(model, "kivi-4", tmp_path / "fp32"))
    fp16 = KVQSession(export_model(model, "kivi-4", tmp_path / "fp16", dtype="fp16"))
    assert fp16.manifest.cache("past") == fp32.manifest.cache("past")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, (1, 170))  # past kivi's recent window: quantized tokens are attended
    a, ca = fp32.step(prompt)
    b, cb = fp16.step(prompt)
    worst = float(np.abs(a - b).max() / np.abs(a).max())
    for token in rng.integers(0, VOCAB, 8):
        a, ca = fp32.step(np.array([[token]]), None, ca)
        b, cb = fp16.step(np.array([[token]]), None, cb)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
    assert worst < 2e-2
    assert fp16.seq_lengths(cb).tolist() == [178]
