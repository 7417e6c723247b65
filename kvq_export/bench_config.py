"""What one ``kvq bench`` run measures: :class:`BenchConfig`, typed, frozen and checked on construction.

``kvq bench`` builds one from its options and :func:`kvq_export.bench.run_bench` takes it; ``to_dict`` /
``from_dict`` give its JSON form, so a script can keep a bench's settings in a file and run it again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvq_export.dtypes import COMPUTE_DTYPES
from kvq_export.errors import KVQError
from kvq_export.flavors import flavor_names, get_flavor
from kvq_export.model_facts import known_fields
from kvq_export.request import DEFAULT_CALIBRATION, CalibrationSpec, WeightSpec, _int

DEFAULT_CONTEXTS = (512, 2048, 8192)
DEFAULT_BATCHES = (1, 4)
#: How a decode cache reaches its context: random data in the stored layout, or a real chunked prefill.
FILLS = ("synthetic", "prefill")


@dataclass(frozen=True)
class BenchConfig:
    """What one bench run measures (``kvq bench``'s settings), checked on construction; see the module docstring.

    Args:
        model: a model spec (``smollm2``, a Hugging Face directory or a ``.gguf`` file).
        schemes: preset names or scheme JSON files; the baseline is added (and reported) automatically.
        flavors: export flavors to compare (each against its own baseline).
        contexts: tokens held per row while decoding (steps end exactly at ``context``).
        batches: batch sizes.
        baseline: the scheme every result is compared with (same flavor, context and batch).
        steps: timed decode steps per session.
        warmup: untimed decode steps before them.
        prefill_tokens: prefill length cap (a prefill is ``min(context, prefill_tokens)`` tokens per row).
        prefill_repeats: timed prefill runs (median), after one untimed run.
        threads: ONNX Runtime intra-op threads (default: ``OMP_NUM_THREADS`` when set, else its choice).
        dtype: compute dtype of the exports.
        work_dir: where exports are kept (default ``$KVQ_CACHE_DIR/bench``).
        calibration: how static-scale schemes are calibrated (see ``kvq export``).
        weights: how every export stores its weights (``kvq export --weights``; the baseline's too).
        ppl_windows: when > 0, also a strict-decode perplexity per export on this many windows of the
            calibration corpus (from token :data:`PPL_OFFSET` on, the text ``kvq validate`` scores).
        ppl_tokens: tokens per perplexity window.
        seed: seeds the synthetic caches and token ids.
        fill: ``synthetic`` (random data in the stored layout, instant) or ``prefill`` (a real chunked prefill
            of random token ids, ``prefill_tokens`` per chunk: slow at long contexts, a check of the former).
        json_out: the report's JSON file, rewritten (atomically) after every result, so a run that is stopped
            keeps every row measured so far (``"complete": false`` until the run ends).
        providers: ONNX Runtime providers of the timed sessions (None: the runtime's default choice).
    """

    model: str
    schemes: tuple[str, ...] = ()
    flavors: tuple[str, ...] = ("ort-gqa",)
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    batches: tuple[int, ...] = DEFAULT_BATCHES
    baseline: str = "fp16"
    steps: int = 32
    warmup: int = 4
    prefill_tokens: int = 512
    prefill_repeats: int = 2
    threads: int | None = None
    dtype: str = "fp32"
    work_dir: str | None = None
    calibration: CalibrationSpec = DEFAULT_CALIBRATION
    weights: WeightSpec = WeightSpec()
    ppl_windows: int = 0
    ppl_tokens: int = 512
    seed: int = 0
    fill: str = "synthetic"
    json_out: str | None = None
    providers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("model", _spec(self.model, "model"))
        put("schemes", tuple(_spec(s, "schemes") for s in _sequence(self.schemes, "schemes")))
        put("flavors", tuple(str(get_flavor(f).name) for f in _sequence(self.flavors, "flavors")))
        if not self.flavors:
            raise KVQError(f"invalid flavors=[]: allowed: one or more of {', '.join(flavor_names())}")
        put("contexts", _positive_ints(self.contexts, "contexts"))
        put("batches", _positive_ints(self.batches, "batches"))
        put("baseline", _spec(self.baseline, "baseline"))
        for name, least in (("steps", 1), ("warmup", 0), ("prefill_tokens", 1), ("prefill_repeats", 1),
                            ("ppl_windows", 0), ("ppl_tokens", 2), ("seed", 0)):
            _int(getattr(self, name), name, least, KVQError)
        if self.threads is not None:
            _int(self.threads, "threads", 1, KVQError)
        if self.dtype not in COMPUTE_DTYPES:
            raise KVQError(f"invalid dtype={self.dtype!r}: allowed: {', '.join(COMPUTE_DTYPES)}")
        put("work_dir", None if self.work_dir is None else _spec(self.work_dir, "work_dir"))
        put("json_out", None if self.json_out is None else _spec(self.json_out, "json_out"))
        if isinstance(self.calibration, Mapping):
            put("calibration", CalibrationSpec.from_dict(self.calibration))
        if not isinstance(self.calibration, CalibrationSpec):
            raise KVQError(f"invalid calibration={self.calibration!r}: allowed: a CalibrationSpec")
        if isinstance(self.weights, Mapping):
            put("weights", WeightSpec.from_dict(self.weights))
        if not isinstance(self.weights, WeightSpec):
            raise KVQError(f"invalid weights={self.weights!r}: allowed: a WeightSpec")
        if self.fill not in FILLS:
            raise KVQError(f"invalid fill={self.fill!r}: allowed: {', '.join(FILLS)}")
        if self.providers is not None:
            put("providers", tuple(_spec(p, "providers") for p in _sequence(self.providers, "providers")))
        too_short = [c for c in self.contexts if c < self.warmup + self.steps + 1]
        if too_short:
            least = self.warmup + self.steps + 1
            raise KVQError(f"context {too_short[0]} is shorter than warmup + steps + 1 = {least}")

    def to_dict(self) -> dict[str, Any]:
        """JSON form (sequences as lists, the calibration and the weights as their own JSON forms)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update({name: list(data[name]) for name in ("schemes", "flavors", "contexts", "batches")})
        data["calibration"], data["weights"] = self.calibration.to_dict(), self.weights.to_dict()
        data["providers"] = None if self.providers is None else list(self.providers)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchConfig:
        """Parse :meth:`to_dict`'s form; missing fields but ``model`` take the defaults."""
        values = dict(known_fields(data, cls, "", KVQError))
        model = values.pop("model", None)
        if model is None:
            raise KVQError("missing bench field 'model'")
        return cls(model, **values)


def _spec(value: Any, name: str) -> str:
    """A non-empty string (a path is taken as its string)."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(value, str) or not value:
        raise KVQError(f"invalid {name} entry {value!r}: allowed: a non-empty string")
    return value


def _sequence(values: Any, name: str) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise KVQError(f"invalid {name}={values!r}: allowed: a list")
    return tuple(values)


def _positive_ints(values: Any, name: str) -> tuple[int, ...]:
    values = _sequence(values, name)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise KVQError(f"invalid {name}={list(values)!r}: allowed: integers >= 1")
    return values
