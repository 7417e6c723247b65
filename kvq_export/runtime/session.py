"""`KVQSession`: open an export directory, keep the quantized cache between steps, generate text.

The cache crosses the graph boundary in its stored form; between steps the runtime only hands the
``present.*`` ONNX Runtime values back as ``past.*`` inputs (no copy, no numpy round trip).

Exports in the ``buffer`` layout (``--flavor ort-gqa``) hold one fixed-capacity buffer per stream: the
session binds the same OrtValue as ``past.*`` input and ``present.*`` output (IO binding), so the kernel
appends in place and ``step`` returns the *same* buffers, updated; an older cache dict of that session
shares them (do not branch from it). A step that would overflow the capacity first copies the rows into
buffers of twice the size (or of the capacity needed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvq_export.errors import RuntimeInputError
from kvq_export.manifest import MODEL_NAME, Manifest
from kvq_export.naming import CAPACITY_AXIS, CacheTensor, present_name, tensor_name
from kvq_export.runtime.sampling import Sampler, SamplingConfig

logger = logging.getLogger(__name__)

#: manifest dtype -> (ONNX Runtime type string, numpy dtype used to build values)
_TYPES = {
    "int64": ("tensor(int64)", np.int64),
    "int8": ("tensor(int8)", np.int8),
    "uint8": ("tensor(uint8)", np.uint8),
    "float16": ("tensor(float16)", np.float16),
    "float32": ("tensor(float)", np.float32),
    "float8e4m3fn": ("tensor(float8e4m3fn)", np.uint8),  # fed as raw bits with an explicit ONNX type
}
_ELEMENT_BYTES = {"int64": 8, "int8": 1, "uint8": 1, "float16": 2, "float32": 4, "float8e4m3fn": 1}

CacheState = dict  # past tensor name -> onnxruntime.OrtValue
#: Tokens per row of a new ``buffer``-layout cache when nothing says how many.
DEFAULT_CAPACITY = 256


def choose_providers(requested: Sequence[str] | None = None) -> list[str]:
    """ONNX Runtime providers: the requested ones (checked), else CUDA when usable, else CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise RuntimeInputError(
                f"provider(s) {', '.join(missing)} not available; available: {', '.join(available)}")
        return list(requested)
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_options(threads: int | None = None):
    """ONNX Runtime session options every kvq session uses (``threads``: intra-op threads, None = ORT's choice)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return options


def ort_value(array: np.ndarray, dtype: str):
    """An OrtValue holding ``array`` as the manifest element type ``dtype`` (fp8: from raw uint8 bits)."""
    return _ort_value(array, dtype)


def _ort_value(array: np.ndarray, dtype: str):
    import onnxruntime as ort

    if dtype == "float8e4m3fn":
        from onnx import TensorProto

        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array).view(np.uint8),
                                                               TensorProto.FLOAT8E4M3FN)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype=_TYPES[dtype][1]))


@dataclass
class Generation:
    """One prompt's result."""

    prompt: str | None
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "length"  # "eos" or "length"
    cache_bytes: int = 0  # bytes held by this batch's whole cache at the end

    def to_dict(self) -> dict:
        """JSON form for ``kvq generate --json``."""
        return {"prompt": self.prompt, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
                "text": self.text, "finish_reason": self.finish_reason, "cache_bytes": self.cache_bytes}


