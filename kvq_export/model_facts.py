"""The model facts: the architecture numbers every part of kvq reads about one model.

One frozen object is derived once from a Hugging Face config through its registered architecture
(:meth:`ModelFacts.from_config`) and recorded as the ``model`` section of ``kvq.json`` (:meth:`ModelFacts.to_dict`,
:meth:`ModelFacts.from_dict`). The exporter, the manifest, the runtimes, the validator, calibration, the planner,
the benchmark and the TensorRT code read its attributes, so a fact has one spelling and one type everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from kvq_export.errors import KVQError, RuntimeInputError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

class CacheGeometry(Protocol):
    """The three facts that size a KV cache: all that cache-only code reads of a model.

    The memory model, a cache graph, a scheme's and a calibration's checks and a builder scale file take one.
    :class:`ModelFacts` has them; :class:`Geometry` is a plain one for quick calculations.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Geometry:
    """A plain :class:`CacheGeometry` (for tests and quick calculations)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


#: Upper bounds of the integer facts: a mistyped huge value must not make a loader build millions of names.
INT_FACTS = {"num_layers": 4096, "num_heads": 4096, "num_kv_heads": 4096, "head_dim": 65536,
             "hidden_size": 2**40, "vocab_size": 2**40, "max_position_embeddings": 2**40}
_KIND_LABELS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", dict: "an object",
                list: "a list"}


def refuse_unknown(data: Mapping[str, Any], allowed: Iterable[str], where: str,
                   error: type[KVQError] = RuntimeInputError) -> None:
    """A key kvq does not read is refused, naming it: an edited or newer file is never half-understood.

    ``where`` prefixes the names (``"model."``; empty at a file's top level); ``error`` is the family member the
    reader raises (kvq.json's :class:`RuntimeInputError`, a request's own), with one wording for every reader.
    """
    allowed = list(allowed)
    unknown = sorted(map(str, set(data) - set(allowed)))
    if unknown:
        raise error(f"unknown field(s) {', '.join(where + k for k in unknown)}; allowed: {', '.join(allowed)}")


def known_fields(data: Any, cls: type, where: str, error: type[KVQError] = RuntimeInputError) -> Mapping[str, Any]:
    """``data`` checked to be an object whose keys all name fields of the dataclass ``cls`` (:func:`refuse_unknown`)."""
    if not isinstance(data, Mapping):
        name = where.rstrip(".")
        raise error(f"{f'field {name!r}' if name else 'the data'} must be an object, got {type(data).__name__}")
    refuse_unknown(data, (f.name for f in fields(cls)), where, error)
    return data


def json_field(data: Mapping[str, Any], name: str, kind: type, *, optional: bool = False, where: str = "") -> Any:
    """``data[name]`` if it has type ``kind``, else a one-line :class:`RuntimeInputError` naming the field.

    A bool is neither an int nor a number; a ``float`` field also takes an integer (returned as float).
    A missing (or null) optional field is None.
    """
    if name not in data or (optional and data[name] is None):
        if optional:
            return None
        raise RuntimeInputError(f"missing the field {where + name!r}")
    value = data[name]
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise RuntimeInputError(f"field {where + name!r} must be {_KIND_LABELS.get(kind, kind.__name__)}, "
                                f"got {type(value).__name__}")
    return float(value) if kind is float else value


@dataclass(frozen=True)
class RopeFacts:
    """The RoPE of the global (full-attention) layers, as transformers describes it.

    ``parameters`` holds the config's JSON-serialisable ``rope_parameters`` (per layer type where the
    family has several, Gemma3), so a reader can rebuild the frequencies without the config.
    """

    rope_type: str
    attention_scaling: float
    parameters: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the ``model.rope`` object of ``kvq.json``)."""
        return {"type": self.rope_type, "attention_scaling": self.attention_scaling, "parameters": self.parameters}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "model.rope.") -> RopeFacts:
        """Parse ``model.rope``; a missing or wrongly typed entry is a :class:`RuntimeInputError` naming it."""
        refuse_unknown(data, ("type", "attention_scaling", "parameters"), where)
        scaling = json_field(data, "attention_scaling", float, where=where)
        if not math.isfinite(scaling) or scaling <= 0:
            raise RuntimeInputError(f"field {where + 'attention_scaling'!r} is {scaling}; allowed: a finite number > 0")
        return cls(rope_type=json_field(data, "type", str, where=where), attention_scaling=scaling,
                   parameters=dict(json_field(data, "parameters", dict, where=where)))


