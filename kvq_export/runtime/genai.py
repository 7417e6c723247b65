"""Serve a kvq export with onnxruntime-genai: the files it reads, and a thin generation loop over it.

onnxruntime-genai (``og``) runs a decoder from a directory holding ``genai_config.json``, an ONNX graph and the
tokenizer files, with its own C++ generation loop. Each step it feeds ``input_ids``, an ``attention_mask`` of the
*whole* sequence so far (``[batch, total]``: a batched prompt right-padded, trailing ``pad_token_id`` masked, then
one column of ones per generated token) and the past cache, found through printf templates
(``past.%d.key.buffer``). With ``past_present_share_buffer`` it allocates one ``[batch, kv_heads, max_length, …]``
buffer per layer and stream up front, taking the element type and packed width from the graph input (int8, or
uint8 holding two 4-bit codes), and binds it as past input and present output, exactly the ``buffer`` layout's
contract (:mod:`kvq_export.naming`).

kvq's ``ort-gqa`` graph differs in one point: it carries each row's length as cache state (``past.seq_lengths``
in, ``present.seq_lengths`` out) and its mask covers only this call's tokens, and og can feed neither.
:func:`adapt_graph` therefore writes ``model.genai.onnx``: the same graph, referencing the same
``model.onnx.data`` (no weight is copied), behind a prologue that takes og's mask and derives both::

    call mask   = attention_mask[:, total - t:]          (t = input_ids' width)
    past length = sum(attention_mask) - sum(call mask)   (per row)

The GroupQueryAttention graph accepts rows padded on either side (kvq feeds left padding, og right padding), so
nothing else changes and ``kvq generate`` keeps running ``model.onnx`` of the same directory.

What og cannot hold: the reference and trt flavours' ``regions`` layout (sinks / quantized codes with dynamic
per-token or per-group scales and zero points / a high-precision recent window, each region sized per call).
An export of those writes no og files; its manifest's ``runtimes`` entry and one log line say why.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export._lazy import require
from kvq_export.cache_layout import BUFFER
from kvq_export.errors import ExportError, RuntimeInputError
from kvq_export.manifest import MODEL_NAME, Manifest
from kvq_export.naming import PARTS, tensor_name
from kvq_export.runtime.sampling import SamplingConfig
from kvq_export.runtime.session import Generation, default_threads

logger = logging.getLogger(__name__)

#: Key of the manifest's ``runtimes`` entry.
RUNTIME = "onnxruntime-genai"
GENAI_CONFIG = "genai_config.json"
GENAI_MODEL = "model.genai.onnx"
#: og model types whose decoder-only state is the plain one (input_ids, mask, cache); anything else is served
#: as ``llama``, which selects the same generic state (kvq's graph needs nothing model-specific from og).
GENAI_TYPES = ("llama", "mistral", "qwen2")
#: Names the prologue gives its values (unique in any kvq graph: they carry this prefix).
_PREFIX = "genai."


# -- what can be served ---------------------------------------------------------------------------------------
def unsupported_reason(manifest: Manifest) -> str | None:
    """Why og cannot serve this export (None when it can)."""
    if manifest.cache_layout.shares_buffers:
        return None
    why = (f"flavour {manifest.flavor} keeps the cache in the {manifest.cache_layout.name!r} layout (sinks / codes "
           "with per-call metadata / a high-precision window, each sized per call), but onnxruntime-genai allocates "
           "one [batch, kv_heads, max_length, head_dim] buffer per layer and stream")
    from kvq_export.export.gqa_flavor import unsupported

    reasons = unsupported(manifest.scheme, manifest.num_layers)
    if reasons:
        return f"{why}; and scheme {manifest.scheme.name or 'custom'} cannot be held by GroupQueryAttention: " + \
            "; ".join(reasons)
    return f"{why}: re-export with --flavor ort-gqa"


def _template(direction: str, part: str, num_layers: int) -> str:
    """The printf template og expands per layer, checked against the naming function for every layer."""
    template = BUFFER.buffer_name(direction, 0, part).replace(".0.", ".%d.", 1)
    if any(template % layer != BUFFER.buffer_name(direction, layer, part) for layer in range(num_layers)):
        raise ExportError(f"cache names of {direction} {part} do not follow one per-layer template")
    return template


def genai_config(manifest: Manifest, *, filename: str = GENAI_MODEL) -> dict[str, Any]:
    """``genai_config.json`` for a ``buffer``-layout export (greedy search defaults, one shared buffer)."""
    model, tokenizer = manifest.model, manifest.tokenizer
    layers = manifest.num_layers
    eos = tokenizer.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else [] if eos is None else [int(eos)]  # [] never stops
    pad = tokenizer.get("pad_token_id")
    pad = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    bos = tokenizer.get("bos_token_id")
    context = model.max_position_embeddings
    kind = model.model_type
    return {
        "model": {
            "type": kind if kind in GENAI_TYPES else "llama",
            "bos_token_id": int(bos) if bos is not None else pad,
            "eos_token_id": eos_ids,
            "pad_token_id": pad,
            "vocab_size": model.vocab_size,
            "context_length": context,
            "decoder": {
                "filename": filename,
                "session_options": {"log_id": "kvq", "provider_options": []},
                "head_size": model.head_dim,
                "hidden_size": model.hidden_size,
                "num_attention_heads": model.num_heads,
                "num_key_value_heads": model.num_kv_heads,
                "num_hidden_layers": layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": _template("past", "key", layers),
                    "past_value_names": _template("past", "value", layers),
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": _template("present", "key", layers),
                    "present_value_names": _template("present", "value", layers),
                },
            },
        },
        "search": {
            "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
            "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
            "early_stopping": True, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
            "past_present_share_buffer": True,
        },
    }


# -- the graph og runs ----------------------------------------------------------------------------------------
def adapt_graph(model_path: str | os.PathLike[str], out_path: str | os.PathLike[str]) -> Path:
    """Write og's variant of a ``buffer``-layout graph (see the module docstring) beside ``model_path``.

    The weights stay in ``model_path``'s external-data file: the new graph references it, so the two graphs share
    one copy. Raises :class:`ExportError` if the graph lacks the inputs/outputs the rewrite replaces.
    """
    import onnx_ir as ir

    model = ir.load(str(model_path))
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    seq_name = tensor_name("past", None, None, "seq_lengths")
    out_seq_name = tensor_name("present", None, None, "seq_lengths")
    missing = [name for name in ("input_ids", "attention_mask", seq_name) if name not in inputs]
    present_seq = [value for value in graph.outputs if value.name == out_seq_name]
    if missing or not present_seq:
        raise ExportError(f"{model_path}: not a kvq buffer-layout graph (missing {missing or [out_seq_name]})")
    call_mask_in, past_lengths_in = inputs["attention_mask"], inputs[seq_name]
    call_mask_in.name = _PREFIX + "unused_call_mask"  # frees the name for og's whole-sequence mask
    full = ir.Value(name="attention_mask", type=ir.TensorType(ir.DataType.INT64),
                    shape=ir.Shape(["batch", "total_sequence_length"]))

    nodes: list[ir.Node] = []

    def op(op_type: str, *args: ir.Value, name: str, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(args), attributes=attrs, outputs=[ir.Value(name=_PREFIX + name)],
                       name=_PREFIX + name)
        nodes.append(node)
        return node.outputs[0]

    def const(name: str, values: list[int]) -> ir.Value:
        return op("Constant", name=name, value=ir.tensor(np.array(values, dtype=np.int64), name=_PREFIX + name))

    axis1 = const("axis1", [1])
    t = op("Shape", inputs["input_ids"], name="new_tokens", start=1, end=2)
    call = op("Slice", full, op("Neg", t, name="minus_new_tokens"), const("end", [np.iinfo(np.int64).max]), axis1,
              name="call_mask")
    past_lengths = op("Sub", op("ReduceSum", full, axis1, name="held", keepdims=0),
                      op("ReduceSum", call, axis1, name="new", keepdims=0), name="past_lengths")
    call_mask_in.replace_all_uses_with(call)
    past_lengths_in.replace_all_uses_with(past_lengths)
    graph.inputs.remove(call_mask_in)
    graph.inputs.remove(past_lengths_in)
    graph.inputs.insert(1, full)
    for value in present_seq:
        graph.outputs.remove(value)
    graph.insert_before(next(iter(graph)), nodes)
    out = Path(out_path)
    ir.save(model, out)  # external tensors stay references into model.onnx.data
    logger.debug("wrote %s (%d prologue nodes)", out, len(nodes))
    return out


def write_genai_files(directory: str | os.PathLike[str], manifest: Manifest) -> dict[str, Any]:
    """Write ``genai_config.json`` and ``model.genai.onnx`` into an export directory, or explain why not.

    Returns the manifest's ``runtimes`` entry for og: ``{"supported": True, "config": .., "model": .., ..}`` or
    ``{"supported": False, "reason": ..}`` (also logged, once).
    """
    reason = unsupported_reason(manifest)
    if reason is not None:
        logger.info("onnxruntime-genai cannot serve this export: %s", reason)
        return {"supported": False, "reason": reason}
    directory = Path(directory)
    config = genai_config(manifest)
    adapt_graph(directory / MODEL_NAME, directory / GENAI_MODEL)
    (directory / GENAI_CONFIG).write_text(json.dumps(config, indent=2))
    entry: dict[str, Any] = {"supported": True, "config": GENAI_CONFIG, "model": GENAI_MODEL,
                             "past_present_share_buffer": True}
    if manifest.scheme.hp_dtype == "fp16" and not manifest.scheme.quantized:
        entry["note"] = ("unquantized fp16 buffer: ONNX Runtime's CPU GroupQueryAttention casts it whole to float32 "
                         "every step (fast on CUDA); an fp32 buffer is the copy-free CPU baseline")
    return entry


def serve_command(directory: str | os.PathLike[str], prompt: str, max_length: int = 256) -> str:
    """One shell line that generates from ``directory`` with onnxruntime-genai alone (no kvq import)."""
    code = (f"import onnxruntime_genai as og; m = og.Model({str(directory)!r}); t = og.Tokenizer(m); "
            f"p = og.GeneratorParams(m); p.set_search_options(max_length={int(max_length)}); "
            f"g = og.Generator(m, p); g.append_tokens(t.encode({prompt!r})); "
            "[g.generate_next_token() for _ in iter(g.is_done, True)]; print(t.decode(g.get_sequence(0)))")
    plain = not any(c in code for c in '"$`\\!')  # then double quotes keep it readable and exact
    return f'python -c "{code}"' if plain else f"python -c {shlex.quote(code)}"


# -- scales for the builder ------------------------------------------------------------------------------------------
#: The builder's ``qmax`` per bit width (a file's scale = threshold / qmax; it rescales by file qmax / its own).
BUILDER_QMAX = {8: 128.0, 4: 8.0}
GRANULARITIES = ("per_channel", "per_tensor")
SCALE_FORMATS = ("genai-scales", "npz")


def builder_scale_file(static, scheme, *, num_layers: int, kv_heads: int, head_dim: int,
                       granularity: str = "per_channel") -> dict[str, Any]:
    """The static scales kvq calibrated, in the builder's ``kv_cache_scale_file`` format.

    ``{"qmax": q, "scales": {"k_scales": [per layer], "v_scales": [per layer]}}``: per layer a flat
    ``kv_heads * head_dim`` list (head-major, GroupQueryAttention's ``[1, kv_heads, 1, head_dim]``) for
    ``per_channel``, one number (the largest channel's scale: nothing clips that did not clip before) for
    ``per_tensor``. ``qmax`` is the builder's own for the scheme's bit width, so a build with
    ``kv_cache_quant_scheme=int{bits}_{granularity}`` uses exactly kvq's scales (the ones ``kvq export --flavor
    ort-gqa`` writes into its graph); the builder rescales them for another bit width.
    """
    from kvq_export.export.gqa_flavor import gqa_scale, unsupported

    if granularity not in GRANULARITIES:
        raise ExportError(f"unknown granularity {granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    reasons = unsupported(scheme, num_layers)
    streams = scheme.streams(num_layers)
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
            _, array = gqa_scale(tq, np.asarray(meta["scales"]), kv_heads, head_dim)
            flat = np.broadcast_to(array.reshape(-1), (kv_heads * head_dim,)) if array.size == 1 else array.reshape(-1)
            values = [float(flat.max())] if granularity == "per_tensor" else [float(x) for x in flat]
            scales[key].append(values)
    return {"qmax": BUILDER_QMAX[width], "scales": scales,
            "kvq": {"scheme": scheme.name or "custom", "bits": width, "granularity": granularity,
                    "builder_option": f"kv_cache_quant_scheme=int{width}_{granularity}"}}


def calibrate_to_file(model_spec: str, scheme, out: str | os.PathLike[str], *, corpus: str = "britannica",
                      tokens: int = 4096, method: str = "absmax", percentile: float = 99.9, offset: int = 0,
                      file_format: str = "genai-scales", granularity: str = "per_channel") -> Path:
    """Calibrate ``scheme``'s static scales on ``model_spec`` and write them as ``file_format``.

    Windows follow ``kvq export --calib-corpus`` (``tokens`` tokens in windows of at most 1024), starting at
    token ``offset`` of the corpus (keep calibration text apart from evaluation text). ``genai-scales`` is the
    builder's scale file (:func:`builder_scale_file`), ``npz`` kvq's own calibration file.
    """
    from kvq_export._atomic import atomic_write
    from kvq_export.calibrate import calibrate_static_scales, save_calibration
    from kvq_export.corpus import load_corpus, token_windows
    from kvq_export.model_source import load_model, model_facts
    from kvq_export.presets import resolve_scheme

    if file_format not in SCALE_FORMATS:
        raise ExportError(f"unknown format {file_format!r}; allowed: {', '.join(SCALE_FORMATS)}")
    scheme = resolve_scheme(scheme)
    model, tokenizer = load_model(model_spec)
    if tokenizer is None:
        raise ExportError(f"{model_spec} has no tokenizer to read the calibration corpus with")
    window = min(1024, tokens)
    windows = token_windows(tokenizer, load_corpus(corpus), max(1, tokens // window), window, offset=offset)
    static = calibrate_static_scales(model, scheme, windows, method=method, percentile=percentile)
    out = Path(out)
    if file_format == "npz":
        return save_calibration(static, out)
    facts = model_facts(model.config)
    data = builder_scale_file(static, scheme, num_layers=facts.num_layers, kv_heads=facts.num_kv_heads,
                              head_dim=facts.head_dim, granularity=granularity)
    data["kvq"].update(corpus=str(corpus), tokens=sum(len(w) for w in windows), offset=offset, method=method,
                       **({"percentile": percentile} if method == "percentile" else {}))
    return atomic_write(out, json.dumps(data, indent=1))


# -- running it --------------------------------------------------------------------------------------------------
class GenaiSession:
    """An export directory on onnxruntime-genai (its C++ loop; kvq only prepares prompts and reads results).

    Args:
        directory: a ``kvq export --flavor ort-gqa`` directory (with ``genai_config.json``).
        threads: intra-op threads (default: ``OMP_NUM_THREADS`` when set, else onnxruntime-genai's choice;
            see :func:`~kvq_export.runtime.session.default_threads`).
        verify_weights: check the graphs and weights against the checksums in ``kvq.json`` (as
            :class:`~kvq_export.runtime.session.KVQSession` does).
    """

    def __init__(self, directory: str | os.PathLike[str], *, threads: int | None = None,
                 verify_weights: bool = True) -> None:
        from kvq_export.manifest import check_export_files
        from kvq_export.manifest import verify_weights as check_weights

        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        check_export_files(self.directory, self.manifest)  # an export is data: nothing it names leaves it
        if verify_weights:
            check_weights(self.directory, self.manifest)
        if not (self.directory / GENAI_CONFIG).is_file():
            entry = self.manifest.runtimes.get(RUNTIME) or {}
            reason = entry.get("reason") or unsupported_reason(self.manifest) or \
                "it was exported before kvq wrote onnxruntime-genai files: re-export it"
            raise RuntimeInputError(f"{self.directory} has no {GENAI_CONFIG}: {reason}")
        self.og = require("onnxruntime_genai")
        self.threads = threads or default_threads()
        self.model = self.og.Model(self._config())
        self.config = json.loads((self.directory / GENAI_CONFIG).read_text())
        self._tokenizer = None
        self._no_eos_model = None

    def _config(self, **model_overlay: Any):
        config = self.og.Config(str(self.directory))
        overlay: dict[str, Any] = {"model": dict(model_overlay)} if model_overlay else {}
        if self.threads:
            overlay.setdefault("model", {})["decoder"] = {"session_options": {"intra_op_num_threads": self.threads}}
        if overlay:
            config.overlay(json.dumps(overlay))
        return config

    @property
    def tokenizer(self):
        """onnxruntime-genai's tokenizer of the export (reads ``tokenizer.json``)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = self.og.Tokenizer(self.model)
            except RuntimeError as err:
                raise RuntimeInputError(f"onnxruntime-genai cannot read the tokenizer of {self.directory}: {err} "
                                        "(pass token ids instead)") from None
        return self._tokenizer

    @property
    def pad_token_id(self) -> int:
        """The id og right-pads a batched prompt with (a trailing one is read as padding)."""
        return int(self.config["model"]["pad_token_id"])

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a row."""
        return list(self.config["model"]["eos_token_id"])

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        *,
        stop_at_eos: bool = True,
    ) -> list[Generation]:
        """Generate like :meth:`KVQSession.generate`, in onnxruntime-genai's loop (one batch, right-padded).

        Greedy results equal ``kvq generate`` on the same export; sampled ones use og's own random generator.
        ``cache_bytes`` is what og's shared buffers hold (capacity = longest prompt + ``max_new_tokens``).
        """
        if max_new_tokens < 1:
            raise RuntimeInputError(f"invalid max_new_tokens={max_new_tokens}: onnxruntime-genai needs >= 1")
        sampling = sampling or SamplingConfig()
        texts = [p if isinstance(p, str) else None for p in prompts]
        token_lists = [list(self.tokenizer.encode(p)) if isinstance(p, str) else [int(t) for t in p]
                       for p in prompts]
        if not token_lists or any(len(t) == 0 for t in token_lists):
            raise RuntimeInputError("every prompt needs at least one token")
        pad = self.pad_token_id
        if len(token_lists) > 1 and any(t[-1] == pad for t in token_lists):
            raise RuntimeInputError(f"a batched prompt ends with pad_token_id {pad}, which onnxruntime-genai reads "
                                    "as padding: run that prompt alone")
        width = max(len(t) for t in token_lists)
        if not stop_at_eos and self._no_eos_model is None:  # og always stops at EOS: load a copy without one
            self._no_eos_model = self.og.Model(self._config(eos_token_id=[]))
        model = self.model if stop_at_eos else self._no_eos_model
        params = self.og.GeneratorParams(model)
        options: dict[str, Any] = {"max_length": width + max_new_tokens, "batch_size": len(token_lists),
                                   "do_sample": not sampling.greedy,
                                   "repetition_penalty": float(sampling.repetition_penalty)}
        if not sampling.greedy:
            options.update(temperature=float(sampling.temperature),
                           top_k=int(sampling.top_k or self.config["model"]["vocab_size"]),
                           top_p=float(sampling.top_p or 1.0))
            if sampling.seed is not None:
                options["random_seed"] = int(sampling.seed)
        params.set_search_options(**options)
        generator = self.og.Generator(model, params)
        ids = np.full((len(token_lists), width), pad, dtype=np.int32)
        for row, toks in enumerate(token_lists):
            ids[row, :len(toks)] = toks
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        nbytes = self.cache_nbytes(generator)
        eos = set(self.eos_token_ids) if stop_at_eos else set()
        results = []
        for row, (text, toks) in enumerate(zip(texts, token_lists)):
            generated = [int(t) for t in generator.get_sequence(row)[width:]]
            result = Generation(text, toks, cache_bytes=nbytes)
            for token in generated[:max_new_tokens]:
                result.tokens.append(token)
                if token in eos:
                    result.finish_reason = "eos"
                    break
            if text is not None:
                result.text = self._continuation(toks, result.tokens)
            results.append(result)
        return results

    def _continuation(self, prompt_tokens: list[int], tokens: list[int]) -> str:
        prompt = self.tokenizer.decode(np.asarray(prompt_tokens, dtype=np.int32))
        full = self.tokenizer.decode(np.asarray(prompt_tokens + tokens, dtype=np.int32))
        return full[len(prompt):] if full.startswith(prompt) else self.tokenizer.decode(
            np.asarray(tokens, dtype=np.int32))

    def cache_nbytes(self, generator) -> int:
        """Bytes of the cache buffers ``generator`` holds (every layer's key and value buffer)."""
        outputs = self.config["model"]["decoder"]["outputs"]
        total = 0
        for layer in range(self.manifest.num_layers):
            for part in PARTS:
                array = generator.get_output(outputs[f"present_{part}_names"] % layer)
                total += int(array.nbytes)
        return total
