"""Tiny randomly initialised models of every registered architecture (no downloads)."""

from __future__ import annotations

import functools

import torch

VOCAB = 128
COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=1024,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "llama":
        return LlamaConfig(**COMMON, tie_word_embeddings=False)
    if kind == "llama-tied":
        return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1e5})
    if kind == "mistral":
        return MistralConfig(**COMMON, sliding_window=48)
    if kind == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(**COMMON, tie_word_embeddings=True)
    raise ValueError(kind)


ARCHS = ("llama", "llama-tied", "mistral", "qwen2")


@functools.cache
def tiny_model(kind: str):
    """A seeded tiny causal LM in eval mode, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, kind)))
    model = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    if kind == "qwen2":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


WORDS = [f"w{i}" for i in range(VOCAB - 1)]


def save_tiny_model_dir(path, kind: str = "llama"):
    """Write a tiny model plus a word-level tokenizer (``w0 w1 ...``) as a Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_model(kind).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path
