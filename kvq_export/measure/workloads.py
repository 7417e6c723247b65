"""Workloads whose prompts share prefixes: SGLang's generated shared prefix, and multi-turn chat.

Both are cut from the offline corpus by :func:`~kvq_export.measure.prompts.corpus_passages` (distinct passages,
tokenized with the served model's tokenizer and decoded back to text), and both are deterministic.

* :func:`shared_prefix_workload`: ``groups`` x ``questions`` requests; each group has a prefix passage of
  ``prefix_tokens``, each request adds its own question passage of ``question_tokens``; the requests are shuffled
  with a fixed seed, so groups interleave: reuse is possible, not trivial. 32 answer tokens (:data:`MAX_TOKENS`).
* :func:`chat_workload`: ``conversations`` of ``turns`` turns on ``/v1/chat/completions``, one system passage
  shared by all, a distinct user passage per turn, the whole history resent each turn with the replies the server
  actually gave. 48 answer tokens.

A workload is a list of jobs; a job is one request (shared prefix) or one conversation (chat). The load
(:mod:`~kvq_export.measure.prefix_load`) hands jobs to clients as they free up and asks :meth:`Workload.request`
for a job's next request given the replies so far; :meth:`Workload.prompt_ids` gives a request's token ids for
:func:`~kvq_export.measure.reuse.allowed_reuse`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from kvq_export.errors import KVQError
from kvq_export.measure.prompts import DEFAULT_OFFSET, corpus_passages

#: a request: a text prompt (``/v1/completions``) or chat messages (``/v1/chat/completions``)
Request = str | tuple[dict[str, str], ...]
#: between a group's prefix and a question
SEPARATOR = "\n\n"
#: chat-template tokens a message may add around its content (role, start and end markers)
TEMPLATE_TOKENS = 8


class WorkloadKind(StrEnum):
    """The serving benchmark's workloads: the first two are :mod:`~kvq_export.measure.load`'s own."""

    REPEATED = "repeated"
    DISTINCT = "distinct"
    SHARED_PREFIX = "shared-prefix"
    CHAT = "chat"


#: answer tokens per request, by workload
MAX_TOKENS = {WorkloadKind.SHARED_PREFIX: 32, WorkloadKind.CHAT: 48}


def _check_sizes(sizes: Any) -> None:
    for name in sizes.__dataclass_fields__:
        value, least = getattr(sizes, name), 0 if name == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise KVQError(f"invalid {name}={value!r}: allowed: an integer >= {least}")


@dataclass(frozen=True)
class SharedPrefixSizes:
    """The shared-prefix workload's shape (SGLang's is 64 x 16, 2048 + 128 tokens; this is scaled to 2 cores)."""

    groups: int = 16
    questions: int = 16
    prefix_tokens: int = 1024
    question_tokens: int = 64
    seed: int = 0  # the order the requests are sent in

    def __post_init__(self) -> None:
        _check_sizes(self)


@dataclass(frozen=True)
class ChatSizes:
    """The chat workload's shape: conversations, turns each, system prompt and user turn lengths in tokens."""

    conversations: int = 32
    turns: int = 6
    system_tokens: int = 300
    user_tokens: int = 60

    def __post_init__(self) -> None:
        _check_sizes(self)


@dataclass(frozen=True)
class Workload(ABC):
    """Jobs for closed-loop clients; ``tokenizer`` (the served model's) turns requests into token ids."""

    tokenizer: Any = field(repr=False, compare=False)
    kind: ClassVar[WorkloadKind]

    @property
    @abstractmethod
    def jobs(self) -> int:
        """How many jobs (each one handed to one client)."""

    @property
    @abstractmethod
    def requests(self) -> int:
        """How many requests all jobs send."""

    @abstractmethod
    def request(self, job: int, replies: Sequence[str]) -> Request | None:
        """Job ``job``'s next request after ``replies`` (its earlier answers, in order); None when it is done."""

    @abstractmethod
    def prompt_ids(self, request: Request) -> list[int]:
        """``request``'s prompt as token ids."""

    @abstractmethod
    def context_needed(self, max_tokens: int) -> int:
        """Positions the longest request needs with ``max_tokens`` answer tokens (an upper bound)."""

    def answer_ids(self, text: str) -> list[int]:
        """An answer's token ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class SharedPrefixWorkload(Workload):
    """``prefixes[g] + SEPARATOR + questions[g][q]`` for every ``(g, q)`` of ``order`` (the order sent)."""

    sizes: SharedPrefixSizes = SharedPrefixSizes()
    prefixes: tuple[str, ...] = ()
    questions: tuple[tuple[str, ...], ...] = ()
    order: tuple[tuple[int, int], ...] = ()
    kind: ClassVar[WorkloadKind] = WorkloadKind.SHARED_PREFIX

    @property
    def jobs(self) -> int:
        return len(self.order)

    @property
    def requests(self) -> int:
        return len(self.order)

    def prompt(self, job: int) -> str:
        """Job ``job``'s prompt."""
        group, question = self.order[job]
        return self.prefixes[group] + SEPARATOR + self.questions[group][question]

    def request(self, job: int, replies: Sequence[str]) -> Request | None:
        return None if replies else self.prompt(job)

    def prompt_ids(self, request: Request) -> list[int]:
        return list(self.tokenizer.encode(request, add_special_tokens=False))

    def context_needed(self, max_tokens: int) -> int:
        return self.sizes.prefix_tokens + self.sizes.question_tokens + TEMPLATE_TOKENS + max_tokens


