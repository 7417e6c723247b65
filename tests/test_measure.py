"""kvq_export.measure's harness: the one timing loop, the synthetic caches, the runners (behaviour, never speed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvq_export.errors import KVQError
from kvq_export.measure.synthetic import graph_cache
from kvq_export.measure.timing import Timing, interleaved, paired_ratio


def _recording(names, log):
    return {name: (lambda i, name=name: log.append((i, name))) for name in names}


def test_every_round_runs_each_stepper_once_in_a_fresh_seeded_order():
    log: list[tuple[int, str]] = []
    timings = interleaved(_recording("abcd", log), 30, warmup=2, seed=5)
    rounds = [[name for i, name in log if i == r] for r in range(32)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert len({tuple(r) for r in rounds}) > 4  # not one order, nor a rotation of four
    assert {name: len(t.seconds) for name, t in timings.items()} == {n: 30 for n in "abcd"}  # warm-up untimed
    again: list[tuple[int, str]] = []
    interleaved(_recording("abcd", again), 30, warmup=2, seed=5)
    assert again == log


def test_self_timed_steppers_report_their_own_seconds():
    timings = interleaved({"remote": lambda i: 0.5 + i, "other": lambda i: 2.0}, 3, warmup=1, self_timed=True)
    assert timings["remote"].seconds == (1.5, 2.5, 3.5) and timings["remote"].median == 2.5
    assert timings["other"].spread == (2.0, 2.0) and timings["other"].fastest == timings["other"].slowest == 2.0


def test_a_failing_stepper_is_dropped_and_named_or_its_error_propagates():
    def flaky(i: int) -> None:
        if i == 2:
            raise KVQError("out of memory")

    failures: dict[str, str] = {}
    timings = interleaved({"ok": lambda i: None, "flaky": flaky}, 4, failures=failures)
    assert set(timings) == {"ok"} and len(timings["ok"].seconds) == 4
    assert failures == {"flaky": "out of memory"}
    with pytest.raises(KVQError, match="out of memory"):
        interleaved({"flaky": flaky}, 4)
    with pytest.raises(KVQError, match="rounds=0"):
        interleaved({"ok": lambda i: None}, 0)
    with pytest.raises(KVQError):
        Timing(())


def test_paired_ratio_of_identical_rounds_is_one():
    assert paired_ratio([0.1, 0.2, 0.3], [0.1, 0.2, 0.3]) == (1.0, 1.0, 1.0)


def test_graph_cache_fills_each_past_with_valid_values_of_its_type():
    rng = np.random.default_rng(0)
    types = {"k": "tensor(uint8)", "v": "tensor(int8)", "f": "tensor(float16)", "g": "tensor(float)"}
    cache = graph_cache(types, (2, 3, 5, 4), rng)
    assert {n: a.dtype for n, a in cache.items()} == {"k": np.uint8, "v": np.int8, "f": np.float16, "g": np.float32}
    assert all(a.shape == (2, 3, 5, 4) for a in cache.values())
    assert all(np.isfinite(cache[n]).all() for n in ("f", "g")) and cache["k"].std() > 10
    with pytest.raises(KVQError, match="allowed: tensor"):
        graph_cache({"x": "tensor(double)"}, (1, 1, 1, 1), rng)


def test_kvq_runner_prefills_steps_and_starts_from_a_synthetic_cache(tmp_path):
    from tiny_models import tiny_model

    from kvq_export.export.exporter import export_model
    from kvq_export.measure.runners import KvqRunner

    directory = export_model(tiny_model("llama"), "fp16", tmp_path / "gqa", flavor="ort-gqa")
    ids = np.arange(3, 11)[None]
    with KvqRunner(directory, chunk=3, threads=1) as runner:
        one, seconds = runner.prefill(ids, 16)
        copies, _ = runner.prefill(np.tile(ids, (2, 1)), 16)  # one prompt repeated: prefilled once, copied
        assert seconds > 0 and copies.logits.shape[0] == 2
        np.testing.assert_array_equal(copies.logits[0], one.logits[0])
        np.testing.assert_array_equal(copies.logits[1], one.logits[0])
        greedy = one.next_tokens()
        runner.step(one)  # the greedy pick of the prefill
        runner.step(copies, greedy.repeat(2, axis=0))  # the same token, given
        np.testing.assert_allclose(copies.logits[1], one.logits[0], atol=1e-5)
        assert runner.cache_bytes(copies) == 2 * runner.cache_bytes(one)
        held = runner.synthetic(2, 12, 16, np.random.default_rng(0))
        runner.step(held)
        runner.step(held)
        assert runner.cache_bytes(held) == runner.cache_bytes(copies)  # the same capacity, 16 tokens a row
    assert runner.session is None


def test_kvq_and_onnxruntime_genai_runners_agree_on_one_export(tmp_path):
    """The peer comparison's engines on one ort-gqa export: the same perplexity, cache bytes at every context."""
    pytest.importorskip("onnxruntime_genai")
    from tiny_models import tiny_model

    from kvq_export.export.exporter import export_model
    from kvq_export.measure.runners import GenaiRunner, KvqRunner
    from kvq_export.peer_compare.genai import EngineSet, measure_engines
    from kvq_export.peer_compare.rows import Row

    directory = export_model(tiny_model("llama"), "fp16", tmp_path / "gqa", flavor="ort-gqa")
    engines = EngineSet()
    engines.add("kvq fp16", Row("kvq ort-gqa", "fp32 buffer", "fp16"), lambda: KvqRunner(directory, chunk=16))
    engines.add("og fp16", Row("genai builder", "fp32 (no kv quant)", "fp16"), lambda: GenaiRunner(directory, chunk=16))
    text = [int(t) for t in np.random.default_rng(0).integers(1, 120, 80)]
    kvq, og = measure_engines(engines, [text[:12], text[12:24]], [40, 64], 3, text, batches=(1, 2))
    assert kvq.ppl == pytest.approx(og.ppl, rel=1e-4) and kvq.ppl_delta == og.ppl_delta == 0.0
    assert kvq.cache_bytes_at == og.cache_bytes_at and set(kvq.cache_bytes_at) == {40, 64}
    assert set(kvq.decode_ms_batch) == set(og.decode_ms_batch) == {1, 2} and kvq.prefill_tok_s_at.keys() == {40, 64}
