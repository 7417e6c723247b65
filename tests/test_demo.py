"""``kvq demo`` on a tiny model directory: five exports, their rows scored as kvq validate scores, reuse, the CLI."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from cli_harness import kvq
from tiny_models import COMMON, WORDS

from kvq_export.demo import DEMO_RUNS, DEPARTS, TABLE_COLUMNS, DemoRun, check_runs, run_demo, serve_lines
from kvq_export.errors import KVQError
from kvq_export.presets import resolve_scheme
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.validate.result import ValidationResult
from kvq_export.validate.runner import ValidateConfig, validate

PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8"
NEW = 6


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


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One export directory for the module: every test after the first reuses the five exports."""
    return tmp_path_factory.mktemp("demo-exports")


@pytest.fixture(scope="module")
def demo(model_dir, work):
    return run_demo(str(model_dir), PROMPT, NEW, work)


def test_the_deployers_cache_is_measured_at_the_models_full_positions(demo):
    far = demo.long_range
    assert far.config.lengths == (1024,) and far.config.ppl_windows == (1024,)
    assert far.export == demo.rows[-1].directory and far.baseline == demo.rows[-2].directory
    assert [g.label for g in far.distance] == ["0-512", "512-1024"]
    assert len(far.retrieval.trials) == 3


def test_five_runs_tell_the_weight_story_and_the_cache_story_apart(demo, model_dir, work):
    rows = demo.rows
    assert [r.role for r in rows] == [run.role for run in DEMO_RUNS]
    assert [r.scheme for r in rows] == ["fp16", "kivi-4-r0-g64", "ort-int8", "fp16", "ort-int8"]
    assert [r.weights for r in rows] == ["fp32", "fp32", "fp32", "int4", "int4"]
    accurate = resolve_scheme(DEMO_RUNS[1].scheme)
    assert (accurate.residual_length, accurate.key.group_size, accurate.value.group_size) == (0, 64, 64)
    base, low, fast, weights_only, deploy = rows
    # every run is scored against the fp16 cache on its own weights; the weights' error against the baseline
    assert [r.against for r in rows] == ["fp16 baseline"] * 4 + ["int4 weights, fp16 cache"]
    assert base.top1 == 1.0 and base.kl == 0.0 and base.departs is None and base.decode_ratio == 1.0
    assert all(r.predictions == len(base.tokens) == NEW for r in rows)
    assert all(0.0 <= r.top1 <= 1.0 and r.kl >= 0.0 and r.kl <= r.kl_max for r in rows)
    assert weights_only.kl > 0 and deploy.kl > 0  # int4 weights and an int8 cache both move the distributions
    assert demo.combined_top1 is not None and demo.combined_kl > 0
    # the deployer's export ships int4 weights: a smaller directory than the same cache with fp32 weights
    assert deploy.directory_bytes < fast.directory_bytes and weights_only.directory_bytes < base.directory_bytes
    assert base.bits_per_element == 16.0 and low.bits_per_element < 16 and 8 < fast.bits_per_element < 16
    assert deploy.bits_per_element == fast.bits_per_element
    assert all(r.decode_ms > 0 for r in rows)
    for r in rows[1:]:  # the departure is the first token its greedy text differs from its reference run's
        ref = next(x for x in rows if x.role == r.against)
        if r.departs is None:
            assert r.tokens == ref.tokens and r.shared == r.text
        else:
            assert r.tokens[:r.departs] == ref.tokens[:r.departs] and r.tokens[r.departs] != ref.tokens[r.departs]
            assert r.text.startswith(r.shared) and len(r.shared) < len(r.text)
    # a second run reuses every export and measures the same
    stamps = {r.directory: Path(r.directory, "kvq.json").stat().st_mtime_ns for r in rows}
    again = run_demo(str(model_dir), PROMPT, NEW, work, at_full_length=False)
    assert {r.directory: Path(r.directory, "kvq.json").stat().st_mtime_ns for r in again.rows} == stamps
    assert [(r.tokens, r.top1, r.kl) for r in again.rows] == [(r.tokens, r.top1, r.kl) for r in rows]


def _words(tokens) -> list[str]:
    """The tiny vocabulary's words of ``tokens`` (id 0, the unknown word, would not read back as one token)."""
    assert all(t > 0 for t in tokens), tokens
    return [WORDS[t - 1] for t in tokens]


def _validate_on(row, baseline_dir: str, text: Path, window_len: int, chunk: int | None = None) -> ValidationResult:
    """``kvq validate`` of ``row``'s export on one window of ``text`` (strict decode unless ``chunk``), no prompts."""
    config = ValidateConfig(corpus=str(text), windows=1, window_len=window_len, chunk=chunk, gen_tokens=0,
                            attention_samples=0)
    return validate(row.directory, baseline_dir, config, progress=False, verify_weights=False)


