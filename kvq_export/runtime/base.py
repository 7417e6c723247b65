"""What every kvq session is: the :class:`Session` protocol, its :class:`Generation` results, the shared steps.

:class:`~kvq_export.runtime.session.KVQSession` runs kvq's own loop on ONNX Runtime,
:class:`~kvq_export.runtime.genai.GenaiSession` onnxruntime-genai's C++ loop. Both check prompts with
:func:`check_prompts` (the same one-line errors), record tokens and finish reasons in :class:`Rows` and turn tokens
into text with :func:`continuation_text`; they differ only in how the next token is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from kvq_export.errors import RuntimeInputError
from kvq_export.manifest import Manifest
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.vocab import FinishReason

#: ``on_token(row, token)``: called for every generated token, in order (for streaming)
TokenCallback = Callable[[int, int], None]
#: token ids to text
Decoder = Callable[[Sequence[int]], str]


@dataclass
class Generation:
    """One prompt's result."""

    prompt: str | None
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: FinishReason = FinishReason.LENGTH
    cache_bytes: int = 0  # bytes held by this batch's whole cache at the end

    def to_dict(self) -> dict:
        """JSON form for ``kvq generate --json``."""
        return {"prompt": self.prompt, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
                "text": self.text, "finish_reason": str(self.finish_reason), "cache_bytes": self.cache_bytes}


