"""Retrieval tasks for long contexts: each a generator of haystack prompts with a gold answer, in a registry.

A task builds a :class:`Layout` (a header, a repeated filler sentence, needles placed at fractions of the
context, a question and the gold answer, all as text) from a random generator; :func:`build_case` turns it into
token ids of an exact total length with the export's tokenizer, so every task shares one way of hitting a length
and a depth. The runner and the report know tasks only through :data:`TASKS`.

The three tasks are the offline ones the field uses (no corpus to download):

* ``passkey``: Landmark Attention's passkey in filler (one 5-digit number);
* ``multikey``: RULER's niah_multikey: several needles "One of the special magic numbers for <adjective-noun>
  is: <7 digits>." among which one key is asked for, the others distractors;
* ``vt``: RULER's variable tracking: a chain ``VAR A = 12345``, ``VAR B = A``, ... spread over the context from
  the depth on, beside a distractor chain from another value; asked for the value of the chain's last variable
  (RULER asks for every variable of the chain; SmolLM2-135M cannot spell five-letter names back, so the gold
  answer here is the value, reached only by following the asked chain).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvq_export.errors import KVQError

#: Text to token ids, no special tokens added (the runner puts the tokenizer's own prefix in front).
Encode = Callable[[str], list[int]]

#: RULER's and Landmark's noise haystack.
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_ADJECTIVES = (
    "ancient", "bitter", "brave", "calm", "clever", "crimson", "curious", "distant", "eager", "elegant", "fierce",
    "fragile", "gentle", "golden", "hollow", "humble", "icy", "jolly", "lively", "lonely", "loyal", "mighty",
    "narrow", "noble", "patient", "polite", "proud", "quiet", "rapid", "rustic", "silent", "silver", "sleepy",
    "smooth", "stormy", "sturdy", "swift", "tender", "vivid", "wise",
)
_NOUNS = (
    "anchor", "badger", "barrel", "beacon", "canyon", "castle", "comet", "compass", "dolphin", "falcon", "feather",
    "forest", "glacier", "harbor", "island", "kettle", "lantern", "meadow", "mirror", "monkey", "orchard", "otter",
    "parrot", "pebble", "pigeon", "quartz", "river", "saddle", "shadow", "spider", "teapot", "thunder", "tiger",
    "tunnel", "valley", "violin", "walnut", "willow", "window", "zebra",
)


@dataclass(frozen=True)
class Needle:
    """A sentence placed at ``depth`` (0: right after the header, 1: right before the question)."""

    depth: float
    text: str


@dataclass(frozen=True)
class Layout:
    """One prompt in text: header, filler around the needles, question, and the gold answer that follows it."""

    header: str
    needles: tuple[Needle, ...]
    question: str
    answer: str
    filler: str = FILLER


@dataclass(frozen=True)
class Case:
    """One trial: the prompt's and the gold answer's token ids (``len(prompt) + len(answer) == length``).

    ``context``: where the question starts in the prompt (what comes before it is the context).
    """

    task: str
    length: int
    depth: float
    trial: int
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    answer_text: str
    context: int


class Task(ABC):
    """A long-context task: draws one :class:`Layout` for a depth from a random generator."""

    name: ClassVar[str]
    description: ClassVar[str]

    @abstractmethod
    def layout(self, depth: float, rng: np.random.Generator) -> Layout:
        """The prompt's parts with its key needle at ``depth``."""


TASKS: dict[str, Task] = {}


def register(cls: type[Task]) -> type[Task]:
    """Add a task to :data:`TASKS` under its name."""
    TASKS[cls.name] = cls()
    return cls


def get_task(name: str) -> Task:
    """The registered task ``name``, or a one-line refusal naming the allowed ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise KVQError(f"unknown long-context task {name!r}; allowed: {', '.join(TASKS)}") from None


def _distinct(draw: Callable[[], str], n: int) -> list[str]:
    """``n`` different results of ``draw``, in the order drawn (a repeat is drawn again)."""
    out: list[str] = []
    while len(out) < n:
        item = draw()
        if item not in out:
            out.append(item)
    return out


@register
class Passkey(Task):
    """Landmark Attention's passkey retrieval."""

    name = "passkey"
    description = "one 5-digit pass key hidden in filler (Landmark)"

    def layout(self, depth: float, rng: np.random.Generator) -> Layout:
        key = str(int(rng.integers(10000, 100000)))
        return Layout(
            header="There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                   "I will quiz you about the important information there.",
            needles=(Needle(depth, f" The pass key is {key}. Remember it. {key} is the pass key."),),
            question="\nWhat is the pass key? The pass key is", answer=f" {key}")