@dataclass(frozen=True)
class ChatWorkload(Workload):
    """``system`` shared by every conversation; ``users[c][t]``: conversation ``c``'s user turn ``t``."""

    sizes: ChatSizes = ChatSizes()
    system: str = ""
    users: tuple[tuple[str, ...], ...] = ()
    kind: ClassVar[WorkloadKind] = WorkloadKind.CHAT

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise KVQError("the chat workload needs a tokenizer with a chat template (to count its prompts' tokens)")

    @property
    def jobs(self) -> int:
        return len(self.users)

    @property
    def requests(self) -> int:
        return sum(len(turns) for turns in self.users)

    def request(self, job: int, replies: Sequence[str]) -> Request | None:
        turn = len(replies)
        if turn >= len(self.users[job]):
            return None
        return chat_messages(self.system, self.users[job][: turn + 1], replies)

    def prompt_ids(self, request: Request) -> list[int]:
        text = self.tokenizer.apply_chat_template(list(request), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def context_needed(self, max_tokens: int) -> int:
        sizes = self.sizes
        messages = 1 + 2 * sizes.turns
        return (sizes.system_tokens + sizes.turns * (sizes.user_tokens + max_tokens) + messages * TEMPLATE_TOKENS)


def chat_messages(system: str, users: Sequence[str], replies: Sequence[str]) -> tuple[dict[str, str], ...]:
    """The history as sent: the system prompt, then each user turn followed by its reply (the last has none yet)."""
    if len(users) != len(replies) + 1:
        raise KVQError(f"a chat request needs one reply fewer than user turns; given {len(users)} and {len(replies)}")
    messages = [{"role": "system", "content": system}]
    for k, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if k < len(replies):
            messages.append({"role": "assistant", "content": replies[k]})
    return tuple(messages)


def shared_prefix_workload(tokenizer: Any, sizes: SharedPrefixSizes = SharedPrefixSizes(), *,
                           corpus: str = "britannica", offset: int = DEFAULT_OFFSET) -> SharedPrefixWorkload:
    """The shared-prefix workload: ``sizes.groups`` prefix passages from ``offset``, then the question passages.

    Raises:
        KVQError: bad sizes, or a corpus too short for them (the message says how many passages fit).

    """
    prefixes, flat = corpus_passages(tokenizer, [(sizes.groups, sizes.prefix_tokens),
                                                 (sizes.groups * sizes.questions, sizes.question_tokens)],
                                     corpus=corpus, offset=offset)
    questions = tuple(tuple(flat[g * sizes.questions : (g + 1) * sizes.questions]) for g in range(sizes.groups))
    order = [(g, q) for g in range(sizes.groups) for q in range(sizes.questions)]
    random.Random(sizes.seed).shuffle(order)
    return SharedPrefixWorkload(tokenizer, sizes, tuple(prefixes), questions, tuple(order))


def chat_workload(tokenizer: Any, sizes: ChatSizes = ChatSizes(), *, corpus: str = "britannica",
                  offset: int = DEFAULT_OFFSET) -> ChatWorkload:
    """The chat workload: the system passage at ``offset``, then every user turn's passage.

    Raises:
        KVQError: bad sizes, a tokenizer without a chat template, or a corpus too short for the passages.

    """
    (system,), flat = corpus_passages(tokenizer, [(1, sizes.system_tokens),
                                                  (sizes.conversations * sizes.turns, sizes.user_tokens)],
                                      corpus=corpus, offset=offset)
    users = tuple(tuple(flat[c * sizes.turns : (c + 1) * sizes.turns]) for c in range(sizes.conversations))
    return ChatWorkload(tokenizer, sizes, system, users)
