"""``--flavor ort-gqa`` (com.microsoft.GroupQueryAttention over a shared cache buffer) vs kvq's reference cache.

Each case teacher-forces a prompt (alone, or a left-padded batch of two) and 50 single-token steps through
the export on ONNX Runtime and, one prompt at a time, through the PyTorch model running kvq's reference
cache with the same static scales (``tests/gqa_harness.py``). The runtime starts with a 16-token buffer,
so every case also grows it (``chunked``: the prompts in two calls). The reference runs the export's prefill
rule (``exact_prefill``): a prompt or chunk attends over the earlier codes and its own exact K/V and stores
their codes, the steps attend over the codes. The prefill itself is checked at the end of the file: the node's
bytes bit for bit, the unquantized export's logits, a prompt joining a row that holds tokens.

Tolerances, measured on the four tiny architectures (see the ``measured`` notes):

* **Exact conditions** -- ``hp_dtype=fp32`` (the reference then quantizes the fp32 K/V, as GQA does) and
  scales that cover every value (calibrated on the test's own tokens, widened 5%): codes are identical
  except float noise at a rounding boundary (measured: 0 everywhere but qwen2 solo, 14 of 14592 = 0.1%,
  all ±1), logits max |Δ| <= 1e-4 (measured <= 7e-7, 6.7e-5 in that qwen2 case; with a code off by one
  <= 1e-3: the high-channel scheme measured 1.5e-4 there, 7 codes of 14592 off), and the manifest-only
  decode equals the reference's dequantized K/V. Unquantized fp32 buffers: logits <= 1e-5 (measured 1e-6).
  Streams with zero points (the graph offsets them so the node stores kvq's unsigned codes): measured 0 code
  differences for int4 keys with zero points (logits <= 1e-6); int8 with zero points on the values (GQA's
  packed q|k|v path) at most 1 of 29184 codes off by one (padded cases), logits <= 3.8e-5. High channels
  (8 per head at 8 bits, split over two nibbles of a head of head_dim + 8): 0 code differences but in qwen2
  solo (above), logits <= 7.2e-7.
* **The presets as shipped** (fp16 high precision, scales from other text): two documented conventions
  separate the codes. (1) kvq's reference cache rounds new K/V to fp16 before quantizing them, GQA
  quantizes the fp32 values: measured 0.02%-2.7% of codes differ by exactly 1. (2) Saturation: GQA clamps
  to [-2^(b-1), 2^(b-1)-1], kvq to ±(2^(b-1)-1), so a value below the calibrated range stores -128/-8
  where kvq stores -127/-7 (measured up to 66 of 29184 codes). No code differs by more than 1. Logits:
  measured max |Δ| 5.1e-3 (int8) and 1.9e-2 (int4) at logits of magnitude 0.7-1.9; asserted <= 1e-2
  and <= 4e-2 of the largest |logit|. fp16 buffers: measured 2e-4, asserted <= 2e-3 of it.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from gqa_harness import PROMPTS, SCHEMES, calibration, compare, editable, left_pad, sequences, step_nodes
from tiny_models import ARCHS, VOCAB, tiny_model

from kvq_export.errors import ExportError, RuntimeInputError, SchemeError
from kvq_export.export.exporter import export_model
from kvq_export.flavors.ort_gqa.capability import unsupported
from kvq_export.flavors.ort_gqa.graph import GQABodyRopeCacheGraph, GQACacheGraph
from kvq_export.flavors.ort_gqa.plan import gqa_scale
from kvq_export.model_facts import Geometry
from kvq_export.presets import PRESETS
from kvq_export.runtime.session import KVQSession
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Role


def _export(tmp_path_factory, arch, scheme, static, **kw):
    out = tmp_path_factory.mktemp("gqa") / f"{arch}-{(scheme.name or 'custom').replace('/', '_')}"
    return KVQSession(export_model(tiny_model(arch), scheme, out, static=static, flavor="ort-gqa", **kw))


@pytest.mark.parametrize("name", ["fp32", "ort-int8/hp-fp32", "ort-int4/hp-fp32", "ort-int4-asymk/hp-fp32",
                                  "int8-asymv/hp-fp32", "int4-high/hp-fp32"])
@pytest.mark.parametrize("batch", ["solo", "padded", "chunked"])
@pytest.mark.parametrize("arch", ARCHS)
def test_codes_and_logits_equal_the_reference_cache(tmp_path_factory, arch, batch, name):
    """``chunked``: the padded prompts in two calls (row 0 starts in the first, both continue in the second)."""
    scheme, prompts = SCHEMES[name], PROMPTS["padded" if batch == "chunked" else batch]
    static = calibration(arch, scheme, covering=sequences(prompts))
    session = _export(tmp_path_factory, arch, scheme, static)
    c = compare(session, arch, scheme, static, prompts, split=6 if batch == "chunked" else None)
    assert c.logits <= (1e-5 if not scheme.quantized else 1e-4 if not c.off_by_one else 1e-3), c
    assert c.saturated == 0 and c.worse == 0 and c.off_by_one <= max(1, c.codes // 500), c
    if scheme.quantized and c.off_by_one == 0:
        assert c.decoded == 0.0, c  # the manifest alone decodes exactly what the reference attends to
    assert c.hp <= 1e-5


@pytest.mark.parametrize("name", ["fp16", "ort-int8", "ort-int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_presets_track_the_reference_cache_left_padded(tmp_path_factory, arch, name):
    scheme = SCHEMES[name]
    static = calibration(arch, scheme)  # random windows: later tokens saturate
    c = compare(_export(tmp_path_factory, arch, scheme, static), arch, scheme, static, PROMPTS["padded"])
    assert c.worse == 0 and c.off_by_one <= 0.05 * max(c.codes, 1), c
    limit = {"fp16": 2e-3, "ort-int8": 1e-2, "ort-int4": 4e-2}[name]
    assert c.logits <= limit * c.logits_scale, c
    if not scheme.quantized:
        assert c.hp <= 2**-10, c  # one fp16 rounding


def test_left_padded_batch_equals_each_prompt_alone(tmp_path_factory):
    scheme = SCHEMES["ort-int8"]
    static = calibration("llama", scheme)
    session = _export(tmp_path_factory, "llama", scheme, static)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [42]]
    batch = session.generate(prompts, 20, stop_at_eos=False)
    for prompt, result in zip(prompts, batch):
        assert session.generate([prompt], 20, stop_at_eos=False)[0].tokens == result.tokens
    ids, mask = left_pad(prompts)
    logits, _ = session.step(ids, mask)
    for row, prompt in enumerate(prompts):
        alone, _ = session.step(np.array([prompt]))
        assert np.abs(logits[row, ids.shape[1] - len(prompt):] - alone[0]).max() <= 1e-5


def test_past_and_present_share_one_buffer(tmp_path_factory):
    scheme = SCHEMES["ort-int4"]
    session = _export(tmp_path_factory, "llama", scheme, calibration("llama", scheme))
    cache = session.empty_cache(2, capacity=32)
    buffers = {name: (value, value.data_ptr()) for name, value in cache.items() if name.endswith(".buffer")}
    nbytes = session.cache_nbytes(cache)
    assert nbytes == 2 * 2 * (2 * 2 * 32 * 16)  # layers x (K, V) x [batch, heads, capacity, 32 / 2]
    _, cache = session.step(np.array([[1, 2, 3], [0, 4, 5]]), np.array([[1, 1, 1], [0, 1, 1]]), cache)
    for _ in range(10):
        _, cache = session.step(np.array([[7], [8]]), None, cache)
    for name, (value, pointer) in buffers.items():  # written in place: same OrtValue, same memory
        assert cache[name] is value and cache[name].data_ptr() == pointer
    assert session.cache_nbytes(cache) == nbytes and session.seq_lengths(cache).tolist() == [13, 12]
    # an idle row (mask 0) keeps its length; a step past the capacity grows the buffers once
    _, cache = session.step(np.zeros((2, 25), np.int64), np.concatenate([np.ones((1, 25)), np.zeros((1, 25))]).astype(
        np.int64), cache)
    assert session.seq_lengths(cache).tolist() == [38, 12]
    assert cache["past.0.key.buffer"].shape() == [2, 2, 64, 16]


def test_steps_carry_their_binding_and_match_fresh_bindings(tmp_path_factory):
    """A step's cache carries its IO binding to the next step: the same logits and bytes as binding afresh.

    Two caches stepped alternately on one session each keep their own binding; a plain dict copy of a cache, a
    grown cache and another batch size bind afresh; logits a step returned are never overwritten by a later one.
    """
    scheme = SCHEMES["ort-int8"]
    session = _export(tmp_path_factory, "llama", scheme, calibration("llama", scheme))
    ids, mask = left_pad([[1, 2, 3], [9, 8, 7, 6, 5]])
    carried = [session.step(ids, mask, session.empty_cache(2, capacity=8))[1] for _ in range(2)]
    fresh = session.step(ids, mask, session.empty_cache(2, capacity=8))[1]
    kept = []
    for token in range(12):  # 5 + 12 tokens cross the capacities of 8 and 16: each cache grows twice
        step = np.array([[token + 3], [token + 4]])
        outs = []
        for i in range(2):
            logits, carried[i] = session.step(step, None, carried[i])
            outs.append(logits)
        logits, fresh = session.step(step, None, dict(fresh))
        assert np.array_equal(outs[0], logits) and np.array_equal(outs[1], logits)
        kept.append((outs[0], outs[0].copy()))
    assert all(np.array_equal(a, b) for a, b in kept)
    assert carried[0]["past.0.key.buffer"].shape()[2] == 32 and session.seq_lengths(carried[0]).tolist() == [15, 17]
    for name in fresh:
        a, b = carried[0][name].numpy(), fresh[name].numpy()
        assert np.array_equal(a[:, :, :15] if a.ndim == 4 else a, b[:, :, :15] if b.ndim == 4 else b), name
    one, _ = session.step(np.array([[7]]), None, session.step(np.array([[1, 2, 3]]))[1])
    assert one.shape == (1, 1, VOCAB)


def test_capacity_is_bounded_by_the_rotary_table(tmp_path_factory):
    session = _export(tmp_path_factory, "llama", SCHEMES["fp16"], None)
    assert session.max_capacity == 1024  # the tiny config's max_position_embeddings
    with pytest.raises(RuntimeInputError, match="capacity 2000 exceeds the 1024 positions"):
        session.empty_cache(1, capacity=2000)
    result = session.generate([[1, 2, 3]], 5)[0]
    assert len(result.tokens) == 5 and result.cache_bytes == 2 * 2 * (1 * 2 * 8 * 32 * 2)  # capacity 3 + 5
    _, cache = session.step(np.arange(700)[None] % VOCAB, None, session.empty_cache(1, capacity=300))
    assert cache["past.0.key.buffer"].shape()[2] == 700  # grown to what the step needed (> 2 x 300)
    _, cache = session.step(np.ones((1, 20), np.int64), None, cache)
    assert cache["past.0.key.buffer"].shape()[2] == 1024  # doubling stops at the rotary table
    _, cache = session.step(np.ones((1, 300), np.int64), None, cache)
    with pytest.raises(RuntimeInputError, match="capacity 1030 exceeds the 1024 positions"):
        session.step(np.ones((1, 10), np.int64), None, cache)


def test_manifest_describes_the_buffer_layout(tmp_path_factory):
    scheme = SCHEMES["ort-int4"]
    session = _export(tmp_path_factory, "qwen2", scheme, calibration("qwen2", scheme))
    data = json.loads((session.directory / "kvq.json").read_text())
    assert data["flavor"] == "ort-gqa" and data["cache"]["layout_name"] == "buffer"
    assert "left-aligned" in data["cache"]["layout"]
    buf = next(t for t in data["cache"]["past"] if t["name"] == "past.1.value.buffer")
    assert buf == {**buf, "dtype": "uint8", "role": "buffer", "bits": 4, "shape": ["batch", 2, "capacity", 16]}
    assert "low nibble" in buf["packing"]
    int8 = [t for t in KVQSession(_export_int8(session)).past if t.role == Role.BUFFER]
    assert {t.dtype for t in int8} == {"int8"}


def _export_int8(session):
    scheme = SCHEMES["ort-int8"]
    out = session.directory.parent / "qwen2-int8"
    return export_model(tiny_model("qwen2"), scheme, out, static=calibration("qwen2", scheme), flavor="ort-gqa")


@pytest.mark.parametrize("name", ["ort-int8", "int4-high/hp-fp32"])  # high channels: codes computed in fp32
def test_fp16_compute_graph_tracks_the_fp32_graph(tmp_path_factory, name):
    scheme = SCHEMES[name]
    static = calibration("mistral", scheme)
    fp32 = _export(tmp_path_factory, "mistral", scheme, static)
    fp16 = _export(tmp_path_factory, "mistral", scheme, static, dtype="fp16")
    prompt = np.random.default_rng(0).integers(0, VOCAB, (1, 60))  # past the sliding window
    a, _ = fp32.step(prompt)
    b, _ = fp16.step(prompt)
    assert float(np.abs(a - b).max() / np.abs(a).max()) < 2e-2


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "phi3"])
def test_unfused_rotary_path_matches_and_names_probes(tmp_path_factory, monkeypatch, arch):
    """GQABodyRopeCacheGraph: RoPE in the body on the packed q|k|v, do_rotary=0 in the node, one packed probe.

    The fused graph names only the raw projections; its probed session rotates them with each layer's own
    tables (Gemma3: local and global RoPE) over each layer's rotary channels (Phi3: half of each head) at
    each row's positions, and must give the unfused graph's post-RoPE probes (left-padded batch).
    """
    import onnx

    from kvq_export.validate.probe import ProbedSession

    scheme = SCHEMES["ort-int8/hp-fp32"]
    static = calibration(arch, scheme)
    fused = ProbedSession(_export(tmp_path_factory, arch, scheme, static).directory)
    out = tmp_path_factory.mktemp("unfused") / "m"
    monkeypatch.setattr(GQACacheGraph, "for_model", classmethod(
        lambda cls, scheme, facts, static=None: GQABodyRopeCacheGraph(scheme, facts, static=static)))
    unfused = ProbedSession(export_model(tiny_model(arch), scheme, out, static=static, flavor="ort-gqa"))
    ids, mask = left_pad(PROMPTS["padded"])
    a, ca = fused.step(ids, mask)
    b, cb = unfused.step(ids, mask)
    for token in range(5):
        assert fused.last_extra.keys() == unfused.last_extra.keys()
        for name, want in unfused.last_extra.items():
            got = fused.last_extra[name]
            assert got.shape == want.shape, name
            real = np.broadcast_to(mask[:, None, :, None].astype(bool), want.shape) if token == 0 else ...
            assert np.abs(got - want)[real].max() <= 1e-5 * max(1.0, np.abs(want).max()), name
        a, ca = fused.step(np.full((2, 1), token), None, ca)
        b, cb = unfused.step(np.full((2, 1), token), None, cb)
        assert np.abs(a - b).max() <= 1e-4
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    named = {o for n in graph.node for o in n.output}
    assert {"probe.0.qkv", "probe.1.qkv"} <= named  # the body's RoPE on the packed q|k|v: one probe per layer
    assert "probe.1.key" not in named and not any(n.op_type == "Transpose" and "gqa" in n.name for n in graph.node)
    nodes = [*graph.node, *(n for node in graph.node if node.op_type == "If" for a in node.attribute
                            for n in a.g.node)]  # a quantized layer's nodes: the prefill and step branches
    rotary = {a.i for n in nodes if n.op_type == "GroupQueryAttention" for a in n.attribute if a.name == "do_rotary"}
    assert rotary == {0}
    fused_names = {o for n in onnx.load(fused.directory / "model.onnx", load_external_data=False).graph.node
                   for o in n.output}
    split = arch == "gemma3"  # q/k norms between projection and node: the parts are split out anyway
    assert ("probe.1.key.projected" in fused_names) == split != ("probe.1.qkv.projected" in fused_names)
    assert "probe.1.key" not in fused_names


def test_high_channels_without_their_calibrated_choice_are_refused(tmp_path):
    """Static scales without the chosen high channels: the export names what is missing (kvq never guesses)."""
    scheme = SCHEMES["int4-high/hp-fp32"]
    static = editable(calibration("llama", scheme))
    for parts in static.values():
        for meta in parts.values():
            meta.pop("high_channels")
    with pytest.raises(SchemeError, match=r"the calibration lacks high_channels for layer 0 key \(8 8-bit channels"):
        export_model(tiny_model("llama"), scheme, tmp_path / "m", static=static, flavor="ort-gqa")
    assert not (tmp_path / "m").exists()


def test_a_graph_without_probes_is_refused_by_name(tmp_path_factory):
    """A probed session needs one of the probe forms; a graph without any says which probe is missing."""
    import shutil

    import onnx

    from kvq_export.validate.probe import ProbedSession

    scheme = SCHEMES["ort-int8/hp-fp32"]
    directory = _export(tmp_path_factory, "llama", scheme, calibration("llama", scheme)).directory
    bare = tmp_path_factory.mktemp("bare") / "m"
    shutil.copytree(directory, bare)
    model = onnx.load(bare / "model.onnx", load_external_data=False)
    kept = [n for n in model.graph.node if not any(o.startswith("probe.") for o in n.output)]
    assert len(kept) < len(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    onnx.save(model, bare / "model.onnx")
    with pytest.raises(RuntimeInputError, match=r"has no probe\.0\.q"):
        ProbedSession(bare, verify_weights=False)  # model.onnx changed on purpose


def _gqa_attrs(session) -> list[dict]:
    import onnx

    graph = onnx.load(session.directory / "model.onnx", load_external_data=False).graph
    return [{a.name: (a.s.decode() if a.s else a.i) for a in n.attribute} for n in step_nodes(graph)]


def test_token_axis_scales_and_a_fp16_layer_among_int8(tmp_path_factory):
    """Token-axis static groups expand to PER_CHANNEL; per-layer overrides give each node its own cache type."""

    def int_sym(bits, axis="channel", group=None):
        return TensorQuant(format="int_sym", bits=bits, axis=axis, group_size=group, scales="static",
                           scale_dtype="fp32")

    scheme = KVQuantScheme(key=int_sym(8, "token", 16), value=int_sym(8), hp_dtype="fp32",
                           layer_overrides=(LayerOverride(1, TensorQuant.fp16(), TensorQuant.fp16()),), name="mixed")
    prompts = PROMPTS["padded"]
    static = editable(calibration("llama", scheme, covering=sequences(prompts)))
    top = float(static[0]["value"]["scales"].max())
    static[0]["value"]["scales"] = np.full_like(static[0]["value"]["scales"], top)  # alone it would be PER_TENSOR
    session = _export(tmp_path_factory, "llama", scheme, static)
    c = compare(session, "llama", scheme, static, prompts)
    assert c.logits <= 1e-4 and c.saturated == 0 and c.worse == 0 and c.off_by_one <= c.codes // 500, c
    attrs = _gqa_attrs(session)
    assert attrs[0]["k_quant_type"] == attrs[0]["v_quant_type"] == "PER_CHANNEL"  # the kernel needs them equal
    assert "k_quant_type" not in attrs[1]  # layer 1: an unquantized fp32 buffer
    assert [t.dtype for t in session.past if t.role == Role.BUFFER] == ["int8", "int8", "float32", "float32"]


def test_equal_scales_use_per_tensor(tmp_path_factory):
    scheme = SCHEMES["ort-int4/hp-fp32"]
    prompts = PROMPTS["solo"]
    static = editable(calibration("llama", scheme, covering=sequences(prompts)))
    for parts in static.values():
        for meta in parts.values():
            meta["scales"] = np.full_like(meta["scales"], meta["scales"].max())
    session = _export(tmp_path_factory, "llama", scheme, static)
    assert {(a["k_quant_type"], a["v_quant_type"]) for a in _gqa_attrs(session)} == {("PER_TENSOR", "PER_TENSOR")}
    c = compare(session, "llama", scheme, static, prompts)
    assert c.logits <= 1e-4 and c.saturated == 0 and c.worse == 0 and c.off_by_one <= c.codes // 500, c


def test_gqa_scale_mapping():
    tq = PRESETS["ort-int8"][0].key
    kind, array = gqa_scale(tq, np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), Geometry(1, 2, 2))
    assert kind == "PER_CHANNEL" and array.shape == (1, 2, 1, 2) and array[0, 1, 0, 0] == 3.0
    kind, array = gqa_scale(tq, np.full((2, 2), 0.5, np.float32), Geometry(1, 2, 2))
    assert kind == "PER_TENSOR" and array.tolist() == [0.5]
    half = dataclasses.replace(tq, axis="token", scale_dtype="fp16")
    kind, array = gqa_scale(half, np.array([[0.1], [0.2]], np.float32), Geometry(1, 2, 4))
    assert kind == "PER_CHANNEL" and array[0, 1, 0].tolist() == [np.float32(np.float16(0.2))] * 4


@pytest.mark.parametrize("preset, reason", [
    ("kivi-4", "dynamic scales"),
    ("q4_0", "dynamic scales"),
    ("int8", "dynamic scales"),
    ("fp8", "format fp8_e4m3"),
    ("kivi-2", "2 bits|format int"),
])
def test_unsupported_schemes_are_refused_with_the_reason(tmp_path, preset, reason):
    scheme = PRESETS[preset][0]
    with pytest.raises(ExportError, match=f"flavor ort-gqa cannot hold scheme {preset}: .*({reason})"):
        export_model(tiny_model("llama"), scheme, tmp_path / preset, flavor="ort-gqa")
    assert not (tmp_path / preset).exists()


def test_windows_and_mixed_key_value_are_refused():
    int8 = PRESETS["ort-int8"][0].key
    assert unsupported(KVQuantScheme(key=int8, value=int8, residual_length=16), 2) == [
        "residual_length=16, sink_tokens=0: GQA keeps no high-precision window (both must be 0)"]
    reasons = unsupported(KVQuantScheme(key=int8, value=TensorQuant.fp16()), 2)
    assert len(reasons) == 1 and "one cache type and one kv_cache_bit_width" in reasons[0]
    # one line per reason, naming the layers it applies to (a 30-layer plan gives a few lines, not 150)
    int4 = PRESETS["ort-int4"][0].key
    overrides = tuple(LayerOverride(layer, key=int4, value=TensorQuant.fp16()) for layer in (0, 1, 2, 5))
    assert unsupported(KVQuantScheme(key=int8, value=int8, layer_overrides=overrides), 6) == [
        "layers 0-2, 5 key and value: different cache types or bit widths, but one GQA node has one cache type and "
        "one kv_cache_bit_width"]


def test_high_channels_must_match_and_fit_the_node_head():
    from gqa_harness import SCHEMES

    high = SCHEMES["int4-high/hp-fp32"]
    assert unsupported(high, 2, head_dim=64) == []
    reasons = unsupported(dataclasses.replace(high, value=dataclasses.replace(high.value, high_channels=16)), 2)
    assert reasons == ["every layer key and value: different high_channels, but one GQA node has one head size "
                       "(head_dim + n)"]
    odd = dataclasses.replace(high, key=dataclasses.replace(high.key, high_channels=4),
                              value=dataclasses.replace(high.value, high_channels=4))
    assert unsupported(odd, 2) == []  # the head size is only known with head_dim
    reasons = unsupported(odd, 2, head_dim=64)
    assert len(reasons) == 1 and "head_dim + n = 68 channels is not a multiple of 8" in reasons[0]


def test_static_scales_need_calibration(tmp_path):
    with pytest.raises(ExportError, match="static scales: calibrate first"):
        export_model(tiny_model("llama"), "ort-int4", tmp_path / "x", flavor="ort-gqa")
    with pytest.raises(ExportError, match="layer 0 key uses static scales but no calibration was given"):
        GQACacheGraph(PRESETS["ort-int4"][0], Geometry(num_layers=2, num_kv_heads=2, head_dim=32), static=None)


def test_fp16_buffer_with_fp32_compute_warns_about_cpu_casts(tmp_path, caplog):
    """ORT's CPU GQA has no fp16 kernel: it would cast the whole fp16 buffer every step; the export says so."""
    import logging

    import onnx
    import onnxruntime as ort

    with caplog.at_level(logging.WARNING, logger="kvq_export.flavors.ort_gqa.graph"):
        out = export_model(tiny_model("llama"), SCHEMES["fp16"], tmp_path / "fp16", flavor="ort-gqa")
    assert "casts the whole buffer to float32 and back every step" in caplog.text
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(out / "model.onnx"), options, providers=["CPUExecutionProvider"])
    inserted = [n for n in onnx.load(tmp_path / "optimized.onnx", load_external_data=False).graph.node
                if n.op_type == "Cast" and any("buffer" in name for name in n.input)]
    assert inserted  # what the warning is about; an fp32 buffer gets none, and no warning:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvq_export.flavors.ort_gqa.graph"):
        out = export_model(tiny_model("llama"), SCHEMES["fp32"], tmp_path / "fp32", flavor="ort-gqa")
    assert "casts the whole buffer" not in caplog.text
    ort.InferenceSession(str(out / "model.onnx"), options, providers=["CPUExecutionProvider"])
    assert not [n for n in onnx.load(tmp_path / "optimized.onnx", load_external_data=False).graph.node
                if n.op_type == "Cast" and any("buffer" in name for name in n.input)]


