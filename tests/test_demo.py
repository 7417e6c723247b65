"""``kvq demo`` on a tiny model directory: three exports, their rows, reuse, and the CLI's output."""

from __future__ import annotations

import pytest
from cli_harness import kvq
from tiny_models import COMMON, WORDS

from kvq_export.demo import DEMO_RUNS, DemoRun, run_demo
from kvq_export.presets import resolve_scheme
from kvq_export.runtime.sampling import SamplingConfig

PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama with head_dim 64 (the demo's 4-bit scheme uses groups of 64) and the word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny") / "tiny-llama-d64"
    torch.manual_seed(5)
    config = LlamaConfig(**{**COMMON, "head_dim": 64, "num_attention_heads": 2, "num_key_value_heads": 1})
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(path)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def test_three_runs_tell_the_story(model_dir, tmp_path):
    rows = run_demo(str(model_dir), PROMPT, 6, tmp_path)
    assert [r.role for r in rows] == [run.role for run in DEMO_RUNS]
    assert [r.scheme for r in rows] == ["fp16", "kivi-4-r0-g64", "ort-int8"]
    accurate = resolve_scheme(DEMO_RUNS[1].scheme)
    assert (accurate.residual_length, accurate.key.group_size, accurate.value.group_size) == (0, 64, 64)
    base, low, fast = rows
    assert base.agree_with_baseline == len(base.tokens) == 6 and base.decode_ratio == 1.0
    assert base.cache_bytes > fast.cache_bytes and base.cache_bytes > low.cache_bytes
    # at 14 tokens the keys' first channel group of 64 is not full (still fp16) and int8's static scales weigh
    assert base.bits_per_element == 16.0 and low.bits_per_element < 16 and 8 < fast.bits_per_element < 16
    assert all(r.decode_ms > 0 for r in rows)
    assert fast.flavor == "ort-gqa" and "og.Model(" in fast.serve and "kvq" not in fast.serve.split("og.Model(")[0]
    assert base.serve.startswith("not servable (flavor reference") and "'runtimes'" in low.serve
    # a second run reuses every export
    stamps = {r.directory: (tmp_path / r.directory).joinpath("kvq.json").stat().st_mtime_ns for r in rows}
    again = run_demo(str(model_dir), PROMPT, 6, tmp_path)
    assert {r.directory: (tmp_path / r.directory).joinpath("kvq.json").stat().st_mtime_ns for r in again} == stamps
    assert [r.tokens for r in again] == [r.tokens for r in rows]


def test_repetition_penalty_changes_greedy_text(model_dir, tmp_path):
    runs = (DemoRun("fp16 baseline", "fp16"),)
    plain = run_demo(str(model_dir), PROMPT, 12, tmp_path, SamplingConfig(), runs)[0]
    penalized = run_demo(str(model_dir), PROMPT, 12, tmp_path, SamplingConfig(repetition_penalty=3.0), runs)[0]
    assert len(set(penalized.tokens)) > len(set(plain.tokens))


def test_cli_demo(model_dir, tmp_path):
    proc = kvq("demo", "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", "4", "--work-dir", tmp_path)
    assert proc.returncode == 0, proc.stderr
    for text in ("fp16 baseline", "most accurate <= 5 bits", "ort-gqa fast path", "ms/token",
                 "serve ort-int8 with onnxruntime-genai: python -c \"import onnxruntime_genai as og"):
        assert text in proc.stdout, (text, proc.stdout)
