"""What ONNX Runtime's ``com.microsoft.GroupQueryAttention`` can hold: the ``ort-gqa`` flavour's limits, by layer.

Kept apart from the flavour's graph code (:mod:`kvq_export.flavors.ort_gqa.graph`) so that what only asks whether a
scheme fits (the onnxruntime-genai packaging, the planner, the builder's scale file) needs no graph builder.
"""

from __future__ import annotations

from kvq_export.naming import PARTS
from kvq_export.scheme import KVQuantScheme
from kvq_export.vocab import Format, Quantizer, Rotation, ScaleMode

#: ``kv_cache_bit_width`` values the node accepts.
GQA_BITS = (8, 4)
#: ONNX Runtime's GroupQueryAttention wants a head size that is a multiple of this (high channels widen the head)
GQA_HEAD_MULTIPLE = 8


def unsupported(scheme: KVQuantScheme, num_layers: int, head_dim: int | None = None) -> list[str]:
    """Why GroupQueryAttention cannot hold ``scheme``'s cache (empty when it can).

    One line per reason, naming the layers it applies to. ``head_dim``: also check the node's head size.
    """
    layers_by_reason: dict[str, list[int]] = {}

    def note(layer: int, text: str) -> None:
        layers_by_reason.setdefault(text, []).append(layer)

    for layer, (key, value) in enumerate(scheme.streams(num_layers)):
        for part, tq in zip(PARTS, (key, value)):
            if not tq.quantized:
                continue
            if tq.residual_length:
                note(layer, f"{part}: residual_length={tq.residual_length} (GQA keeps no high-precision window)")
            if tq.quantizer != Quantizer.KVQ:
                note(layer, f"{part}: quantizer {tq.quantizer} (ggml blocks need dynamic per-32 scales; GQA: static)")
            if tq.format not in (Format.INT_SYM, Format.INT):
                note(layer, f"{part}: format {tq.format} (GQA's cache holds int8/int4 codes only, int_sym or int; "
                     "fp8 is not implemented on CPU)")
            elif tq.bits not in GQA_BITS:
                note(layer, f"{part}: {tq.bits} bits (kv_cache_bit_width is 8 or 4)")
            if tq.scales != ScaleMode.STATIC:
                note(layer, f"{part}: dynamic scales (GQA takes fixed k_scale/v_scale: use static scales, "
                     "e.g. the ort-int8 / ort-int4 presets)")
        if key.quantized != value.quantized or (key.quantized and key.bits != value.bits):
            note(layer, "key and value: different cache types or bit widths, but one GQA node has one cache type "
                 "and one kv_cache_bit_width")
        elif key.quantized and key.high_channels != value.high_channels:
            note(layer, "key and value: different high_channels, but one GQA node has one head size (head_dim + n)")
        elif key.quantized and head_dim and (head_dim + key.high_channels) % GQA_HEAD_MULTIPLE:
            note(layer, f"high_channels={key.high_channels}: the node's head of head_dim + n = "
                 f"{head_dim + key.high_channels} channels is not a multiple of {GQA_HEAD_MULTIPLE} (ONNX Runtime "
                 f"needs one; allowed n: multiples of {GQA_HEAD_MULTIPLE} when head_dim is)")
    reasons = [f"{layer_span(layers, num_layers)} {text}" for text, layers in layers_by_reason.items()]
    if scheme.quantized and (scheme.residual_length or scheme.sink_tokens):
        reasons.append(f"residual_length={scheme.residual_length}, sink_tokens={scheme.sink_tokens}: GQA keeps no "
                       "high-precision window (both must be 0)")
    return reasons


def layer_span(layers: list[int], num_layers: int) -> str:
    """``every layer``, ``layer 3`` or ``layers 0-2, 5`` (ascending layer indices)."""
    if len(layers) == num_layers:
        return "every layer"
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"layer {text}" if len(layers) == 1 else f"layers {text}"


def rope_in_body(scheme: KVQuantScheme, num_layers: int) -> bool:
    """Whether RoPE must run in the body, before the node.

    True when some layer's keys are rotated or offset after RoPE, or its node's head is wider than the model's
    (high channels).
    """
    return any(key.rotation != Rotation.NONE or key.has_zero_point or key.high_channels
               for key, _ in scheme.streams(num_layers))
