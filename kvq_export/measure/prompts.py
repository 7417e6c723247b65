"""Prompts for a serving benchmark: distinct passages of the offline corpus, about ``tokens`` tokens each, as text.

The corpus (:mod:`kvq_export.corpus`, britannica by default) is tokenized with the served model's tokenizer and cut
into consecutive windows from ``offset``; each window is decoded back to text, which is what a server receives (its
own tokenizer may count a token more or less where a window starts mid-word).
"""

from __future__ import annotations

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
