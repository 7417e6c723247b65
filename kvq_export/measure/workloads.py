"""Workloads for closed-loop clients: SGLang's generated shared prefix, multi-turn chat, and mixed lengths.

All are cut from the offline corpus (:func:`~kvq_export.measure.prompts.corpus_passages` and
:func:`~kvq_export.measure.prompts.corpus_windows`: passages tokenized with the served model's tokenizer and decoded
back to text), and all are deterministic.

* :func:`shared_prefix_workload`: ``groups`` x ``questions`` requests; each group has a prefix passage of
  ``prefix_tokens``, each request adds its own question passage of ``question_tokens``; the requests are shuffled
  with a fixed seed, so groups interleave: reuse is possible, not trivial. 32 answer tokens (:data:`MAX_TOKENS`).
* :func:`chat_workload`: ``conversations`` of ``turns`` turns on ``/v1/chat/completions``, one system passage
  shared by all, a distinct user passage per turn, the whole history resent each turn with the replies the server
  actually gave. 48 answer tokens.
* :func:`mixed_workload`: ``requests`` prompts on ``/v1/completions`` whose lengths follow a lognormal (median
  ``prompt_median``, sigma :data:`MIXED_SIGMA`) truncated to ``[prompt_min, prompt_max]`` tokens, each asking for a
  number of answer tokens drawn uniformly from ``[answer_min, answer_max]`` (greedy; an answer may end sooner, at
  EOS). Every prompt starts at its own corpus offset and no two share a prefix of
  :data:`~kvq_export.measure.prompts.DISTINCT_PREFIX` tokens, so a prefix cache has nothing to reuse: what the
  server holds grows with the tokens of the sequences it runs, which is what this workload measures
  (:mod:`~kvq_export.measure.cache_use`).

A workload is a list of jobs; a job is one request (shared prefix, mixed) or one conversation (chat). The load
(:mod:`~kvq_export.measure.prefix_load`) hands jobs to clients as they free up and asks :meth:`Workload.request`
for a job's next request given the replies so far; :meth:`Workload.prompt_ids` gives a request's token ids for
:func:`~kvq_export.measure.reuse.allowed_reuse`.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from statistics import NormalDist
from typing import Any, ClassVar

from kvq_export.errors import KVQError
from kvq_export.measure.prompts import DEFAULT_OFFSET, corpus_passages, corpus_windows

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
    MIXED = "mixed"


#: answer tokens per request, by workload (mixed: the most a request asks for)
MAX_TOKENS = {WorkloadKind.SHARED_PREFIX: 32, WorkloadKind.CHAT: 48, WorkloadKind.MIXED: 256}
#: the mixed workload's lognormal prompt lengths: sigma of the length's logarithm (its mu: log of the median)
MIXED_SIGMA = 0.8


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
class MixedSizes:
    """The mixed workload's shape: requests, prompt tokens (median and range), answer tokens (range), seed."""

    requests: int = 64
    prompt_median: int = 600
    prompt_min: int = 100
    prompt_max: int = 4000
    answer_min: int = 32
    answer_max: int = MAX_TOKENS[WorkloadKind.MIXED]
    seed: int = 0

    def __post_init__(self) -> None:
        _check_sizes(self)
        if not self.prompt_min <= self.prompt_median <= self.prompt_max:
            raise KVQError(f"invalid prompt lengths min={self.prompt_min}, median={self.prompt_median}, "
                           f"max={self.prompt_max}: allowed: min <= median <= max")
        if self.answer_min > self.answer_max:
            raise KVQError(f"invalid answer lengths min={self.answer_min} > max={self.answer_max}: allowed: min <= max")