@register
class MultiKey(Task):
    """RULER's niah_multikey: the asked key's 7-digit number among distractor needles with other keys."""

    name = "multikey"
    description = "4 keyed 7-digit numbers, one asked for, 3 distractors (RULER niah_multikey)"
    needles = 4

    def layout(self, depth: float, rng: np.random.Generator) -> Layout:
        keys = _distinct(lambda: f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}",
                         self.needles)
        values = [str(int(v)) for v in rng.integers(1_000_000, 10_000_000, size=self.needles)]
        depths = [depth, *rng.uniform(0.0, 1.0, size=self.needles - 1).tolist()]
        return Layout(
            header="Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the numbers afterwards.",
            needles=tuple(Needle(d, f" One of the special magic numbers for {k} is: {v}.")
                          for d, k, v in zip(depths, keys, values)),
            question=f"\nWhat is the special magic number for {keys[0]} mentioned in the provided text? The special "
                     f"magic number for {keys[0]} mentioned in the provided text is:",
            answer=f" {values[0]}")


@register
class VariableTracking(Task):
    """RULER's variable tracking: a chain of assignments from a value, beside a distractor chain from another."""

    name = "vt"
    description = "the value at the end of a 4-hop chain of assignments, beside a distractor chain (RULER vt)"
    hops = 4

    def layout(self, depth: float, rng: np.random.Generator) -> Layout:
        names = _distinct(lambda: "".join(chr(ord("A") + int(c)) for c in rng.integers(0, 26, size=5)),
                          2 * (self.hops + 1))
        values = [str(int(v)) for v in rng.choice(np.arange(10000, 100000), size=2, replace=False)]
        chains = [names[:self.hops + 1], names[self.hops + 1:]]
        needles = []
        # the asked chain from the depth to the end, the distractor over the whole context; both in order
        for chain, value, start in zip(chains, values, (depth, float(rng.uniform(0.0, 1.0)))):
            statements = [f" VAR {chain[0]} = {value}."] + [f" VAR {b} = {a}." for a, b in zip(chain, chain[1:])]
            spread = np.linspace(start, 1.0, len(statements) + 1)[:-1] if start < 1.0 else [1.0] * len(statements)
            needles += [Needle(float(d), text) for d, text in zip(spread, statements)]
        asked = chains[0][-1]
        return Layout(
            header="Memorize and track the chain(s) of variable assignment hidden in the following text.",
            needles=tuple(needles),
            question=f"\nQuestion: What is the value of VAR {asked}? Follow the chain of assignments. Answer: "
                     f"The value of VAR {asked} is",
            answer=f" {values[0]}")


def build_case(task: Task, encode: Encode, prefix: list[int], *, length: int, depth: float, trial: int,
               rng: np.random.Generator) -> Case:
    """One trial of ``task`` of exactly ``length`` tokens (prompt and answer), the key needle at ``depth``.

    ``prefix``: the tokens the tokenizer puts before a text (its BOS, or none). The filler is whole sentences
    repeated; each needle goes in at the sentence boundary nearest its depth (needles at one boundary keep their
    order), and the filler is cut to the exact length at its end, just before the question.
    """
    layout = task.layout(depth, rng)
    header, question, answer = encode(layout.header), encode(layout.question), encode(layout.answer)
    needles = [encode(n.text) for n in layout.needles]
    room = length - len(prefix) - len(header) - len(question) - len(answer) - sum(map(len, needles))
    unit = encode(layout.filler)
    if room < len(unit):
        raise KVQError(f"a {task.name} case of {length} tokens leaves no room for its filler (needs at least "
                       f"{length - room + len(unit)} tokens); allowed: longer lengths")
    sentences = -(-room // len(unit))  # whole sentences, the last one cut
    boundary = [round(n.depth * sentences) for n in layout.needles]  # 0: before the first sentence
    at = sorted(range(len(needles)), key=lambda i: (boundary[i], i))
    body: list[int] = []
    placed = 0
    for s in range(sentences + 1):
        while placed < len(at) and boundary[at[placed]] <= s:
            body += needles[at[placed]]
            placed += 1
        if s < sentences:
            body += unit if s < sentences - 1 else unit[:room - (sentences - 1) * len(unit)]
    context = [*prefix, *header, *body]
    return Case(task.name, length, depth, trial, (*context, *question), tuple(answer), layout.answer.strip(),
                len(context))


def trial_rng(seed: int, task: str, length: int, trial: int) -> np.random.Generator:
    """The generator of one trial at one length: the same seed gives the same case whatever else the grid holds.

    Every depth of a trial draws the same keys, values and distractors (a fresh generator from the same key):
    the depths differ only in where the key needle stands, so their prompts share the context before it.
    """
    return np.random.default_rng([seed, length, trial, *task.encode()])
