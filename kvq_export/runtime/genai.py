"""Run a kvq export on onnxruntime-genai (``og``): a thin generation loop over its C++ one, and scales for its builder.

The files og reads (``genai_config.json``, the entry graph ``model.genai.onnx``) are written at export by
:mod:`kvq_export.flavors.ort_gqa.genai`, which also says what og can serve and how it feeds the graph.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvq_export._atomic import atomic_write
from kvq_export._lazy import require
from kvq_export._read import TOKENIZER_FILES, TOKENIZER_LIMIT, check_sizes, read_json
from kvq_export.calibration import calibrate_static_scales, calibration_windows
from kvq_export.calibration.artifact import describe_weights
from kvq_export.errors import ExportError, RuntimeInputError
from kvq_export.flavors.ort_gqa.capability import unsupported
from kvq_export.flavors.ort_gqa.genai import GENAI_CONFIG, GENAI_MODEL, RUNTIME, genai_config, unsupported_reason
from kvq_export.graph_facts import check_graph_facts
from kvq_export.manifest import (
    Manifest,
    check_same_export,
    export_identity,
    load_static,
    resolve_inside,
)
from kvq_export.manifest import verify_weights as check_weights
from kvq_export.model_facts import CacheGeometry
from kvq_export.model_source import load_model, model_facts
from kvq_export.naming import PARTS
from kvq_export.presets import resolve_scheme
from kvq_export.request import CalibrationMethod, WeightSpec
from kvq_export.runtime.base import Generation, PromptBatch, Rows, TokenCallback, check_prompts
from kvq_export.runtime.device import genai_providers, set_genai_providers
from kvq_export.runtime.ort_setup import default_threads
from kvq_export.runtime.sampling import SamplingConfig

logger = logging.getLogger(__name__)


def serve_command(directory: str | os.PathLike[str], prompt: str, max_length: int = 256) -> str:
    """One shell line that generates from ``directory`` with onnxruntime-genai alone (no kvq import)."""
    code = (f"import onnxruntime_genai as og; m = og.Model({str(directory)!r}); t = og.Tokenizer(m); "
            f"p = og.GeneratorParams(m); p.set_search_options(max_length={int(max_length)}); "
            f"g = og.Generator(m, p); g.append_tokens(t.encode({prompt!r})); "
            "[g.generate_next_token() for _ in iter(g.is_done, True)]; print(t.decode(g.get_sequence(0)))")
    plain = not any(c in code for c in '"$`\\!')  # then double quotes keep it readable and exact
    return f'python -c "{code}"' if plain else f"python -c {shlex.quote(code)}"


#: The tokenizer.json models onnxruntime-genai's tokenizer reads. It fails on the others (WordLevel and WordPiece
#: parsed as BPE merges, Unigram on its vocabulary's form), and that failure has taken the whole process down.
GENAI_TOKENIZER_MODELS = ("BPE",)


def _tokenizer_model_type(directory: Path) -> str | None:
    """``model.type`` of an export's tokenizer.json; None without such a file or field (og says what it misses)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = read_json(path, "tokenizer file", limit=TOKENIZER_LIMIT, error=RuntimeInputError)
    except RuntimeInputError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    kind = model.get("type") if isinstance(model, dict) else None
    return kind if isinstance(kind, str) else None


# -- scales for the builder ------------------------------------------------------------------------------------------
#: The builder's ``qmax`` per bit width (a file's scale = threshold / qmax; it rescales by file qmax / its own).
BUILDER_QMAX = {8: 128.0, 4: 8.0}
GRANULARITIES = ("per_channel", "per_tensor")
SCALE_FORMATS = ("genai-scales", "npz")


