"""onnxruntime-genai's view of a plan: whether it serves it, and the nearest plan it does serve."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvq_export.cache_layout import BUFFER
from kvq_export.errors import KVQError
from kvq_export.flavors.ort_gqa.capability import unsupported
from kvq_export.flavors.ort_gqa.genai import mixed_types_reason
from kvq_export.memory import predict
from kvq_export.model_facts import Geometry
from kvq_export.plan.allocation import RESOLUTION, Option, allocate, scheme_from_choice
from kvq_export.plan.candidates import CANDIDATE_SETS
from kvq_export.scheme import KVQuantScheme, TensorQuant

if TYPE_CHECKING:
    from kvq_export.model_facts import ModelFacts


def genai_view(scheme: KVQuantScheme, options: Sequence[Sequence[Option]], budget_bytes: int, facts: ModelFacts,
               context: int, *, about: str, resolution: int = RESOLUTION,
               ) -> tuple[dict[str, Any] | None, KVQuantScheme | None]:
    """Whether onnxruntime-genai serves a plan, and if not, the nearest plan it serves.

    og allocates one cache element type for every layer (:func:`kvq_export.flavors.ort_gqa.genai.mixed_types_reason`),
    so a plan mixing 8-bit and 4-bit layers is not served. The nearest plan is the least damage under the same
    budget with every layer's option of one element type: the plan ``kvq plan`` gives with only those candidates
    (``ort-gqa-int4`` / ``ort-gqa-int8`` for the ``ort-gqa`` set). Returns (the report's entry, that scheme);
    (None, None) when GroupQueryAttention cannot hold the plan at all.
    """
    layers, heads, dim = facts.num_layers, facts.num_kv_heads, facts.head_dim
    if unsupported(scheme, layers, dim):
        return None, None

    def buffers(s: KVQuantScheme, num_layers: int):
        return BUFFER.tensors(s, Geometry(num_layers, heads, dim))

    reason = mixed_types_reason(buffers(scheme, layers), layers)
    if reason is None:
        return {"servable": True}, None
    kind = {}  # option (key, value) -> its buffers' element types
    for row in options:
        for o in row:
            kind.setdefault((o.key, o.value), tuple(sorted({t.dtype for t in buffers(
                KVQuantScheme(key=o.key, value=o.value, sink_tokens=scheme.sink_tokens), 1)})))
    best: tuple[float, list[tuple[TensorQuant, TensorQuant]], tuple[str, ...]] | None = None
    for types in dict.fromkeys(kind.values()):
        rows = [[o for o in row if kind[(o.key, o.value)] == types] for row in options]
        try:
            chosen = allocate(rows, budget_bytes, resolution)
        except KVQError:  # no plan of this type fits the budget
            continue
        damage = sum(row[i].damage for row, i in zip(rows, chosen))
        if best is None or damage < best[0]:
            best = (damage, [(row[i].key, row[i].value) for row, i in zip(rows, chosen)], types)
    entry: dict[str, Any] = {"servable": False, "reason": reason, "nearest": None}
    if best is None:
        return entry, None
    damage, choice, types = best
    nearest = scheme_from_choice(choice, f"{scheme.name or 'plan'}-genai", scheme.sink_tokens)
    bits = {o.key.bits for o in options[0] if kind[(o.key, o.value)] == types}
    candidates = f"ort-gqa-int{min(bits)}" if about == CANDIDATE_SETS["ort-gqa"].about and len(bits) == 1 else \
        f"only its {'/'.join(types)} candidates"
    entry["nearest"] = {"scheme": nearest.to_dict(), "bits_per_element": predict(nearest, facts, context)
                        .bits_per_element, "predicted_damage": damage, "candidates": candidates}
    return entry, nearest