def draw_lengths(sizes: MixedSizes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prompt tokens, answer tokens) of each request of the mixed workload, drawn with ``sizes.seed``.

    Prompt lengths: a lognormal with mu = log(``prompt_median``) and sigma :data:`MIXED_SIGMA`, truncated to
    ``[prompt_min, prompt_max]``, sampled by strata: request ``i`` of ``n`` takes the truncated distribution's
    quantile at a random point of ``[i/n, (i+1)/n)``, then the lengths are shuffled. So any count follows the
    distribution closely (at 64 the median is within a few % of ``prompt_median`` and the longest prompt near
    ``prompt_max``), whatever the seed. Answer lengths: uniform integers in ``[answer_min, answer_max]``, from a
    second generator, so changing one range leaves the other's draws alone.
    """
    drawn, n = random.Random(f"mixed-prompts-{sizes.seed}"), sizes.requests
    lognormal = NormalDist(math.log(sizes.prompt_median), MIXED_SIGMA)  # of the length's logarithm
    low, high = lognormal.cdf(math.log(sizes.prompt_min)), lognormal.cdf(math.log(sizes.prompt_max))
    prompts = []
    for i in range(n):
        level = min(max(low + (i + drawn.random()) / n * (high - low), 1e-12), 1 - 1e-12)
        prompts.append(min(max(round(math.exp(lognormal.inv_cdf(level))), sizes.prompt_min), sizes.prompt_max))
    drawn.shuffle(prompts)
    drawn = random.Random(f"mixed-answers-{sizes.seed}")
    answers = [drawn.randint(sizes.answer_min, sizes.answer_max) for _ in range(n)]
    return tuple(prompts), tuple(answers)


@dataclass(frozen=True)
class Workload(ABC):
    """Jobs for closed-loop clients; ``tokenizer`` (the served model's) turns requests into token ids."""

    tokenizer: Any = field(repr=False, compare=False)
    kind: ClassVar[WorkloadKind]
    #: whether the load samples the server's cache occupancy (:mod:`~kvq_export.measure.cache_use`)
    watches_cache: ClassVar[bool] = False

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

    def answer_tokens(self, job: int, default: int) -> int:
        """The answer tokens job ``job``'s requests ask for: ``default`` (the load's) unless the workload draws them."""
        return default


class OnePromptWorkload(Workload):
    """A workload whose every job sends one plain-text prompt (:meth:`prompt`) and is done after its answer."""

    @abstractmethod
    def prompt(self, job: int) -> str:
        """Job ``job``'s prompt."""

    @property
    def requests(self) -> int:
        return self.jobs

    def request(self, job: int, replies: Sequence[str]) -> Request | None:
        return None if replies else self.prompt(job)

    def prompt_ids(self, request: Request) -> list[int]:
        return self.answer_ids(request)  # plain text, tokenized as an answer is


@dataclass(frozen=True)
class SharedPrefixWorkload(OnePromptWorkload):
    """``prefixes[g] + SEPARATOR + questions[g][q]`` for every ``(g, q)`` of ``order`` (the order sent)."""

    sizes: SharedPrefixSizes = SharedPrefixSizes()
    prefixes: tuple[str, ...] = ()
    questions: tuple[tuple[str, ...], ...] = ()
    order: tuple[tuple[int, int], ...] = ()
    kind: ClassVar[WorkloadKind] = WorkloadKind.SHARED_PREFIX

    @property
    def jobs(self) -> int:
        return len(self.order)

    def prompt(self, job: int) -> str:
        group, question = self.order[job]
        return self.prefixes[group] + SEPARATOR + self.questions[group][question]

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


@dataclass(frozen=True)
class MixedWorkload(OnePromptWorkload):
    """``prompts[j]`` asking for ``answers[j]`` tokens, one request per job, sent in order."""

    sizes: MixedSizes = MixedSizes()
    prompts: tuple[str, ...] = ()
    answers: tuple[int, ...] = ()
    kind: ClassVar[WorkloadKind] = WorkloadKind.MIXED
    watches_cache: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.answers):
            raise KVQError(f"the mixed workload needs one answer length per prompt; given {len(self.prompts)} "
                           f"prompts and {len(self.answers)} lengths")

    @property
    def jobs(self) -> int:
        return len(self.prompts)

    def prompt(self, job: int) -> str:
        return self.prompts[job]

    def context_needed(self, max_tokens: int) -> int:
        """The longest prompt the sizes allow and the most answer tokens (``max_tokens`` is not what it asks)."""
        return self.sizes.prompt_max + TEMPLATE_TOKENS + self.sizes.answer_max

    def answer_tokens(self, job: int, default: int) -> int:
        return self.answers[job]


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


def mixed_workload(tokenizer: Any, sizes: MixedSizes = MixedSizes(), *, corpus: str = "britannica",
                   offset: int = DEFAULT_OFFSET) -> MixedWorkload:
    """The mixed workload: :func:`draw_lengths`, each prompt a window of its length from its own corpus offset.

    The windows (:func:`~kvq_export.measure.prompts.corpus_windows`) are cut one after another from ``offset`` and
    start over, a little further on, when the corpus ends: long prompts may overlap others' text, but no two prompts
    share a prefix of :data:`~kvq_export.measure.prompts.DISTINCT_PREFIX` tokens.

    Raises:
        KVQError: bad sizes, or a prompt longer than the corpus after ``offset``.

    """
    prompt_lengths, answers = draw_lengths(sizes)
    prompts = corpus_windows(tokenizer, prompt_lengths, corpus=corpus, offset=offset)
    return MixedWorkload(tokenizer, sizes, tuple(prompts), answers)
