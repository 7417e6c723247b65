"""One session interface: kvq's loop and onnxruntime-genai's both are a ``Session``, check prompts alike and agree.

The export is the byte-level tiny llama in the ort-gqa flavour (fp32 cache): both tokenizers read it, so text
prompts go through either runtime.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from gqa_harness import SCHEMES
from tiny_models import BYTE_VOCAB, byte_model, byte_tokenizer

from kvq_export.errors import RuntimeInputError
from kvq_export.export.exporter import export_model
from kvq_export.runtime import RUNTIMES, open_session
from kvq_export.runtime.base import PromptBatch, Rows, Session, check_prompts, continuation_text
from kvq_export.runtime.sampling import Sampler, SamplingConfig
from kvq_export.runtime.session import KVQSession
from kvq_export.vocab import FinishReason

POSITIONS = 1024  # tiny_models.COMMON
PROMPTS = [[72, 105, 33], [80, 81, 82, 83, 84, 85, 86], [7]]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return export_model(byte_model(), SCHEMES["fp32"], tmp_path_factory.mktemp("session") / "gqa", flavor="ort-gqa",
                        tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def kvq(export_dir):
    return open_session(export_dir, "kvq")


@pytest.fixture(scope="module")
def genai(export_dir):
    pytest.importorskip("onnxruntime_genai")
    return open_session(export_dir, "genai")


def test_both_runtimes_are_sessions(kvq, genai):
    assert isinstance(kvq, Session) and isinstance(genai, Session)
    assert isinstance(kvq, KVQSession) and (kvq.runtime, genai.runtime) == RUNTIMES
    assert not isinstance(object(), Session)


@pytest.mark.parametrize("new_tokens", [0, 1, 9])
def test_greedy_generations_are_identical(kvq, genai, new_tokens):
    streamed = {}
    results = {}
    for session in (kvq, genai):
        calls = streamed[session.runtime] = []
        results[session.runtime] = session.generate(PROMPTS, new_tokens, on_token=lambda r, t, calls=calls:
                                                    calls.append((r, t)))
    ours, theirs = results["kvq"], results["genai"]
    assert [(r.prompt_tokens, r.tokens, r.finish_reason, r.cache_bytes) for r in theirs] == \
        [(r.prompt_tokens, r.tokens, r.finish_reason, r.cache_bytes) for r in ours]
    assert all(len(r.tokens) == new_tokens and r.finish_reason == FinishReason.LENGTH for r in ours)
    # on_token sees every token, one step at a time, rows in order
    assert streamed["genai"] == streamed["kvq"]
    assert streamed["kvq"] == [(row, r.tokens[step]) for step in range(new_tokens) for row, r in enumerate(ours)]
    # the text of a continuation is written once, with each runtime's own decoder
    for session, result in ((kvq, ours), (genai, theirs)):
        assert [r.text for r in result] == [continuation_text(session.decode, r.prompt_tokens, r.tokens)
                                            for r in result]


def test_text_prompts_encode_alike(kvq, genai):
    prompts = ["Once upon a time", "The capital"]
    ours, theirs = kvq.generate(prompts, 5), genai.generate(prompts, 5)
    assert [r.prompt for r in ours] == [r.prompt for r in theirs] == prompts
    assert [(r.prompt_tokens, r.tokens) for r in theirs] == [(r.prompt_tokens, r.tokens) for r in ours]
    assert ours[0].prompt_tokens == kvq.encode(prompts[0]) == genai.encode(prompts[0])


BAD_PROMPTS = [
    ([[]], "prompt 0 has no token; every prompt needs at least one token"),
    ([], "prompts: expected at least one prompt, got none"),
    ("Hello", "prompts: expected a list of strings or token-id lists, got one string"),
    ([[1, 2], ["a"]], "prompt 1: expected text or a list of integer token ids"),
    ([[1, True]], "prompt 0: expected text or a list of integer token ids"),
    ([[5, BYTE_VOCAB]], f"prompt 0: token id {BYTE_VOCAB} at position 1 is outside the vocabulary; allowed: 0 .. 255"),
    ([[3], [-1]], "prompt 1: token id -1 at position 0 is outside the vocabulary; allowed: 0 .. 255"),
    ([[5] * (POSITIONS + 1)], f"prompt 0 has {POSITIONS + 1} tokens, beyond the {POSITIONS} positions this export "
                              "supports (max_position_embeddings)"),
    (["ok", "\udcff"], "prompt '\\udcff' is not valid UTF-8 text"),
]


@pytest.mark.parametrize("prompts, message", BAD_PROMPTS)
def test_prompt_errors_are_the_same_one_line_messages(kvq, genai, prompts, message, monkeypatch):
    for session in (kvq, genai):
        if session is kvq:
            monkeypatch.setattr(session, "prefill", _refuse)
        else:  # onnxruntime-genai's loop starts from GeneratorParams
            monkeypatch.setattr(session.og, "GeneratorParams", _refuse)
        with pytest.raises(RuntimeInputError) as info:
            session.generate(prompts, 4)
        assert str(info.value) == message, session.runtime


@pytest.mark.parametrize("value", [-1, 2.5, True, "4"])
def test_max_new_tokens_is_checked_alike(kvq, genai, value):
    for session in (kvq, genai):
        with pytest.raises(RuntimeInputError) as info:
            session.generate(PROMPTS, value)
        assert str(info.value) == f"invalid max_new_tokens={value!r}: allowed: an integer >= 0"


def test_context_limits_differ_by_the_last_token_only(kvq, genai):
    """The same message, one token apart: kvq never feeds the last sampled token, og's sequence holds it."""
    messages = {}
    for session in (kvq, genai):
        with pytest.raises(RuntimeInputError) as info:
            session.generate([[5] * 1000], 100)
        messages[session.runtime] = str(info.value)
    pattern = (r"a 1000-token prompt with max_new_tokens=100 would put (\d+) tokens in a row, which exceeds the "
               rf"export's context_length {POSITIONS}; allowed: max_new_tokens <= (\d+)")
    held, allowed = zip(*(re.fullmatch(pattern, messages[r]).groups() for r in RUNTIMES))
    assert held == ("1099", "1100") and allowed == ("25", "24")
    assert len(kvq.generate([[5] * 1000], 25)[0].tokens) == 25
    assert len(genai.generate([[5] * 1000], 24)[0].tokens) == 24