# -- prefill: exact attention among the prompt's tokens, the node's codes written once --------------------------

PREFILL_SCHEMES = ["ort-int8", "ort-int4", "ort-int4-asymk", "int8-asymv/hp-fp32", "int4-high/hp-fp32"]


def _every_call_quantized(tmp_path_factory, monkeypatch, arch, scheme, static):
    """The same export with ``fast_prefill=False``: the quantized node runs on every call, prefills too."""
    from kvq_export.export.exporter import export_model

    original = GQACacheGraph.for_model
    monkeypatch.setattr(GQACacheGraph, "for_model", classmethod(
        lambda cls, scheme, facts, *, static=None: original(scheme, facts, static=static, fast_prefill=False)))
    out = tmp_path_factory.mktemp("every-call") / f"{arch}-{(scheme.name or 'custom').replace('/', '_')}"
    return KVQSession(export_model(tiny_model(arch), scheme, out, static=static, flavor="ort-gqa"))


def _buffers(session, cache) -> dict[str, list[np.ndarray]]:
    """Each buffer's stored positions ``[0, seq_lengths[b])`` per row."""
    lengths = session.seq_lengths(cache)
    return {name: [value.numpy()[row, :, :n] for row, n in enumerate(lengths)]
            for name, value in cache.items() if name.endswith(".buffer")}


