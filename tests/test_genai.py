"""onnxruntime-genai serves kvq's ort-gqa exports; kvq writes the builder's scale file.

The tiny models' word-level tokenizer is not one onnxruntime-genai reads, so prompts go in as token ids; the
text path runs on SmolLM2 (``test_smollm2_text_prompts_through_genai``, slow).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_harness import kvq
from genai_harness import builder_model_dir, run_builder
from gqa_harness import SCHEMES, calibration
from tiny_models import VOCAB, WORDS, byte_model, byte_tokenizer, layered_model, tiny_model

from kvq_export.calibration import calibrate_static_scales
from kvq_export.errors import ExportError, KVQError, RuntimeInputError
from kvq_export.export.exporter import export_model
from kvq_export.flavors.ort_gqa.genai import (
    GENAI_CONFIG,
    GENAI_MODEL,
    RUNTIME,
    engine_reason,
    genai_config,
)
from kvq_export.flavors.ort_gqa.genai_graph import adapt_graph
from kvq_export.manifest import MODEL_NAME, Manifest
from kvq_export.memory import predict
from kvq_export.model_facts import Geometry
from kvq_export.naming import present_name
from kvq_export.plan import plan_scheme, scheme_from_choice
from kvq_export.runtime.genai import GenaiSession, builder_scale_file, serve_command
from kvq_export.runtime.sampling import Sampler, SamplingConfig
from kvq_export.runtime.session import KVQSession
from kvq_export.scheme import KVQuantScheme
from kvq_export.vocab import FinishReason, Role

pytest.importorskip("onnxruntime_genai")

PROMPTS = {"solo": [[5, 17, 99, 3, 42, 8, 77]],
           "ragged": [[11, 12, 13], [60, 61, 2, 9, 100, 4, 4, 7, 1, 3, 3], [5, 17, 99, 3, 42, 8, 77]]}
NEW_TOKENS = 24
GEOMETRY = Geometry(num_layers=2, num_kv_heads=2, head_dim=32)  # tiny_models.COMMON


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("genai")
    out = {}
    for name in ("fp32", "ort-int8", "ort-int4", "ort-int4-asymk", "int4-high/hp-fp32"):
        scheme = SCHEMES[name]
        out[name] = export_model(tiny_model("llama"), scheme, root / name.replace("/", "_"), flavor="ort-gqa",
                                 static=calibration("llama", scheme))
    return out


def _held_bytes(scheme, seq_len: int, batch: int) -> int:
    """What the memory model predicts a buffer cache holds (static scales and zero points live in the graph)."""
    report = predict(scheme, GEOMETRY, seq_len, batch)
    return report.total_bytes - report.breakdown["scales"] - report.breakdown["zero_points"]


@pytest.mark.parametrize("batch", ["solo", "ragged"])
# asymk: RoPE and the offset in the body; int4-high: 8-bit channels in a node head of head_dim + 8 nibbles
@pytest.mark.parametrize("name", ["fp32", "ort-int8", "ort-int4-asymk", "int4-high/hp-fp32"])
def test_greedy_tokens_equal_kvq_generate(exports, name, batch):
    prompts = PROMPTS[batch]
    ours = KVQSession(exports[name]).generate(prompts, NEW_TOKENS)
    theirs = GenaiSession(exports[name]).generate(prompts, NEW_TOKENS)
    assert [r.tokens for r in theirs] == [r.tokens for r in ours]
    assert all(len(r.tokens) == NEW_TOKENS for r in theirs)
    capacity = max(map(len, prompts)) + NEW_TOKENS  # both runtimes size the buffer for the whole generation
    assert theirs[0].cache_bytes == ours[0].cache_bytes == _held_bytes(SCHEMES[name], capacity, len(prompts))


def test_int4_buffers_hold_two_codes_per_byte(exports):
    prompts = PROMPTS["ragged"]
    theirs = GenaiSession(exports["ort-int4"]).generate(prompts, 8)
    ours = KVQSession(exports["ort-int4"]).generate(prompts, 8)
    assert [r.tokens for r in theirs] == [r.tokens for r in ours]
    assert theirs[0].cache_bytes == _held_bytes(SCHEMES["ort-int4"], 11 + 8, 3) == ours[0].cache_bytes


def test_eos_ends_rows_alike(tmp_path):
    model = copy.deepcopy(tiny_model("llama"))
    prompts = PROMPTS["ragged"][:2]
    plain = KVQSession(export_model(model, SCHEMES["fp32"], tmp_path / "plain", flavor="ort-gqa")).generate(prompts, 12)
    # row 1 ends at its 4th token or before (og right-pads with the EOS id, so no prompt may end with it)
    eos = next(t for t in plain[1].tokens[3:] if t not in {p[-1] for p in prompts})
    model.config.eos_token_id = eos
    directory = export_model(model, SCHEMES["fp32"], tmp_path / "eos", flavor="ort-gqa")
    assert json.loads((directory / GENAI_CONFIG).read_text())["model"]["eos_token_id"] == [eos]
    ours = KVQSession(directory).generate(prompts, 12)
    theirs = GenaiSession(directory).generate(prompts, 12)
    assert ours[1].finish_reason == FinishReason.EOS and len(ours[1].tokens) < 12
    assert [(r.tokens, r.finish_reason) for r in theirs] == [(r.tokens, r.finish_reason) for r in ours]
    # stop_at_eos=False: og's config is overlaid with no EOS id, rows run to max_new_tokens as in kvq
    ours = KVQSession(directory).generate(prompts, 12, stop_at_eos=False)
    assert [r.tokens for r in GenaiSession(directory).generate(prompts, 12, stop_at_eos=False)] == \
        [r.tokens for r in ours]


def test_genai_files_follow_the_manifest(exports):
    directory = exports["ort-int8"]
    manifest = Manifest.load(directory)
    assert manifest.runtimes[RUNTIME].to_dict() == {"supported": True, "config": GENAI_CONFIG, "model": GENAI_MODEL,
                                                    "past_present_share_buffer": True, "engine_batches": True}
    config = json.loads((directory / GENAI_CONFIG).read_text())
    decoder = config["model"]["decoder"]
    assert config["search"]["past_present_share_buffer"] is True and decoder["filename"] == GENAI_MODEL
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"],
            decoder["num_attention_heads"]) == (2, 2, 32, 4)
    buffers = [t.name for t in manifest.cache("past") if t.role == Role.BUFFER]
    named = [decoder["inputs"][f"past_{part}_names"] % layer for layer in range(2) for part in ("key", "value")]
    assert sorted(named) == sorted(buffers)
    graph = onnx.load(str(directory / GENAI_MODEL), load_external_data=False).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", *buffers]
    assert [o.name for o in graph.output] == ["logits", *(name.replace("past.", "present.", 1) for name in buffers)]
    # one copy of the weights: og's graph points into model.onnx.data
    locations = {entry.value for tensor in graph.initializer for entry in tensor.external_data
                 if entry.key == "location"}
    assert locations == {MODEL_NAME + ".data"}
    assert not (directory / (GENAI_MODEL + ".data")).exists()
    assert (directory / GENAI_MODEL).stat().st_size < 2 * (directory / MODEL_NAME).stat().st_size
    # og pads on the right: its graph has none of the nodes that realign kvq's left-padded rows
    realigning = {"GatherND", "Where"}
    kvq_graph = onnx.load(str(directory / MODEL_NAME), load_external_data=False).graph
    assert realigning <= {node.op_type for node in kvq_graph.node}
    assert not realigning & {node.op_type for node in graph.node}


#: (prompt, tokens to generate) of the og.Engine tests: lengths 3 to 11, rows finishing at different steps, one prompt
#: ending with the pad id (the Engine's mask comes from its own lengths, not from the token values)
ENGINE_REQUESTS = [([11, 12, 13], 12), ([60, 61, 2, 9, 100, 4, 4, 7, 1, 3, 3], 6), ([5, 17, 99, 3, 42, 8, 77], 9),
                   ([23, 7, 51, 40, 0], 12)]


def _engine(directory):
    """(onnxruntime_genai, an og.Engine on ``directory``) with no EOS id (the tiny model's must not end a row)."""
    og = pytest.importorskip("onnxruntime_genai")
    config = og.Config(str(directory))
    config.overlay(json.dumps({"model": {"eos_token_id": []}}))
    return og, og.Engine(og.Model(config))


def _begin_turn(og, request, prompt: list[int], n: int) -> None:
    options = og.TurnOptions(request)
    options.set_max_generated_tokens(n)
    options.set_do_sample(False)
    request.begin_turn(np.asarray(prompt, np.int32), options)


def _engine_greedy(directory, requests, arrivals) -> list[list[int]]:
    """Greedy tokens of each ``(prompt, n)`` served by one og.Engine.

    Request i arrives at engine step ``arrivals[i]`` (or as soon as the engine is idle). The Engine batches
    arrivals statically: up to 4 rows, padded to the longest prompt, each row's mask its own length, so a longer
    row's step sees the shorter rows' masks end in zeros.
    """
    og, engine = _engine(directory)
    queue = sorted(range(len(requests)), key=lambda i: arrivals[i])
    index_of, tokens = {}, [[] for _ in requests]
    events, step, held = engine.create_event_buffer(64), 0, []
    while queue or engine.has_pending_requests():
        while queue and (arrivals[queue[0]] <= step or not engine.has_pending_requests()):
            index = queue.pop(0)
            request = engine.create_request()
            _begin_turn(og, request, *requests[index])
            index_of[id(request)] = index
            held.append(request)  # alive until the end: ids stay unique
        for event in engine.run(events):
            assert not event.flags & og.EngineEventFlags.FAILED, event.error_code
            if event.flags & og.EngineEventFlags.TOKEN:
                tokens[index_of[id(event.request)]].append(int(event.token))
        step += 1
    return tokens


@pytest.mark.parametrize("name", ["fp32", "ort-int8", "ort-int4", "int4-high/hp-fp32"])
def test_engine_batches_give_each_prompt_its_greedy_alone(exports, name):
    """Batched by og.Engine, each prompt gets the greedy tokens it gets alone.

    og.Engine feeds each row a mask of its own length (trailing zeros on shorter rows), og.Generator one of equal
    width: the entry graph takes each row's new tokens as the last of its own ones, so both serve alike.
    """
    manifest = Manifest.load(exports[name])
    assert engine_reason(manifest) is None
    older = dataclasses.replace(manifest, runtimes={RUNTIME: dataclasses.replace(manifest.runtimes[RUNTIME],
                                                                                  engine_batches=False)})
    assert "a shorter row of an og.Engine batch decodes wrong tokens: re-export it" in engine_reason(older)
    session = KVQSession(exports[name])
    alone = [session.generate([prompt], n, stop_at_eos=False)[0].tokens for prompt, n in ENGINE_REQUESTS]
    assert all(len(tokens) == n for tokens, (_, n) in zip(alone, ENGINE_REQUESTS))
    assert _engine_greedy(exports[name], ENGINE_REQUESTS, [0, 0, 0, 0]) == alone  # one batch of four
    assert _engine_greedy(exports[name], ENGINE_REQUESTS, [0, 2, 3, 5]) == alone  # staggered: batches of 1 and 3


def test_engine_second_turn_continues_the_sequence(exports):
    """A request alone may take another turn: its new prompt and reply continue the first turn's cache."""
    og, engine = _engine(exports["ort-int8"])
    request, events = engine.create_request(), engine.create_event_buffer(64)

    def turn(prompt: list[int], n: int) -> list[int]:
        _begin_turn(og, request, prompt, n)
        out = []
        while engine.has_pending_requests():
            out += [int(e.token) for e in engine.run(events) if e.flags & og.EngineEventFlags.TOKEN]
        return out

    first, second = [11, 12, 13, 40], [5, 6, 7]
    replies = turn(first, 5), turn(second, 6)
    session = KVQSession(exports["ort-int8"])
    assert replies[0] == session.generate([first], 5, stop_at_eos=False)[0].tokens
    assert replies[1] == session.generate([first + replies[0] + second], 6, stop_at_eos=False)[0].tokens


def test_right_padded_rows_give_the_left_padded_result(exports):
    """onnxruntime-genai right-pads a batched prompt, kvq left-pads it: the GQA graph gives both one result."""
    session = KVQSession(exports["ort-int8"])
    prompts = PROMPTS["ragged"]
    width = max(map(len, prompts))
    left, right = (np.zeros((len(prompts), width), np.int64) for _ in range(2))
    for row, toks in enumerate(prompts):
        left[row, width - len(toks):] = toks
        right[row, :len(toks)] = toks
    logits_l, cache_l = session.step(left, (left > 0).astype(np.int64), session.empty_cache(3, capacity=32))
    # KVQSession.step takes kvq's documented left padding only; onnxruntime-genai feeds right padding to the same
    # graph: the right-padded batch runs on the session's ONNX Runtime graph as onnxruntime-genai feeds it
    feeds = {"input_ids": right, "attention_mask": (right > 0).astype(np.int64),
             **session.cache_arrays(session.empty_cache(3, capacity=32))}
    outputs = dict(zip([o.name for o in session.session.get_outputs()], session.session.run(None, feeds)))
    logits_r = outputs["logits"]
    cache_r = session.cache_from_arrays({spec.name: outputs[present_name(spec.name)] for spec in session.past})
    for row, toks in enumerate(prompts):
        n = len(toks)
        np.testing.assert_allclose(logits_r[row, :n], logits_l[row, width - n:], atol=1e-5)
    lengths = session.seq_lengths(cache_r)
    assert list(lengths) == [len(p) for p in prompts] == list(session.seq_lengths(cache_l))
    for name, value in cache_r.items():
        if name.endswith(".buffer"):
            for row, n in enumerate(lengths):
                assert np.array_equal(value.numpy()[row, :, :n], cache_l[name].numpy()[row, :, :n]), name


MODELS = Path(__file__).resolve().parents[1] / "models"
GQA_PLANS = sorted(path.name for path in MODELS.glob("*gqa*.json"))


def _on_layers(scheme: KVQuantScheme) -> tuple[KVQuantScheme, int]:
    """``scheme``'s distinct per-layer (key, value) formats in order of first use, one per layer, and the layer count.

    At least two layers: a plan of one format keeps a tiny model's usual two.
    """
    layers = 1 + max((o.layer for o in scheme.layer_overrides), default=0)
    formats = list(dict.fromkeys(scheme.streams(layers)))
    choice = formats if len(formats) > 1 else formats * 2
    return dataclasses.replace(scheme_from_choice(choice, scheme.name), hp_dtype=scheme.hp_dtype), len(choice)


def _served_as_kvq(directory, scheme, num_layers: int) -> None:
    """The export is served with kvq's greedy tokens if its layers share one bit width; else its manifest says why."""
    entry = Manifest.load(directory).runtimes[RUNTIME]
    widths = {tq.bits for pair in scheme.streams(num_layers) for tq in pair}
    if len(widths) == 1:
        assert entry.supported is True
        prompts = PROMPTS["ragged"]
        assert [r.tokens for r in GenaiSession(directory).generate(prompts, 8)] == \
            [r.tokens for r in KVQSession(directory).generate(prompts, 8)]
        return
    assert entry.supported is False and not (directory / GENAI_CONFIG).exists()
    assert "one element type" in entry.reason and "int8 (8-bit codes)" in entry.reason
    assert "uint8 (two 4-bit codes per byte)" in entry.reason and "--candidates ort-gqa-int4" in entry.reason
    with pytest.raises(RuntimeInputError, match="has no genai_config.json: onnxruntime-genai allocates every layer"):
        GenaiSession(directory)
    # onnxruntime-genai itself, on the files written anyway: it allocates the first layer's type for every layer
    manifest = Manifest.load(directory)
    (directory / GENAI_CONFIG).write_text(json.dumps(genai_config(manifest)))
    adapt_graph(directory / MODEL_NAME, directory / GENAI_MODEL)
    with pytest.raises(RuntimeInputError, match=r"cannot run .*Unexpected input data type. Actual: \(tensor\(u?int8"):
        GenaiSession(directory, verify_weights=False).generate(PROMPTS["ragged"], 4)


@pytest.mark.parametrize("name", GQA_PLANS)
def test_shipped_gqa_plans_are_served_or_say_why(name, tmp_path):
    """Each shipped ort-gqa plan's per-layer formats, on a tiny model, are served or say why.

    onnxruntime-genai serves it exactly as kvq does, or (8-bit and 4-bit layers together, which it cannot
    allocate) the manifest says so and names the plans it serves.
    """
    scheme, layers = _on_layers(KVQuantScheme.from_json((MODELS / name).read_text()))
    model = layered_model(layers)
    static = calibrate_static_scales(model, scheme, np.random.default_rng(3).integers(0, VOCAB, (4, 64)).tolist())
    directory = export_model(model, scheme, tmp_path / "gqa", flavor="ort-gqa", static=static)
    _served_as_kvq(directory, scheme, layers)


def test_fresh_plan_offers_the_nearest_plan_genai_serves(tmp_path, caplog):
    """A fresh ort-gqa plan mixing int8 and int4 layers offers the nearest plan onnxruntime-genai serves.

    That is the least damage plan of one bit width under the same budget, and onnxruntime-genai serves it.
    """
    model = tiny_model("llama")
    windows = np.random.default_rng(5).integers(0, VOCAB, (2, 48)).tolist()
    with caplog.at_level(logging.WARNING, logger="kvq_export.plan"):
        plan = plan_scheme(model, windows, budget=6.5, context=256)
    assert {k.bits for k, _ in plan.scheme.streams(2)} == {8, 4} and plan.genai["servable"] is False
    nearest = plan.genai["nearest"]
    assert nearest["candidates"] == "ort-gqa-int4" and nearest["bits_per_element"] <= 6.5
    assert nearest["predicted_damage"] >= plan.damage and nearest["scheme"] == plan.genai_nearest.to_dict()
    assert f"onnxruntime-genai cannot serve {plan.scheme.name}" in caplog.text
    assert "the nearest plan it serves (--candidates ort-gqa-int4)" in caplog.text
    assert plan.to_dict()["onnxruntime_genai"] == plan.genai
    # the nearest plan is what planning with only the 4-bit candidates gives
    again = plan_scheme(model, windows, budget=6.5, context=256, candidates="ort-gqa-int4")
    assert again.scheme.streams(2) == plan.genai_nearest.streams(2) and again.genai == {"servable": True}
    for name, scheme in (("mixed", plan.scheme), ("nearest", plan.genai_nearest)):
        directory = export_model(model, scheme, tmp_path / name, flavor="ort-gqa",
                                 static=calibrate_static_scales(model, scheme, windows))
        _served_as_kvq(directory, scheme, 2)


def test_regions_layout_exports_say_why(tmp_path):
    directory = export_model(tiny_model("llama"), "kivi-4", tmp_path / "kivi4")
    entry = Manifest.load(directory).runtimes[RUNTIME]
    assert entry.supported is False and "regions" in entry.reason and "kivi-4" in entry.reason
    assert engine_reason(Manifest.load(directory)) == entry.reason
    assert not (directory / GENAI_CONFIG).exists() and not (directory / GENAI_MODEL).exists()
    with pytest.raises(RuntimeInputError, match="has no genai_config.json: flavor reference"):
        GenaiSession(directory)
    # a scheme GQA can hold, exported with the reference flavour: the fix is the flavour
    directory = export_model(tiny_model("llama"), SCHEMES["ort-int8"], tmp_path / "ref8",
                             static=calibration("llama", SCHEMES["ort-int8"]))
    assert "re-export with --flavor ort-gqa" in Manifest.load(directory).runtimes[RUNTIME].reason


def test_builder_scale_file_holds_kvq_scales():
    static = calibration("llama", SCHEMES["ort-int8"])
    data = builder_scale_file(static, SCHEMES["ort-int8"], GEOMETRY)
    assert data["qmax"] == 128.0 and data["kvq"]["builder_option"] == "kv_cache_quant_scheme=int8_per_channel"
    for layer in range(2):
        for part, key in (("key", "k_scales"), ("value", "v_scales")):
            expected = np.asarray(static[layer][part]["scales"], np.float32).reshape(-1)
            assert np.array_equal(np.asarray(data["scales"][key][layer], np.float32), expected)
    tensor = builder_scale_file(static, SCHEMES["ort-int8"], GEOMETRY,
                                granularity="per_tensor")
    assert tensor["scales"]["k_scales"][1] == [float(np.max(static[1]["key"]["scales"]))]
    int4 = builder_scale_file(calibration("llama", SCHEMES["ort-int4"]), SCHEMES["ort-int4"], GEOMETRY)
    assert int4["qmax"] == 8.0 and int4["kvq"]["builder_option"] == "kv_cache_quant_scheme=int4_per_channel"
    with pytest.raises(ExportError, match="no builder kv_cache_quant_scheme"):
        builder_scale_file({}, SCHEMES["fp16"], GEOMETRY)
    asymk = SCHEMES["ort-int4-asymk"]
    with pytest.raises(ExportError, match="key streams have zero points, the builder's cache is symmetric"):
        builder_scale_file(calibration("llama", asymk), asymk, GEOMETRY)
    with pytest.raises(ExportError, match="no calibrated scales for layer 1"):
        builder_scale_file({0: static[0]}, SCHEMES["ort-int8"], GEOMETRY)
    with pytest.raises(ExportError, match="granularity"):
        builder_scale_file(static, SCHEMES["ort-int8"], GEOMETRY, granularity="x")


def test_cli_calibrate_feeds_the_builder(tmp_path):
    """``kvq calibrate --format genai-scales`` is a file the onnxruntime-genai builder accepts as it is."""
    model_dir = builder_model_dir(tmp_path / "tiny")
    corpus = tmp_path / "text.txt"
    corpus.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(0, 600, 7)))
    scales = tmp_path / "scales.json"
    proc = kvq("calibrate", "--model", str(model_dir), "--scheme", "ort-int8", "--calib-corpus", str(corpus),
                "--calib-tokens", "64", "--calib-offset", "0", "--out", str(scales))
    assert proc.returncode == 0, proc.stderr
    assert "kv_cache_quant_scheme=int8_per_channel" in proc.stdout
    data = json.loads(scales.read_text())
    assert len(data["scales"]["k_scales"]) == 2 and len(data["scales"]["v_scales"][0]) == 2 * 32
    assert data["kvq"]["tokens"] == 64 and data["kvq"]["method"] == "absmax"
    out = tmp_path / "built"
    build = run_builder(model_dir, out, scales)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    graph = onnx.load(str(out / "model.onnx")).graph
    built = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer if t.name.endswith("_scale")}
    for layer in range(2):
        for key, name in (("k_scales", "k_scale"), ("v_scales", "v_scale")):
            np.testing.assert_array_equal(built[f"model.layers.{layer}.attn.{name}"],
                                          np.asarray(data["scales"][key][layer], np.float32))


