"""kvq's capacity measurement: arithmetic and incremental rows.

Cache bytes per sequence read from the graph, the budget arithmetic, rows written as they are measured (never
timings: the machine is shared).
"""

from __future__ import annotations

import json

import pytest
from genai_harness import builder_model_dir, run_builder
from gqa_harness import SCHEMES, calibration
from tiny_models import tiny_model

from kvq_export.capacity import (
    CapacityError,
    Footprint,
    capacity_row,
    choose_backend,
    footprint,
    plot_capacity,
    read_rows,
    run_capacity,
)
from kvq_export.export.exporter import export_model
from kvq_export.weight_bytes import weight_bytes

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # tiny_models.COMMON


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("capacity")
    return {name: export_model(tiny_model("llama"), SCHEMES[name], root / name.replace("/", "_"), flavor="ort-gqa",
                         static=calibration("llama", SCHEMES[name]))
            for name in ("fp32", "ort-int8", "ort-int4")}


@pytest.mark.parametrize(("name", "bytes_per_element"), [("fp32", 4), ("ort-int8", 1), ("ort-int4", 0.5)])
def test_cache_bytes_per_sequence_follow_the_cache_type(exports, name, bytes_per_element):
    print_ = footprint(exports[name])
    assert print_.copies == 1  # kvq's og config shares past and present
    assert print_.cache_bytes_per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM * bytes_per_element
    assert print_.cache_bytes(2048) == 2048 * print_.cache_bytes_per_token
    assert print_.weight_bytes == weight_bytes(exports[name]).total


def test_budget_arithmetic():
    print_ = Footprint("x", "/x", weight_bytes=1000, cache_bytes_per_token=10)
    assert print_.sequences(budget_bytes=1000 + 10 * 100 * 7 + 99, context=100) == 7
    assert print_.sequences(budget_bytes=500, context=100) == 0
    assert print_.sequences(budget_bytes=1000 + 10 * 100 * 7, context=100, overhead_bytes=1000) == 6
    measured = {"rss_loaded": 5000, "rss": 5000 + 3 * 1200, "steps": [0.3, 0.1, 0.2], "prefill_tokens_per_s": 50.0}
    row = capacity_row(print_, 100, 3, 5000 + 10 * 1200 + 5, "og", measured)
    assert row.cache_bytes_per_sequence == 1000
    assert row.predicted_rss_bytes == 5000 + 3 * 1000
    assert row.measured_cache_bytes_per_sequence == 1200
    assert row.measured_sequences == 10
    assert row.predicted_sequences == (5000 + 10 * 1200 + 5 - 5000) // 1000  # overhead = rss_loaded - weights
    assert row.decode_step_ms == pytest.approx(200.0)
    assert row.tokens_per_s == pytest.approx(15.0)
    assert row.prefill_tokens_per_s == 50.0


def test_rows_are_written_as_measured(exports, tmp_path):
    out = tmp_path / "rows.jsonl"
    calls = []

    def measure_fn(jobs, context, concurrent, new_tokens, threads):
        calls.append((context, dict(jobs)))
        if len(calls) == 2:  # a run stopped during the second context keeps the first context's rows
            assert len(out.read_text().splitlines()) == 2
            raise KeyboardInterrupt
        return {"fp32": {"rss_loaded": 10, "rss": 10 + concurrent * 100, "steps": [0.01]},
                "int8": "int8 at 64 tokens x 2: out of memory"}

    with pytest.raises(KeyboardInterrupt):
        run_capacity({"fp32": exports["fp32"], "int8": exports["ort-int8"]}, contexts=(64, 96), concurrent=2,
                     budget_bytes=1 << 20, new_tokens=4, out=out, measure_fn=measure_fn)
    assert calls[0] == (64, {"fp32": ("session", str(exports["fp32"])), "int8": ("session", str(exports["ort-int8"]))})
    rows = read_rows(out)
    assert [(r.name, r.context, r.concurrent, r.backend) for r in rows] == [("fp32", 64, 2, "session"),
                                                                            ("int8", 64, 2, "session")]
    assert rows[0].cache_bytes_per_sequence == footprint(exports["fp32"]).cache_bytes(64)
    assert rows[0].measured_cache_bytes_per_sequence == 100
    assert rows[1].status == "failed: int8 at 64 tokens x 2: out of memory"
    assert rows[1].predicted_sequences == footprint(exports["ort-int8"]).sequences(1 << 20, 64)


def test_failed_measurement_keeps_the_prediction(exports, tmp_path):
    def measure_fn(*args):
        raise CapacityError("no memory")

    rows = run_capacity({"int4": exports["ort-int4"]}, contexts=(32, 64), concurrent=1, budget_bytes=1 << 20,
                        new_tokens=2, out=tmp_path / "rows.jsonl", measure_fn=measure_fn)
    assert [r.status for r in rows] == ["failed: no memory"] * 2
    predicted = run_capacity({"int4": exports["ort-int4"]}, contexts=(32, 64), concurrent=1, budget_bytes=1 << 20,
                             new_tokens=2, measure_fn=measure_fn, predict_only=True)
    assert [r.status for r in predicted] == ["predicted"] * 2
    assert [r.predicted_sequences for r in predicted] == [r.predicted_sequences for r in rows]
    assert [r.predicted_sequences for r in rows] == [r.sequences(1 << 20, c) for r, c in
                                                     ((footprint(exports["ort-int4"]), 32),
                                                      (footprint(exports["ort-int4"]), 64))]