@pytest.mark.parametrize("name", PREFILL_SCHEMES)
def test_prefill_writes_the_codes_the_node_writes(tmp_path_factory, monkeypatch, name):
    """Layer 0 sees the same K/V either way: its buffers hold the quantized node's bytes, bit for bit.

    (Deeper layers' K/V follow from the exact attention below them, so they are checked against the reference
    cache instead: ``test_codes_and_logits_equal_the_reference_cache``.) Decode steps from one cache then give
    the same logits and bytes in both graphs: the decode branch is the node as before.
    """
    scheme = SCHEMES[name]
    static = calibration("llama", scheme)
    fast = _export(tmp_path_factory, "llama", scheme, static)
    every = _every_call_quantized(tmp_path_factory, monkeypatch, "llama", scheme, static)
    ids, mask = left_pad(PROMPTS["padded"])
    _, cache_fast = fast.step(ids, mask, fast.empty_cache(2, capacity=16))
    _, cache_every = every.step(ids, mask, every.empty_cache(2, capacity=16))
    got, want = _buffers(fast, cache_fast), _buffers(every, cache_every)
    layer0 = [n for n in got if n.startswith("past.0.")]
    assert len(layer0) == 2
    for buffer in layer0:
        for a, b in zip(got[buffer], want[buffer]):
            assert a.dtype == b.dtype and np.array_equal(a, b), buffer
    _, cache_copy = fast.step(ids, mask, fast.empty_cache(2, capacity=16))  # the same prefill again
    for a, b in zip(_buffers(fast, cache_copy).values(), got.values()):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    for token in (7, 3, 11):
        a, cache_fast = fast.step(np.full((2, 1), token), None, cache_fast)
        b, cache_copy = every.step(np.full((2, 1), token), None, cache_copy)
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    for a, b in zip(_buffers(fast, cache_fast).values(), _buffers(every, cache_copy).values()):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", PREFILL_SCHEMES)
def test_prefill_logits_are_the_unquantized_exports(tmp_path_factory, name):
    """A prompt attends over its own exact K/V: its logits are the fp32-buffer export's (left-padded batch)."""
    scheme = SCHEMES[name]
    quantized = _export(tmp_path_factory, "qwen2", scheme, calibration("qwen2", scheme))
    plain = _export(tmp_path_factory, "qwen2", SCHEMES["fp32"], None)
    ids, mask = left_pad(PROMPTS["padded"])
    a, _ = quantized.step(ids, mask)
    b, _ = plain.step(ids, mask)
    real = mask.astype(bool)
    assert np.abs(a - b)[real].max() <= 1e-5 * max(1.0, np.abs(b).max())


