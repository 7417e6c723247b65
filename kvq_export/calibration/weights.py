"""The model calibration runs for an export with int weight blocks: its weights as the export computes with them."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from kvq_export.errors import ExportError
from kvq_export.model_facts import ModelFacts
from kvq_export.vocab import WeightFormat
from kvq_export.weight_blocks import (
    BITS,
    W8A8_TABLE_BITS,
    W8A8_TABLE_BLOCK,
    dequantized_blocks,
    dequantized_channels,
)

logger = logging.getLogger(__name__)


def dequantized_model(model: Any, spec: Any) -> Any:
    """A copy of Hugging Face ``model`` whose weights are what an export with ``spec``'s weights computes with.

    ``spec`` (a :class:`~kvq_export.request.WeightSpec`) of an int format: every weight :func:`quantize_weights`
    quantizes -- each layer's q/k/v/o and MLP projections, the embedding and an untied lm_head (a tied one shares
    the embedding, as in the graph) -- is replaced by :func:`dequantized_blocks` of it (w8a8:
    :func:`dequantized_channels`, a scale per output row, but the embedding int8 blocks, as the graph stores it).
    Blocks run along each weight's input dimension, per output row, so a fused projection's slices are quantized
    alike whole or apart.
    Calibration and planning run this model, so the cache's static scales are measured on the keys and values the
    export computes (MatMulNBits' ``accuracy_level`` and w8a8 round activations at run time, which no weight copy
    holds).
    Other formats return ``model`` itself: fp16 storage rounds weights far below any cache format's step.

    A layer whose values are stored rotated has the rotation folded into ``v_proj`` / ``o_proj`` before the export
    quantizes them; this copy quantizes the unrotated weights (the same block error, other rounding).
    """
    if spec.format not in BITS and spec.format != WeightFormat.W8A8:
        return model
    import copy

    import torch

    from kvq_export.arch import get_arch

    arch = get_arch(model.config)
    facts = ModelFacts.from_config(model.config, arch)
    names = [arch.embed_name(), *([arch.lm_head_name()] if arch.lm_head_name() else [])]
    for layer in range(facts.num_layers):
        parts = arch.layer_names(layer)
        names += [linear.weight for linear in (parts.q, parts.k, parts.v, parts.o, parts.gate, parts.up, parts.down)]
    copied = copy.deepcopy(model)
    start = time.perf_counter()
    with torch.no_grad():
        for name in dict.fromkeys(names):  # a fused tensor (Phi3's qkv_proj) is named by each of its slices
            try:
                param = copied.get_parameter(name)
            except AttributeError:
                raise ExportError(f"{facts.model_type}: weight {name!r} is not a parameter of the model") from None
            weight = param.detach().to(device="cpu", dtype=torch.float32).numpy()  # [out, in]
            if spec.format == WeightFormat.W8A8 and name == arch.embed_name():  # the table: int8 blocks
                run = dequantized_blocks(weight.T, bits=W8A8_TABLE_BITS, block_size=W8A8_TABLE_BLOCK,
                                         symmetric=True).T
            elif spec.format == WeightFormat.W8A8:
                run = dequantized_channels(weight.T).T
            else:
                run = dequantized_blocks(weight.T, bits=BITS[spec.format], block_size=spec.block_size,
                                         symmetric=spec.symmetric).T
            param.copy_(torch.from_numpy(np.ascontiguousarray(run)).to(param.dtype))
    logger.info("dequantized %d weights of the model as %s (%s) in %.1f s", len(set(names)), spec.format,
                f"blocks of {spec.block_size}, {'symmetric' if spec.symmetric else 'asymmetric'}"
                if spec.format in BITS else "int8 per output channel", time.perf_counter() - start)
    return copied