@pytest.mark.parametrize("backend", ["session", "og"])
def test_real_measurement_and_plot(exports, tmp_path, backend):
    if backend == "og":
        pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "rows.jsonl"
    rows = run_capacity({"int8": exports["ort-int8"], "fp32": exports["fp32"]}, contexts=(48,), concurrent=2,
                        budget_bytes=1 << 30, new_tokens=3, backend=backend, threads=1, out=out,
                        providers=["CPUExecutionProvider"])  # --device cpu, carried into the measuring process
    assert [r.status for r in rows] == ["ok", "ok"]
    for row in rows:
        assert row.backend == backend
        assert row.rss_bytes > 0 and row.rss_loaded_bytes > 0 and row.tokens_per_s > 0
        assert row.predicted_rss_bytes == row.rss_loaded_bytes + 2 * row.cache_bytes_per_sequence
        assert (row.prefill_tokens_per_s is not None) == (backend == "og")
    assert [json.loads(line)["name"] for line in out.read_text().splitlines()] == ["int8", "fp32"]
    assert [r.extra["interleaved_with"] for r in rows] == [["fp32"], ["int8"]]
    png = plot_capacity(rows, tmp_path / "capacity.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_options_are_one_line_errors(exports, tmp_path):
    with pytest.raises(CapacityError, match="no genai_config.json"):
        footprint(tmp_path)
    with pytest.raises(CapacityError, match="allowed: auto, synthetic, og, session, ort"):
        run_capacity({"x": exports["fp32"]}, backend="gpu")
    with pytest.raises(CapacityError, match="allowed: > new_tokens"):
        run_capacity({"x": exports["fp32"]}, contexts=(4,), new_tokens=8)


def test_cli_writes_rows_and_plot(exports, tmp_path):
    from click.testing import CliRunner

    from kvq_export.cli import cli

    out, png = tmp_path / "rows.jsonl", tmp_path / "c.png"
    result = CliRunner().invoke(cli, ["bench-serve", f"int4={exports['ort-int4']}", "--context", "40",
                                      "--concurrent", "1", "--new-tokens", "2", "--threads", "1", "--budget-gb", "1",
                                      "--out", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "int4 @40:" in result.output
    assert [r.name for r in read_rows(out)] == ["int4"] and png.is_file()


@pytest.mark.parametrize("name", ["ort-int8", "ort-int4"])
def test_symbolic_cache_widths_come_from_the_config(exports, tmp_path, name):
    """The builder leaves a quantized cache's heads and head size symbolic: og allocates the config's."""
    import shutil

    import onnx

    from kvq_export.flavors.ort_gqa.genai import GENAI_MODEL

    copy = tmp_path / "copy"
    shutil.copytree(exports[name], copy)
    proto = onnx.load(str(copy / GENAI_MODEL), load_external_data=False)
    for value in proto.graph.input:
        if value.name.startswith("past") and len(value.type.tensor_type.shape.dim) == 4:
            for axis in (1, 3):
                value.type.tensor_type.shape.dim[axis].dim_param = f"d{axis}"
    onnx.save(proto, str(copy / GENAI_MODEL))
    if name == "ort-int8":
        assert footprint(copy).cache_bytes_per_token == footprint(exports[name]).cache_bytes_per_token
    else:  # two 4-bit codes a byte: the config's head size would count twice the bytes
        with pytest.raises(CapacityError, match="whose widths the graph or config give"):
            footprint(copy)


@pytest.fixture(scope="module")
def builder_int8(tmp_path_factory):
    """onnxruntime-genai's builder on the tiny model with an int8 per-channel cache (separate past and present)."""
    pytest.importorskip("onnxruntime_genai")
    root = tmp_path_factory.mktemp("builder")
    model_dir = builder_model_dir(root / "tiny")
    scales = root / "scales.json"
    per_layer = [[0.05] * (KV_HEADS * HEAD_DIM)] * LAYERS
    scales.write_text(json.dumps({"qmax": 128.0, "scales": {"k_scales": per_layer, "v_scales": per_layer}}))
    out = root / "built"
    build = run_builder(model_dir, out, scales)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    return out


def test_ort_backend_steps_a_builder_graph_on_a_synthetic_cache(builder_int8, exports, tmp_path):
    assert choose_backend(builder_int8, "synthetic") == "ort" and choose_backend(builder_int8, "auto") == "og"
    assert choose_backend(exports["fp32"], "synthetic") == "session"
    print_ = footprint(builder_int8)
    assert print_.copies == 2 and print_.cache_bytes_per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM
    rows = run_capacity({"builder": builder_int8, "int8": exports["ort-int8"]}, contexts=(40,), concurrent=2,
                        budget_bytes=1 << 30, new_tokens=3, backend="synthetic", threads=1,
                        out=tmp_path / "rows.jsonl")
    assert [(r.name, r.backend, r.status) for r in rows] == [("builder", "ort", "ok"), ("int8", "session", "ok")]
    assert rows[0].tokens_per_s > 0 and rows[0].prefill_tokens_per_s is None


def test_ort_backend_refuses_a_shared_buffer(exports):
    from kvq_export.capacity import measure

    result = measure({"x": ("ort", str(exports["fp32"]))}, 40, 1, 2, threads=1)
    assert "past_present_share_buffer is on" in result["x"]
