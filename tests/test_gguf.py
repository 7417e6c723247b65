"""GGUF files of every registered family: written as llama.cpp writes them, loaded through kvq like HF directories.

Each case is a tiny random model written as a float32 GGUF with llama.cpp's tensor names, metadata keys and
value transforms (Llama's q/k row permutation, Gemma's ``w + 1`` norms), then loaded with ``load_model(path)``:
the same weights (Gemma's norms come back as float32 ``(1 + w) - 1``), fp32 logits of a prefill and decode steps
within 1e-4 of the source model, and a quantized export that runs. The configs use what a GGUF states and
transformers' loader drops (Qwen3's head_dim, Phi3's partial rotary, soft-caps, linear RoPE scaling: kvq
restores them); what no GGUF key states (Gemma2/3's ``query_pre_attn_scalar``, Gemma3's layer pattern) keeps
the config default, so the source model is the model the file describes.

Families transformers cannot load from GGUF, and RoPE scaling it would silently drop, are refused by kvq with
one line.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from state_harness import teacher_forced_logits
from tiny_models import COMMON, VOCAB

from kvq_export.cli import cli
from kvq_export.errors import ModelError
from kvq_export.export.exporter import export_model
from kvq_export.model_source import GGUF_ARCHITECTURES, load_config, load_model, model_facts
from kvq_export.presets import PRESETS, resolve_scheme
from kvq_export.runtime.session import KVQSession

gguf = pytest.importorskip("gguf")

logger = logging.getLogger(__name__)

FP32_CACHE = resolve_scheme(str(Path(__file__).resolve().parents[1] / "tools" / "schemes" / "fp32-cache.json"))
PROMPT = [5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 9]
DECODE = [7, 8, 9, 120, 33, 2]  # past Gemma's sliding window of 8


@dataclass(frozen=True)
class GgufCase:
    """A family as llama.cpp writes it: the GGUF architecture, and the ``general.name`` it carries."""

    arch: str  # gguf.MODEL_ARCH member name
    loads_as: str  # the model_type transformers gives the loaded model
    name: str | None = None


def _config(kind: str):
    import transformers as tf

    if kind == "llama":  # linear RoPE scaling: llama.cpp writes rope.scaling.type/factor, kvq restores them
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    if kind == "mistral":  # no sliding window: llama.cpp runs Mistral as Llama and writes none
        return tf.MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False)
    if kind == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if kind == "qwen3":  # head_dim 32: kvq restores attention.key_length (transformers' default would be 128)
        return tf.Qwen3Config(**COMMON, tie_word_embeddings=True)
    if kind == "gemma":
        return tf.GemmaConfig(**COMMON, tie_word_embeddings=True)
    if kind == "gemma2":  # small soft-caps (restored by kvq); query_pre_attn_scalar: no GGUF key, the default 256
        return tf.Gemma2Config(**{**COMMON, "head_dim": 64}, sliding_window=8, attn_logit_softcapping=2.0,
                               final_logit_softcapping=5.0, tie_word_embeddings=True)
    if kind == "gemma3":  # six layers: the one pattern a GGUF gets (five sliding, one global, linear RoPE x8)
        return tf.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 6}, sliding_window=8, final_logit_softcapping=5.0,
            tie_word_embeddings=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    if kind == "phi3":  # RoPE on half of each head: kvq restores it from rope.dimension_count
        return tf.Phi3Config(**COMMON, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})
    if kind == "olmo2":
        return tf.Olmo2Config(**COMMON, tie_word_embeddings=False)
    raise ValueError(kind)


#: registered families transformers loads from GGUF (Mistral is written as Llama, as llama.cpp does)
LOADS = {
    "llama": GgufCase("LLAMA", "llama"),
    "mistral": GgufCase("LLAMA", "llama", name="Mistral-7B-v0.1"),
    "qwen2": GgufCase("QWEN2", "qwen2"),
    "qwen3": GgufCase("QWEN3", "qwen3"),
    "gemma2": GgufCase("GEMMA2", "gemma2"),
    "gemma3": GgufCase("GEMMA3", "gemma3_text"),
    "phi3": GgufCase("PHI3", "phi3"),
}
#: registered families transformers 5.24 cannot load from GGUF: its loader has no config mapping for them
REFUSED = {"gemma": GgufCase("GEMMA", "gemma"), "olmo2": GgufCase("OLMO2", "olmo2")}


def _source_model(kind: str):
    """The tiny model with O(1) activations and random norms and biases, so every weight shows in the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, kind)) + 2)
    model = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms hold w of (1 + w), the others w itself
                p.copy_((0.0 if kind.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, p.shape[1] ** -0.5 if kind.startswith("gemma") else 0.25)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:  # Qwen2's q/k/v biases
                p.normal_(0.0, 0.5)
    return model


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the Llama architecture (each head's rotary pairs interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _gemma_norm(weight: np.ndarray) -> np.ndarray:
    """llama.cpp stores Gemma's norm weights as ``1 + w`` (its RMSNorm multiplies by the stored weight)."""
    return weight + np.float32(1.0)


def write_gguf(model, path: Path, case: GgufCase) -> Path:
    """A float32 GGUF of ``model`` with the metadata, tensor names and value transforms of llama.cpp's converter."""
    cfg = model.config
    arch = getattr(gguf.MODEL_ARCH, case.arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    if case.name:
        writer.add_name(case.name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.PHI3):
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(VOCAB)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"w{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(2)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    gemma = case.arch.startswith("GEMMA")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        data = tensor.float().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and base.endswith(("q_proj", "k_proj")):
            data = _llama_permute(data, cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads)
        if gemma and base.endswith("norm"):
            data = _gemma_norm(data)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"llama.cpp has no name for {name} in {case.arch}"
        writer.add_tensor(f"{gguf_name}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _expected_weights(model, case: GgufCase) -> dict[str, torch.Tensor]:
    """The state dict transformers gives back: the source's, with Gemma's norms through fp32 ``(1 + w) - 1``."""
    want = {}
    for name, tensor in model.state_dict().items():
        if case.arch.startswith("GEMMA") and name.rsplit(".", 1)[0].endswith("norm"):
            tensor = torch.from_numpy(_gemma_norm(tensor.numpy()) - np.float32(1.0))
        want[name] = tensor
    return want


@pytest.fixture(scope="module")
def kvq_cache(tmp_path_factory):
    """One kvq cache for the module: each GGUF is converted once, the later loads read the cached directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQ_CACHE_DIR", str(tmp_path_factory.mktemp("kvq-cache")))
        yield


@pytest.fixture(scope="module", params=sorted(LOADS))
def written(request, tmp_path_factory, kvq_cache):
    """(kind, source model, GGUF path) for each family that loads."""
    kind = request.param
    model = _source_model(kind)
    return kind, model, write_gguf(model, tmp_path_factory.mktemp("gguf") / f"tiny-{kind}.gguf", LOADS[kind])


def test_gguf_loads_the_same_weights(written):
    """Same facts (from the header alone, then from the converted model) and the same weights as the source."""
    kind, model, path = written
    case = LOADS[kind]
    want_facts = dataclasses.replace(model_facts(model.config), model_type=case.loads_as)
    assert model_facts(load_config(path)) == want_facts  # before any conversion: transformers + kvq's restore
    loaded, tokenizer = load_model(path)
    assert tokenizer is not None
    assert model_facts(loaded.config) == model_facts(load_config(path)) == want_facts
    want, got = _expected_weights(model, case), loaded.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_gguf_export_matches_the_source_model(written, tmp_path):
    """fp32 cache: prefill and decode logits equal the source model's to 1e-4; int4 cache: equal the source's export."""
    kind, model, path = written
    tokens = PROMPT + DECODE
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy()
    session = KVQSession(export_model(path, FP32_CACHE, tmp_path / "fp32", flavor="ort-gqa"))
    got = teacher_forced_logits(session, tokens, len(PROMPT))
    err = float(np.abs(got - want).max())
    logger.warning("%s: GGUF export max |logits - source model| = %.2e (max |logit| %.2f)", kind, err,
                   float(np.abs(want).max()))
    assert got.shape == want.shape and err <= 1e-4, f"{kind}: max |Δlogits| {err:.2e}"

    # every token quantized (no high-precision window): the GGUF's export equals the source model's export
    scheme = PRESETS["int4-sym-g32"][0]
    got = teacher_forced_logits(KVQSession(export_model(path, scheme, tmp_path / "int4")), tokens, len(PROMPT))
    ref = teacher_forced_logits(KVQSession(export_model(model, scheme, tmp_path / "int4-source")), tokens, len(PROMPT))
    err, moved = float(np.abs(got - ref).max()), float(np.abs(ref - want).max())
    logger.warning("%s: int4-sym-g32 export of the GGUF vs of the source model: max |Δlogits| %.2e "
                   "(quantization itself moves them by %.2e)", kind, err, moved)
    assert np.isfinite(got).all() and err <= 1e-4, f"{kind}: int4 max |Δlogits| {err:.2e}"


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_gguf_of_a_family_transformers_cannot_load_is_refused_in_one_line(kind, tmp_path, monkeypatch):
    """The GGUF loader of transformers 5.24 has no config mapping for Gemma or OLMo2: kvq says so before converting."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(_source_model(kind), tmp_path / f"tiny-{kind}.gguf", REFUSED[kind])
    arch = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, REFUSED[kind].arch)]
    with pytest.raises(ValueError, match=f"GGUF model with architecture {arch} is not supported yet"):
        load_gguf_checkpoint(str(path))  # the reason: transformers itself refuses the architecture
    for load in (load_model, load_config):
        with pytest.raises(ModelError) as err:
            load(path)
        message = str(err.value)
        assert "\n" not in message and f"GGUF architecture {arch!r}" in message, message
        assert all(name in message for name in GGUF_ARCHITECTURES), message
    assert not (tmp_path / "cache").exists()  # refused before any conversion
    result = CliRunner().invoke(cli, ["memory", "--model", str(path), "--scheme", "fp16", "--seq-len", "8"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"GGUF architecture {arch!r}" in result.stderr


def test_gguf_of_an_architecture_kvq_does_not_export_is_refused_in_one_line(tmp_path):
    """A GGUF architecture transformers reads but kvq has no family for (GPT-2) is refused from its header."""
    path = _header_only(tmp_path / "gpt2.gguf", "gpt2", lambda writer: None)
    with pytest.raises(ModelError, match=r"GGUF architecture 'gpt2'.*gemma2.*qwen3") as err:
        load_config(path)
    assert "\n" not in str(err.value)


def _header_only(path: Path, arch: str, write) -> Path:
    """A GGUF with ``arch``'s header, what ``write(writer)`` adds, and no weights: enough for kvq's header check."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    write(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("what", "write"), [
    ("per-frequency RoPE factors (rope_freqs)", lambda w: w.add_tensor("rope_freqs.weight", np.ones(16, np.float32))),
    ("RoPE scaling 'yarn'", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)),
    ("needs a positive rope.scaling.factor", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)),
])
def test_gguf_rope_scaling_transformers_would_drop_is_refused_in_one_line(tmp_path, what, write):
    """Llama 3 / LongRoPE factor tensors and YaRN: transformers' GGUF loader reads neither, the model would differ.

    (And linear scaling without its factor: nothing to restore.)
    """
    path = _header_only(tmp_path / "scaled.gguf", "llama", write)
    with pytest.raises(ModelError) as err:
        load_config(path)
    assert "\n" not in str(err.value) and what in str(err.value), str(err.value)


def test_loadable_gguf_architectures_are_the_tested_ones():
    assert set(GGUF_ARCHITECTURES) == {gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, c.arch)] for c in LOADS.values()}
    assert not set(GGUF_ARCHITECTURES) & {gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, c.arch)]
                                          for c in REFUSED.values()}


def test_gguf_transformers_cannot_map_is_refused_in_one_line(tmp_path, monkeypatch):
    """Transformers raises NotImplementedError for a ``llama`` GGUF whose name is exactly ``mistral``: one line."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(_source_model("llama"), tmp_path / "named.gguf", GgufCase("LLAMA", "llama", name="mistral"))
    with pytest.raises(ModelError, match="cannot read the model at") as err:
        load_model(path)
    assert "\n" not in str(err.value)
