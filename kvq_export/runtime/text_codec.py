"""An export's tokenizer without transformers: ``tokenizers`` for ``tokenizer.json``, jinja2 for the chat template.

``kvq serve`` holds a tokenizer for the life of the process; transformers' ``AutoTokenizer`` imports torch and
costs about 200 MB of resident memory for what the ``tokenizers`` library alone does here. :class:`TextCodec`
reads the same files (bounded, from inside the export) and gives the same ids and text as the transformers
tokenizer ``kvq generate`` uses (``tests/test_text_codec.py`` holds the two side by side): encode with the
tokenizer's own special tokens, decode with special tokens left out, and the chat template rendered as
transformers renders it (a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvq_export._read import TOKENIZER_FILES, TOKENIZER_LIMIT, check_sizes
from kvq_export.errors import RuntimeInputError
from kvq_export.manifest import Manifest, check_export_files

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: special-token entries of tokenizer_config.json a chat template may name
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TextCodec:
    """Token ids to text and back for one export directory (``encode``, ``decode``, ``chat_prompt``)."""

    def __init__(self, directory: str | Path, manifest: Manifest) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        check_export_files(self.directory, manifest)  # an export is data: no file read from outside it
        check_sizes(self.directory, TOKENIZER_FILES, "tokenizer file", limit=TOKENIZER_LIMIT, error=RuntimeInputError)
        path = self.directory / TOKENIZER_JSON
        if not path.is_file():
            raise RuntimeInputError(f"{self.directory} has no {TOKENIZER_JSON} (exported without a tokenizer)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own untyped errors
            raise RuntimeInputError(f"{path} is not a tokenizer the tokenizers library reads: {err}") from None
        self.config = _read_json(self.directory / TOKENIZER_CONFIG)
        self.chat_template = _chat_template(self.directory, self.config)
        self.clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
        self._template = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids (the tokenizer's own special tokens added, as transformers adds them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids, special tokens left out."""
        text = self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
        return _clean_up(text) if self.clean_up_spaces else text

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template's text for ``messages``, ending where the assistant's answer starts."""
        if not self.chat_template:
            raise RuntimeInputError(f"{self.directory} has no chat template")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        special = {key: _token_text(self.config.get(key)) for key in SPECIAL_TOKEN_KEYS if self.config.get(key)}
        return self._template.render(messages=list(messages), add_generation_prompt=True, **special)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RuntimeInputError(f"{path} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else {}


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` where the export has one, else tokenizer_config.json's ``chat_template`` string."""
    path = directory / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken's ``content``."""
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _environment():
    """The jinja2 environment transformers renders chat templates in (sandboxed: a template is data, not code)."""
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise RuntimeInputError(f"the chat template refused these messages: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _clean_up(text: str) -> str:
    """The ``clean_up_tokenization`` of transformers: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