def _generate(directory, *args: str):
    """``kvq generate DIRECTORY ARGS`` in this process (exceptions other than a one-line error are kept)."""
    from click.testing import CliRunner

    from kvq_export.cli import cli

    return CliRunner().invoke(cli, ["generate", str(directory), *args])


def _one_line_error(result) -> str:
    """The CLI's ``error: ...`` line of a failed ``kvq generate`` (a traceback-worthy exception fails the test)."""
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, repr(result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not result.stdout, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    """An fp32 ort-gqa export whose tokenizer onnxruntime-genai reads (text prompts through both runtimes)."""
    return export_model(byte_model(), SCHEMES["fp32"], tmp_path_factory.mktemp("bytes") / "gqa", flavor="ort-gqa",
                        tokenizer=byte_tokenizer())


def test_cli_generate_genai_json_equals_kvq(byte_export):
    prompts = ["--prompt", "Once upon a time", "--prompt", "The capital"]
    runs = {runtime: _generate(byte_export, *prompts, "--max-new-tokens", "6", "--runtime", runtime, "--json")
            for runtime in ("genai", "kvq")}
    # --device cpu replaces the config's providers with onnxruntime-genai's default, the CPU: the same tokens
    runs["genai-cpu"] = _generate(byte_export, *prompts, "--max-new-tokens", "6", "--runtime", "genai", "--device",
                                  "cpu", "--json", "-")
    assert all(run.exit_code == 0 for run in runs.values()), {k: repr(r.exception) for k, r in runs.items()}
    genai, ours, on_cpu = (json.loads(runs[runtime].stdout) for runtime in ("genai", "kvq", "genai-cpu"))
    assert [r["tokens"] for r in on_cpu["results"]] == [r["tokens"] for r in genai["results"]]
    assert genai["runtime"] == "genai" and [r["prompt"] for r in genai["results"]] == prompts[1::2]
    # a random model's bytes are seldom UTF-8, and the two tokenizers replace broken bytes differently: the text
    # is compared on SmolLM2 (test_smollm2_text_prompts_through_genai)
    keys = ("prompt", "prompt_tokens", "tokens", "finish_reason", "cache_bytes")
    assert [{k: r[k] for k in keys} for r in genai["results"]] == [{k: r[k] for k in keys} for r in ours["results"]]
    assert all(len(r["tokens"]) == 6 and isinstance(r["text"], str) for r in genai["results"])


def test_cli_generate_genai_errors_are_one_line(exports, byte_export, tmp_path, monkeypatch):
    line = _one_line_error(_generate(byte_export, "--prompt", "Hi", "--max-new-tokens", "5000", "--runtime", "genai"))
    assert "exceeds the export's context_length 1024; allowed: max_new_tokens <= 1022" in line
    # a config kvq did not write (here one naming a graph that is not there) is refused before og reads it:
    # by its checksum, and without the check because it is not the config of this manifest
    broken = tmp_path / "broken"
    shutil.copytree(byte_export, broken)
    config = json.loads((broken / GENAI_CONFIG).read_text())
    config["model"]["decoder"]["filename"] = "missing.onnx"
    (broken / GENAI_CONFIG).write_text(json.dumps(config))
    assert "genai_config.json" in _one_line_error(_generate(broken, "--prompt", "Hi", "--runtime", "genai"))
    line = _one_line_error(_generate(broken, "--prompt", "Hi", "--runtime", "genai", "--no-verify"))
    assert "is not the one kvq wrote" in line and "model.decoder.filename" in line
    # onnxruntime-genai refusing the directory itself: its own error, on one line
    og = pytest.importorskip("onnxruntime_genai")
    with monkeypatch.context() as patch:
        def refuse(*args, **kwargs):
            raise RuntimeError("Load model from missing.onnx failed:\n File doesn't exist")

        patch.setattr(og, "Model", refuse)
        line = _one_line_error(_generate(byte_export, "--prompt", "Hi", "--runtime", "genai"))
    assert line.startswith(f"error: onnxruntime-genai cannot load {byte_export}: ") and "missing.onnx" in line
    # the tiny models' word-level tokenizer is not one onnxruntime-genai reads
    line = _one_line_error(_generate(exports["fp32"], "--prompt", "w1", "--runtime", "genai"))
    assert line.startswith("error: onnxruntime-genai cannot read the tokenizer")
    reference = export_model(tiny_model("llama"), "q4_0", tmp_path / "q40")
    assert "has no genai_config.json" in _one_line_error(_generate(reference, "--prompt", "w1", "--runtime", "genai"))
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # not installed
    line = _one_line_error(_generate(byte_export, "--prompt", "Hi", "--runtime", "genai"))
    assert line.startswith("error: onnxruntime_genai is not available")


def test_serve_command_is_one_line_without_kvq(exports):
    line = serve_command(exports["fp32"], "Once upon a time", 64)
    assert "\n" not in line and "kvq_export" not in line and "og.Model(" in line and "max_length=64" in line


def test_repetition_penalty_follows_ctrl():
    logits = np.array([[2.0, -1.0, 1.9, 0.5]], dtype=np.float32)
    assert Sampler(SamplingConfig())(logits).tolist() == [0]
    sampler = Sampler(SamplingConfig(repetition_penalty=2.0))
    sampler.prime([[0, 1]])  # prompt tokens count: 2.0 -> 1.0, -1.0 -> -2.0
    np.testing.assert_allclose(sampler.penalized(logits), [[1.0, -2.0, 1.9, 0.5]])
    assert sampler(logits).tolist() == [2]
    assert sampler(np.array([[2.0, -1.0, 1.9, 0.5]], np.float32)).tolist() == [0]  # 2 is now held too: 0.95 < 1
    unprimed = Sampler(SamplingConfig(repetition_penalty=1.5))
    assert unprimed(logits).tolist() == [0] and unprimed(logits).tolist() == [2]  # generated tokens count


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_repetition_penalty_is_validated(value):
    with pytest.raises(KVQError, match="repetition_penalty"):
        SamplingConfig(repetition_penalty=value)


@pytest.mark.slow
def test_smollm2_text_prompts_through_genai(tmp_path_factory):
    """On the real model og reads kvq's tokenizer files: the same ids, the same greedy continuation."""
    from smollm2_harness import deployer_export

    directory = deployer_export(tmp_path_factory)
    prompts = ["Once upon a time", "The capital of France is a city that"]
    ours = KVQSession(directory).generate(prompts, 24)
    theirs = GenaiSession(directory).generate(prompts, 24)
    assert [r.prompt_tokens for r in theirs] == [r.prompt_tokens for r in ours]
    assert [r.tokens for r in theirs] == [r.tokens for r in ours]
    assert [r.text for r in theirs] == [r.text for r in ours]


@pytest.mark.parametrize("name", ["ort-int8", "ort-int4-asymk", "int4-high/hp-fp32"])
def test_a_prompt_appended_in_chunks_gives_kvq_the_same_chunks_logits(exports, name):
    """onnxruntime-genai appending a prompt in pieces gets the logits kvq's loop gets stepping the same pieces.

    og's graph (no left-padding realignment) takes each chunk after the first down the same exact branch: the held
    codes decoded, the chunk's own exact K/V, its codes written at the row's next places (test_gqa_flavor.py checks
    that rule against the reference cache).
    """
    genai = GenaiSession(exports[name])
    params = genai.og.GeneratorParams(genai.model)
    params.set_search_options(max_length=32, do_sample=False)
    generator = genai.og.Generator(genai.model, params)
    session = KVQSession(exports[name])
    cache = session.empty_cache(1, capacity=32)
    for chunk in ([5, 17, 99, 3, 42], [8, 77, 60, 61], [2, 9, 100]):
        generator.append_tokens(np.asarray([chunk], np.int32))
        logits, cache = session.step(np.asarray([chunk]), None, cache)
        theirs = np.asarray(generator.get_logits(), np.float32).reshape(-1)
        np.testing.assert_allclose(theirs, logits[0, -1], rtol=0, atol=1e-4 * np.abs(logits[0, -1]).max())
