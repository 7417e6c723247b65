"""kvq validate --long-context: the task generators, the shared prefill, the scores, the gates and the command."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from cli_harness import kvq
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import byte_model, byte_tokenizer

from kvq_export.errors import GateError, KVQError
from kvq_export.export.exporter import export_model
from kvq_export.runtime.session import KVQSession
from kvq_export.validate.long_context.config import LongContextConfig
from kvq_export.validate.long_context.distance import group_scores
from kvq_export.validate.long_context.gates import LongContextGates, parse_group_limit
from kvq_export.validate.long_context.result import LongContextResult, RetrievalResult, TrialResult
from kvq_export.validate.long_context.retrieval import TrialRunner, mcnemar_p, run_trials
from kvq_export.validate.long_context.tasks import TASKS, Case, build_case, trial_rng
from kvq_export.validate.scores import TokenScores

TOKENIZER = byte_tokenizer()


def encode(text: str) -> list[int]:
    return list(TOKENIZER(text, add_special_tokens=False)["input_ids"])


def case(task: str, length: int, depth: float, *, seed: int = 0, trial: int = 0) -> Case:
    return build_case(TASKS[task], encode, [], length=length, depth=depth, trial=trial,
                      rng=trial_rng(seed, task, length, trial))


# -- the generators -----------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(task=st.sampled_from(sorted(TASKS)), length=st.integers(700, 2000), depth=st.floats(0.0, 1.0))
def test_a_case_has_exactly_its_length_and_its_answer_in_the_context(task, length, depth):
    c = case(task, length, depth)
    assert len(c.prompt) + len(c.answer) == length
    assert c.context < len(c.prompt)
    text = TOKENIZER.decode(list(c.prompt[:c.context]))
    assert c.answer_text in text  # the gold answer is retrievable from the context
    assert TOKENIZER.decode(list(c.answer)).strip() == c.answer_text


@pytest.mark.parametrize("task", sorted(TASKS))
def test_the_key_needle_moves_with_the_depth_and_the_depths_share_the_context_before_it(task):
    cases = [case(task, 1500, d) for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    where = [TOKENIZER.decode(list(c.prompt)).find(c.answer_text) for c in cases]
    assert where == sorted(where) and where[0] < where[-1]
    assert len({c.answer_text for c in cases}) == 1  # one trial's depths ask for the same answer
    for shallow, deep in zip(cases, cases[1:]):
        shared = next(i for i, (a, b) in enumerate(zip(shallow.prompt, deep.prompt)) if a != b)
        # they part where the shallower needle starts: its sentence holds the answer (one byte per token)
        assert where[cases.index(shallow)] - 80 <= shared <= where[cases.index(shallow)]


def test_the_same_seed_gives_the_same_case_and_another_seed_another():
    assert case("multikey", 1200, 0.5) == case("multikey", 1200, 0.5)
    assert case("multikey", 1200, 0.5).answer != case("multikey", 1200, 0.5, seed=1).answer
    assert case("passkey", 1200, 0.5, trial=1).answer != case("passkey", 1200, 0.5).answer


def test_a_length_too_short_for_the_task_is_one_line():
    with pytest.raises(KVQError, match="leaves no room for its filler"):
        case("vt", 200, 0.5)


def test_the_config_refuses_what_it_cannot_run():
    with pytest.raises(KVQError, match="unknown long-context task 'needle'; allowed: passkey, multikey, vt"):
        LongContextConfig(tasks=("needle",))
    with pytest.raises(KVQError, match="exceeds the 1024 positions"):
        LongContextConfig(lengths=(4096,)).for_(1024)
    assert LongContextConfig().for_(8192).lengths == (1024, 2048, 4096, 8192)
    assert LongContextConfig().for_(3000).ppl_windows == (2048, 3000)
    assert LongContextConfig(depths=5).depth_values == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert LongContextConfig().groups(8192) == ((0, 512), (512, 2048), (2048, 4096), (4096, 8192))


# -- scoring a trial on a session whose next token is known ------------------------------------------------------
class CountingSession:
    """A stand-in session that predicts ``last token + 1`` (mod 256) with a margin, and keeps its cache as numpy."""

    def empty_cache(self, batch, capacity=None):
        return {"held": np.zeros((batch, 0), np.int64)}

    def cache_arrays(self, cache):
        return cache

    def cache_from_arrays(self, arrays):
        return dict(arrays)

    def step(self, ids, mask, cache):
        logits = np.zeros((ids.shape[0], 1, 256), np.float32)
        logits[0, 0, (ids[0, -1] + 1) % 256] = 5.0
        return logits, {"held": np.concatenate([cache["held"], ids], axis=1)}


def _counting_case(answer: list[int]) -> Case:
    prompt = (1, 2, 3, 9, 10)
    return Case("passkey", len(prompt) + len(answer), 0.5, 0, prompt, tuple(answer), "", 3)


def test_an_answer_greedy_reproduces_is_a_hit_with_its_log_probability():
    runner = TrialRunner(CountingSession(), chunk=2, decode=lambda t: " ".join(map(str, t)))
    out = runner.finish(_counting_case([11, 12, 13]), CountingSession().empty_cache(1), 0)
    top = 5.0 - np.log(np.exp(5.0) + 255)
    assert out.hit and out.said == "11 12 13" and out.logprob == pytest.approx(3 * top)


def test_a_missed_answer_says_where_greedy_left_it_and_still_scores_every_gold_token():
    runner = TrialRunner(CountingSession(), chunk=2, decode=lambda t: " ".join(map(str, t)))
    out = runner.finish(_counting_case([11, 40, 41]), CountingSession().empty_cache(1), 0)
    top, other = 5.0 - np.log(np.exp(5.0) + 255), -np.log(np.exp(5.0) + 255)
    assert not out.hit and out.said == "11 12"  # greedy's tokens up to the first that departs
    assert out.logprob == pytest.approx(top + other + top)  # 41 follows the fed 40


def test_exact_mcnemar_p_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_p(3, 3) == 1.0
    assert mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)


# -- on real graphs: the shared prefill is the trials' own ---------------------------------------------------------
@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    model = byte_model()
    return {name: export_model(model, scheme, root / name.replace("/", "-"), flavor=flavor, tokenizer=TOKENIZER)
            for name, scheme, flavor in (("fp16", "fp16", "ort-gqa"), ("reference", "kivi-4", "reference"),
                                         ("fp16-reference", "fp16", "reference"))}


@pytest.mark.parametrize("name", ["fp16", "reference"])
def test_trials_sharing_a_prefill_score_as_they_do_alone(exports, name):
    session = KVQSession(exports[name], last_logits=True)
    cases = [case(task, 700, d) for task in ("passkey", "vt") for d in (0.0, 0.5, 1.0)]
    runner = TrialRunner(session, chunk=128, decode=session.decode)
    shared = run_trials(runner, cases)
    alone = [runner.run_group([c])[0] for c in cases]
    assert shared == alone  # bit for bit: the same steps from the same cache


def _trial(task, length, depth, base, export, trial=0):
    return TrialResult(task, length, depth, trial, "1", base, export, -1.0, -2.0 if base and not export else -1.0,
                       "1", "1")


def test_cells_the_baseline_misses_are_kept_but_left_out_of_the_pass_rate():
    r = RetrievalResult((_trial("passkey", 1024, 0.0, True, True), _trial("passkey", 1024, 0.0, True, False, 1),
                         _trial("passkey", 1024, 1.0, True, True), _trial("passkey", 1024, 1.0, True, True, 1),
                         _trial("vt", 1024, 0.0, False, True), _trial("vt", 1024, 0.0, True, True, 1)))
    assert [c.baseline_passes for c in r.cells()] == [True, True, False]
    assert r.scored() == (3, 4) and r.pass_rate() == 0.75
    assert r.flips() == (1, 1) and r.mcnemar_p() == 1.0
    assert r.worst_cell_deficit() == 1
    assert np.isnan(r.pass_rate("vt")) and r.scored("vt") == (0, 0)


def test_distance_groups_pool_the_windows_by_target_position():
    rng = np.random.default_rng(0)
    windows = []
    for length in (8, 16):
        scores = TokenScores()
        for begin in range(0, length - 1, 4):
            n = min(4, length - 1 - begin)
            logits = rng.standard_normal((1, n, 5))
            scores.add(logits, logits, rng.integers(0, 5, (1, n)))
        windows.append(scores)
    groups = group_scores(windows, ((0, 4), (4, 16), (16, 32)))
    assert [(g.start, g.end, g.predictions) for g in groups] == [(0, 4, 6), (4, 16, 4 + 12)]
    assert all(g.perplexity_delta_rel == 0 and g.kl_mean == 0 and g.top1_agreement == 1 for g in groups)


def test_the_log_probability_gate_reads_every_trial_and_misses_on_none():
    from types import SimpleNamespace

    # _trial: -1.0 for both, but -2.0 for the export where it loses the answer: mean drop 0.25 nats over 4 trials
    trials = (_trial("passkey", 1024, 0.0, True, True), _trial("passkey", 1024, 0.0, True, False, 1),
              _trial("vt", 1024, 0.0, False, False), _trial("vt", 1024, 1.0, False, True))
    result = SimpleNamespace(retrieval=RetrievalResult(trials), distance=())
    assert LongContextGates(max_logprob_drop=0.25).misses(result) == []
    missed = LongContextGates(max_logprob_drop=0.2).misses(result)
    assert missed == ["the gold answers' log-probability -0.250 nats vs the baseline (mean of 4 trials) drops by "
                      "more than --max-logprob-drop 0.2"]
    empty = SimpleNamespace(retrieval=RetrievalResult(()), distance=())
    assert LongContextGates(max_logprob_drop=1).misses(empty) == ["--max-logprob-drop: no retrieval trial was run"]
    for bad in (-0.1, float("nan"), True):
        with pytest.raises(GateError, match="allowed: a finite number >= 0"):
            LongContextGates(max_logprob_drop=bad)


def test_group_limits_parse_and_unmeasured_groups_miss():
    assert parse_group_limit("0.005") == (None, 0.005)
    assert parse_group_limit("4096-8192=0.01") == ("4096-8192", 0.01)
    for bad in ("x", "1-2=nan", "a-b=0.1", "-0.1"):
        with pytest.raises(GateError, match="allowed: VALUE or START-END=VALUE"):
            parse_group_limit(bad)
    with pytest.raises(GateError, match=r"allowed: a number in \[0, 1\]"):
        LongContextGates(min_retrieval=2)


# -- the command ----------------------------------------------------------------------------------------------------
def _long(exports, tmp_path, *extra):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return kvq("validate", exports["reference"], "--baseline", exports["fp16-reference"], "--long-context",
               "--corpus", corpus, "--tasks", "passkey,multikey", "--lengths", "700,900", "--depths", "3",
               "--ppl-windows", "300,600", "--prefill-chunk", "256", "--quiet", *extra)


def test_the_command_writes_json_heat_map_and_report_and_gates(exports, tmp_path):
    out = _long(exports, tmp_path, "--json", tmp_path / "r.json", "--heatmap", tmp_path / "h.png",
                "--report", tmp_path / "r.html", "--max-group-ppl-delta", "512-600=10", "--max-logprob-drop", "100")
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert [g["start"] for g in data["distance"]] == [0, 512]
    assert len(data["retrieval"]["trials"]) == 2 * 2 * 3
    assert data["config"]["lengths"] == [700, 900] and data["cpu"]
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    assert "retrieval by task and length" in out.stdout
    assert "Perplexity by distance" in (tmp_path / "r.html").read_text()
    # the second run takes the baseline's trials from the first's JSON: the same trials, the same numbers
    missed = _long(exports, tmp_path, "--max-group-ppl-delta", "100-200=0.1", "--max-group-ppl-delta", "0",
                   "--baseline-trials", tmp_path / "r.json", "--json", tmp_path / "again.json")
    assert missed.returncode == 1 and "group 100-200 was not measured" in missed.stderr
    assert json.loads((tmp_path / "again.json").read_text())["retrieval"] == data["retrieval"]
    (tmp_path / "bad.json").write_text('{"config": {}}')
    bad = _long(exports, tmp_path, "--baseline-trials", tmp_path / "bad.json")
    assert bad.returncode == 1 and "bad.json: not a kvq validate --long-context --json result" in bad.stderr


def test_a_result_reads_back_the_numbers_it_reports(exports, tmp_path):
    from kvq_export.validate.long_context.runner import validate_long_context

    corpus = tmp_path / "c.txt"
    corpus.write_text("words " * 400)
    config = LongContextConfig(tasks=("passkey",), lengths=(600,), depths=2, corpus=str(corpus),
                               ppl_windows=(256,), ppl_chunk=32)
    result = validate_long_context(exports["reference"], exports["fp16-reference"], config)
    assert isinstance(result, LongContextResult)
    again = validate_long_context(exports["reference"], exports["fp16-reference"], config)
    assert again.retrieval == result.retrieval and again.distance == result.distance  # reproducible from the seed
    assert json.loads(result.to_json())["retrieval"]["summary"]["trials"] == 2
    assert LongContextResult.from_dict(json.loads(result.to_json())) == result  # what --baseline-trials reads
    reused = validate_long_context(exports["reference"], exports["fp16-reference"], config, baseline_from=result)
    assert reused.retrieval == result.retrieval  # the baseline's trials taken, the export's run again: the same
    with pytest.raises(KVQError, match="ran baseline .* on another grid or config"):
        validate_long_context(exports["reference"], exports["fp16-reference"], dataclasses.replace(config, seed=1),
                              baseline_from=result)


@pytest.mark.parametrize("args, message", [
    (("--lengths", "600"), "--lengths applies only to --long-context"),
    (("--baseline-trials", __file__), "--baseline-trials applies only to --long-context"),
    (("--max-logprob-drop", "0.1"), "--max-logprob-drop applies only to --long-context"),
    (("--long-context", "--windows", "2"), "--windows applies only to validation without --long-context"),
    (("--long-context", "--tasks", "needle"), "unknown task 'needle'; allowed: passkey, multikey, vt"),
    (("--long-context", "--lengths", "5000"), "--lengths 5000 exceeds the 1024 positions"),
    (("--long-context", "--heatmap", "h.jpg"), "the heat map is a PNG"),
    (("--long-context", "--tasks", "", "--heatmap", "h.png"), "--heatmap needs a retrieval task to map"),
])
def test_options_of_the_other_mode_and_bad_values_are_one_line(exports, args, message):
    out = kvq("validate", exports["reference"], "--baseline", exports["fp16-reference"], *args)
    assert out.returncode != 0 and message in out.stderr
