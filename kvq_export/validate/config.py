"""What ``kvq validate`` runs: the corpus windows, the greedy prompts and how much of each it samples."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "In a small village at the foot of the mountains, there lived an old clockmaker who",
    "The three most important inventions of the nineteenth century were",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "The recipe calls for two cups of flour, one egg and",
    "When the war ended, the soldiers returned home to find",
)


@dataclass(frozen=True)
class ValidateConfig:
    """What to run; the defaults are protocol P: 8 x 512 britannica tokens from token 0, strict decode."""

    corpus: str = "britannica"
    windows: int = 8
    window_len: int = 512
    offset: int = 0  # tokens skipped at the start of the corpus
    chunk: int | None = None  # None = strict decode (one token per step)
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    gen_tokens: int = 64
    attention_samples: int = 4  # decode positions per window for the attention analysis
    top_k: int = 8
    latency_buckets: int = 4  # context-length buckets for the latency table