class KVQSession:
    """An export directory on ONNX Runtime.

    Args:
        directory: a ``kvq export`` output directory (``kvq.json`` + ``model.onnx``).
        providers: ONNX Runtime providers; default CUDA when onnxruntime-gpu sees a GPU, else CPU.
        threads: intra-op threads (default: ONNX Runtime's choice).
        capacity: tokens per row a new ``buffer``-layout cache holds before it must grow (default: what
            ``generate`` needs, else :data:`DEFAULT_CAPACITY`); ignored by the ``regions`` layout.
    """

    def __init__(self, directory: str | Path, *, providers: Sequence[str] | None = None,
                 threads: int | None = None, capacity: int | None = None) -> None:
        import onnxruntime as ort

        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        model_path = self.directory / MODEL_NAME
        if not model_path.is_file():
            raise RuntimeInputError(f"{self.directory} has a manifest but no {MODEL_NAME}")
        self.session = ort.InferenceSession(str(model_path), session_options(threads),
                                            providers=choose_providers(providers))
        self.past: list[CacheTensor] = self.manifest.cache("past")
        self.layout = self.manifest.cache_layout
        self.capacity = capacity
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise RuntimeInputError(f"invalid capacity={capacity!r}: allowed: an integer >= 1")
        self._check_graph()
        self._outputs = ["logits", *(present_name(t.name) for t in self.past)]
        #: extra graph outputs fetched by every step (validation probes), values left in ``last_extra``
        self.extra_outputs: tuple[str, ...] = ()
        self.last_extra: dict[str, np.ndarray] = {}
        self._tokenizer = None

    # -- contract checks ----------------------------------------------------------------------------------
    def _check_graph(self) -> None:
        """The graph's inputs/outputs must be exactly what the manifest promises."""
        graph_inputs = {i.name: i for i in self.session.get_inputs()}
        graph_outputs = {o.name: o for o in self.session.get_outputs()}
        expected_in = {"input_ids": "int64", "attention_mask": "int64", **{t.name: t.dtype for t in self.past}}
        expected_out = {"logits": "float32", **{present_name(t.name): t.dtype for t in self.past}}
        for kind, graph, expected in (("input", graph_inputs, expected_in), ("output", graph_outputs, expected_out)):
            extra = sorted(set(graph) - set(expected))
            if extra:
                raise RuntimeInputError(
                    f"graph {kind} {extra[0]} is not in the manifest (manifest does not match graph)")
            for name, dtype in expected.items():
                if name not in graph:
                    raise RuntimeInputError(f"manifest {kind} {name} is missing from the graph")
                if graph[name].type != _TYPES[dtype][0]:
                    raise RuntimeInputError(
                        f"graph {kind} {name}: manifest says {_TYPES[dtype][0]}, graph has {graph[name].type}")

    def check_cache(self, cache: CacheState, batch: int) -> None:
        """Every past tensor present, with the manifest's dtype, rank, fixed dims and batch size."""
        for spec in self.past:
            value = cache.get(spec.name)
            if value is None:
                raise RuntimeInputError(f"cache tensor {spec.name} is missing")
            actual_type = value.data_type()
            if actual_type != _TYPES[spec.dtype][0]:
                raise RuntimeInputError(
                    f"cache tensor {spec.name}: expected {_TYPES[spec.dtype][0]}, got {actual_type}")
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
        out = {}
        for spec in self.past:
            shape = [batch if d == "batch" else d if isinstance(d, int) else size if d == CAPACITY_AXIS else 0
                     for d in spec.shape]
            out[spec.name] = _ort_value(np.zeros(shape, dtype=_TYPES[spec.dtype][1]), spec.dtype)
        return out

    @property
    def max_capacity(self) -> int | None:
        """Largest ``buffer`` capacity the graph supports (its fused rotary table), None if unbounded."""
        if self.layout != "buffer":
            return None
        return int(self.manifest.model.get("max_position_embeddings") or 0) or None

    def _capacity(self, wanted: int) -> int:
        """``wanted`` if the graph supports it (capped at :attr:`max_capacity` for generous defaults)."""
        top = self.max_capacity
        if top is not None and wanted > top:
            raise RuntimeInputError(
                f"cache capacity {wanted} exceeds the {top} positions this ort-gqa export supports "
                "(its fused RoPE table has max_position_embeddings rows)")
        return wanted

    def _grow(self, cache: CacheState, need: int) -> CacheState:
        """Copy a ``buffer`` cache into buffers holding at least ``need`` tokens per row."""
        buffers = [spec for spec in self.past if spec.role == "buffer"]
        if not buffers:
            return cache
        old = cache[buffers[0].name].shape()[2]
        if need <= old:
            return cache
        top = self.max_capacity
        size = max(need, 2 * old) if top is None else max(min(2 * old, top), need)
        size = self._capacity(size)  # refuses a need beyond the graph's positions
        logger.info("growing the cache buffers from %d to %d tokens per row (one copy)", old, size)
        out = dict(cache)
        for spec in buffers:
            array = cache[spec.name].numpy()
            grown = np.zeros((*array.shape[:2], size, array.shape[3]), dtype=array.dtype)
            grown[:, :, :old] = array
            out[spec.name] = _ort_value(grown, spec.dtype)
        return out

    def cache_nbytes(self, cache: CacheState) -> int:
        """Bytes of the stored cache regions (the per-row ``seq_lengths`` bookkeeping excluded)."""
        total = 0
        for spec in self.past:
            if spec.role != "seq_lengths":
                total += int(np.prod(cache[spec.name].shape())) * _ELEMENT_BYTES[spec.dtype]
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
        input_ids = np.asarray(input_ids, dtype=np.int64)
        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise RuntimeInputError(f"input_ids: expected shape [batch, seq >= 1], got {list(input_ids.shape)}")
        mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
        if mask.shape != input_ids.shape:
            raise RuntimeInputError(f"attention_mask: expected shape {list(input_ids.shape)}, got {list(mask.shape)}")
        cache = self.empty_cache(input_ids.shape[0]) if cache is None else cache
        self.check_cache(cache, input_ids.shape[0])
        if self.layout == "buffer":
            return self._step_in_place(input_ids, mask, cache)
        feeds = {"input_ids": _ort_value(input_ids, "int64"), "attention_mask": _ort_value(mask, "int64"), **cache}
        outs = self.session.run_with_ort_values(self._outputs + list(self.extra_outputs), feeds)
        count = len(self._outputs)
        self.last_extra = {name: value.numpy() for name, value in zip(self.extra_outputs, outs[count:])}
        return outs[0].numpy(), {spec.name: value for spec, value in zip(self.past, outs[1:count])}

    def _step_in_place(self, input_ids: np.ndarray, mask: np.ndarray,
                       cache: CacheState) -> tuple[np.ndarray, CacheState]:
        """One step on a ``buffer`` cache: the same OrtValues are bound as past inputs and present outputs."""
        need = int(self.seq_lengths(cache).max(initial=0)) + input_ids.shape[1]
        cache = self._grow(cache, need)
        binding = self.session.io_binding()
        binding.bind_ortvalue_input("input_ids", _ort_value(input_ids, "int64"))
        binding.bind_ortvalue_input("attention_mask", _ort_value(mask, "int64"))
        binding.bind_output("logits")
        names = ["logits"]  # get_outputs() follows the binding order
        for spec in self.past:
            binding.bind_ortvalue_input(spec.name, cache[spec.name])
            if spec.role == "buffer":  # written in place: past and present are one buffer
                binding.bind_ortvalue_output(present_name(spec.name), cache[spec.name])
            else:
                binding.bind_output(present_name(spec.name))
            names.append(present_name(spec.name))
        extra = list(getattr(self, "extra_outputs", ()))
        for name in extra:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        values = dict(zip(names + extra, binding.get_outputs()))
        self.last_extra = {name: values[name].numpy() for name in extra}
        new = {spec.name: cache[spec.name] if spec.role == "buffer" else values[present_name(spec.name)]
               for spec in self.past}
        return values["logits"].numpy(), new

    # -- text ---------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The tokenizer saved in the export directory."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
            except (OSError, ValueError) as err:
                raise RuntimeInputError(f"{self.directory} has no usable tokenizer: {err}") from None
        return self._tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        *,
        stop_at_eos: bool = True,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[Generation]:
        """Prefill a left-padded batch, then decode until EOS or ``max_new_tokens``.

        ``prompts`` are strings (tokenized with the export's tokenizer) or token-id lists.
        ``on_token(row, token)`` is called for every generated token (for streaming).
        """
        if max_new_tokens < 0:
            raise RuntimeInputError(f"invalid max_new_tokens={max_new_tokens}: allowed: >= 0")
        texts = [p if isinstance(p, str) else None for p in prompts]
        token_lists = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
        if not token_lists or any(len(t) == 0 for t in token_lists):
            raise RuntimeInputError("every prompt needs at least one token")
        eos = self.manifest.tokenizer.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        results = [Generation(text, toks) for text, toks in zip(texts, token_lists)]
        sampler = Sampler(sampling or SamplingConfig())
        sampler.prime(token_lists)

        width = max(len(t) for t in token_lists)
        ids = np.zeros((len(token_lists), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, toks in enumerate(token_lists):
            ids[row, width - len(toks):] = toks
            mask[row, width - len(toks):] = 1
        capacity = self.capacity or (width + max_new_tokens if self.layout == "buffer" else None)
        if capacity is not None and self.max_capacity is not None:
            capacity = min(capacity, self.max_capacity)
        logits, cache = self.step(ids, mask, self.empty_cache(len(token_lists), capacity=capacity))
        active = np.ones(len(results), dtype=bool)
        for _ in range(max_new_tokens):
            nxt = sampler(logits[:, -1])
            for row in np.flatnonzero(active):
                token = int(nxt[row])
                results[row].tokens.append(token)
                if on_token is not None:
                    on_token(int(row), token)
                if stop_at_eos and token in eos_ids:
                    active[row] = False
                    results[row].finish_reason = "eos"
            if not active.any() or len(results[0].tokens) >= max_new_tokens and all(
                    len(r.tokens) >= max_new_tokens for r, a in zip(results, active) if a):
                break
            # finished rows feed padding: nothing is stored for them
            logits, cache = self.step(nxt[:, None], active[:, None].astype(np.int64), cache)
        nbytes = self.cache_nbytes(cache)
        for result in results:
            result.cache_bytes = nbytes
            if self._tokenizer is not None or result.prompt is not None:
                result.text = continuation_text(self.tokenizer, result.prompt_tokens, result.tokens)
        return results


def continuation_text(tokenizer, prompt_tokens: Sequence[int], tokens: Sequence[int]) -> str:
    """Text of ``tokens`` as it reads after the prompt (keeps the leading space tokenizers fold in)."""
    prompt = tokenizer.decode(list(prompt_tokens), skip_special_tokens=True)
    full = tokenizer.decode([*prompt_tokens, *tokens], skip_special_tokens=True)
    return full[len(prompt):] if full.startswith(prompt) else tokenizer.decode(list(tokens), skip_special_tokens=True)


def _show(shape, batch: int) -> list:
    return [batch if d == "batch" else d for d in shape]
