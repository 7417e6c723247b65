"""``kvq compare``: two export directories through Polygraphy's Comparator.

Each export runs in a :class:`KVQRunner` (ONNX Runtime underneath, the cache carried from one
iteration to the next exactly as a serving runtime would), fed the same tokens: a left-padded prefill
and then single-token decode steps. Outputs compared per iteration: ``logits`` and, per layer, the
cache each export holds decoded with only its manifest (``cache.<layer>.key`` / ``.value``, float32
``[batch, kv_heads, tokens, head_dim]``, right-aligned), so exports of different schemes are
comparable. Tolerances are per output: one pair for logits, one for the cache.

The verdict comes back as a :class:`Comparison`: true when everything matched, with each output's largest
absolute and relative error over the iterations. Polygraphy's own per-output log is shown with ``verbose``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.manifest import Manifest, decode_cache, load_static
from kvq_export.manifest import verify_weights as check_weights
from kvq_export.memory import check_fits, check_positions, high_precision_tokens, predict
from kvq_export.runtime.session import KVQSession
from kvq_export.validate.feeds import prompt_batch
from kvq_export.vocab import Part

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerances:
    """Per-output tolerances (Polygraphy's ``max`` error statistic)."""

    logits_atol: float = 1e-3
    logits_rtol: float = 1e-3
    cache_atol: float = 1e-3
    cache_rtol: float = 1e-3

    def compare_func(self):
        """Polygraphy's simple comparison with these tolerances (logits vs every cache output)."""
        from polygraphy.comparator import SimpleCompareFunc

        return SimpleCompareFunc(atol={"logits": self.logits_atol, "": self.cache_atol},
                                 rtol={"logits": self.logits_rtol, "": self.cache_rtol}, check_error_stat="max")


@dataclass(frozen=True)
class OutputError:
    """One compared output's largest errors over every iteration, its tolerances, and whether it matched."""

    name: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "max_abs": self.max_abs, "max_rel": self.max_rel, "atol": self.atol,
                "rtol": self.rtol, "passed": self.passed}


@dataclass(frozen=True)
class Comparison:
    """What a comparison found: Polygraphy's verdict and every output's errors (true when it matched)."""

    passed: bool
    outputs: tuple[OutputError, ...]

    def __bool__(self) -> bool:
        return self.passed

    @property
    def missed(self) -> list[OutputError]:
        """The outputs beyond tolerance."""
        return [o for o in self.outputs if not o.passed]

    def summary(self) -> list[OutputError]:
        """A short list whatever the model's depth: ``logits``, then the worst cache key and value layer (named)."""
        rows = [o for o in self.outputs if not o.name.startswith("cache.")]
        for part in Part:
            streams = [o for o in self.outputs if o.name.startswith("cache.") and o.name.endswith(f".{part}")]
            if streams:
                rows.append(max(streams, key=lambda o: (not o.passed, o.max_abs)))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "outputs": [o.to_dict() for o in self.outputs]}


def summarize(accuracy, tolerances: Tolerances) -> Comparison:
    """A :class:`Comparison` from Polygraphy's ``compare_accuracy`` result (per output: the worst iteration).

    ``accuracy``: one ``AccuracyResult`` (runner pair -> iterations), or a list of them (newer Polygraphy: one per
    comparison function).
    """
    worst: dict[str, list[float]] = {}
    passed: dict[str, bool] = {}
    per_function = [accuracy] if hasattr(accuracy, "values") else list(accuracy)
    for iterations in (its for result in per_function for its in result.values()):
        for iteration in iterations:
            for name, result in iteration.items():
                errors = worst.setdefault(name, [0.0, 0.0])
                errors[0] = max(errors[0], result.max_absdiff or 0.0)
                errors[1] = max(errors[1], result.max_reldiff or 0.0)
                passed[name] = passed.get(name, True) and bool(result)
    outputs = []
    for name, (max_abs, max_rel) in worst.items():
        logits = name == "logits"
        outputs.append(OutputError(
            name, max_abs, max_rel, tolerances.logits_atol if logits else tolerances.cache_atol,
            tolerances.logits_rtol if logits else tolerances.cache_rtol, passed[name]))
    return Comparison(bool(accuracy), tuple(outputs))