@runtime_checkable
class Session(Protocol):
    """An export directory opened for generation (see :func:`kvq_export.runtime.open_session`)."""

    #: the name ``open_session`` and ``kvq generate --runtime`` know it by
    runtime: ClassVar[str]
    #: whether the runtime's sequence also holds the last sampled token (then a generation needs one position more)
    holds_last_token: ClassVar[bool]
    directory: Path
    manifest: Manifest

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids, as this session's tokenizer reads it."""
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids (special tokens left out)."""
        ...

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 64,
                 sampling: SamplingConfig | None = None, *, stop_at_eos: bool = True,
                 on_token: TokenCallback | None = None) -> list[Generation]:
        """One :class:`Generation` per prompt (text, or token ids): at most ``max_new_tokens`` tokens each."""
        ...


# -- prompts ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptBatch:
    """Checked prompts: each one's text (None for token ids) and token ids."""

    texts: list[str | None]
    tokens: list[list[int]]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def width(self) -> int:
        """Tokens of the longest prompt."""
        return max(map(len, self.tokens))

    def padded(self, *, left: bool, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``[batch, width]`` int64 ids padded with ``pad`` on the left or the right, and the mask (1 = real)."""
        ids = np.full((len(self), self.width), pad, dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, toks in enumerate(self.tokens):
            cols = slice(self.width - len(toks), None) if left else slice(0, len(toks))
            ids[row, cols] = toks
            mask[row, cols] = 1
        return ids, mask


def check_prompts(prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int, *,
                  encode: Callable[[str], list[int]], manifest: Manifest, holds_last_token: bool) -> PromptBatch:
    """Refuse, before any work, prompts a session cannot generate from; token ids of the rest.

    A prompt is text (valid Unicode, encoded with ``encode``) or a list of integer token ids inside the vocabulary.
    A row holds its prompt padded to the longest one plus the tokens fed back (all but the last, or all of them when
    ``holds_last_token``): that must fit the export's positions.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise RuntimeInputError(f"invalid max_new_tokens={max_new_tokens!r}: allowed: an integer >= 0")
    if isinstance(prompts, (str, bytes)):
        raise RuntimeInputError("prompts: expected a list of strings or token-id lists, got one string")
    prompts = list(prompts)
    if not prompts:
        raise RuntimeInputError("prompts: expected at least one prompt, got none")
    texts = [p if isinstance(p, str) else None for p in prompts]
    tokens = [_prompt_tokens(row, prompt, encode) for row, prompt in enumerate(prompts)]
    vocab = manifest.model.vocab_size
    for row, toks in enumerate(tokens):
        if not toks:
            raise RuntimeInputError(f"prompt {row} has no token; every prompt needs at least one token")
        bad = next((col for col, t in enumerate(toks) if not 0 <= t < vocab), None)
        if bad is not None:
            raise RuntimeInputError(f"prompt {row}: token id {toks[bad]} at position {bad} is outside the vocabulary; "
                                    f"allowed: 0 .. {vocab - 1}")
    positions = manifest.model.max_position_embeddings
    for row, toks in enumerate(tokens):
        if len(toks) > positions:
            raise RuntimeInputError(f"prompt {row} has {len(toks)} tokens, beyond the {positions} positions this "
                                    "export supports (max_position_embeddings)")
    batch = PromptBatch(texts, tokens)
    fed = max_new_tokens if holds_last_token else max(max_new_tokens - 1, 0)
    if batch.width + fed > positions:
        allowed = positions - batch.width + (0 if holds_last_token else 1)
        raise RuntimeInputError(f"a {batch.width}-token prompt with max_new_tokens={max_new_tokens} would put "
                                f"{batch.width + fed} tokens in a row, which exceeds the export's context_length "
                                f"{positions}; allowed: max_new_tokens <= {allowed}")
    return batch


def _prompt_tokens(row: int, prompt, encode: Callable[[str], list[int]]) -> list[int]:
    """One prompt's token ids (ints, possibly outside the vocabulary: checked by the caller)."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes arrive as lone surrogates
            raise RuntimeInputError(f"prompt {prompt[:40]!r} is not valid UTF-8 text") from None
        return [int(t) for t in encode(prompt)]
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, (Sequence, np.ndarray)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
        raise RuntimeInputError(f"prompt {row}: expected text or a list of integer token ids")
    return [int(t) for t in prompt]


def eos_token_ids(manifest: Manifest) -> frozenset[int]:
    """The ids that end a row (none when the export's tokenizer names no EOS)."""
    return frozenset(manifest.tokenizer.eos_ids)


# -- results ------------------------------------------------------------------------------------------------------
class Rows:
    """A batch's generations as tokens arrive: an EOS token ends its row, ``on_token`` sees every recorded token."""

    def __init__(self, batch: PromptBatch, eos_ids: Sequence[int] | frozenset[int] = (),
                 on_token: TokenCallback | None = None) -> None:
        self.results = [Generation(text, toks) for text, toks in zip(batch.texts, batch.tokens)]
        self.active = np.ones(len(batch), dtype=bool)  # rows still generating
        self.eos = frozenset(eos_ids)
        self.on_token = on_token

    @property
    def done(self) -> bool:
        """Every row ended with EOS."""
        return not self.active.any()

    def add(self, tokens: np.ndarray) -> None:
        """One new token per row ``[batch]``; rows that ended ignore theirs."""
        for row in np.flatnonzero(self.active):
            token = int(tokens[row])
            result = self.results[row]
            result.tokens.append(token)
            if self.on_token is not None:
                self.on_token(int(row), token)
            if token in self.eos:
                self.active[row] = False
                result.finish_reason = FinishReason.EOS

    def finish(self, cache_bytes: int, decode: Decoder | None) -> list[Generation]:
        """The results, with the cache bytes held and (given a ``decode``) each continuation's text."""
        for result in self.results:
            result.cache_bytes = cache_bytes
            if decode is not None:
                result.text = continuation_text(decode, result.prompt_tokens, result.tokens)
        return self.results


def continuation_text(decode: Decoder, prompt_tokens: Sequence[int], tokens: Sequence[int], *,
                      prompt_text: str | None = None) -> str:
    """Text of ``tokens`` as it reads after the prompt (keeps the leading space tokenizers fold in).

    ``prompt_text``: the prompt's decoded text when the caller already holds it (a streaming loop decodes it once).
    """
    prompt = decode(list(prompt_tokens)) if prompt_text is None else prompt_text
    full = decode([*prompt_tokens, *tokens])
    return full[len(prompt):] if full.startswith(prompt) else decode(list(tokens))
