"""Prompts for a serving benchmark: distinct passages of the offline corpus, about ``tokens`` tokens each, as text.

The corpus (:mod:`kvq_export.corpus`, britannica by default) is tokenized with the served model's tokenizer and cut
into consecutive windows from ``offset``; each window is decoded back to text, which is what a server receives (its
own tokenizer may count a token more or less where a window starts mid-word).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvq_export.corpus import load_corpus, token_windows
from kvq_export.errors import KVQError

DEFAULT_PROMPT_TOKENS = 160
DEFAULT_PROMPTS = 64
#: where the prompts start in the corpus: after protocol P's 8 x 512 scored tokens
DEFAULT_OFFSET = 8192


def corpus_prompts(tokenizer: Any, count: int = DEFAULT_PROMPTS, tokens: int = DEFAULT_PROMPT_TOKENS, *,
                   corpus: str = "britannica", offset: int = DEFAULT_OFFSET) -> list[str]:
    """``count`` distinct prompts of about ``tokens`` tokens of ``corpus`` each, decoded with ``tokenizer``.

    ``tokenizer`` needs ``encode(text, add_special_tokens=False)`` and ``decode(ids)`` (any Hugging Face tokenizer).

    Raises:
        KVQError: bad counts, or a corpus too short for them (the message says how many fit).

    """
    windows = token_windows(tokenizer, load_corpus(corpus), count, tokens, offset=offset)
    prompts = [tokenizer.decode(window).strip() for window in windows]
    if len(set(prompts)) != len(prompts):
        raise KVQError(f"the corpus gave repeated prompts of {tokens} tokens; ask for fewer or longer ones")
    return prompts


def corpus_passages(tokenizer: Any, runs: Sequence[tuple[int, int]], *, corpus: str = "britannica",
                    offset: int = DEFAULT_OFFSET) -> list[list[str]]:
    """Runs of distinct passages, one run per ``(count, tokens)`` of ``runs``, cut one after another from ``offset``.

    Each passage is the next window of ``tokens`` tokens, decoded and stripped; a window that decodes to a passage
    already given (the corpus repeats a few headers) is skipped, so every passage of every run differs.

    Raises:
        KVQError: bad counts, or a corpus too short for them (the message says how far it got).

    """
    for count, tokens in runs:
        for name, value in (("count", count), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVQError(f"invalid {name}={value!r}: allowed: an integer >= 1")
    ids = [int(i) for i in tokenizer.encode(load_corpus(corpus), add_special_tokens=False)]
    seen: set[str] = set()
    out, at = [], offset
    for count, tokens in runs:
        passages: list[str] = []
        while len(passages) < count:
            if at + tokens > len(ids):
                raise KVQError(f"the corpus has {len(ids)} tokens; after offset {offset} it gave only "
                               f"{len(seen)} distinct passages of the {sum(c for c, _ in runs)} asked")
            passage = tokenizer.decode(ids[at : at + tokens]).strip()
            at += tokens
            if passage not in seen:
                seen.add(passage)
                passages.append(passage)
        out.append(passages)
    return out