def builder_scale_file(static, scheme, geometry: CacheGeometry, *,
                       granularity: str = "per_channel") -> dict[str, Any]:
    """The static scales kvq calibrated, for the model of ``geometry``, in the builder's ``kv_cache_scale_file`` format.

    ``{"qmax": q, "scales": {"k_scales": [per layer], "v_scales": [per layer]}}``: per layer a flat
    ``kv_heads * head_dim`` list (head-major, GroupQueryAttention's ``[1, kv_heads, 1, head_dim]``) for
    ``per_channel``, one number (the largest channel's scale: nothing clips that did not clip before) for
    ``per_tensor``. ``qmax`` is the builder's own for the scheme's bit width, so a build with
    ``kv_cache_quant_scheme=int{bits}_{granularity}`` uses exactly kvq's scales (the ones ``kvq export --flavor
    ort-gqa`` writes into its graph); the builder rescales them for another bit width.
    """
    from kvq_export.flavors.ort_gqa.plan import gqa_scale  # lazy: imports torch and onnx

    if granularity not in GRANULARITIES:
        raise ExportError(f"unknown granularity {granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    kv_heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    reasons = unsupported(scheme, geometry.num_layers)
    streams = scheme.streams(geometry.num_layers)
    if reasons or not scheme.quantized or any(not k.quantized or not v.quantized for k, v in streams):
        why = "; ".join(reasons) or "some layer keeps an unquantized cache"
        raise ExportError(f"scheme {scheme.name or 'custom'} has no builder kv_cache_quant_scheme: {why} (use a "
                          "static symmetric int8/int4 scheme such as ort-int8 or ort-int4)")
    zero_points = sorted({part for pair in streams for part, tq in zip(PARTS, pair) if tq.has_zero_point})
    if zero_points:  # kvq's graph offsets such streams; the builder's node would read them as symmetric
        raise ExportError(f"scheme {scheme.name or 'custom'} has no builder kv_cache_quant_scheme: its "
                          f"{' and '.join(zero_points)} streams have zero points, the builder's cache is symmetric "
                          "(use a static symmetric int8/int4 scheme such as ort-int8 or ort-int4)")
    if any(tq.high_channels for pair in streams for tq in pair):  # kvq's graph widens such heads
        raise ExportError(f"scheme {scheme.name or 'custom'} has no builder kv_cache_quant_scheme: it keeps "
                          "8-bit high channels, the builder's cache has one bit width per channel (use a static "
                          "symmetric int8/int4 scheme such as ort-int8 or ort-int4)")
    bits = {tq.bits for pair in streams for tq in pair}
    if len(bits) != 1:
        raise ExportError(f"scheme {scheme.name or 'custom'} mixes {sorted(bits)} bits; the builder takes one width")
    width = bits.pop()
    scales: dict[str, list] = {"k_scales": [], "v_scales": []}
    for layer, pair in enumerate(streams):
        for part, tq, key in zip(PARTS, pair, ("k_scales", "v_scales")):
            meta = (static or {}).get(layer, {}).get(part)
            if meta is None or "scales" not in meta:
                raise ExportError(f"no calibrated scales for layer {layer} {part}")
            _, array = gqa_scale(tq, np.asarray(meta["scales"]), geometry)
            flat = np.broadcast_to(array.reshape(-1), (kv_heads * head_dim,)) if array.size == 1 else array.reshape(-1)
            values = [float(flat.max())] if granularity == "per_tensor" else [float(x) for x in flat]
            scales[key].append(values)
    return {"qmax": BUILDER_QMAX[width], "scales": scales,
            "kvq": {"scheme": scheme.name or "custom", "bits": width, "granularity": granularity,
                    "builder_option": f"kv_cache_quant_scheme=int{width}_{granularity}"}}


def calibrate_to_file(model_spec: str, scheme, out: str | os.PathLike[str], *, corpus: str = "britannica",
                      tokens: int = 4096, method: str = "absmax", percentile: float = 99.9, offset: int = 0,
                      file_format: str = "genai-scales", granularity: str = "per_channel",
                      weights: WeightSpec | None = None) -> Path:
    """Calibrate ``scheme``'s static scales on ``model_spec`` and write them as ``file_format``.

    Windows follow ``kvq export --calib-corpus`` (``tokens`` tokens in windows of at most 1024), starting at
    token ``offset`` of the corpus (keep calibration text apart from evaluation text). ``genai-scales`` is the
    builder's scale file (:func:`builder_scale_file`), ``npz`` kvq's own calibration file. ``weights`` int4 / int8:
    measured on the model with the weights such an export computes with (ONNX Runtime's blocks dequantized, the
    builder's ``-p int4`` MatMuls come from the same quantizer); both files record which weights
    (:attr:`~kvq_export.calibration.Calibration.weights`; the scale file's ``kvq.weights`` / ``kvq.measured_on``).
    """
    if file_format not in SCALE_FORMATS:
        raise ExportError(f"unknown format {file_format!r}; allowed: {', '.join(SCALE_FORMATS)}")
    scheme = resolve_scheme(scheme)
    model, tokenizer = load_model(model_spec)
    if tokenizer is None:
        raise ExportError(f"{model_spec} has no tokenizer to read the calibration corpus with")
    windows = calibration_windows(tokenizer, corpus, tokens, offset=offset)
    static = calibrate_static_scales(model, scheme, windows, method=method, percentile=percentile, weights=weights)
    out = Path(out)
    if file_format == "npz":
        return static.save(out)
    data = builder_scale_file(static, scheme, model_facts(model.config), granularity=granularity)
    data["kvq"].update(corpus=str(corpus), tokens=sum(len(w) for w in windows), offset=offset, method=method,
                       **({"percentile": percentile} if method == CalibrationMethod.PERCENTILE else {}),
                       weights=None if static.weights is None else dict(static.weights),
                       measured_on=describe_weights(static.weights))
    return atomic_write(out, json.dumps(data, indent=1))


# -- running it --------------------------------------------------------------------------------------------------
def _written_config(directory: Path, manifest: Manifest) -> dict[str, Any]:
    """The export's ``genai_config.json``, refused unless it is exactly what kvq writes for its manifest.

    og reads the decoder graph, head counts and context length from this file: one pointing at another graph
    (a subfolder holding another model) or stating other facts would run something else than the manifest says.
    """
    written = read_json(directory / GENAI_CONFIG, GENAI_CONFIG, error=RuntimeInputError)  # bounded read
    expected = genai_config(manifest)
    if written != expected:
        where = _first_difference(written, expected)
        raise RuntimeInputError(f"{directory}: {GENAI_CONFIG} is not the one kvq wrote for this export ({where} "
                                "differs); export again")
    return written


def _first_difference(got: Any, want: Any, where: str = "") -> str:
    """The dotted path of the first value that differs between two JSON values."""
    if isinstance(got, dict) and isinstance(want, dict):
        for key in sorted(set(got) | set(want)):
            if got.get(key) != want.get(key):
                return _first_difference(got.get(key), want.get(key), f"{where}.{key}" if where else key)
    return where or "the whole file"


class GenaiSession:
    """An export directory on onnxruntime-genai (its C++ loop; kvq only prepares prompts and reads results).

    Args:
        directory: a ``kvq export --flavor ort-gqa`` directory (with ``genai_config.json``).
        threads: intra-op threads (default: ``OMP_NUM_THREADS`` when set, else onnxruntime-genai's choice;
            see :func:`~kvq_export.runtime.ort_setup.default_threads`).
        verify_weights: check the graphs and weights against the checksums in ``kvq.json`` (as
            :class:`~kvq_export.runtime.session.KVQSession` does).
        providers: ONNX Runtime providers (:func:`~kvq_export.runtime.device.providers_for`); None: the ones
            ``genai_config.json`` names (CPU as kvq writes it).
    """

    runtime: ClassVar[str] = "genai"
    holds_last_token: ClassVar[bool] = True  # og's sequence (and max_length) counts the last sampled token

    def __init__(self, directory: str | os.PathLike[str], *, threads: int | None = None,
                 verify_weights: bool = True, providers: Sequence[str] | None = None) -> None:
        self.directory = Path(directory)
        opened = export_identity(self.directory) if self.directory.is_dir() else None
        self.manifest = Manifest.load(self.directory)  # checks that nothing the export names leaves it
        if verify_weights:
            check_weights(self.directory, self.manifest)
        if not (self.directory / GENAI_CONFIG).is_file():
            entry = self.manifest.runtimes.get(RUNTIME)
            reason = (entry and entry.reason) or unsupported_reason(self.manifest) or \
                "it was exported before kvq wrote onnxruntime-genai files: re-export it"
            raise RuntimeInputError(f"{self.directory} has no {GENAI_CONFIG}: {reason}")
        # the graph og runs is the source of truth: the manifest (and calibration file) must describe it
        static = load_static(self.directory, self.manifest)
        graph = resolve_inside(self.directory, GENAI_MODEL)
        check_graph_facts(self.directory, self.manifest, graph, static)
        self.og = require("onnxruntime_genai")
        self.threads = threads or default_threads()
        self.providers = None if providers is None else list(providers)
        genai_providers(self.providers)  # one the C++ runtime cannot take is refused before any load
        # onnxruntime-genai reads these whole: a sparse or endless one is refused first
        check_sizes(self.directory, TOKENIZER_FILES, "tokenizer file", limit=TOKENIZER_LIMIT, error=RuntimeInputError)
        self.config = _written_config(self.directory, self.manifest)
        with self._og_call("load"):
            self.model = self.og.Model(self._config())
        self._tokenizer, self._tokenizer_error = self._load_tokenizer()
        self._no_eos_model = None
        self._opened = opened
        check_same_export(self.directory, opened, "while this session opened it")

    @contextmanager
    def _og_call(self, what: str) -> Iterator[None]:
        """Turn og's own refusals (a config or graph it cannot run) into one-line :class:`RuntimeInputError`."""
        try:
            yield
        except RuntimeError as err:  # og raises its C++ exceptions as RuntimeError
            detail = " ".join(str(err).split())
            raise RuntimeInputError(f"onnxruntime-genai cannot {what} {self.directory}: {detail}") from None

    def _config(self, **model_overlay: Any):
        config = self.og.Config(str(self.directory))
        set_genai_providers(config, self.providers)
        overlay: dict[str, Any] = {"model": dict(model_overlay)} if model_overlay else {}
        if self.threads:
            overlay.setdefault("model", {})["decoder"] = {"session_options": {"intra_op_num_threads": self.threads}}
        if overlay:
            config.overlay(json.dumps(overlay))
        return config

    @property
    def tokenizer(self):
        """onnxruntime-genai's tokenizer of the export (read from ``tokenizer.json`` when the session opened)."""
        if self._tokenizer is None:
            raise RuntimeInputError(self._tokenizer_error)
        return self._tokenizer

    def _load_tokenizer(self):
        """(tokenizer, None), or (None, why og cannot read it): the error is raised when text is used."""
        kind = _tokenizer_model_type(self.directory)
        if kind is not None and kind not in GENAI_TOKENIZER_MODELS:  # og fails on these, and has crashed doing so
            return None, (f"onnxruntime-genai cannot read the tokenizer of {self.directory}: its tokenizer.json model "
                          f"is {kind}; onnxruntime-genai reads {', '.join(GENAI_TOKENIZER_MODELS)} (pass token ids "
                          "instead)")
        try:
            return self.og.Tokenizer(self.model), None
        except RuntimeError as err:
            return None, (f"onnxruntime-genai cannot read the tokenizer of {self.directory}: {err} (pass token ids "
                          "instead)")

    @property
    def pad_token_id(self) -> int:
        """The id og right-pads a batched prompt with (a trailing one is read as padding)."""
        return int(self.config["model"]["pad_token_id"])

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a row."""
        return list(self.config["model"]["eos_token_id"])

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids, as onnxruntime-genai's tokenizer reads it."""
        return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids, as onnxruntime-genai's tokenizer writes it."""
        return self.tokenizer.decode(np.asarray(tokens, dtype=np.int32))

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        *,
        stop_at_eos: bool = True,
        on_token: TokenCallback | None = None,
    ) -> list[Generation]:
        """Generate like :meth:`KVQSession.generate`, in onnxruntime-genai's loop (one batch, right-padded).

        Greedy results equal ``kvq generate`` on the same export; sampled ones use og's own random generator.
        ``cache_bytes`` is what og's shared buffers hold (capacity = longest prompt + ``max_new_tokens``).
        """
        batch = check_prompts(prompts, max_new_tokens, encode=self.encode, manifest=self.manifest,
                              holds_last_token=self.holds_last_token)
        pad = self.pad_token_id
        if len(batch) > 1 and any(t[-1] == pad for t in batch.tokens):
            raise RuntimeInputError(f"a batched prompt ends with pad_token_id {pad}, which onnxruntime-genai reads "
                                    "as padding: run that prompt alone")
        generator = self._prefill(batch, max_new_tokens, sampling or SamplingConfig(), stop_at_eos=stop_at_eos)
        rows = Rows(batch, self.eos_token_ids if stop_at_eos else (), on_token)
        for _ in range(max_new_tokens):
            with self._og_call("run"):
                if generator.is_done():  # every row ended with EOS
                    break
                generator.generate_next_token()
                tokens = generator.get_next_tokens()  # [B]
            rows.add(tokens)
        return rows.finish(self.cache_nbytes(generator), self.decode if self._tokenizer is not None else None)

    def _prefill(self, batch: PromptBatch, max_new_tokens: int, sampling: SamplingConfig, *, stop_at_eos: bool):
        """An og generator holding the right-padded prompts, its buffers sized for ``max_new_tokens`` more."""
        if not stop_at_eos and self._no_eos_model is None:  # og always stops at EOS: load a copy without one
            # read now from the directory: only while it still holds the export this session opened
            check_same_export(self.directory, self._opened, "since this session opened it")
            with self._og_call("load"):
                self._no_eos_model = self.og.Model(self._config(eos_token_id=[]))
            check_same_export(self.directory, self._opened, "since this session opened it")
        model = self.model if stop_at_eos else self._no_eos_model
        options: dict[str, Any] = {"max_length": batch.width + max_new_tokens, "batch_size": len(batch),
                                   "do_sample": not sampling.greedy,
                                   "repetition_penalty": float(sampling.repetition_penalty)}
        if not sampling.greedy:
            options.update(temperature=float(sampling.temperature),
                           top_k=int(sampling.top_k or self.config["model"]["vocab_size"]),
                           top_p=float(sampling.top_p or 1.0))
            if sampling.seed is not None:
                options["random_seed"] = int(sampling.seed)
        ids, _ = batch.padded(left=False, pad=self.pad_token_id)  # og reads trailing pad ids as padding
        with self._og_call("run"):
            params = self.og.GeneratorParams(model)
            params.set_search_options(**options)
            generator = self.og.Generator(model, params)
            generator.append_tokens(ids.astype(np.int32))
        return generator

    def cache_nbytes(self, generator) -> int:
        """Bytes of the cache buffers ``generator`` holds (every layer's key and value buffer)."""
        outputs = self.config["model"]["decoder"]["outputs"]
        total = 0
        for layer in range(self.manifest.num_layers):
            for part in PARTS:
                array = generator.get_output(outputs[f"present_{part}_names"] % layer)
                total += int(array.nbytes)
        return total