def _refuse(*args, **kwargs):
    raise AssertionError("the prompts were run")


def test_generate_is_prefill_then_decode(kvq):
    """``generate`` composes ``prefill`` and ``decode_n_tokens``; ``decode_one_token`` is one step of one token."""
    batch = check_prompts(PROMPTS, 6, encode=kvq.encode, manifest=kvq.manifest, holds_last_token=False)
    assert batch.width == 7 and len(batch) == 3
    ids, mask = batch.padded(left=True)
    assert ids[2].tolist() == [0] * 6 + [7] and mask.sum(axis=1).tolist() == [3, 7, 1]
    logits, cache = kvq.prefill(batch, 6)
    assert logits.shape == (3, BYTE_VOCAB) and kvq.seq_lengths(cache).reshape(-1).tolist() == [3, 7, 1]
    rows = Rows(batch)
    cache = kvq.decode_n_tokens(logits, cache, 6, Sampler(SamplingConfig()), rows)
    assert [r.tokens for r in rows.results] == [r.tokens for r in kvq.generate(PROMPTS, 6)]
    assert kvq.seq_lengths(cache).reshape(-1).tolist() == [3 + 5, 7 + 5, 1 + 5]  # the last token is never fed
    # one more token by hand: the step's logits are the last position's
    tokens = np.array([r.tokens[-1] for r in rows.results])
    one, cache = kvq.decode_one_token(tokens, np.array([True, False, True]), cache)
    assert one.shape == (3, BYTE_VOCAB) and kvq.seq_lengths(cache).reshape(-1).tolist() == [9, 12, 7]


def test_an_early_eos_row_does_not_feed_past_the_positions(kvq, monkeypatch):
    """Row 0 ends at its first token while row 1 fills every position: no step runs after the last token."""
    first = kvq.generate([PROMPTS[0]], 1)[0].tokens[0]
    tokenizer = dataclasses.replace(kvq.manifest.tokenizer, eos_token_id=first)
    monkeypatch.setattr(kvq, "manifest", dataclasses.replace(kvq.manifest, tokenizer=tokenizer))
    long = [9] * (POSITIONS - 3)
    results = kvq.generate([PROMPTS[0], long], 4)
    assert (results[0].tokens, results[0].finish_reason) == ([first], "eos")
    assert (results[1].tokens, results[1].finish_reason) == (kvq.generate([long], 4)[0].tokens, "length")
    assert len(results[1].tokens) == 4  # row 1 holds 1021 + 3 fed tokens: every position


def test_right_padding_for_onnxruntime_genai():
    ids, mask = PromptBatch([None, None], [[1, 2, 3], [4]]).padded(left=False, pad=9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_open_session_refuses_what_it_does_not_know(export_dir):
    with pytest.raises(RuntimeInputError, match="unknown runtime 'trt'; allowed: kvq, genai"):
        open_session(export_dir, "trt")
    with pytest.raises(RuntimeInputError, match="runtime genai takes no capacity; allowed: threads, verify_weights"):
        open_session(export_dir, "genai", capacity=64)
    assert open_session(export_dir, capacity=64, verify_weights=False).capacity == 64


def _cli(*args: str):
    from click.testing import CliRunner

    from kvq_export.cli import cli

    return CliRunner().invoke(cli, ["generate", *args])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_cli_streams_either_runtime(export_dir, runtime):
    if runtime == "genai":
        pytest.importorskip("onnxruntime_genai")
    args = [str(export_dir), "--prompt", "Once upon", "--max-new-tokens", "5", "--runtime", runtime]
    streamed, whole = _cli(*args), _cli(*args, "--json")
    assert streamed.exit_code == 0 and whole.exit_code == 0, (repr(streamed.exception), repr(whole.exception))
    result = json.loads(whole.stdout)["results"][0]
    assert streamed.stdout == f"Once upon{result['text']}\n"
    assert streamed.stderr == f"[cache: {result['cache_bytes']} bytes]\n"
    # a refused prompt prints nothing on stdout, one line on stderr
    refused = _cli(str(export_dir), "--prompt", "Hi", "--max-new-tokens", "5000", "--runtime", runtime)
    assert refused.exit_code == 1 and refused.stdout == "" and len(refused.stderr.splitlines()) == 1
