"""GGUF files as llama.cpp writes them, from tiny random models of every registered family."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import COMMON, VOCAB

gguf = pytest.importorskip("gguf")


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


def source_model(kind: str):
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


def gemma_norm(weight: np.ndarray) -> np.ndarray:
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
            data = gemma_norm(data)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"llama.cpp has no name for {name} in {case.arch}"
        writer.add_tensor(f"{gguf_name}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
