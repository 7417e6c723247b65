"""`KVQSession`: open an export directory, keep the quantized cache between steps, generate text.

The cache crosses the graph boundary in its stored form; between steps the runtime only hands the
``present.*`` ONNX Runtime values back as ``past.*`` inputs (no copy, no numpy round trip).

How the cache is laid out is the export's :class:`~kvq_export.cache_layout.CacheLayout`; the session asks it
for empty caches, capacities and which tensors to bind in place. Exports in the ``buffer`` layout
(``--flavor ort-gqa``) hold one fixed-capacity buffer per stream: the session binds the same OrtValue as
``past.*`` input and ``present.*`` output (IO binding), so the kernel appends in place and ``step`` returns
the *same* buffers, updated; an older cache dict of that session shares them (do not branch from it). A step
that would overflow the capacity first copies the rows into buffers of twice the size (or of the capacity
needed).

``generate`` is :meth:`KVQSession.prefill` (the left-padded prompts, one run), then
:meth:`KVQSession.decode_n_tokens`, which samples a token per row and feeds it back through
:meth:`KVQSession.decode_one_token`; each is one :meth:`KVQSession.step` away from the graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from kvq_export._read import TOKENIZER_FILES, TOKENIZER_LIMIT, check_sizes
from kvq_export.dtypes import DType
from kvq_export.errors import KVQError, RuntimeInputError
from kvq_export.graph_facts import check_graph_facts
from kvq_export.manifest import (
    MODEL_NAME,
    Manifest,
    check_export_files,
    check_same_export,
    export_identity,
    load_static,
    resolve_inside,
)
from kvq_export.manifest import verify_weights as check_weights
from kvq_export.manifest_sections import GraphValue
from kvq_export.naming import CacheTensor, present_name, tensor_name
from kvq_export.runtime.base import (
    Generation,
    PromptBatch,
    Rows,
    TokenCallback,
    check_prompts,
    eos_token_ids,
)
from kvq_export.runtime.io_binding import Binding, BoundCache, CacheState
from kvq_export.runtime.ort_setup import attend_stored, choose_providers, open_onnx, ort_value, session_options
from kvq_export.runtime.sampling import Sampler, SamplingConfig
from kvq_export.vocab import Role

logger = logging.getLogger(__name__)

#: Tokens per row of a new ``buffer``-layout cache when nothing says how many.
DEFAULT_CAPACITY = 256


class KVQSession:
    """An export directory on ONNX Runtime.

    Args:
        directory: a ``kvq export`` output directory (``kvq.json`` + ``model.onnx``).
        providers: ONNX Runtime providers; default CUDA when onnxruntime-gpu sees a GPU, else CPU.
        threads: intra-op threads (default: :func:`~kvq_export.runtime.ort_setup.default_threads`).
        capacity: tokens per row a new ``buffer``-layout cache holds before it must grow (default: what
            ``generate`` needs, else :data:`DEFAULT_CAPACITY`); ignored by the ``regions`` layout.
        verify_weights: check ``model.onnx`` and its weights against the sha256 the manifest recorded at
            export (a corrupted or edited file is refused). Hashing reads every byte once per process
            (about a second per GB); pass False to skip it for speed on trusted storage.
        spinning: keep ONNX Runtime's intra-op thread spinning between runs (see :func:`.ort_setup.session_options`).
        tokenizer: load the export's transformers tokenizer (False: token ids only; ``kvq serve`` reads the
            tokenizer files itself through :class:`~kvq_export.runtime.text_codec.TextCodec`).
        last_logits: run the graph with the head on each row's last position only
            (:func:`~kvq_export.runtime.last_logits.last_position_model`): ``step`` then returns logits
            ``[batch, 1, vocab]``. Where the graph's head has another form the full graph runs
            (:attr:`last_logits` says which).
        stored_prefill: every call attends over the stored codes, a prompt's own tokens' too, as a decode step does
            (the graph's :data:`~kvq_export.naming.EXACT_PREFILL` set false), so what a cache row holds follows from
            its tokens alone, however they were split into calls (what prefix reuse needs). The default attends
            exactly over a call's own tokens: faster at prompt length, and a prompt's tokens see each other exactly.

    An export is data, never code: every file it uses must lie inside ``directory``, its tokenizer loads
    with remote code disabled, the calibration file must match its digest and the graph's own constants, and the
    graph must carry the manifest's scheme.
    """

    runtime: ClassVar[str] = "kvq"
    holds_last_token: ClassVar[bool] = False  # the last sampled token is never fed

    def __init__(self, directory: str | Path, *, providers: Sequence[str] | None = None,
                 threads: int | None = None, capacity: int | None = None, verify_weights: bool = True,
                 spinning: bool = False, tokenizer: bool = True, last_logits: bool = False,
                 stored_prefill: bool = False) -> None:
        self.directory = Path(directory)
        opened = export_identity(self.directory) if self.directory.is_dir() else None
        self.manifest = Manifest.load(self.directory)
        model_path = resolve_inside(self.directory, MODEL_NAME)
        if not model_path.is_file():
            raise RuntimeInputError(f"{self.directory} has a manifest but no {MODEL_NAME}")
        if verify_weights:
            check_weights(self.directory, self.manifest)
        self.static = load_static(self.directory, self.manifest)  # checks the calibration digest
        rewritten = None
        if last_logits:
            from kvq_export.runtime.last_logits import last_position_model

            rewritten = last_position_model(model_path)
        #: whether the graph computes the logits of each row's last position only
        self.last_logits = rewritten is not None
        options = session_options(threads, spinning=spinning)
        quantized = self.manifest.scheme.quantized
        #: whether every call attends over what the cache stores (an unquantized cache stores its values exactly)
        self.stored_prefill = stored_prefill or not quantized
        self._overrides = attend_stored(model_path, options, rewritten) if stored_prefill and quantized else []
        self.session = open_onnx(model_path, options, choose_providers(providers), rewritten)
        self.past: list[CacheTensor] = self.manifest.cache("past")
        self.layout = self.manifest.cache_layout
        self.capacity = capacity
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise RuntimeInputError(f"invalid capacity={capacity!r}: allowed: an integer >= 1")
        self._check_graph(model_path)
        #: extra graph outputs fetched by every step (validation probes), values left in ``last_extra``
        self.extra_outputs: tuple[str, ...] = ()
        self.last_extra: dict[str, np.ndarray] = {}
        # everything the session reads is read now: an export replaced later (--force) cannot mix into it
        self._tokenizer, self._tokenizer_error = (self._load_tokenizer() if tokenizer else
                                                  (None, f"{self.directory} was opened without its tokenizer"))
        self._opened = opened
        check_same_export(self.directory, opened, "while this session opened it")

    # -- contract checks ----------------------------------------------------------------------------------
    def _check_graph(self, model_path: Path) -> None:
        """The graph's inputs/outputs, its own facts and constants must be exactly what the manifest promises."""
        graph_inputs = {i.name: i for i in self.session.get_inputs()}
        graph_outputs = {o.name: o for o in self.session.get_outputs()}
        # the manifest's declared inputs/outputs too (read by the TensorRT builder): an edited name or dtype is refused
        declared_in, declared_out = (_declared(getattr(self.manifest, kind), kind) for kind in ("inputs", "outputs"))
        expected_in = {**declared_in, **{t.name: t.dtype for t in self.past}}
        expected_out = {**declared_out, **{present_name(t.name): t.dtype for t in self.past}}
        for kind, graph, expected in (("input", graph_inputs, expected_in), ("output", graph_outputs, expected_out)):
            extra = sorted(set(graph) - set(expected))
            if extra:
                raise RuntimeInputError(
                    f"graph {kind} {extra[0]} is not in the manifest (manifest does not match graph)")
            for name, dtype in expected.items():
                if name not in graph:
                    raise RuntimeInputError(f"manifest {kind} {name} is missing from the graph")
                if graph[name].type != DType.get(dtype).ort_type:
                    raise RuntimeInputError(
                        f"graph {kind} {name}: manifest says {DType.get(dtype).ort_type}, graph has {graph[name].type}")
        # the graph holds the truth: its metadata as this session read it, and its constants
        check_graph_facts(self.directory, self.manifest, model_path, self.static,
                          carried=self.session.get_modelmeta().custom_metadata_map)
        fixed = {t.name: t.shape for t in self.past}
        for value in self.session.get_inputs():
            want = fixed.get(value.name)
            if want is not None and len(value.shape) == len(want) and any(
                    isinstance(w, int) and isinstance(g, int) and w != g for w, g in zip(want, value.shape)):
                raise RuntimeInputError(f"graph input {value.name} has shape {value.shape}, the manifest says "
                                        f"{list(want)} (manifest does not match graph)")

    def check_cache(self, cache: CacheState, batch: int, specs: Sequence[CacheTensor] | None = None) -> None:
        """Every past tensor (of ``specs``, default all) present, with the manifest's dtype, rank, dims and batch."""
        from onnxruntime import OrtValue

        if not isinstance(cache, dict):
            raise RuntimeInputError(f"cache: expected a dict of OrtValues (from step or empty_cache), got "
                                    f"{type(cache).__name__}")
        for spec in self.past if specs is None else specs:
            value = cache.get(spec.name)
            if value is None:
                raise RuntimeInputError(f"cache tensor {spec.name} is missing")
            if not isinstance(value, OrtValue):
                raise RuntimeInputError(
                    f"cache tensor {spec.name}: expected an onnxruntime.OrtValue (as step/empty_cache return), got "
                    f"{type(value).__module__}.{type(value).__name__}; wrap arrays with "
                    "kvq_export.runtime.ort_setup.ort_value(array, dtype)")
            actual_type = value.data_type()
            if actual_type != DType.get(spec.dtype).ort_type:
                raise RuntimeInputError(
                    f"cache tensor {spec.name}: expected {DType.get(spec.dtype).ort_type}, got {actual_type}")
            shape = value.shape()
            if len(shape) != len(spec.shape):
                raise RuntimeInputError(f"cache tensor {spec.name}: expected shape {list(spec.shape)}, got {shape}")
            for want, got in zip(spec.shape, shape):
                expect = batch if want == "batch" else want
                if isinstance(expect, int) and expect != got:
                    raise RuntimeInputError(
                        f"cache tensor {spec.name}: expected shape {_show(spec.shape, batch)}, got {shape}")

    # -- cache ----------------------------------------------------------------------------------------------
    def empty_cache(self, batch: int, *, capacity: int | None = None) -> CacheState:
        """A cache holding no token for ``batch`` sequences (``buffer`` layout: ``capacity`` tokens per row)."""
        size = self._capacity(capacity or self.capacity or DEFAULT_CAPACITY)
        return self.cache_from_arrays(self.layout.arrays(self.past, self.manifest.scheme, self.manifest.num_layers,
                                                         batch, 0, capacity=size))

    def cache_from_arrays(self, arrays: dict[str, np.ndarray]) -> CacheState:
        """A cache of OrtValues from numpy arrays keyed by past names (fp8 codes as raw uint8 bits)."""
        return {spec.name: ort_value(arrays[spec.name], spec.dtype) for spec in self.past}

    @property
    def max_capacity(self) -> int | None:
        """Largest ``buffer`` capacity the graph supports (its fused rotary table), None if unbounded."""
        return self.max_positions if self.layout.has_capacity else None

    def _capacity(self, wanted: int) -> int:
        """``wanted`` if the graph supports it (capped at :attr:`max_capacity` for generous defaults)."""
        top = self.max_capacity
        if top is not None and wanted > top:
            raise RuntimeInputError(
                f"cache capacity {wanted} exceeds the {top} positions this ort-gqa export supports "
                "(its fused RoPE table has max_position_embeddings rows)")
        return wanted

    def _grow(self, cache: CacheState, need: int) -> CacheState:
        """Copy a fixed-capacity cache into buffers holding at least ``need`` tokens per row (else: unchanged)."""
        if not self.layout.has_capacity:  # every step comes here: no shape queries for unbounded layouts
            return cache
        old = self.layout.capacity_of({spec.name: cache[spec.name].shape() for spec in self.past
                                       if self.layout.shared(spec)})
        if old is None or need <= old:
            return cache
        top = self.max_capacity
        size = max(need, 2 * old) if top is None else max(min(2 * old, top), need)
        size = self._capacity(size)  # refuses a need beyond the graph's positions
        logger.info("growing the cache buffers from %d to %d tokens per row (one copy)", old, size)
        return {spec.name: ort_value(self.layout.grown(spec, cache[spec.name].numpy(), size), spec.dtype)
                if self.layout.shared(spec) else cache[spec.name] for spec in self.past}

    def cache_nbytes(self, cache: CacheState) -> int:
        """Bytes of the stored cache regions (the per-row ``seq_lengths`` bookkeeping excluded)."""
        total = 0
        for spec in self.past:
            if spec.role != Role.SEQ_LENGTHS:
                total += int(np.prod(cache[spec.name].shape())) * DType.get(spec.dtype).itemsize
        return total

    def cache_arrays(self, cache: CacheState) -> dict[str, np.ndarray]:
        """The cache as numpy arrays keyed by past names (fp8 codes as raw uint8 bits)."""
        return {name: value.numpy() for name, value in cache.items()}

    @staticmethod
    def seq_lengths(cache: CacheState) -> np.ndarray:
        """Real tokens held per row."""
        return cache[tensor_name("past", None, None, "seq_lengths")].numpy()

    # -- one forward ----------------------------------------------------------------------------------------
    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
             cache: CacheState | None = None) -> tuple[np.ndarray, CacheState]:
        """Run new tokens ``[B, t]`` (left-padded, mask 0 = padding) through the graph; return (logits, cache)."""
        input_ids = self._check_ids(input_ids)
        mask = self._check_mask(attention_mask, input_ids.shape)
        cache = self.empty_cache(input_ids.shape[0]) if cache is None else cache
        batch = input_ids.shape[0]
        bound = cache.binding if isinstance(cache, BoundCache) and cache.binding.holds(self, cache, batch) else None
        # buffers the last step bound are the checked OrtValues themselves: only the rest is checked again
        self.check_cache(cache, batch, self.past if bound is None else bound.rebound)
        lengths = self.seq_lengths(cache).astype(np.int64)
        # a fixed capacity grows first (and refuses what its graph cannot hold, naming the capacity)
        need = int(lengths.max(initial=0)) + input_ids.shape[1]
        if bound is None or bound.capacity is None or need > bound.capacity:
            grown = self._grow(cache, need)
            bound = bound if grown is cache else None
            cache = grown
        self._check_positions(lengths + mask.sum(axis=1))
        logits, new = self._run(input_ids, mask, cache, bound)
        self._check_finite(logits, mask, cache, new)
        return logits, new

    # -- input checks (before any work) ----------------------------------------------------------------------
    def _check_ids(self, input_ids) -> np.ndarray:
        """``[batch, seq >= 1]`` integer token ids inside the vocabulary."""
        raw = np.asarray(input_ids)
        if raw.ndim != 2 or raw.shape[1] < 1 or raw.shape[0] < 1:
            raise RuntimeInputError(f"input_ids: expected shape [batch >= 1, seq >= 1], got {list(raw.shape)}")
        if raw.dtype.kind not in "iu":
            raise RuntimeInputError(f"input_ids: expected integer token ids, got dtype {raw.dtype}")
        vocab = self.manifest.model.vocab_size
        if raw.min() < 0 or raw.max() >= vocab:
            bad = (raw < 0) | (raw >= vocab)
            row, col = (int(i) for i in np.argwhere(bad)[0])
            raise RuntimeInputError(f"input_ids[{row}, {col}] = {int(raw[row, col])} is outside the vocabulary; "
                                    f"allowed: 0 .. {vocab - 1}")
        return raw.astype(np.int64, copy=False)

    @staticmethod
    def _check_mask(attention_mask, shape: tuple[int, ...]) -> np.ndarray:
        """0/1 and left-padded per row (zeros then ones; an all-zero row feeds only padding)."""
        if attention_mask is None:
            return np.ones(shape, dtype=np.int64)
        raw = np.asarray(attention_mask)
        if raw.shape != shape:
            raise RuntimeInputError(f"attention_mask: expected shape {list(shape)}, got {list(raw.shape)}")
        if raw.dtype.kind not in "iub" or raw.size and (raw.min() < 0 or raw.max() > 1):
            raise RuntimeInputError("attention_mask: allowed values are 0 (left padding) and 1 (real token), got "
                                    f"{np.unique(raw)[:8].tolist()}")
        mask = raw.astype(np.int64, copy=False)
        if mask.shape[1] > 1 and (mask[:, 1:] < mask[:, :-1]).any():
            unsorted = (mask[:, 1:] < mask[:, :-1]).any(axis=1)
            raise RuntimeInputError(f"attention_mask row {int(np.flatnonzero(unsorted)[0])} is not left-padded "
                                    "(a 0 after a 1); pad on the left: [0, .., 0, 1, .., 1]")
        if mask.size and not mask.any():  # the graph has no token to take its shapes from
            raise RuntimeInputError("attention_mask holds no real token (1) in any row: a step needs at least one")
        return mask

    @property
    def max_positions(self) -> int:
        """Tokens a row can hold: the model's positions (also the ``buffer`` layout's rotary table)."""
        return self.manifest.model.max_position_embeddings

    def _check_positions(self, totals: np.ndarray, *, what: str = "this step") -> None:
        """Refuse, before running, a row that would hold more tokens than the model has positions."""
        top = self.max_positions
        if totals.size and int(totals.max()) > top:
            row = int(np.argmax(totals))
            raise RuntimeInputError(f"{what} would put {int(totals[row])} tokens in row {row}, beyond the {top} "
                                    "positions this export supports (max_position_embeddings)")

    def _check_finite(self, logits: np.ndarray, mask: np.ndarray, fed: CacheState,
                      written: CacheState | None = None) -> None:
        """NaN/Inf logits of a real token: name the cache tensor (fed, or written this step) that holds them.

        A float16 cache tensor holding Inf means the model's keys or values exceeded float16's range when
        they were stored: that is said, with the tensor, instead of blaming the weights.
        """
        if np.isfinite(logits[:, -1]).all():  # the usual case: one pass over [batch, vocab]
            return
        real = mask[:, -1] == 1
        if np.isfinite(logits[real, -1]).all():  # only padding rows (finished in generate) are not finite
            return
        for when, cache in (("fed to this step", fed), ("written by this step", written or {})):
            for spec in self.past:
                if spec.dtype not in ("float16", "float32") or spec.role == Role.SEQ_LENGTHS or spec.name not in cache:
                    continue
                if cache is fed and written is not None and self.layout.shared(spec):
                    continue  # updated in place: it now holds what this step wrote
                values = cache[spec.name].numpy()
                if not values.size or np.isfinite(values).all():
                    continue
                if spec.dtype == "float16" and np.isinf(values).any():
                    what = f"layer {spec.layer} {spec.part} {spec.role}" if spec.layer is not None else spec.role
                    raise RuntimeInputError(
                        f"cache tensor {spec.name} holds values beyond float16's range (±65504) ({what}, {when}): "
                        "the model's keys or values exceed what this float16 cache stores; use a scheme whose cache "
                        "keeps them in float32 (or one that quantizes them with scales)")
                raise RuntimeInputError(f"cache tensor {spec.name} holds NaN or Inf ({when}); the logits are not "
                                        "finite")
        computed = " computed in float16 (its activations may exceed float16's range)" \
            if self.manifest.dtype == "fp16" else ""
        raise RuntimeInputError(f"the graph{computed} produced NaN or Inf logits (input and cache are finite): the "
                                "weights or the calibration scales are broken")

    def _run(self, input_ids: np.ndarray, mask: np.ndarray, cache: CacheState,
             bound: Binding | None = None) -> tuple[np.ndarray, CacheState]:
        """One graph run through IO binding; tensors the layout shares are bound as past input and present output.

        ``bound``: the binding of the step that returned ``cache`` (its shared buffers are ``cache``'s): only the
        inputs and outputs that change from step to step are bound again (a decode step of a small model is short
        enough for binding every buffer to show). The returned cache carries the binding on to the next step.
        """
        if bound is None:
            bound = Binding(self, cache, input_ids.shape[0])
        binding = bound.binding
        binding.bind_ortvalue_input("input_ids", ort_value(input_ids, "int64"))
        binding.bind_ortvalue_input("attention_mask", ort_value(mask, "int64"))
        # outputs of a known shape go into fresh arrays of ours: nothing to wrap or copy after the run
        positions = 1 if self.last_logits else input_ids.shape[1]
        logits = np.empty((input_ids.shape[0], positions, self.manifest.model.vocab_size), dtype=np.float32)
        binding.bind_ortvalue_output("logits", ort_value(logits, "float32"))
        values = {}
        for spec in bound.rebound:
            binding.bind_ortvalue_input(spec.name, cache[spec.name])
            shape = bound.fixed_shape(spec)
            if shape is None:
                binding.bind_output(present_name(spec.name))
            else:
                values[present_name(spec.name)] = ort_value(np.empty(shape, DType.get(spec.dtype).bits_numpy),
                                                             spec.dtype)
                binding.bind_ortvalue_output(present_name(spec.name), values[present_name(spec.name)])
        for name in self.extra_outputs:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        if bound.reads_outputs:  # (wrapping every output in a Python object costs about 15 us each)
            values = dict(zip(bound.names, binding.get_outputs()))
        self.last_extra = {name: values[name].numpy() for name in self.extra_outputs}
        new = BoundCache({spec.name: cache[spec.name] if self.layout.shared(spec) else values[present_name(spec.name)]
                           for spec in self.past}, bound)
        return logits, new

    # -- text ---------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The tokenizer saved in the export directory (read when the session opened)."""
        if self._tokenizer is None:
            raise RuntimeInputError(self._tokenizer_error)
        return self._tokenizer

    def _load_tokenizer(self):
        """(tokenizer, None), or (None, why there is none): the error is raised when text is used."""
        if not self.manifest.tokenizer.files:
            return None, f"{self.directory} has no tokenizer (exported without one): pass token ids"
        try:
            return load_tokenizer(self.directory, self.manifest), None
        except RuntimeInputError as err:
            return None, str(err)

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids (the tokenizer's special tokens included, as it adds them)."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids, special tokens left out."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    # -- generation: prefill, then decode one token at a time -----------------------------------------------
    def prefill(self, batch: PromptBatch, max_new_tokens: int) -> tuple[np.ndarray, CacheState]:
        """Run the left-padded prompts into a new cache sized for the whole generation; last logits ``[B, V]``."""
        ids, mask = batch.padded(left=True)  # [B, W]
        capacity = self.capacity or self.layout.capacity_for(batch.width + max_new_tokens)
        if capacity is not None and self.max_capacity is not None:
            capacity = min(capacity, self.max_capacity)
        logits, cache = self.step(ids, mask, self.empty_cache(len(batch), capacity=capacity))
        return logits[:, -1], cache

    def decode_one_token(self, tokens: np.ndarray, active: np.ndarray,
                         cache: CacheState) -> tuple[np.ndarray, CacheState]:
        """Feed one token per row ``[B]`` (rows not ``active`` feed padding: nothing is stored); logits ``[B, V]``."""
        logits, cache = self.step(tokens[:, None], active[:, None].astype(np.int64), cache)
        return logits[:, -1], cache

    def decode_n_tokens(self, logits: np.ndarray, cache: CacheState, n: int, sampler: Sampler,
                        rows: Rows) -> CacheState:
        """Sample up to ``n`` tokens per row into ``rows``, feeding each back, until every row ended; the cache."""
        for i in range(n):
            tokens = sampler(np.where(rows.active[:, None], logits, 0.0))  # [B]; ended rows: their padding's logits
            rows.add(tokens)
            if rows.done or i == n - 1:  # the last token is never fed
                break
            logits, cache = self.decode_one_token(tokens, rows.active, cache)
        return cache

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        *,
        stop_at_eos: bool = True,
        on_token: TokenCallback | None = None,
    ) -> list[Generation]:
        """Prefill a left-padded batch, then decode until EOS or ``max_new_tokens``.

        ``prompts`` are strings (tokenized with the export's tokenizer) or token-id lists.
        ``on_token(row, token)`` is called for every generated token (for streaming).
        """
        batch = check_prompts(prompts, max_new_tokens, encode=self.encode, manifest=self.manifest,
                              holds_last_token=self.holds_last_token)
        rows = Rows(batch, eos_token_ids(self.manifest) if stop_at_eos else (), on_token)
        sampler = Sampler(sampling or SamplingConfig())
        sampler.prime(batch.tokens)
        logits, cache = self.prefill(batch, max_new_tokens)
        cache = self.decode_n_tokens(logits, cache, max_new_tokens, sampler, rows)
        return rows.finish(self.cache_nbytes(cache), self.decode if self._tokenizer is not None else None)


def _declared(values: Sequence[GraphValue], kind: str) -> dict[str, str]:
    """``{name: dtype}`` of a manifest's ``inputs`` or ``outputs`` (a dtype kvq does not know is one line)."""
    out = {}
    for i, value in enumerate(values):
        try:
            DType.get(value.dtype)
        except KVQError as err:
            raise RuntimeInputError(f"invalid manifest: {kind}[{i}].dtype: {err}") from None
        out[value.name] = value.dtype
    return out


def load_tokenizer(directory: str | Path, manifest: Manifest):
    """The Hugging Face tokenizer saved in an export directory (never running code the export ships)."""
    from transformers import AutoTokenizer

    check_export_files(Path(directory), manifest)
    check_sizes(directory, TOKENIZER_FILES, "tokenizer file", limit=TOKENIZER_LIMIT,
                error=RuntimeInputError)  # transformers reads them whole
    try:  # an export is data: never run code it ships (auto_map), never ask about it
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise RuntimeInputError(f"{directory} has no usable tokenizer: {err}") from None


def _show(shape, batch: int) -> list:
    return [batch if d == "batch" else d for d in shape]