@dataclass(frozen=True)
class ModelFacts:
    """The numbers kvq knows about one model; the ``model`` section of ``kvq.json`` (same keys)."""

    model_type: str
    num_layers: int
    num_heads: int  # query heads per layer
    num_kv_heads: int  # key/value heads per layer (fewer than query heads under GQA)
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    scaling: float  # factor on q.k before the softmax
    sliding_windows: tuple[int | None, ...]  # per layer: the sliding window, or None (full attention)
    rope: RopeFacts
    source: str | None = None  # the model spec the export was made from (None: an in-memory model)

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer``: a query at position q sees keys at p with q - window < p <= q (None: all)."""
        return self.sliding_windows[layer]

    @property
    def rope_theta(self) -> float | None:
        """The RoPE base of the global layers, or None when the parameters record none."""
        params = self.rope.parameters
        if isinstance(params.get("full_attention"), dict):  # per-layer-type RoPE (Gemma3): the global layers'
            params = params["full_attention"]
        theta = params.get("rope_theta")
        return float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else None

    # -- derivation ------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: PretrainedConfig, arch: Any, *, source: str | None = None) -> ModelFacts:
        """The facts of ``config`` as ``arch``, its registered architecture reader (an ``Arch``), reads them.

        The caller picks the reader (``kvq_export.arch.get_arch(config)``, or
        :func:`kvq_export.model_source.model_facts` which does both), so the facts sit below the exporter.
        """
        rope = arch.rope()
        parameters = {k: v for k, v in arch.rope_parameters().items()
                      if isinstance(v, (int, float, str, bool, type(None), list, dict))}
        return cls(
            model_type=arch.model_type, num_layers=arch.num_layers, num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, hidden_size=arch.hidden_size,
            vocab_size=arch.vocab_size, max_position_embeddings=arch.max_positions,
            tie_word_embeddings=arch.tie_word_embeddings, scaling=float(arch.scaling),
            sliding_windows=tuple(arch.layer_window(i) for i in range(arch.num_layers)),
            rope=RopeFacts(rope.rope_type, float(rope.attention_scaling), parameters), source=source,
        )

    # -- (de)serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON form (the ``model`` section of ``kvq.json``)."""
        return {
            "model_type": self.model_type, "num_layers": self.num_layers, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "scaling": self.scaling,
            "sliding_windows": list(self.sliding_windows), "rope": self.rope.to_dict(), "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "model.") -> ModelFacts:
        """Parse and check a ``model`` section: every field present with its type and within its bounds.

        Anything malformed is one :class:`RuntimeInputError` line naming the field and what it allows.
        """
        known_fields(data, cls, where)
        ints = {}
        for name, top in INT_FACTS.items():
            value = json_field(data, name, int, where=where)
            if not 1 <= value <= top:
                raise RuntimeInputError(f"field {where + name!r} is {value}; allowed: 1 .. {top}")
            ints[name] = value
        if ints["num_heads"] % ints["num_kv_heads"]:
            raise RuntimeInputError(f"field {where + 'num_heads'!r} is {ints['num_heads']}; allowed: a multiple "
                                    f"of {where + 'num_kv_heads'} ({ints['num_kv_heads']})")
        scaling = json_field(data, "scaling", float, where=where)
        if not math.isfinite(scaling) or scaling <= 0:
            raise RuntimeInputError(f"field {where + 'scaling'!r} is {scaling}; allowed: a finite number > 0")
        windows = json_field(data, "sliding_windows", list, where=where)
        if len(windows) != ints["num_layers"] or not all(
                w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 1) for w in windows):
            raise RuntimeInputError(f"field {where + 'sliding_windows'!r} must list one entry per layer "
                                    f"({ints['num_layers']}), each null or an integer >= 1")
        return cls(
            model_type=json_field(data, "model_type", str, where=where), **ints,
            tie_word_embeddings=json_field(data, "tie_word_embeddings", bool, where=where), scaling=scaling,
            sliding_windows=tuple(windows),
            rope=RopeFacts.from_dict(json_field(data, "rope", dict, where=where), where=where + "rope."),
            source=json_field(data, "source", str, optional=True, where=where),
        )
