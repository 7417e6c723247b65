"""No silent wrong output at run time: inputs outside what the graph can compute are refused before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB, WORDS, save_tiny_model_dir

from kvq_export.errors import KVQError, RuntimeInputError
from kvq_export.export.exporter import export_model
from kvq_export.request import CalibrationSpec
from kvq_export.runtime.ort_setup import ort_value
from kvq_export.runtime.sampling import Sampler, SamplingConfig
from kvq_export.runtime.session import KVQSession

MAX_POSITIONS = 1024  # tiny_models.COMMON


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    model = save_tiny_model_dir(root / "tiny")
    text = root / "calib.txt"
    text.write_text(" ".join(WORDS * 20))
    return {"kivi": export_model(model, "kivi-2", root / "kivi"), "fp16": export_model(model, "fp16", root / "fp16"),
            "gqa": export_model(model, "ort-int8", root / "gqa", flavor="ort-gqa",
                                calibration=CalibrationSpec(corpus=str(text), tokens=256, offset=0))}


@pytest.fixture(scope="module")
def sessions(exports):
    return {name: KVQSession(path) for name, path in exports.items()}


def _no_run(session, monkeypatch):
    """Fail the test if the graph runs: the refusal must come before any work."""
    def boom(*args, **kwargs):
        raise AssertionError("the graph ran")
    monkeypatch.setattr(session.session, "run_with_ort_values", boom, raising=False)
    monkeypatch.setattr(session.session, "run_with_iobinding", boom, raising=False)


@pytest.mark.parametrize("name", ["kivi", "gqa"])
def test_prompts_and_steps_beyond_the_positions_are_refused_before_work(sessions, name, monkeypatch):
    session = sessions[name]
    with monkeypatch.context() as m:
        _no_run(session, m)
        with pytest.raises(RuntimeInputError, match=f"beyond the {MAX_POSITIONS} positions"):
            session.generate([[5] * (MAX_POSITIONS + 1)], 1)
        with pytest.raises(RuntimeInputError, match="max_new_tokens=100 would put 1099 tokens"):
            session.generate([[5] * 1000], 100)
    assert len(session.generate([[5] * (MAX_POSITIONS - 3)], 4)[0].tokens) == 4  # exactly fills the positions
    _, cache = session.step(np.full((1, MAX_POSITIONS - 1), 5), None, session.empty_cache(1, capacity=MAX_POSITIONS))
    _, cache = session.step(np.array([[6]]), None, cache)
    _no_run(session, monkeypatch)
    with pytest.raises(RuntimeInputError, match="would put 1025 tokens in row 0|capacity 1025 exceeds the 1024"):
        session.step(np.array([[7]]), None, cache)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 3), min_size=4, max_size=4), min_size=1, max_size=3))
def test_masks_must_be_zero_one_and_left_padded(sessions, rows):
    session, mask = sessions["kivi"], np.array(rows)
    ids = np.full(mask.shape, 5)
    valid = np.isin(mask, (0, 1)).all() and (np.diff(mask, axis=1) >= 0).all() and mask.any()
    if valid:
        _, cache = session.step(ids, mask)
        assert session.seq_lengths(cache).tolist() == mask.sum(axis=1).tolist()  # a row holds its real tokens
    else:
        with pytest.MonkeyPatch.context() as m:
            _no_run(session, m)
            with pytest.raises(RuntimeInputError, match="attention_mask"):
                session.step(ids, mask)


@pytest.mark.parametrize("mask", [[[0, 0, 0]], [[0, 0], [0, 0]]])
def test_a_step_of_padding_only_is_refused_before_the_graph_runs(sessions, mask, monkeypatch):
    _no_run(sessions["kivi"], monkeypatch)
    with pytest.raises(RuntimeInputError, match="no real token"):
        sessions["kivi"].step(np.full((len(mask), len(mask[0])), 5), np.array(mask))


@pytest.mark.parametrize("mask, message", [([[2, 1, 1]], "allowed values are 0"), ([[1, 1, 0]], "not left-padded"),
                                           ([[0.5, 1, 1]], "allowed values are 0"), ([[1, 1]], "expected shape")])
def test_step_rejects_bad_masks(sessions, mask, message, monkeypatch):
    _no_run(sessions["kivi"], monkeypatch)
    with pytest.raises(RuntimeInputError, match=message):
        sessions["kivi"].step(np.array([[5, 6, 7]]), np.array(mask))


@pytest.mark.parametrize("ids", [[[5, VOCAB, 7]], [[5, -1, 7]], [[5.0, 6.0]]])
def test_token_ids_outside_the_vocabulary_are_rejected(sessions, ids, monkeypatch):
    _no_run(sessions["kivi"], monkeypatch)
    with pytest.raises(RuntimeInputError, match="outside the vocabulary|integer token ids"):
        sessions["kivi"].step(np.array(ids))
    if isinstance(ids[0][0], int):
        with pytest.raises(RuntimeInputError, match="outside the vocabulary"):
            sessions["kivi"].generate(ids, 1)


def test_nan_in_a_fed_cache_names_the_tensor(sessions):
    session = sessions["fp16"]
    _, cache = session.step(np.array([[5, 6, 7]]))
    arrays = session.cache_arrays(cache)
    name = "past.1.value.recent"
    poisoned = arrays[name].copy()
    poisoned[0, 0, 1, 0] = np.nan
    dtype = next(t.dtype for t in session.past if t.name == name)
    with pytest.raises(RuntimeInputError, match=f"cache tensor {name} holds NaN or Inf"):
        session.step(np.array([[8]]), None, {**cache, name: ort_value(poisoned, dtype)})


def test_non_finite_logits_are_never_sampled():
    logits = np.zeros((2, 8))
    logits[1, 3] = np.nan
    for config in (SamplingConfig(), SamplingConfig(temperature=0.7, seed=0)):
        with pytest.raises(KVQError, match="row 1 contain NaN or Inf"):
            Sampler(config)(logits)
    assert Sampler(SamplingConfig())(logits[:1]).tolist() == [0]


@settings(max_examples=300, deadline=None, database=None)
@given(temperature=st.floats(5e-324, 1e308) | st.sampled_from([5e-324, 1e-310, 1e-300, 1e-38, 1e300]),
       top_k=st.none() | st.integers(1, 2**40), top_p=st.none() | st.floats(1e-300, 1.0),
       logits=st.lists(st.floats(-3e4, 3e4) | st.sampled_from([0.0, 5.0]), min_size=2, max_size=12))
def test_every_accepted_temperature_samples_a_token(temperature, top_k, top_p, logits):
    """A subnormal temperature once overflowed the tempered logits (inf - inf = NaN) and crashed the sampler."""
    row = np.array([logits], np.float32)
    token = int(Sampler(SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=0))(row)[0])
    assert 0 <= token < row.shape[1]
    if top_k is not None and top_k < row.shape[1]:  # never a token outside the k most likely
        assert row[0, token] >= np.sort(row[0])[-top_k]
    if temperature < 1e-300 and (row[0] == row[0].max()).sum() == 1:  # the limit of a vanishing temperature
        assert token == int(row[0].argmax())


@pytest.mark.parametrize("kwargs", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(temperature=-0.5), dict(temperature="1"), dict(top_p=float("nan")),
                                    dict(top_p=0), dict(top_p=1.5), dict(top_k=0), dict(top_k=2.5),
                                    dict(top_k=True), dict(seed=-1), dict(seed=1.5)])
def test_sampling_parameters_are_validated(kwargs):
    with pytest.raises(KVQError, match=f"invalid {next(iter(kwargs))}="):
        SamplingConfig(**kwargs)


def test_numpy_caches_are_refused_with_a_clear_error(sessions):
    session = sessions["kivi"]
    _, cache = session.step(np.array([[5, 6]]))
    with pytest.raises(RuntimeInputError, match="expected an onnxruntime.OrtValue .* got numpy.ndarray"):
        session.step(np.array([[7]]), None, session.cache_arrays(cache))


def test_generate_still_runs_batches_with_finished_rows(sessions):
    session = sessions["kivi"]
    results = session.generate([[5, 6, 7], [9]], 3, stop_at_eos=False)
    assert [len(r.tokens) for r in results] == [3, 3]


def test_the_tokenizer_never_runs_code_shipped_in_an_export(exports, tmp_path):
    import shutil

    export_dir = tmp_path / "remote"
    shutil.copytree(exports["kivi"], export_dir)
    config = json.loads((export_dir / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (export_dir / "tokenizer_config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (export_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    session = KVQSession(export_dir, verify_weights=False)  # the checksums would refuse the edit: test the loader
    try:
        session.tokenizer("w1 w2")
    except RuntimeInputError:
        pass  # refusing the tokenizer is fine too; running its code is not
    assert not marker.exists()


@pytest.mark.parametrize(("env", "explicit", "expected"), [
    (None, None, 0),  # 0: ONNX Runtime picks
    ("1", None, 1),
    ("3", 2, 2),      # an explicit count wins over the environment
    ("abc", None, 0),
    ("0", None, 0),
])
def test_sessions_take_their_threads_from_omp_num_threads(env, explicit, expected, monkeypatch, caplog):
    from kvq_export.runtime.ort_setup import session_options

    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert session_options(explicit).intra_op_num_threads == expected
    assert ("not a positive integer" in caplog.text) == (env in ("abc", "0"))