@contextmanager
def _polygraphy_log(verbose: bool):
    """Polygraphy's per-output log when ``verbose``; otherwise only its critical messages."""
    if verbose:
        yield
        return
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        yield


def run_comparison(runners, feeds, tolerances: Tolerances, *, verbose: bool = True) -> Comparison:
    """Run ``runners`` on ``feeds`` through Polygraphy's Comparator and compare them with ``tolerances``."""
    from polygraphy.comparator import Comparator

    with _polygraphy_log(verbose):
        results = Comparator.run(runners, data_loader=feeds)
        accuracy = Comparator.compare_accuracy(results, compare_func=tolerances.compare_func())
    return summarize(accuracy, tolerances)


def kvq_runner_class():
    """The Polygraphy runner class over a KVQSession (made on first use: Polygraphy is imported lazily)."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class KVQRunner(BaseRunner):
        """A Polygraphy runner over :class:`~kvq_export.runtime.session.KVQSession`."""

        def __init__(self, directory: str | os.PathLike[str], name: str | None = None,
                     providers: Sequence[str] | None = None) -> None:
            super().__init__(name=name or Path(directory).name, prefix="kvq-onnxrt-runner")
            self.directory = Path(directory)
            self.providers = providers

        def activate_impl(self) -> None:
            # compare_exports verified the weights
            self.session = KVQSession(self.directory, verify_weights=False, providers=self.providers)
            self.static = load_static(self.directory, self.session.manifest)
            self.cache = None

        def get_input_metadata_impl(self):
            return (TensorMetadata().add("input_ids", np.int64, (-1, -1))
                    .add("attention_mask", np.int64, (-1, -1)))

        def infer_impl(self, feed_dict):
            import time

            start = time.perf_counter()
            logits, self.cache = self.session.step(feed_dict["input_ids"], feed_dict["attention_mask"], self.cache)
            self.inference_time = time.perf_counter() - start  # Polygraphy reports it
            return {"logits": logits, **decoded_cache(self.session, self.cache, self.static)}

        def deactivate_impl(self) -> None:
            del self.session, self.cache

    return KVQRunner


def decoded_cache(session, cache, static) -> dict[str, np.ndarray]:
    """The held cache decoded with only the manifest, as right-aligned [B, H, N, D] arrays per layer (model basis)."""
    # the model's basis: exports with different rotations hold comparable K/V
    rows = decode_cache(session.manifest, session.cache_arrays(cache), direction="past", static=static,
                        basis="model")
    out = {}
    longest = max(k.shape[1] for k, _ in (row[0] for row in rows))
    for layer in range(session.manifest.num_layers):
        for index, part in enumerate(("key", "value")):
            first = rows[0][layer][index]
            array = np.zeros((len(rows), first.shape[0], longest, first.shape[2]), np.float32)
            for b, row in enumerate(rows):
                tensor = row[layer][index]
                array[b, :, longest - tensor.shape[1]:] = tensor
            out[f"cache.{layer}.{part}"] = array
    return out


def compare_feeds(vocab_size: int, *, prompt_len: int = 48, batch: int = 2, steps: int = 4,
                  seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A left-padded prefill then ``steps`` single-token decode feeds (token ids only)."""
    ids, mask = prompt_batch(vocab_size, prompt_len=prompt_len, batch=batch, seed=seed)
    rng = np.random.default_rng(seed + 1)
    feeds = [{"input_ids": ids, "attention_mask": mask}]
    for _ in range(steps):
        feeds.append({"input_ids": rng.integers(0, vocab_size, (batch, 1)).astype(np.int64),
                      "attention_mask": np.ones((batch, 1), np.int64)})
    return feeds


def _check_compare_size(manifests, *, prompt_len: int, batch: int, steps: int, sized: bool = False) -> None:
    """Refuse, before any session starts, runs past the model's positions or beyond the memory available.

    The Comparator keeps every step's outputs of both runs: the logits, and the cache after each step.
    ``sized``: the prompt length was chosen by :func:`comparison_prompt_len`, not given, so the refusal says why.
    """
    length = prompt_len + steps
    what, advice = "prompt length + steps", "compare shorter runs"
    if sized:
        window = max(high_precision_window(m) for m in manifests)
        what = (f"the prompt length sized past the exports' {window}-token high-precision window "
                f"({prompt_len}) + steps ({steps}) =")
        advice = ("give a shorter --prompt-len (the quantized cache is then not compared) or compare a scheme "
                  "with a shorter window")
    for manifest in manifests:
        check_positions([length], manifest.model.max_position_embeddings, what, advice)
    needed = sum(4 * batch * m.model.vocab_size * length + (steps + 1) * predict(m.scheme, m.model, length,
                                                                                   batch).total_bytes
                 for m in manifests)
    check_fits(needed, f"compare at batch {batch}", "compare a smaller batch or shorter runs")


