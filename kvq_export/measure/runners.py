"""Runners: one small protocol for everything kvq times, after Polygraphy's (one runner per runtime).

A runner is a context manager (entering loads the model, leaving lets it go) with three calls:

* ``prefill(ids, capacity) -> (state, seconds)``: a state holding ``ids`` ([batch, tokens]) with room for
  ``capacity`` tokens per row, and the seconds the prefill itself took (loading and allocation excluded);
* ``step(state, tokens=None)``: one decode step, feeding ``tokens`` ([batch, 1]) or, when None, the greedy pick
  of the last step (what a generation loop pays: binding, run, logits, argmax);
* ``cache_bytes(state) -> int``: the cache bytes the state holds.

Runners on a graph kvq can fill (:class:`KvqRunner`, :class:`OrtGraphRunner`) also start from a synthetic cache
(``synthetic(batch, length, capacity, rng)``, :mod:`~kvq_export.measure.synthetic`), so a long context costs no
prefill. Runners that score text add ``perplexity(windows) -> float`` (strict decode). Runtimes load lazily:
``onnxruntime_genai`` in :class:`GenaiRunner`, ``llama_cpp`` in :class:`kvq_export.peer_compare.llama.LlamaCppRunner`.
:func:`kvq_export.measure.timing.interleaved` times their steps side by side.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvq_export.errors import KVQError
from kvq_export.flavors.ort_gqa.genai import GENAI_CONFIG
from kvq_export.measure.scoring import NllPool, perplexity
from kvq_export.measure.synthetic import graph_cache, synthetic_cache


class Runner(Protocol):
    """What :mod:`kvq_export.measure` times (see the module docstring)."""

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc: object) -> None: ...

    def prefill(self, ids: Any, capacity: int) -> tuple[Any, float]: ...

    def step(self, state: Any, tokens: np.ndarray | None = None) -> None: ...

    def cache_bytes(self, state: Any) -> int: ...


def as_ids(ids: Any) -> np.ndarray:
    """Token ids as an int64 [batch, tokens] array (a flat list is one row)."""
    array = np.asarray(ids, dtype=np.int64)
    return array[None] if array.ndim == 1 else array


def _one_prompt(ids: np.ndarray) -> bool:
    """Whether a batch of more than one row is one prompt repeated."""
    return ids.shape[0] > 1 and bool((ids == ids[:1]).all())


@dataclass
class KvqState:
    """A kvq session's cache, with the next tokens to feed or the logits they are picked from."""

    cache: Any
    tokens: np.ndarray | None = None
    logits: np.ndarray | None = None  # [batch, 1, vocab] of the last step

    def next_tokens(self) -> np.ndarray:
        return self.tokens if self.tokens is not None else self.logits.argmax(-1)


