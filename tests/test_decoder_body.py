"""The decoder body built from weights matches transformers (eager, fp32) on tiny random models.

The KV cache here is a TEST-ONLY float cache (:class:`SimpleFloatCache`): past K/V per layer come in
as ``past.{i}.key``/``past.{i}.value`` [B, Hkv, P, D] and go out concatenated with the new tokens;
positions are P + cumsum(attention_mask) - 1 (HF semantics, every past slot real).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvq_export.arch import get_arch, supported_model_types
from kvq_export.errors import ExportError, ModelError
from kvq_export.export.decoder import CacheGraph, DecoderSpec, build_decoder
from kvq_export.flavors.cache_graph import AttentionInputs, CallValues
from kvq_export.graph.builder import GraphBuilder, save
from kvq_export.model_facts import ModelFacts

logger = logging.getLogger(__name__)

ATOL = 1e-4
PREFILL = 11
DECODE_STEPS = 4

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)

CASES = {
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral-sw8": ("mistral", dict(sliding_window=8, head_dim=16)),
    "qwen2-bias": ("qwen2", dict()),
    # layer 1 slides (i >= max_window_layers), layer 0 does not
    "qwen2-sw8-layer1": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "llama-rope-llama3": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "llama-rope-linear": (
        "llama",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    "llama-rope-yarn": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16
            )
        ),
    ),
}


# ------------------------------------------------------------------------------------ test-only cache
@dataclass(frozen=True, kw_only=True)
class FloatCall(CallValues):
    """TEST-ONLY: the per-call values of :class:`SimpleFloatCache`."""

    layers: list[tuple[ir.Value, ir.Value]]  # past key, value per layer
    k_pos: ir.Value
    k_valid: ir.Value
    masks: dict[int | None, ir.Value] = field(default_factory=dict)
    kv: list[tuple[ir.Value, ir.Value]] = field(default_factory=list)  # present key, value per layer


class SimpleFloatCache(CacheGraph[FloatCall]):
    """TEST-ONLY CacheGraph: float past/present K/V, eager attention with an additive finite mask."""

    def begin(self, b: GraphBuilder, *, attention_mask: ir.Value, spec: DecoderSpec) -> FloatCall:
        facts = spec.facts
        dt, hkv, d = spec.dtype, facts.num_kv_heads, facts.head_dim
        layers = [
            (
                b.input(f"past.{i}.key", dt, ["batch", hkv, "past", d]),
                b.input(f"past.{i}.value", dt, ["batch", hkv, "past", d]),
            )
            for i in range(facts.num_layers)
        ]

        past_len = b.op("Shape", layers[0][0], start=2, end=3)  # [1]
        # HF: position = (tokens before) - 1; left pads get clipped to 0 (their rows are garbage anyway).
        cumsum = b.op("CumSum", attention_mask, b.const(1))
        q_pos = b.op("Max", b.op("Add", cumsum, b.op("Sub", past_len, b.const([1]))), b.const([0]))

        batch = b.op("Shape", attention_mask, end=1)
        past_shape = b.op("Concat", batch, past_len, axis=0)  # [B, P]
        past_pos = b.op(
            "Unsqueeze", b.op("Range", b.const(0), b.op("Squeeze", past_len), b.const(1)), b.const([0])
        )
        k_pos = b.op("Concat", b.op("Expand", past_pos, past_shape), q_pos, axis=1)  # [B, P+t]
        k_valid = b.op(
            "Concat",
            b.op("Expand", b.const(True), past_shape),
            b.op("Equal", attention_mask, b.const(1)),
            axis=1,
        )
        return FloatCall(spec=spec, positions=q_pos, layers=layers, k_pos=k_pos, k_valid=k_valid)

    def _mask(self, b: GraphBuilder, call: FloatCall, window: int | None) -> ir.Value:
        """Additive mask [B, 1, t, P+t]: 0 where allowed, the dtype's most negative finite value elsewhere."""
        if window in call.masks:
            return call.masks[window]
        q = b.op("Unsqueeze", call.positions, b.const([1, 3]))  # [B, 1, t, 1]
        k = b.op("Unsqueeze", call.k_pos, b.const([1, 2]))  # [B, 1, 1, T]
        allowed = b.op("And", b.op("Unsqueeze", call.k_valid, b.const([1, 2])), b.op("LessOrEqual", k, q))
        if window is not None:
            allowed = b.op("And", allowed, b.op("Greater", k, b.op("Sub", q, b.const(window))))
        np_dtype = np.dtype(call.spec.dtype.numpy())
        mask = b.op("Where", allowed, b.const(0.0, np_dtype), b.const(np.finfo(np_dtype).min, np_dtype))
        call.masks[window] = mask
        return mask

    def attend(self, b: GraphBuilder, layer: int, inputs: AttentionInputs[FloatCall]) -> ir.Value:
        call, (q, k, v) = inputs.call, inputs.qkv
        f, dtype = call.spec.facts, call.spec.dtype
        past_k, past_v = call.layers[layer]
        k_all = b.op("Concat", past_k, k, axis=2)
        v_all = b.op("Concat", past_v, v, axis=2)
        call.kv.append((k_all, v_all))
        if f.kv_groups > 1:  # GQA: repeat each kv head for its group of query heads (HF repeat_kv)
            reps = b.const([1, 1, f.kv_groups, 1, 1])
            shape = b.const([0, f.num_heads, -1, f.head_dim])
            k_all = b.op("Reshape", b.op("Tile", b.op("Unsqueeze", k_all, b.const([2])), reps), shape)
            v_all = b.op("Reshape", b.op("Tile", b.op("Unsqueeze", v_all, b.const([2])), reps), shape)
        np_dtype = np.dtype(dtype.numpy())
        scores = b.op(
            "Mul",
            b.op("MatMul", q, b.op("Transpose", k_all, perm=[0, 1, 3, 2])),
            b.const(f.scaling, np_dtype),
        )
        scores = b.op("Add", scores, self._mask(b, call, f.window(layer)))
        probs = b.op("Softmax", b.op("Cast", scores, to=ir.DataType.FLOAT), axis=-1)
        return b.op("MatMul", b.op("Cast", probs, to=dtype), v_all)

    def end(self, b: GraphBuilder, call: FloatCall) -> None:
        f, dtype = call.spec.facts, call.spec.dtype
        shape = ["batch", f.num_kv_heads, "total", f.head_dim]
        for i, (k_all, v_all) in enumerate(call.kv):
            b.output(k_all, f"present.{i}.key", dtype, shape)
            b.output(v_all, f"present.{i}.value", dtype, shape)


