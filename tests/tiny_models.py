"""Tiny randomly initialised models of every registered architecture (no downloads)."""

from __future__ import annotations

import functools

import torch

from kvq_export.model_facts import ModelFacts, RopeFacts
from kvq_export.vocab import Axis

VOCAB = 128
COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=1024,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)


def attention_facts(*, num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int = 1,
                    scaling: float | None = None, window: int | None = None) -> ModelFacts:
    """Facts of a model with these attention numbers and the rest filler, for code that reads only those.

    Every layer slides ``window`` (None: full attention); ``scaling`` defaults to ``head_dim ** -0.5``.
    """
    return ModelFacts(model_type="llama", num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, hidden_size=num_heads * head_dim, vocab_size=VOCAB,
                      max_position_embeddings=1024, tie_word_embeddings=False,
                      scaling=head_dim**-0.5 if scaling is None else scaling,
                      sliding_windows=(window,) * num_layers, rope=RopeFacts("default", 1.0, {"rope_theta": 10000.0}))


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
    return _new_config(kind)


def _new_config(kind: str):
    """The families with QK-norms, Gemma's norms/soft-capping/per-layer RoPE, fused projections, OLMo2 norms."""
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig, Olmo2Config, Phi3Config, Qwen3Config

    mqa_256 = {**COMMON, "num_key_value_heads": 1, "head_dim": 256}  # one KV head, head_dim 256
    if kind == "qwen3":  # per-head q/k norms; layer 1 slides (i >= max_window_layers)
        return Qwen3Config(**COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                           max_window_layers=1)
    if kind == "gemma":
        return GemmaConfig(**mqa_256, tie_word_embeddings=True)
    if kind == "gemma2":  # layer 0 slides; small caps so soft-capping bites on O(1) activations
        return Gemma2Config(**{**COMMON, "head_dim": 64}, query_pre_attn_scalar=48, sliding_window=8,
                            attn_logit_softcapping=2.0, final_logit_softcapping=5.0, tie_word_embeddings=True)
    if kind == "gemma3":
        return Gemma3TextConfig(
            **mqa_256, query_pre_attn_scalar=200, sliding_window=8, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    if kind == "phi3":  # fused qkv / gate_up; RoPE on half of each head
        return Phi3Config(**COMMON, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5})
    if kind == "olmo2":
        return Olmo2Config(**COMMON, tie_word_embeddings=False)
    raise ValueError(kind)


ARCHS = ("llama", "llama-tied", "mistral", "qwen2")
#: the newer families (tests/test_archs.py); kept apart so the preset-by-preset suites stay fast
NEW_ARCHS = ("qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2")


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


@functools.cache
def loud_model(kind: str):
    """:func:`tiny_model` with O(1) activations and random norms: every weight (and soft-cap) matters.

    (transformers' init keeps activations near 0.02, where soft-capping is linear and a norm's weight hardly
    shows. The quantized-cache tests keep that quiet init: there one code that float noise puts one step
    apart moves the logits by about the activations' size.)
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, kind)) + 1)
    model = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    if kind in NEW_ARCHS:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:  # Gemma's norms hold w of (1 + w), the others w itself
                    p.copy_((0.0 if kind.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
                elif "embed_tokens" in name:  # Gemma scales embeddings by sqrt(hidden): O(1) either way
                    p.normal_(0.0, p.shape[1] ** -0.5 if kind.startswith("gemma") else 0.25)
                elif p.dim() == 2:
                    p.normal_(0.0, p.shape[1] ** -0.5)
    return model


WORDS = [f"w{i}" for i in range(VOCAB - 1)]


def tiny_tokenizer():
    """The tiny models' word-level tokenizer: ``[UNK]`` is id 0, word ``w{i}`` is id ``i + 1``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def save_tiny_model_dir(path, kind: str = "llama", *, loud: bool = False):
    """Write a tiny model (``loud``: :func:`loud_model`) and a word-level tokenizer (``w0 w1 ...``) as an HF folder."""
    (loud_model if loud else tiny_model)(kind).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def fit_head_dim(scheme, head_dim: int):
    """``scheme`` with every token-axis group wider than ``head_dim`` narrowed to ``head_dim``.

    The tiny models have head_dim 32; a preset with token groups of 64 (made for head_dim 64 and up) runs on them
    as its groups-of-32 twin.
    """
    import dataclasses

    def fit(tq):
        wide = tq.quantized and tq.axis == Axis.TOKEN and (tq.group_size or 0) > head_dim
        return dataclasses.replace(tq, group_size=head_dim) if wide else tq

    return dataclasses.replace(scheme, key=fit(scheme.key), value=fit(scheme.value))


#: Vocabulary of :func:`byte_model`: one token per byte.
BYTE_VOCAB = 256


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte) that onnxruntime-genai reads too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2TokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return GPT2TokenizerFast(tokenizer_object=tok, eos_token=None, bos_token=None, unk_token=None)


@functools.cache
def byte_model():
    """The tiny llama with :func:`byte_tokenizer`'s vocabulary (text prompts through either runtime)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(BYTE_VOCAB)
    config = LlamaConfig(**{**COMMON, "vocab_size": BYTE_VOCAB}, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@functools.cache
def layered_model(num_layers: int):
    """The tiny llama with ``num_layers`` layers (per-layer schemes with more distinct layers than two)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(num_layers)
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": num_layers}, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