class KvqRunner:
    """A kvq export in kvq's own loop (:class:`~kvq_export.runtime.session.KVQSession`).

    ``chunk``: a prefill feeds at most this many tokens per step (None: one step); the session options
    (``threads``, ``providers``, ``spinning``, ``verify_weights``) go to the session as they are.
    """

    def __init__(self, directory: str | Path, *, chunk: int | None = None, **session_options: Any) -> None:
        self.directory, self.chunk, self.options = Path(directory), chunk, session_options
        self.session: Any = None

    def __enter__(self) -> KvqRunner:
        from kvq_export.runtime.session import KVQSession

        self.session = KVQSession(self.directory, **self.options)
        return self

    def __exit__(self, *exc: object) -> None:
        self.session = None

    def prefill(self, ids: Any, capacity: int) -> tuple[KvqState, float]:
        """A cache holding ``ids``; a batch of one prompt repeated is prefilled once and its cache copied."""
        ids = as_ids(ids)
        if ids.shape[1] < 1:
            raise KVQError("a prefill needs at least one token per row")
        rows, first = ids.shape[0], ids[:1] if _one_prompt(ids) else ids
        cache = self.session.empty_cache(first.shape[0], capacity=capacity)
        chunk = self.chunk or ids.shape[1]
        start = time.perf_counter()
        for i in range(0, ids.shape[1], chunk):
            logits, cache = self.session.step(first[:, i:i + chunk], None, cache)
        seconds = time.perf_counter() - start
        if first.shape[0] != rows:
            cache = self.session.cache_from_arrays({name: np.repeat(array, rows, axis=0) for name, array
                                                    in self.session.cache_arrays(cache).items()})
        return KvqState(cache, logits=np.repeat(logits[:, -1:], rows // first.shape[0], axis=0)), seconds

    def synthetic(self, batch: int, length: int, capacity: int | None, rng: np.random.Generator) -> KvqState:
        """A cache of random valid data holding ``length`` tokens per row, and random first tokens."""
        cache = synthetic_cache(self.session, batch, length, capacity=capacity, rng=rng)
        return KvqState(cache, tokens=rng.integers(1, self.session.manifest.model.vocab_size, (batch, 1)))

    def step(self, state: KvqState, tokens: np.ndarray | None = None) -> None:
        logits, state.cache = self.session.step(state.next_tokens() if tokens is None else tokens, None, state.cache)
        state.tokens, state.logits = None, logits[:, -1:]

    def cache_bytes(self, state: KvqState) -> int:
        return self.session.cache_nbytes(state.cache)

    def perplexity(self, windows: Sequence[Sequence[int]]) -> float:
        """Strict decode (:func:`kvq_export.measure.scoring.perplexity`)."""
        return perplexity(self.session, windows)["ppl"]


def genai_decoder(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the whole ``genai_config.json``, its ``model.decoder`` section) of an onnxruntime-genai directory."""
    path = Path(directory) / GENAI_CONFIG
    if not path.is_file():
        raise KVQError(f"{directory} has no {GENAI_CONFIG}: export with --flavor ort-gqa or use the builder")
    config = json.loads(path.read_text())
    return config, config["model"]["decoder"]


@dataclass
class GraphState:
    """The past tensors an ONNX Runtime graph is fed, the tokens they hold, the next tokens."""

    cache: dict[str, np.ndarray]
    length: int
    tokens: np.ndarray


class OrtGraphRunner:
    """The decoder graph onnxruntime-genai loads, run in ONNX Runtime as og's loop runs it, on a synthetic cache.

    For graphs whose past and present are separate tensors (the model builder's quantized caches): feed the past,
    keep the present as the next past, pick the next token greedily. It starts from :meth:`synthetic` only; a
    shared-buffer graph (og writes present into past's buffer) is refused.
    """

    def __init__(self, directory: str | Path, *, threads: int | None = None,
                 providers: Sequence[str] | None = None) -> None:
        self.directory, self.threads, self.providers = Path(directory), threads, providers
        self.config, self.decoder = genai_decoder(directory)
        self.session: Any = None

    def __enter__(self) -> OrtGraphRunner:
        import onnxruntime as ort

        if self.config.get("search", {}).get("past_present_share_buffer", False):
            raise KVQError(f"{self.directory}: past_present_share_buffer is on; the ort runner feeds separate past "
                           "and present tensors only (allowed: og, or session for a kvq export)")
        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as og runs its sessions
        if self.threads:
            options.intra_op_num_threads = int(self.threads)
        self.session = ort.InferenceSession(str(self.directory / self.decoder["filename"]), options,
                                            providers=list(self.providers or ["CPUExecutionProvider"]))
        return self

    def __exit__(self, *exc: object) -> None:
        self.session = None

    def _names(self, kind: str) -> list[str]:
        """Every layer's key and value names of ``kind`` (``past`` inputs, ``present`` outputs)."""
        table = self.decoder["inputs" if kind == "past" else "outputs"]
        return [table[f"{kind}_{part}_names"] % layer for layer in range(int(self.decoder["num_hidden_layers"]))
                for part in ("key", "value")]

    def prefill(self, ids: Any, capacity: int) -> tuple[GraphState, float]:
        raise KVQError(f"{self.directory}: the ort runner starts from a synthetic cache only (synthetic())")

    def synthetic(self, batch: int, length: int, capacity: int | None, rng: np.random.Generator) -> GraphState:
        """Past tensors of random valid codes holding ``length`` tokens (og's layout: no capacity to size)."""
        types = {value.name: value.type for value in self.session.get_inputs()}
        shape = (batch, int(self.decoder["num_key_value_heads"]), length, int(self.decoder["head_size"]))
        cache = graph_cache({name: types[name] for name in self._names("past")}, shape, rng)
        try:
            vocab = int(self.config["model"]["vocab_size"])
        except KeyError:
            raise KVQError(f"{self.directory}: {GENAI_CONFIG} has no model.vocab_size") from None
        return GraphState(cache, length, rng.integers(1, vocab, (batch, 1)).astype(np.int64))

    def step(self, state: GraphState, tokens: np.ndarray | None = None) -> None:
        names, batch = self.decoder["inputs"], state.tokens.shape[0]
        feed = {names["input_ids"]: state.tokens if tokens is None else np.asarray(tokens, np.int64),
                names["attention_mask"]: np.ones((batch, state.length + 1), np.int64), **state.cache}
        logits, *present = self.session.run([self.decoder["outputs"]["logits"], *self._names("present")], feed)
        state.cache = dict(zip(state.cache, present))
        state.length += 1
        state.tokens = logits[:, -1:].argmax(-1).astype(np.int64)

    def cache_bytes(self, state: GraphState) -> int:
        return sum(int(array.nbytes) for array in state.cache.values())


class GenaiRunner:
    """A directory onnxruntime-genai loads (a builder build, or a kvq ort-gqa export), in og's own loop.

    The model never stops early (no end-of-sequence token: a timed run decodes every step it is asked for);
    ``threads`` sets the decoder's intra-op threads, ``providers`` replace the config's; ``chunk``: a batch-1
    prefill appends at most this many tokens per call (og takes a larger batch's prompt in one call, once).
    """

    def __init__(self, directory: str | Path, *, threads: int | None = None, providers: Sequence[str] | None = None,
                 chunk: int | None = None) -> None:
        self.directory, self.threads, self.providers, self.chunk = Path(directory), threads, providers, chunk
        self.decoder = genai_decoder(directory)[1]
        self.og: Any = None
        self.model: Any = None

    def __enter__(self) -> GenaiRunner:
        import onnxruntime_genai as og

        from kvq_export.runtime.device import set_genai_providers

        config = og.Config(str(self.directory))
        set_genai_providers(config, self.providers)
        overlay: dict[str, Any] = {"model": {"eos_token_id": []}}
        if self.threads:
            overlay["model"]["decoder"] = {"session_options": {"intra_op_num_threads": int(self.threads)}}
        config.overlay(json.dumps(overlay))
        self.og, self.model = og, og.Model(config)
        return self

    def __exit__(self, *exc: object) -> None:
        self.model = None

    def _generator(self, max_length: int, batch: int = 1) -> Any:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False, batch_size=batch)
        return self.og.Generator(self.model, params)

    def prefill(self, ids: Any, capacity: int) -> tuple[Any, float]:
        ids = as_ids(ids).astype(np.int32)
        generator = self._generator(capacity, ids.shape[0])
        chunk = self.chunk if ids.shape[0] == 1 and self.chunk else ids.shape[1]
        start = time.perf_counter()
        for i in range(0, ids.shape[1], chunk):
            generator.append_tokens(ids[:, i:i + chunk])
        return generator, time.perf_counter() - start

    def step(self, state: Any, tokens: np.ndarray | None = None) -> None:
        """One decode step: og runs the last token and picks the next greedily (its C++ loop)."""
        if tokens is not None:
            raise KVQError("onnxruntime-genai picks its own next token: step() takes no tokens")
        state.generate_next_token()

    def cache_bytes(self, state: Any) -> int:
        """Bytes of the present key/value tensors og holds."""
        return sum(int(state.get_output(name).nbytes) for name in self._present())

    def _present(self) -> list[str]:
        names = self.decoder["outputs"]
        return [names[f"present_{part}_names"] % layer for layer in range(int(self.decoder["num_hidden_layers"]))
                for part in ("key", "value")]

    def perplexity(self, windows: Sequence[Sequence[int]]) -> float:
        """Strict decode, one token per step, NLL pooled over the windows.

        One generator per window: onnxruntime-genai 0.18 refuses a second ``append_tokens`` on a batch of more
        than one row ("AppendTokens can only be called once for batch_size > 1"), so the windows run one by one.
        """
        ids = np.asarray(windows, dtype=np.int32)
        pool = NllPool()
        for row in ids:
            generator = self._generator(ids.shape[1])
            for i in range(ids.shape[1] - 1):
                generator.append_tokens(row[i:i + 1])
                pool.add(generator.get_logits(), [row[i + 1]])
        return pool.ppl
