"""kvq plan (kvq_export.plan): per-layer formats under a bit budget by measured attention damage."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gqa_harness import compare, sequences, step_nodes
from tiny_models import VOCAB, save_tiny_model_dir, tiny_model

from kvq_export.calibration import calibrate_static_scales
from kvq_export.cli import cli
from kvq_export.errors import KVQError, SchemeError
from kvq_export.export.exporter import export_model
from kvq_export.flavors.ort_gqa.capability import unsupported
from kvq_export.memory import predict
from kvq_export.model_facts import Geometry
from kvq_export.model_source import model_facts
from kvq_export.plan import (
    CANDIDATE_SETS,
    CandidateSet,
    Option,
    allocate,
    candidate_set,
    fitting,
    plan_scheme,
    scheme_from_choice,
    with_value_window,
)
from kvq_export.presets import get_preset
from kvq_export.request import CalibrationSpec
from kvq_export.runtime.session import KVQSession
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Axis, Format, Quantizer, Rotation

INT8, INT4 = get_preset("ort-int8").key, get_preset("ort-int4").key


@pytest.fixture(scope="module")
def windows() -> list[list[int]]:
    return np.random.default_rng(5).integers(0, VOCAB, (2, 48)).tolist()


# -- allocation ---------------------------------------------------------------------------------------------
def _random_options(rng, layers: int, per_layer: int) -> list[list[Option]]:
    return [[Option(INT4, INT4, float(rng.random()), int(rng.integers(10, 100))) for _ in range(per_layer)]
            for _ in range(layers)]


def test_allocate_matches_exhaustive_search():
    rng = np.random.default_rng(0)
    for trial in range(30):
        options = _random_options(rng, 4, 3)
        budget = int(rng.integers(60, 300))
        feasible = [c for c in itertools.product(range(3), repeat=4)
                    if sum(options[i][j].nbytes for i, j in enumerate(c)) <= budget]
        if not feasible:
            with pytest.raises(KVQError, match="no allocation fits"):
                allocate(options, budget, resolution=budget)
            continue
        best = min(sum(options[i][j].damage for i, j in enumerate(c)) for c in feasible)
        got = allocate(options, budget, resolution=budget)  # a grid of one byte: exact
        assert sum(options[i][j].nbytes for i, j in enumerate(got)) <= budget, trial
        assert sum(options[i][j].damage for i, j in enumerate(got)) == pytest.approx(best), trial


def test_allocate_coarse_grid_never_exceeds_the_budget():
    rng = np.random.default_rng(1)
    for _ in range(20):
        options = _random_options(rng, 6, 4)
        budget = int(rng.integers(400, 600))
        got = allocate(options, budget, resolution=7)
        assert sum(options[i][j].nbytes for i, j in enumerate(got)) <= budget


def test_scheme_from_choice_round_trips():
    choice = [(INT4, INT4), (INT8, INT8), (INT4, INT4), (INT4, INT8)]
    scheme = scheme_from_choice(choice, "p")
    assert scheme.key == INT4 and scheme.value == INT4 and len(scheme.layer_overrides) == 2
    assert scheme.streams(4) == choice
    assert KVQuantScheme.from_json(scheme.to_json()).streams(4) == choice


def test_candidate_sets():
    assert CANDIDATE_SETS["ort-gqa"].tied and not CANDIDATE_SETS["kivi"].tied
    gqa = CANDIDATE_SETS["ort-gqa"].options()
    assert {(k.format, k.bits) for k, _ in gqa} == {("int_sym", 8), ("int", 8), ("int_sym", 4), ("int", 4)}
    assert all(not unsupported(KVQuantScheme(key=k, value=v), 2) for k, v in gqa)  # GQA holds every option
    assert len(CANDIDATE_SETS["kivi"].options()) == 25
    custom = candidate_set("ort-int8,ort-int4,ort-int8")
    assert custom.options() == [(INT8, INT8), (INT4, INT4)]
    with pytest.raises(SchemeError, match="windows"):
        candidate_set("kivi-4")
    small = fitting(CANDIDATE_SETS["kivi"], 32)  # token groups of 64 do not fit head_dim 32
    assert all(v.group_size == 32 for _, v in small.options()) and len(small.options()) == 5 * 2


def test_accuracy_set_offers_rotated_and_ggml_streams():
    cset = CANDIDATE_SETS["accuracy"]
    assert not cset.tied
    for streams in (cset.keys, cset.values):
        assert any(t.rotation == Rotation.HADAMARD and t.quantizer == Quantizer.KVQ for t in streams)
        assert any(t.quantizer == Quantizer.GGML and t.rotation == Rotation.HADAMARD for t in streams)
        assert {t.bits for t in streams} == {2, 3, 4, 5, 6, 8}
        assert len(set(streams)) == len(streams)
    assert {t.high_channels for t in cset.keys} == {0, 4, 8, 16, 24} and not any(t.high_channels for t in cset.values)
    assert {t.bits for t in cset.keys if t.high_channels} == {3, 4}
    assert all(t.format == Format.INT for t in cset.values if t.bits == 3)  # 8 levels: a symmetric group would have 7
    assert {t.axis for t in cset.keys if t.quantizer == Quantizer.KVQ and t.bits < 8} == {Axis.CHANNEL}
    assert all(t.axis == Axis.TOKEN for t in cset.values)
    assert all(t.clip < 1 for t in cset.values if t.bits == 2 and t.group_size == 32)
    for key, value in cset.options():  # every option is a valid scheme for a head_dim-64 model
        KVQuantScheme(key=key, value=value).check_model(Geometry(30, 3, 64))
    small = fitting(cset, 32)
    assert all((v.group_size or 32) <= 32 for _, v in small.options())
    assert len(small.keys) == len(cset.keys) and len(small.values) < len(cset.values)


# -- planning on a tiny model -----------------------------------------------------------------------------
@pytest.mark.parametrize("metric", ["attention", "kl"])
def test_ort_gqa_plan_spends_the_budget_where_damage_is(windows, metric):
    model = tiny_model("llama")
    facts = model_facts(model.config)
    context = 4096
    low = predict(KVQuantScheme(key=INT4, value=INT4), facts, context).bits_per_element
    high = predict(KVQuantScheme(key=INT8, value=INT8), facts, context).bits_per_element
    budget = (low + high) / 2 + 0.01  # room for exactly one of the two layers at 8 bits
    plan = plan_scheme(model, windows, budget=budget, context=context, candidates="ort-int8,ort-int4",
                       metric=metric, calibration=CalibrationSpec(method="absmax"))
    assert plan.bits_per_element <= budget
    streams = plan.scheme.streams(2)
    assert sorted(k.bits for k, _ in streams) == [4, 8] and all(k == v for k, v in streams)
    damage = {(d.layer, d.key.bits): d.damage for d in plan.damages}
    assert all(damage[(layer, 4)] > damage[(layer, 8)] for layer in range(2))
    gain = [damage[(layer, 4)] - damage[(layer, 8)] for layer in range(2)]
    upgraded = next(layer for layer, (k, _) in enumerate(streams) if k.bits == 8)
    assert upgraded == int(np.argmax(gain))  # the 8 bits go to the layer where they remove more damage
    assert plan.damage == pytest.approx(sum(damage[(layer, k.bits)] for layer, (k, _) in enumerate(streams)))
    uniform4 = next(u for u in plan.uniform if u["key"].startswith("int4"))
    assert plan.damage < uniform4["damage"] and uniform4["bits_per_element"] == pytest.approx(low)


def test_untied_plan_measures_keys_and_values_separately(windows):
    model = tiny_model("llama")
    cset = fitting(CANDIDATE_SETS["kivi"], 32)
    plan = plan_scheme(model, windows, budget=4.5, context=4096, candidates=cset)
    assert plan.bits_per_element <= 4.5
    measured = {(d.key is not None, d.value is not None) for d in plan.damages}
    assert measured == {(True, False), (False, True)}
    two_bit = [d for d in plan.damages if d.key is not None and d.key.bits == 2]
    eight_bit = [d for d in plan.damages if d.key is not None and d.key.bits == 8]
    assert sum(d.damage for d in two_bit) > sum(d.damage for d in eight_bit)
    assert all(d.value_induced == 0 for d in plan.damages if d.value is None)  # keys alone: no value error


def test_rotated_candidates_are_measured_in_the_model_basis(windows):
    """Rotating an unquantized stream is exact (no damage); a rotated 2-bit stream is measured, not ignored."""
    import dataclasses

    from kvq_export.calibration.passes import collect_attention_samples
    from kvq_export.plan import attention_damage, o_proj_weight

    model = tiny_model("llama")
    samples = collect_attention_samples(model, windows, [0, 1], 2)
    weight = o_proj_weight(model, 1)
    fp32_rot = dataclasses.replace(KVQuantScheme(hp_dtype="fp32").key, rotation="hadamard")
    assert attention_damage(samples[1], weight, fp32_rot, fp32_rot)[0] < 1e-10
    two = next(v for v in fitting(CANDIDATE_SETS["accuracy"], 32).values if v.bits == 2)
    plain = dataclasses.replace(two, rotation="none")
    rotated, unrotated = (attention_damage(samples[1], weight, None, v) for v in (two, plain))
    assert rotated[0] > 1e-6 and rotated[2] > 0 and rotated != unrotated


def test_accuracy_plan_fits_a_three_and_a_half_bit_budget(windows):
    model = tiny_model("llama")
    plan = plan_scheme(model, windows, budget=3.5, context=4096, candidates=fitting(CANDIDATE_SETS["accuracy"], 32))
    assert plan.bits_per_element <= 3.5
    cset = fitting(CANDIDATE_SETS["accuracy"], 32)
    assert all(k in cset.keys and v in cset.values for k, v in plan.scheme.streams(2))
    assert len(plan.damages) == 2 * (len(cset.keys) + len(cset.values))
    best_fitting = min(u["damage"] for u in plan.uniform if u["bits_per_element"] <= 3.5)
    assert plan.damage <= best_fitting + 1e-12  # never worse than the best uniform choice within the budget


def test_sink_tokens_are_measured_and_paid_for(windows):
    from kvq_export.calibration.passes import collect_attention_samples
    from kvq_export.plan import attention_damage, o_proj_weight

    model = tiny_model("llama")
    samples = collect_attention_samples(model, windows, [0, 1], 2)
    two_key, two_value = (next(t for t in streams if t.bits == 2) for streams in
                          (CANDIDATE_SETS["accuracy"].keys, fitting(CANDIDATE_SETS["accuracy"], 32).values))
    quantized = attention_damage(samples[0], o_proj_weight(model, 0), two_key, two_value)[0]
    exact = attention_damage(samples[0], o_proj_weight(model, 0), two_key, two_value, sink_tokens=len(windows[0]))[0]
    assert quantized > 1e-6 and exact < 1e-10  # every token a sink: nothing is quantized
    cset = fitting(CANDIDATE_SETS["accuracy"], 32)
    plan = plan_scheme(model, windows, budget=4.5, context=256, candidates=cset, sink_tokens=4)
    assert plan.scheme.sink_tokens == 4 and plan.settings["sink_tokens"] == 4
    assert predict(plan.scheme, model_facts(model.config), 256).bits_per_element == pytest.approx(plan.bits_per_element)
    assert plan.bits_per_element <= 4.5
    with pytest.raises(KVQError, match="sink_tokens"):
        plan_scheme(model, windows, budget=4.5, context=256, candidates=cset, sink_tokens=-1)


def test_recent_windows_are_measured_per_query_and_paid_for(windows):
    import dataclasses

    from kvq_export.calibration.passes import collect_attention_samples
    from kvq_export.plan import attention_damage, o_proj_weight, reference_dequant

    model = tiny_model("llama")
    samples = collect_attention_samples(model, windows, [0, 1], 2)
    weight = o_proj_weight(model, 0)
    two = next(v for v in fitting(CANDIDATE_SETS["accuracy"], 32).values if v.bits == 2)
    windowed = dataclasses.replace(two, residual_length=5)
    # by hand: a query at position p reads values p-4..p exactly and the older ones quantized
    induced = []
    for sample in samples[0]:
        a, v = sample.attention(), sample.values
        v_hat = reference_dequant(v, two, None)
        positions = sample.positions.repeat(a.shape[1] // sample.positions.shape[0])
        o_hat = torch.stack([torch.stack([a[h, row] @ torch.where((torch.arange(v.shape[1]) > pos - 5)[:, None],
                                                                   v[h], v_hat[h]) for row, pos in
                                          enumerate(positions.tolist())]) for h in range(a.shape[0])])
        o = torch.bmm(a, v)
        induced.append(float(((o_hat - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-30)).mean()))
    plain, short = (attention_damage(samples[0], weight, None, t) for t in (two, windowed))
    assert short[2] == pytest.approx(np.mean(induced), rel=1e-5)
    assert 0 < short[0] < plain[0] and short[2] < plain[2]
    everything = dataclasses.replace(two, residual_length=len(windows[0]))
    assert attention_damage(samples[0], weight, everything, everything)[0] < 1e-10  # nothing left to quantize

    cset = fitting(CANDIDATE_SETS["accuracy-recent"], 32)
    assert {v.residual_length for v in cset.values} == {None, 8, 16, 32, 64} and not any(k.residual_length
                                                                                     for k in cset.keys)
    plan = plan_scheme(model, windows, budget=3.5, context=256, candidates=cset)
    assert predict(plan.scheme, model_facts(model.config), 256).bits_per_element == pytest.approx(plan.bits_per_element)
    assert plan.bits_per_element <= 3.5
    assert any("residual_length=16" in reason for reason in unsupported(
        KVQuantScheme(key=INT4, value=dataclasses.replace(INT4, residual_length=16)), 2))

    # --value-window: every value candidate keeps the same window
    kivi = CANDIDATE_SETS["kivi"]
    assert with_value_window(kivi, 8).keys == kivi.keys
    assert {v.residual_length for v in with_value_window(kivi, 8).values} == {8}
    channel_values = CandidateSet("per-channel values", keys=kivi.keys[:1],
                                  values=(TensorQuant(axis="channel", group_size=32),))
    with pytest.raises(KVQError, match="multiple of their group size"):
        with_value_window(channel_values, 8)
    with pytest.raises(KVQError, match="value window -1"):
        with_value_window(kivi, -1)
    plan = plan_scheme(model, windows, budget=3.5, context=256, candidates=fitting(CANDIDATE_SETS["accuracy"], 32),
                       value_window=8)
    assert plan.settings["value_window"] == 8 and plan.bits_per_element <= 3.5
    assert all(v.residual_length == 8 for _, v in plan.scheme.streams(2))


SHIPPED_PLANS = {  # budget: the candidates `kvq plan` chose from (the commands are in models/smollm2.md)
    "3.5": CANDIDATE_SETS["accuracy-recent"],
    "4.5": CANDIDATE_SETS["accuracy"],
    "6.5": with_value_window(CANDIDATE_SETS["accuracy"], 8),
}


@pytest.mark.parametrize("budget", sorted(SHIPPED_PLANS))
def test_shipped_smollm2_plans_fit_the_model_and_their_budget(budget):
    """``models/smollm2-plan-*.json`` describe SmolLM2's cache within their budget, from their candidate sets."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "models" / f"smollm2-plan-{budget}.json"
    scheme = KVQuantScheme.from_json(path.read_text())
    geometry = Geometry(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M: 3 kv heads of 64 channels
    scheme.check_model(geometry)
    assert scheme.residual_length == 0 and scheme.sink_tokens == 0
    assert float(budget) - 0.1 < predict(scheme, geometry, 4096).bits_per_element <= float(budget)
    if not any(v.residual_length for _, v in scheme.streams(30)):  # no window: the budget holds at any length
        assert predict(scheme, geometry, 512).bits_per_element <= float(budget)
    cset = SHIPPED_PLANS[budget]
    assert all(k in cset.keys and v in cset.values for k, v in scheme.streams(30))
    assert len(set(scheme.streams(30))) > 1  # a per-layer plan, not a uniform scheme


def test_plan_reports_each_stage_as_progress(windows):
    from kvq_export.progress import reporting

    steps, threads = [], torch.get_num_threads()
    with reporting(steps.append):
        plan_scheme(tiny_model("llama"), windows, budget=6.0, context=4096, candidates="ort-gqa")
    ended = [(s.desc, s.done, s.total) for s in steps if s.finished]
    assert ended == [("attention samples: forward passes", 2, 2), ("plan: calibrating candidates", 2, 2),
                     ("plan: measuring attention damage", 2, 2), ("plan: allocating bits", 1, 1)]
    assert [s.done for s in steps if s.desc == "plan: measuring attention damage"] == [0, 1, 2, 2]
    assert torch.get_num_threads() == threads  # the analysis runs at one thread; the caller's count comes back


def test_plan_errors(windows):
    model = tiny_model("llama")
    with pytest.raises(KVQError, match="no allocation fits"):
        plan_scheme(model, windows, budget=2.0, context=4096, candidates="ort-gqa",
                    calibration=CalibrationSpec(method="absmax"))
    with pytest.raises(KVQError, match="allowed: attention, kl"):
        plan_scheme(model, windows, budget=5.0, context=4096, metric="mse")


def test_mixed_bit_widths_export_per_layer_on_ort_gqa(tmp_path):
    """One GroupQueryAttention node per layer, each with its own kv_cache_bit_width, equal to the reference."""
    import onnx

    scheme = KVQuantScheme(key=INT8, value=INT8, hp_dtype="fp32", name="mixed-bits",
                           layer_overrides=(LayerOverride(1, key=INT4, value=INT4),))
    prompts = [[5, 17, 99, 3, 42, 8, 77]]
    static = calibrate_static_scales(tiny_model("llama"), scheme, sequences(prompts))
    static = {layer: {part: {role: a * np.float32(1.05) for role, a in meta.items()} for part, meta in parts.items()}
              for layer, parts in static.items()}
    session = KVQSession(export_model(tiny_model("llama"), scheme, tmp_path / "x", static=static, flavor="ort-gqa"))
    graph = onnx.load(session.directory / "model.onnx", load_external_data=False).graph
    widths = [next(a.i for a in n.attribute if a.name == "kv_cache_bit_width") for n in step_nodes(graph)]
    assert widths == [8, 4]
    c = compare(session, "llama", scheme, static, prompts)
    assert c.logits <= 1e-4 and c.worse == 0 and c.off_by_one <= c.codes // 500, c


def test_cli_plan_writes_a_scheme(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    rng = np.random.default_rng(2)
    corpus = tmp_path / "text.txt"
    corpus.write_text(" ".join(f"w{i}" for i in rng.integers(0, VOCAB - 1, 400)))
    out, report = tmp_path / "planned.json", tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["plan", "--model", str(model_dir), "--corpus", str(corpus), "--tokens", "128",
                                      "--offset", "100", "--budget", "6", "--context", "1024", "--calib-method",
                                      "absmax", "--out", str(out), "--json", str(report)])
    assert result.exit_code == 0, result.output
    scheme = KVQuantScheme.from_json(out.read_text())
    assert scheme.name == "planned" and "bits/element at 1024 tokens" in result.output
    assert "plan: measuring" not in result.output  # no progress bars when stderr is not a terminal
    data = json.loads(report.read_text())
    # 2 layers x the default set's tied candidates (int8 / int4, with and without key zero points and high channels)
    assert data["bits_per_element"] <= 6 and len(data["damages"]) == 2 * len(CANDIDATE_SETS["ort-gqa"].options())
    assert data["settings"]["offset"] == 100
    # onnxruntime-genai serves a plan whose layers share one bit width (one cache element type)
    widths = {tq.bits for pair in scheme.streams(2) for tq in pair}
    assert data["onnxruntime_genai"]["servable"] is (len(widths) == 1)
    bad = CliRunner().invoke(cli, ["plan", "--model", str(model_dir), "--corpus", str(corpus), "--budget", "1",
                                   "--tokens", "64", "--offset", "0", "--out", str(out)])
    assert bad.exit_code == 1 and "no allocation fits" in bad.output
    nowhere = CliRunner().invoke(cli, ["plan", "--model", str(model_dir), "--budget", "6", "--out",
                                       str(tmp_path / "missing" / "p.json")])
    assert nowhere.exit_code == 1 and "its directory does not exist" in nowhere.output
    negative = CliRunner().invoke(cli, ["plan", "--budget", "4", "--value-window", "-3", "--out", str(out)])
    assert negative.exit_code == 2 and "--value-window" in negative.output


def test_kl_metric_is_zero_for_an_unquantized_candidate(windows):
    fp32 = KVQuantScheme(hp_dtype="fp32")
    from kvq_export.plan import CandidateSet, measure_kl

    cset = CandidateSet("exact", pairs=((fp32.key, fp32.value), (INT4, INT4)))
    static = calibrate_static_scales(tiny_model("llama"), KVQuantScheme(key=INT4, value=INT4), windows)
    damages = measure_kl(tiny_model("llama"), windows, cset, {INT4: static}, 2)
    exact = [d.damage for d in damages if d.key is None]
    assert exact and max(exact) < 1e-9
    assert min(d.damage for d in damages if d.key is not None) > 1e-7
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()  # inference mode does not leak


def test_plan_calibrates_candidates_like_export_by_default():
    """A plan's damages are measured with the static scales ``kvq export`` will use unless told otherwise."""
    import inspect

    def default(command: str) -> str:
        return next(p.default for p in cli.commands[command].params if p.name == "calib_method")

    assert default("plan") == default("export") == "absmax"
    assert inspect.signature(plan_scheme).parameters["calibration"].default.method == "absmax"


# -- choices pinned across changes to the planner's arithmetic -------------------------------------------------
PINS = Path(__file__).resolve().parent / "data" / "plan_pins.json"
#: ``plan_scheme`` settings whose planned schemes and measured damages ``data/plan_pins.json`` holds, as the
#: planner gave them before its measurement was batched: a faster planner must choose the same, from the same
#: damages (on the tiny model and the ``windows`` fixture).
PINNED = {
    "ort-gqa": dict(budget=6.0, context=4096, candidates="ort-gqa"),
    "ort-gqa-percentile": dict(budget=5.5, context=4096, candidates="ort-gqa",
                               calibration=CalibrationSpec(method="percentile")),
    "ort-attention-calibrated": dict(budget=6.02, context=4096, candidates="ort-int8,ort-int4",
                                     calibration=CalibrationSpec(method="attention")),
    "ort-gqa-kl": dict(budget=6.0, context=4096, candidates="ort-gqa", metric="kl"),
    "kivi": dict(budget=4.5, context=4096, candidates=fitting(CANDIDATE_SETS["kivi"], 32)),
    "accuracy-sinks": dict(budget=4.5, context=256, candidates=fitting(CANDIDATE_SETS["accuracy"], 32), sink_tokens=4),
    "accuracy-recent": dict(budget=3.5, context=256, candidates=fitting(CANDIDATE_SETS["accuracy-recent"], 32)),
    "accuracy-value-window": dict(budget=4.0, context=256, candidates=fitting(CANDIDATE_SETS["accuracy"], 32),
                                  value_window=8),
}


def pinned_plan(case: str, windows: list[list[int]]) -> dict:
    """The planned scheme and every measured damage of a :data:`PINNED` case, in ``data/plan_pins.json``'s form."""
    plan = plan_scheme(tiny_model("llama"), windows, name=case, **PINNED[case])
    return {"scheme": plan.scheme.to_dict(),
            "damages": [[d.layer, d.key.describe() if d.key else None, d.value.describe() if d.value else None,
                         d.damage, d.key_induced, d.value_induced] for d in plan.damages]}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_plan_choices_and_damages_are_pinned(case, windows):
    pinned = json.loads(PINS.read_text())[case]
    got = pinned_plan(case, windows)
    assert got["scheme"] == pinned["scheme"]
    assert [d[:3] for d in got["damages"]] == [d[:3] for d in pinned["damages"]]
    # another CPU's float32 kernels (AVX2, AVX-512) sum in another order: a damage near zero moves by a few 1e-8,
    # so each agrees to 1e-4 of itself or 1e-3 of the case's largest damage
    largest = max(abs(x) for d in pinned["damages"] for x in d[3:])
    for measured, recorded in zip(got["damages"], pinned["damages"]):
        assert measured[3:] == pytest.approx(recorded[3:], rel=1e-4, abs=1e-3 * largest), measured[:3]
