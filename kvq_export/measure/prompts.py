"""Prompts for a serving benchmark: distinct passages of the offline corpus, about ``tokens`` tokens each, as text.

The corpus (:mod:`kvq_export.corpus`, britannica by default) is tokenized with the served model's tokenizer and cut
into consecutive windows from ``offset``; each window is decoded back to text, which is what a server receives (its
own tokenizer may count a token more or less where a window starts mid-word). :func:`corpus_windows` cuts windows of
any lengths, more tokens in all than the corpus holds: they may overlap, but no two start alike.
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
#: :func:`corpus_windows`: no two passages begin with the same this many tokens
DISTINCT_PREFIX = 16
#: :func:`corpus_windows`: each pass through the corpus starts this many tokens later than the one before
PASS_SHIFT = 251


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
    ids = _corpus_ids(tokenizer, corpus)
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


def _corpus_ids(tokenizer: Any, corpus: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(load_corpus(corpus), add_special_tokens=False)]


def corpus_windows(tokenizer: Any, lengths: Sequence[int], *, corpus: str = "britannica",
                   offset: int = DEFAULT_OFFSET, prefix: int = DISTINCT_PREFIX) -> list[str]:
    """A passage of ``corpus`` per entry of ``lengths`` (that many tokens), no two of them starting alike.

    Windows are cut one after another from ``offset``, like :func:`corpus_passages`; when the next one would run past
    the corpus's end, a new pass starts :data:`PASS_SHIFT` tokens later than the last one did (wrapping round within
    the starts that leave room for the window). So windows of later passes overlap earlier ones' text (a corpus of
    90k tokens gives a great many 4000-token passages), each from a start of its own. Each passage is decoded and
    stripped, then encoded again as a server would: where its first ``prefix - 1`` tokens equal an earlier passage's,
    its window moves on a token until they do not. Two passages therefore share fewer than ``prefix - 1`` leading
    tokens (``prefix`` with a BOS token a server may add): a prefix cache finds nothing of one to reuse for another.

    Raises:
        KVQError: bad lengths, a window longer than the corpus after ``offset`` (the message says how long), or a
            corpus with too few distinct starts for the passages asked.

    """
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise KVQError(f"invalid length={length!r}: allowed: an integer >= 1")
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 2:
        raise KVQError(f"invalid prefix={prefix!r}: allowed: an integer >= 2")
    ids = _corpus_ids(tokenizer, corpus)
    starts: set[tuple[int, ...]] = set()
    out: list[str] = []
    at, passes = offset, 0
    for length in lengths:
        room = len(ids) - offset - length  # the last start a window of this length may take, past offset
        if room < 0:
            raise KVQError(f"the corpus has {len(ids)} tokens; a window of {length} after offset {offset} does not fit")
        for _ in range(2 * (room + 1)):  # every start, and some again after a pass moved on
            if at + length > len(ids):
                passes += 1
                at = offset + passes * PASS_SHIFT % (room + 1)
            passage = tokenizer.decode(ids[at : at + length]).strip()
            head = tuple(tokenizer.encode(passage, add_special_tokens=False)[: prefix - 1])
            if passage and head not in starts:
                break
            at += 1
        else:
            raise KVQError(f"the corpus has too few distinct starts for {len(out) + 1} passages of up to {length} "
                           f"tokens with no {prefix - 1} leading tokens alike")
        starts.add(head)
        out.append(passage)
        at += length
    return out
