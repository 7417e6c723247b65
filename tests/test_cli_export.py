"""`kvq export` and `kvq generate` on a tiny model directory with its own tokenizer."""

from __future__ import annotations

import json

import pytest
from cli_harness import kvq
from tiny_models import WORDS, save_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_export_then_generate_json(model_dir, tmp_path):
    out = tmp_path / "exp"
    proc = kvq("export", "--model", str(model_dir), "--scheme", "kivi-2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) >= ["kvq.json", "model.onnx", "model.onnx.data", "tokenizer.json"]
    proc = kvq("generate", str(out), "--prompt", "w1 w2 w3", "--prompt", "w9", "--max-new-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["scheme"] == "kivi-2" and len(data["results"]) == 2
    for result in data["results"]:
        assert len(result["tokens"]) == 6 and isinstance(result["text"], str) and result["cache_bytes"] > 0


def test_generate_streams_one_prompt(model_dir, tmp_path):
    out = tmp_path / "exp"
    assert kvq("export", "--model", str(model_dir), "--scheme", "int4-sym-g32", "--out", str(out)).returncode == 0
    proc = kvq("generate", str(out), "--prompt", "w5 w6", "--max-new-tokens", "4", "--temperature", "0.8",
               "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("w5 w6") and len(proc.stdout.split()) == 2 + 4
    assert "cache:" in proc.stderr


def test_cli_errors_are_one_line(model_dir, tmp_path):
    out = tmp_path / "exp"
    assert kvq("export", "--model", str(model_dir), "--scheme", "int4-sym-g32", "--out", str(out)).returncode == 0
    for args, message in [
        (("export", "--model", str(model_dir), "--scheme", "int4-sym-g32", "--out", str(out)), "already exists"),
        (("export", "--model", str(model_dir), "--scheme", "ort-int4", "--out", str(tmp_path / "s")),
         "static scales: calibrate first"),
        (("generate", str(tmp_path), "--prompt", "w1"), "not a kvq export directory"),
        (("generate", str(out), "--prompt", "w1", "--top-p", "0.5", "--temperature", "-1"), None),
    ]:
        proc = kvq(*args)
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr
        if message:
            assert proc.returncode == 1 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_static_scheme_calibrates_from_a_text_file(model_dir, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(WORDS * 20))
    out = tmp_path / "ort"
    proc = kvq("export", "--model", str(model_dir), "--scheme", "ort-int8", "--out", str(out), "--calib-corpus",
               str(text), "--calib-tokens", "256", "--calib-offset", "0")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "kvq.json").read_text())
    assert manifest["calibration"]["file"] == "calibration.npz" and (out / "calibration.npz").is_file()
    proc = kvq("generate", str(out), "--prompt", "w1 w2", "--max-new-tokens", "3", "--json")
    assert proc.returncode == 0, proc.stderr


def test_ort_gqa_export_generates_validates_and_compares_from_the_cli(model_dir, tmp_path):
    """The fast path goes through the same commands as the reference flavour."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS * 40))
    out, base = tmp_path / "gqa", tmp_path / "fp16"
    for args in (("--scheme", "ort-int4", "--out", str(out), "--flavor", "ort-gqa", "--calib-corpus", str(text),
                  "--calib-tokens", "256", "--calib-offset", "0", "--calib-method", "percentile", "--percentile",
                  "99.5"),
                 ("--scheme", "fp16", "--out", str(base))):
        proc = kvq("export", "--model", str(model_dir), *args)
        assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "kvq.json").read_text())
    assert manifest["flavor"] == "ort-gqa"
    assert {k: manifest["calibration"][k] for k in ("source", "corpus", "tokens", "method", "percentile")} == {
        "source": "calibrated", "corpus": str(text), "tokens": 256, "method": "percentile", "percentile": 99.5}
    proc = kvq("generate", str(out), "--prompt", "w1 w2", "--prompt", "w3", "--max-new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [len(r["tokens"]) for r in json.loads(proc.stdout)["results"]] == [4, 4]
    result = tmp_path / "v.json"
    proc = kvq("validate", str(out), "--baseline", str(base), "--corpus", str(text), "--windows", "2",
               "--window-len", "40", "--gen-tokens", "4", "--json", str(result), "--quiet")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(result.read_text())
    assert r["flavor"] == "ort-gqa" and r["memory"]["prediction_matches"] and r["attention"]["samples"] > 0
    assert r["attention"]["summary"]["key_mse"] > 0 and r["token"]["predictions"] == 2 * 39
    assert r["calibration"]["windows_overlap_calibration"] and "in-sample" in proc.stdout
    proc = kvq("validate", str(out), "--baseline", str(base), "--corpus", str(text), "--windows", "1",
               "--window-len", "40", "--offset", "256", "--gen-tokens", "0", "--json", str(result), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text())["calibration"]["windows_overlap_calibration"] is False
    assert kvq("compare", str(out), str(out)).returncode == 0