def test_a_prompt_joining_a_row_that_holds_tokens_gives_what_it_gives_alone(tmp_path_factory):
    """A call of several tokens is exact for every row, whatever the others hold: batching changes no answer.

    Row 0 holds a prompt and gets a chunk of two more; row 1 joins with a prompt of its own in the same call.
    Row 1's logits and codes are its prompt's alone; the quantized node would have attended over its codes.
    """
    scheme = SCHEMES["ort-int4"]
    fast = _export(tmp_path_factory, "llama", scheme, calibration("llama", scheme))
    first = (np.array([[0, 0, 4, 5, 6], [0, 0, 0, 0, 0]]), np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]))
    _, cache = fast.step(*first, fast.empty_cache(2, capacity=16))  # row 1 idle
    assert fast.seq_lengths(cache).tolist() == [3, 0]
    joined = (np.array([[0, 0, 0, 8, 9], [1, 2, 3, 4, 5]]), np.array([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]))
    a, cache = fast.step(*joined, cache)
    assert fast.seq_lengths(cache).tolist() == [5, 5]
    alone, cache_alone = fast.step(np.array([[1, 2, 3, 4, 5]]), None, fast.empty_cache(1, capacity=16))
    np.testing.assert_allclose(a[1], alone[0], rtol=0, atol=1e-5 * np.abs(alone).max())
    for joined_rows, alone_rows in zip(_buffers(fast, cache).values(), _buffers(fast, cache_alone).values()):
        assert np.array_equal(joined_rows[1], alone_rows[0])