#: Prompt length of a comparison when neither export keeps a high-precision window (and the least otherwise).
DEFAULT_PROMPT_LEN = 48


def high_precision_window(manifest) -> int:
    """Tokens a row of this export holds before the first quantized one (0: quantized from the first token)."""
    limit = manifest.model.max_position_embeddings
    window = high_precision_tokens(manifest.scheme, manifest.model, limit)
    return 0 if window >= limit else window  # an unquantized export has no window to leave


def comparison_prompt_len(manifests, *, batch: int) -> int:
    """A prompt length at which the two longest rows hold quantized tokens in every export compared.

    Row ``r`` of :func:`kvq_export.validate.feeds.prompt_batch` is ``prompt_len - r * (prompt_len // 4)`` tokens
    long (rows from the fifth on hold one token whatever the length), so the second row (the only other one at
    the default batch of 2) must exceed the longest high-precision window too.
    """
    window = max((high_precision_window(m) for m in manifests), default=0)
    length = max(DEFAULT_PROMPT_LEN, window + 16)
    while length - (min(batch, 2) - 1) * (length // 4) <= window:  # grows with length: ends
        length += 16
    return length


def warn_unexercised(manifests, names, *, prompt_len: int, steps: int) -> list[str]:
    """One warning per export whose high-precision window the longest row never leaves (logged and returned)."""
    out = []
    for manifest, name in zip(manifests, names):
        window = high_precision_window(manifest)
        if window and prompt_len + steps <= window:
            out.append(f"{name} ({manifest.scheme.name or 'custom'}) keeps its first {window} tokens in high "
                       f"precision and the longest row holds {prompt_len + steps}: its quantized cache is not "
                       f"compared (raise --prompt-len above {window})")
            logger.warning("%s", out[-1])
    return out


def compare_exports(dir_a: str | os.PathLike[str], dir_b: str | os.PathLike[str],
                    tolerances: Tolerances | None = None, *, prompt_len: int | None = None, batch: int = 2,
                    steps: int = 4, seed: int = 0, verify_weights: bool = True,
                    providers: Sequence[str] | None = None, verbose: bool = True) -> Comparison:
    """Run both exports through Polygraphy's Comparator; a :class:`Comparison`, true when every output matched.

    ``prompt_len``: None sizes the prompt past both exports' high-precision windows
    (:func:`comparison_prompt_len`); a length that stays inside one logs a warning, as a match there says
    nothing about the quantized cache. ``verify_weights``: first check both exports' files against their
    manifests' checksums. ``providers``: ONNX Runtime providers of both sessions. ``verbose``: Polygraphy's
    per-output log.
    """
    tol = tolerances or Tolerances()
    ma, mb = Manifest.load(dir_a), Manifest.load(dir_b)
    if verify_weights:
        check_weights(dir_a, ma)
        check_weights(dir_b, mb)
    for field in ("vocab_size", "num_layers", "num_kv_heads", "head_dim"):
        a, b = getattr(ma.model, field), getattr(mb.model, field)
        if a != b:
            raise KVQError(f"{dir_a} and {dir_b} are different models ({field}: {a} vs {b})")
    sized = prompt_len is None
    if sized:
        prompt_len = comparison_prompt_len((ma, mb), batch=batch)
    warn_unexercised((ma, mb), (str(dir_a), str(dir_b)), prompt_len=prompt_len, steps=steps)
    _check_compare_size((ma, mb), prompt_len=prompt_len, batch=batch, steps=steps, sized=sized)
    runner = kvq_runner_class()
    feeds = compare_feeds(ma.model.vocab_size, prompt_len=prompt_len, batch=batch, steps=steps, seed=seed)
    return run_comparison([runner(dir_a, providers=providers), runner(dir_b, providers=providers)], feeds, tol,
                          verbose=verbose)
