"""``TextCodec`` (what ``kvq serve`` tokenizes with, no transformers) gives the ids and text transformers gives."""

from __future__ import annotations

import shutil

import pytest
from serve_harness import chat_tokenizer
from tiny_models import byte_tokenizer, tiny_model

from kvq_export.errors import RuntimeInputError
from kvq_export.export.exporter import export_model
from kvq_export.manifest import Manifest
from kvq_export.runtime.session import load_tokenizer
from kvq_export.runtime.text_codec import TextCodec

TEXTS = ["w1 w2 w3", " hello  world, it's   fine. ", "Ünïcödé — 日本語 🙂", "a\nb\n\n c", "w5 w7 w9 w7"]
MESSAGES = [{"role": "system", "content": "w8 w9"}, {"role": "user", "content": "w1 w2"},
            {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4"}]


@pytest.fixture(scope="module", params=["word-level", "byte-level BPE"])
def export(request, tmp_path_factory):
    tokenizer = chat_tokenizer() if request.param == "word-level" else byte_tokenizer()
    if request.param != "word-level":
        tokenizer.chat_template = chat_tokenizer().chat_template
    return export_model(tiny_model("llama"), "fp16", tmp_path_factory.mktemp("codec") / "x", tokenizer=tokenizer)


def test_ids_text_and_chat_prompt_equal_transformers(export):
    manifest = Manifest.load(export)
    ours, theirs = TextCodec(export, manifest), load_tokenizer(export, manifest)
    for text in TEXTS:
        ids = list(theirs(text)["input_ids"])
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == list(theirs(text, add_special_tokens=False)["input_ids"])
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.chat_prompt(MESSAGES) == theirs.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                    tokenize=False)


def test_a_tokenizer_outside_the_export_is_never_read(export, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(export, copy)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(copy / "tokenizer.json", outside)
    (copy / "tokenizer.json").unlink()
    (copy / "tokenizer.json").symlink_to(outside)
    with pytest.raises(RuntimeInputError, match="outside the export directory"):
        TextCodec(copy, Manifest.load(copy))