# ------------------------------------------------------------------------------------------- helpers
def tiny_config(model_type: str, **overrides):
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    config._attn_implementation = "eager"
    return config


def random_model(config, seed: int = 0):
    """Make a HF causal LM with O(1) activations: random norms and biases too, so every weight matters."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model.eval()


def session(model_ir: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model_ir).SerializeToString(), providers=["CPUExecutionProvider"])


class Runner:
    """Feeds an exported model step by step, passing present back as past."""

    def __init__(self, sess: ort.InferenceSession, spec: DecoderSpec, batch: int) -> None:
        self.sess = sess
        facts = spec.facts
        dt = np.dtype(spec.dtype.numpy())
        empty = np.zeros((batch, facts.num_kv_heads, 0, facts.head_dim), dt)
        self.past = {f"past.{i}.{kv}": empty for i in range(facts.num_layers) for kv in ("key", "value")}

    def __call__(self, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        mask = np.ones_like(ids) if mask is None else mask
        outs = self.sess.run(None, {"input_ids": ids, "attention_mask": mask, **self.past})
        names = [o.name for o in self.sess.get_outputs()]
        result = dict(zip(names, outs, strict=True))
        self.past = {n.replace("present.", "past."): a for n, a in result.items() if n.startswith("present.")}
        return result["logits"]


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), use_cache=False).logits.float().numpy()


def decoder_spec(config, dtype: ir.DataType) -> DecoderSpec:
    """The spec :func:`build_decoder` hands its cache graph for ``config`` in ``dtype``."""
    arch = get_arch(config)
    return DecoderSpec.of(ModelFacts.from_config(config, arch), arch, dtype)


def export(model, dtype: str = "fp32") -> tuple[ort.InferenceSession, DecoderSpec]:
    model_ir = build_decoder(model, get_arch(model.config), SimpleFloatCache(), dtype=dtype)
    return session(model_ir), decoder_spec(model.config, model_ir.graph.inputs[2].dtype)


# --------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_hf(case: str) -> None:
    model_type, overrides = CASES[case]
    model = random_model(tiny_config(model_type, **overrides))
    sess, spec = export(model)

    rng = np.random.default_rng(1)
    total = PREFILL + DECODE_STEPS + 3
    ids = rng.integers(0, TINY["vocab_size"], size=(1, total), dtype=np.int64)
    ref = hf_logits(model, ids)

    run = Runner(sess, spec, batch=1)
    got = [run(ids[:, :PREFILL])]
    for step in range(PREFILL, PREFILL + DECODE_STEPS):  # one token at a time
        got.append(run(ids[:, step : step + 1]))
    got.append(run(ids[:, PREFILL + DECODE_STEPS :]))  # then a 3-token chunk with a past
    got = np.concatenate(got, axis=1)

    err = np.abs(got - ref).max()
    logger.info("%s: max |logits - HF| = %.3g (logit scale %.3g)", case, err, np.abs(ref).max())
    assert got.shape == ref.shape
    assert err <= ATOL, f"{case}: max |Δ| {err}"


@pytest.mark.parametrize("case", ["llama-untied", "mistral-sw8", "qwen2-sw8-layer1"])
def test_left_padded_batch_matches_single_prompts(case: str) -> None:
    model_type, overrides = CASES[case]
    model = random_model(tiny_config(model_type, **overrides))
    sess, spec = export(model)

    rng = np.random.default_rng(2)
    lengths = [PREFILL, 6]
    prompts = [rng.integers(0, TINY["vocab_size"], size=n, dtype=np.int64) for n in lengths]
    ids = np.zeros((2, PREFILL), np.int64)
    mask = np.zeros((2, PREFILL), np.int64)
    for row, p in enumerate(prompts):
        ids[row, PREFILL - len(p) :] = p
        mask[row, PREFILL - len(p) :] = 1

    batch_logits = Runner(sess, spec, batch=2)(ids, mask)
    for row, p in enumerate(prompts):
        ref = hf_logits(model, p[None, :])[0]
        got = batch_logits[row, PREFILL - len(p) :]
        assert np.isfinite(batch_logits[row]).all()
        assert np.abs(got - ref).max() <= ATOL, f"{case} prompt {row}"


def test_rope_tables_equal_transformers() -> None:
    for case in ("llama-untied", "llama-rope-llama3", "llama-rope-linear", "llama-rope-yarn"):
        model_type, overrides = CASES[case]
        model = random_model(tiny_config(model_type, **overrides))
        rope = get_arch(model.config).rope()
        np.testing.assert_array_equal(rope.inv_freq, model.model.rotary_emb.inv_freq.numpy())
        assert rope.attention_scaling == model.model.rotary_emb.attention_scaling
    model_type, overrides = CASES["llama-rope-yarn"]
    assert get_arch(tiny_config(model_type, **overrides)).rope().attention_scaling != 1.0


def test_fp16_body_runs_and_stays_close() -> None:
    model = random_model(tiny_config("llama", tie_word_embeddings=True))
    model_ir = build_decoder(model, get_arch(model.config), SimpleFloatCache(), dtype="fp16")
    assert model_ir.graph.outputs[0].dtype == ir.DataType.FLOAT
    assert model_ir.graph.inputs[2].dtype == ir.DataType.FLOAT16
    sess = session(model_ir)
    spec = decoder_spec(model.config, ir.DataType.FLOAT16)
    ids = np.random.default_rng(3).integers(0, TINY["vocab_size"], size=(1, PREFILL + 1), dtype=np.int64)
    run = Runner(sess, spec, batch=1)
    got = np.concatenate([run(ids[:, :PREFILL]), run(ids[:, PREFILL:])], axis=1)
    ref = hf_logits(model, ids)
    err = np.abs(got - ref).max()
    logger.info("fp16 body: max |logits - HF fp32| = %.3g (logit scale %.3g)", err, np.abs(ref).max())
    # HF's own fp16 model is about as far from fp32 (the last bits differ: matmul accumulation order).
    assert err < 5e-3 * np.abs(ref).max()


def test_state_dict_with_numpy_weights_matches_model() -> None:
    model = random_model(tiny_config("qwen2"))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    ids = np.arange(PREFILL, dtype=np.int64)[None, :]
    a = session(build_decoder(model, None, SimpleFloatCache()))
    b = session(build_decoder((state, model.config), None, SimpleFloatCache()))
    spec = decoder_spec(model.config, ir.DataType.FLOAT)
    np.testing.assert_array_equal(Runner(a, spec, 1)(ids), Runner(b, spec, 1)(ids))


def test_save_writes_model_and_data(tmp_path: Path) -> None:
    model = random_model(tiny_config("llama"))
    model_ir = build_decoder(model, get_arch(model.config), SimpleFloatCache())
    path = save(model_ir, tmp_path / "out" / "model.onnx")
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    spec = decoder_spec(model.config, ir.DataType.FLOAT)
    ids = np.arange(5, dtype=np.int64)[None, :]
    from_file = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(Runner(from_file, spec, 1)(ids), Runner(session(model_ir), spec, 1)(ids))
    save(model_ir, path)  # overwriting in place works too
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_graph_interface() -> None:
    model = random_model(tiny_config("mistral", sliding_window=8))
    model_ir = build_decoder(model, None, SimpleFloatCache())
    inputs = [v.name for v in model_ir.graph.inputs]
    outputs = [v.name for v in model_ir.graph.outputs]
    assert inputs[:2] == ["input_ids", "attention_mask"] and inputs[2:4] == ["past.0.key", "past.0.value"]
    assert outputs[0] == "logits" and outputs[1:3] == ["present.0.key", "present.0.value"]
    assert str(model_ir.graph.outputs[0].shape) == "[batch,seq,128]"
    assert model_ir.opset_imports[""] == 23 and model_ir.ir_version == 10
    facts = decoder_spec(model.config, ir.DataType.FLOAT).facts
    assert (facts.sliding_windows, facts.window(1), facts.kv_groups, facts.scaling) == ((8, 8), 8, 2, 0.25)


def test_unsupported_model_type_lists_supported() -> None:
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2)
    with pytest.raises(ModelError) as err:
        get_arch(config)
    assert "gpt2" in str(err.value)
    for model_type in ("llama", "mistral", "qwen2"):
        assert model_type in str(err.value)
    assert set(supported_model_types()) >= {"llama", "mistral", "qwen2"}


def test_dynamic_rope_is_refused() -> None:
    config = tiny_config("llama", rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ExportError, match="dynamic"):
        build_decoder(random_model(config), None, SimpleFloatCache())


def test_bad_dtype_and_missing_weight() -> None:
    model = random_model(tiny_config("llama"))
    with pytest.raises(ExportError, match="fp16"):
        build_decoder(model, None, SimpleFloatCache(), dtype="int8")
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ModelError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        build_decoder((state, model.config), None, SimpleFloatCache())


def test_builder_consts_outputs_and_names() -> None:
    b = GraphBuilder(opset=23)
    x = b.input("x", np.float32, ["n", 2])
    assert b.const([1, 2]) is b.const([1, 2])
    assert b.const([1, 2]) is not b.const([1, 2], np.int32)
    assert b.const(1.0).dtype == ir.DataType.FLOAT and b.const(1).dtype == ir.DataType.INT64
    y = b.output(x, "y")  # an input cannot also be the output: goes through Identity
    assert y is not x and y.name == "y" and y.dtype == ir.DataType.FLOAT
    with pytest.raises(ExportError, match="used twice"):
        b.input("x", np.float32, [1])
    b.output(b.op("Relu", x), "z")  # no dtype
    with pytest.raises(ExportError, match="no dtype"):
        b.build()


def test_build_time_for_a_30_layer_model(tmp_path: Path) -> None:
    """SmolLM2-135M dimensions with random weights: build, save and load take seconds."""
    config = tiny_config(
        "llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=100000.0),
        tie_word_embeddings=True,
    )
    arch = get_arch(config)
    rng = np.random.default_rng(0)
    state = {
        name: rng.standard_normal(shape, dtype=np.float32) * 0.02
        for name, shape in _llama_shapes(arch).items()
    }

    start = time.perf_counter()
    model_ir = build_decoder((state, config), arch, SimpleFloatCache())
    built = time.perf_counter()
    path = save(model_ir, tmp_path / "model.onnx")
    saved = time.perf_counter()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    loaded = time.perf_counter()
    logits = Runner(sess, decoder_spec(config, ir.DataType.FLOAT), batch=1)(np.arange(16)[None, :])
    ran = time.perf_counter()

    n_params = sum(v.const_value.size for v in model_ir.graph.initializers.values())
    logger.warning(
        "30-layer SmolLM2-like body (%d nodes, %.1f M params): build %.2f s, save %.2f s, "
        "ORT load %.2f s, 16-token prefill %.3f s",
        len(model_ir.graph),
        n_params / 1e6,
        built - start,
        saved - built,
        loaded - saved,
        ran - loaded,
    )
    assert 130e6 < n_params < 140e6
    assert logits.shape == (1, 16, 49152) and np.isfinite(logits).all()
    assert built - start < 20.0


def _llama_shapes(arch) -> dict[str, tuple[int, ...]]:
    facts = ModelFacts.from_config(arch.config, arch)
    h, inter, d = facts.hidden_size, arch.intermediate_size, facts.head_dim
    shapes = {arch.embed_name(): (facts.vocab_size, h), arch.final_norm_name(): (h,)}
    for i in range(facts.num_layers):
        n = arch.layer_names(i)
        shapes.update(
            {
                n.q.weight: (facts.num_heads * d, h),
                n.k.weight: (facts.num_kv_heads * d, h),
                n.v.weight: (facts.num_kv_heads * d, h),
                n.o.weight: (h, facts.num_heads * d),
                n.gate.weight: (inter, h),
                n.up.weight: (inter, h),
                n.down.weight: (h, inter),
                n.input_norm: (h,),
                n.post_attention_norm: (h,),
            }
        )
    return shapes
