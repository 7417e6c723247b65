"""Package a kvq export for onnxruntime-genai: ``genai_config.json`` and the entry graph ``model.genai.onnx``.

:func:`write_genai_files` writes both into a ``buffer``-layout (``ort-gqa``) export directory and returns the
manifest's ``runtimes`` entry for onnxruntime-genai (og): supported, with its files, or not, with the reason
(:func:`unsupported_reason`: the ``regions`` layout, or layers whose cache element types differ,
:func:`mixed_types_reason`). :func:`genai_config` names the cache through og's printf templates
(``past.%d.key.buffer``), checked against kvq's naming for every layer; the entry graph
(:func:`~kvq_export.flavors.ort_gqa.genai_graph.adapt_graph`) is the same graph and weights file behind a prologue
that derives each row's held length and this call's mask from the whole-sequence mask og feeds.
:func:`engine_reason` says whether ``og.Engine`` may batch an export's requests.

How og's two loops lay out the mask, what the prologue computes and what og cannot hold: docs/design/genai.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvq_export.cache_layout import BUFFER
from kvq_export.errors import ExportError
from kvq_export.flavors.ort_gqa.capability import layer_span, unsupported
from kvq_export.manifest import MODEL_NAME, Manifest
from kvq_export.manifest_sections import RuntimeSupport
from kvq_export.naming import CacheTensor
from kvq_export.vocab import Part

logger = logging.getLogger(__name__)

#: Key of the manifest's ``runtimes`` entry.
RUNTIME = "onnxruntime-genai"
GENAI_CONFIG = "genai_config.json"
GENAI_MODEL = "model.genai.onnx"
#: og model types whose decoder-only state is the plain one (input_ids, mask, cache); anything else is served
#: as ``llama``, which selects the same generic state (kvq's graph needs nothing model-specific from og).
GENAI_TYPES = ("llama", "mistral", "qwen2")
#: Names the prologue gives its values (unique in any kvq graph: they carry this prefix).


# -- what can be served ---------------------------------------------------------------------------------------
#: ``kvq plan`` candidate sets whose every plan og serves: one bit width, so one cache element type, for all layers.
SERVABLE_PLAN_SETS = ("ort-gqa-int4", "ort-gqa-int8")
#: What a buffer of each element type holds (GroupQueryAttention reads each kind of cache only in its own type).
_HOLDS = {"int8": "int8 (8-bit codes)", "uint8": "uint8 (two 4-bit codes per byte)"}


def mixed_types_reason(buffers: Iterable[CacheTensor], num_layers: int) -> str | None:
    """Why og cannot allocate these ``buffer``-layout cache tensors (None when it can).

    og 0.18 allocates every layer's buffers with one element type, its first cache input's, while
    GroupQueryAttention reads 8-bit codes only from int8 and 4-bit codes only from uint8 (and an unquantized cache
    from its float type): a scheme whose layers differ in bit width, or mix quantized and unquantized layers, has
    no type og can allocate. Head widths may differ per layer (og reads each layer's from the graph), so 4-bit
    layers with and without 8-bit high channels mix freely.
    """
    layers_by_type: dict[str, list[int]] = {}
    for spec in buffers:
        if spec.role == BUFFER.role and spec.layer not in layers_by_type.get(spec.dtype, []):
            layers_by_type.setdefault(spec.dtype, []).append(spec.layer)
    if len(layers_by_type) < 2:
        return None
    kinds = ", ".join(f"{layer_span(sorted(layers), num_layers)}: {_HOLDS.get(dtype, dtype)}"
                      for dtype, layers in sorted(layers_by_type.items(), key=lambda item: min(item[1])))
    return (f"onnxruntime-genai allocates every layer's cache buffer with one element type, but the layers' types "
            f"differ ({kinds}) and GroupQueryAttention reads each only in its own: plan one bit width for every "
            f"layer (kvq plan --candidates {' or '.join(SERVABLE_PLAN_SETS)}) or export a uniform preset (ort-int8, "
            "ort-int4)")


def unsupported_reason(manifest: Manifest) -> str | None:
    """Why og cannot serve this export (None when it can)."""
    if manifest.cache_layout.shares_buffers:
        return mixed_types_reason(manifest.cache("past"), manifest.num_layers)
    why = (f"flavor {manifest.flavor} keeps the cache in the {str(manifest.cache_layout.name)!r} layout (sinks / codes "
           "with per-call metadata / a high-precision window, each sized per call), but onnxruntime-genai allocates "
           "one [batch, kv_heads, max_length, head_dim] buffer per layer and stream")
    reasons = unsupported(manifest.scheme, manifest.num_layers)
    if reasons:
        return f"{why}; and scheme {manifest.scheme.name or 'custom'} cannot be held by GroupQueryAttention: " + \
            "; ".join(reasons)
    return f"{why}: re-export with --flavor ort-gqa"


def _template(direction: str, part: Part, num_layers: int) -> str:
    """The printf template og expands per layer, checked against the naming function for every layer."""
    template = BUFFER.buffer_name(direction, 0, part).replace(".0.", ".%d.", 1)
    if any(template % layer != BUFFER.buffer_name(direction, layer, part) for layer in range(num_layers)):
        raise ExportError(f"cache names of {direction} {part} do not follow one per-layer template")
    return template


def genai_config(manifest: Manifest, *, filename: str = GENAI_MODEL) -> dict[str, Any]:
    """``genai_config.json`` for a ``buffer``-layout export (greedy search defaults, one shared buffer)."""
    model, tokenizer = manifest.model, manifest.tokenizer
    layers = manifest.num_layers
    eos_ids = list(tokenizer.eos_ids)  # [] never stops
    pad = tokenizer.pad_token_id
    pad = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    bos = tokenizer.bos_token_id
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
                    "past_key_names": _template("past", Part.KEY, layers),
                    "past_value_names": _template("past", Part.VALUE, layers),
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": _template("present", Part.KEY, layers),
                    "present_value_names": _template("present", Part.VALUE, layers),
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
def engine_reason(manifest: Manifest) -> str | None:
    """Why ``og.Engine`` cannot batch this export's requests correctly (None when it can).

    An entry graph whose prologue reads only og.Generator's masks (exports without ``engine_batches`` in their
    ``runtimes`` entry) serves og.Generator and a lone Engine request, but gives a shorter row of an Engine batch
    wrong tokens: a server checks this before batching.
    """
    entry = manifest.runtimes.get(RUNTIME)
    if entry is None or not entry.supported:
        return (entry and entry.reason) or unsupported_reason(manifest) or \
            "it was exported before kvq wrote onnxruntime-genai files: re-export it"
    if not entry.engine_batches:
        return ("its model.genai.onnx reads only og.Generator's attention masks, so a shorter row of an og.Engine "
                "batch decodes wrong tokens: re-export it")
    return None


def write_genai_files(directory: str | os.PathLike[str], manifest: Manifest) -> RuntimeSupport:
    """Write ``genai_config.json`` and ``model.genai.onnx`` into an export directory, or explain why not.

    Returns the manifest's ``runtimes`` entry for og: ``{"supported": True, "config": .., "model": .., ..}`` or
    ``{"supported": False, "reason": ..}`` (also logged, once).
    """
    reason = unsupported_reason(manifest)
    if reason is not None:
        logger.info("onnxruntime-genai cannot serve this export: %s", reason)
        return RuntimeSupport(supported=False, reason=reason)
    directory = Path(directory)
    config = genai_config(manifest)
    from kvq_export.flavors.ort_gqa.genai_graph import adapt_graph  # lazy: imports onnx_ir

    adapt_graph(directory / MODEL_NAME, directory / GENAI_MODEL)
    (directory / GENAI_CONFIG).write_text(json.dumps(config, indent=2))
    note = None
    if manifest.scheme.hp_dtype == "fp16" and not manifest.scheme.quantized:
        note = ("unquantized fp16 buffer: ONNX Runtime's CPU GroupQueryAttention casts it whole to float32 every "
                "step (fast on CUDA); an fp32 buffer is the copy-free CPU baseline")
    return RuntimeSupport(supported=True, config=GENAI_CONFIG, model=GENAI_MODEL, past_present_share_buffer=True,
                          engine_batches=True, note=note)