def test_one_token_prompt_scores_equal_kvq_validate(model_dir, work, tmp_path, monkeypatch):
    """After a one-token prompt the demo's teacher-forced pass is validate's strict decode: the same numbers."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))  # validate's fp32-weight reference goes here
    result = run_demo(str(model_dir), "w7", NEW, work, at_full_length=False)
    rows = {r.role: r for r in result.rows}
    text = tmp_path / "window.txt"
    text.write_text(" ".join(["w7", *_words(result.rows[0].tokens)]))
    for row in result.rows[1:]:
        if row.weights != rows[row.against].weights:  # the weights' error: validate's weight-only line
            got = _validate_on(row, row.directory, text, NEW + 1).weight_only.scores
            # validate's fp32-weight reference keeps the row's flavor (ort-gqa), the demo's baseline is reference
            assert got.top1_agreement == pytest.approx(row.top1, abs=1.5 / NEW)
            assert got.kl.mean == pytest.approx(row.kl, rel=0.05), row.role
            continue
        got = _validate_on(row, rows[row.against].directory, text, NEW + 1).token.scores
        assert got.predictions == row.predictions, row.role
        assert got.top1_agreement == row.top1, row.role
        assert got.kl.mean == pytest.approx(row.kl, rel=1e-5, abs=1e-9), row.role
        assert got.kl.max == pytest.approx(row.kl_max, rel=1e-5, abs=1e-9), row.role


def test_demo_scores_lie_within_kvq_validates_spread_on_the_same_prompt(demo, tmp_path, monkeypatch):
    """Top-1 and KL of each cache lie between the two readings validate gives of the same prompt and continuation.

    ``--chunk`` as long as the prompt: the prompt in one call, as the demo prefills it, but the continuation in one
    call too (its tokens see each other's exact K/V); strict decode: the prompt one token per step as well (every
    token reads the codes). The demo's continuation is decoded one token per step after a prefill: in between.
    """
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    rows = {r.role: r for r in demo.rows}
    prompt = PROMPT.split()
    text = tmp_path / "window.txt"
    text.write_text(" ".join([*prompt, *_words(demo.rows[0].tokens)]))
    scored = slice(len(prompt) - 1, len(prompt) - 1 + NEW)  # the predictions of the continuation's tokens
    checked = 0
    for row in demo.rows[1:]:
        if row.weights != rows[row.against].weights:
            continue  # validate refuses a baseline with other weights; the one-token test covers this row
        readings = [_validate_on(row, rows[row.against].directory, text, len(prompt) + NEW, chunk).token.scores
                    for chunk in (len(prompt), None)]
        kl = sorted(float(np.mean(r.kl_by_position[scored])) for r in readings)
        top1 = sorted(float(np.mean(r.top1_by_position[scored])) for r in readings)
        assert kl[0] * (1 - 1e-5) <= row.kl <= kl[1] * (1 + 1e-5), (row.role, kl, row.kl)
        assert top1[0] - 1e-9 <= row.top1 <= top1[1] + 1e-9, (row.role, top1, row.top1)
        checked += 1
    assert checked == 3


def test_runs_are_checked_before_any_export():
    with pytest.raises(KVQError, match="measured against 'later'.*allowed: an earlier run's role"):
        check_runs((DemoRun("base", "fp16"), DemoRun("x", "ort-int8", against="later"), DemoRun("later", "fp16")))
    with pytest.raises(KVQError, match="appears twice"):
        check_runs((DemoRun("base", "fp16"), DemoRun("base", "kivi-4")))


def test_serve_lines_name_the_absolute_export_and_its_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my export").mkdir()
    export, serve, curl = serve_lines("my export", "It's a \"test\".", 16)
    assert shlex.split(export) == [f"EXPORT={tmp_path / 'my export'}"]
    assert serve == 'kvq serve "$EXPORT"'
    words = shlex.split(curl)
    assert words[:2] == ["curl", "-s"] and words[2].endswith("/v1/completions")
    assert json.loads(words[-1]) == {"model": "my export", "prompt": "It's a \"test\".", "max_tokens": 16}


def test_repetition_penalty_changes_greedy_text(model_dir, work):
    runs = (DemoRun("fp16 baseline", "fp16"),)
    plain = run_demo(str(model_dir), PROMPT, 12, work, SamplingConfig(), runs, at_full_length=False).rows[0]
    penalized = run_demo(str(model_dir), PROMPT, 12, work, SamplingConfig(repetition_penalty=3.0), runs,
                         at_full_length=False).rows[0]
    assert len(set(penalized.tokens)) > len(set(plain.tokens))


def test_cli_demo(demo, model_dir, work):
    proc = kvq("demo", "--model", model_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--work-dir", work)
    assert proc.returncode == 0, proc.stderr
    for text in (*(run.role for run in DEMO_RUNS), *filter(None, TABLE_COLUMNS),
                 "deployer's export against the fp16 baseline", 'kvq serve "$EXPORT"', "curl -s ",
                 "deployer's export against the int4 weights, fp16 cache at 1024 tokens: perplexity"):
        assert text in proc.stdout, (text, proc.stdout)
    assert f"EXPORT={Path(demo.rows[-1].directory).resolve()}" in proc.stdout
    assert "python -c" not in proc.stdout
    assert (DEPARTS in proc.stdout) == any(r.departs is not None for r in demo.rows)
