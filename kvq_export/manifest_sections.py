"""The fixed-shape sections of ``kvq.json``, as frozen records (:class:`~kvq_export.manifest.Manifest` holds them).

Each has ``to_dict`` (the exact JSON the exporter writes: key order kept, optional keys left out when unset) and
``from_dict`` (a one-line :class:`~kvq_export.errors.RuntimeInputError` naming the field for anything malformed,
an unknown key included), so readers write ``manifest.calibration.digest`` instead of indexing nested dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvq_export.errors import RuntimeInputError
from kvq_export.model_facts import json_field as _get
from kvq_export.model_facts import known_fields


def _set_fields(record: Any, *, keep_none: tuple[str, ...] = ()) -> dict[str, Any]:
    """A record's fields in declared order, unset (None) ones left out unless named in ``keep_none``."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is not None or f.name in keep_none:
            out[f.name] = value
    return out


def _optional_int(data: Mapping[str, Any], name: str, where: str) -> int | None:
    return _get(data, name, int, optional=True, where=where)


@dataclass(frozen=True)
class GraphValue:
    """A graph input or output that is not part of the cache: its name, element type and symbolic shape."""

    name: str
    dtype: str
    shape: tuple[str | int, ...]
    meaning: str | None = None  # what its values say, where the name does not

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``meaning`` only when set)."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                **({"meaning": self.meaning} if self.meaning is not None else {})}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> GraphValue:
        """Parse :meth:`to_dict`'s form; ``where`` names the entry in errors (``inputs[0]``)."""
        data = known_fields(data, cls, f"{where}.")
        shape = _get(data, "shape", list, where=f"{where}.")
        if not all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in shape):
            raise RuntimeInputError(f"field '{where}.shape' must list dimension names and integers")
        return cls(name=_get(data, "name", str, where=f"{where}."), dtype=_get(data, "dtype", str, where=f"{where}."),
                   shape=tuple(shape), meaning=_get(data, "meaning", str, optional=True, where=f"{where}."))


def graph_values(data: Mapping[str, Any], name: str) -> tuple[GraphValue, ...]:
    """The ``inputs`` or ``outputs`` section."""
    return tuple(GraphValue.from_dict(item, f"{name}[{i}]") for i, item in enumerate(_get(data, name, list)))


@dataclass(frozen=True)
class TokenizerFacts:
    """The special tokens of the export's tokenizer, and whether its files were written beside the graph."""

    eos_token_id: int | tuple[int, ...] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    files: bool = True

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a row (empty when the tokenizer names no EOS)."""
        eos = self.eos_token_id
        return tuple(eos) if isinstance(eos, tuple) else () if eos is None else (eos,)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (several EOS ids as a list)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {"eos_token_id": eos, "bos_token_id": self.bos_token_id, "pad_token_id": self.pad_token_id,
                "files": self.files}

    @classmethod
    def from_dict(cls, data: Any) -> TokenizerFacts:
        """Parse :meth:`to_dict`'s form; a missing field takes the default (an export without the section)."""
        data = known_fields(data, cls, "tokenizer.")
        eos = data.get("eos_token_id")
        if isinstance(eos, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
                raise RuntimeInputError("field 'tokenizer.eos_token_id' must be an integer or a list of integers")
            eos = tuple(eos)
        else:
            eos = _optional_int(data, "eos_token_id", "tokenizer.")
        files = _get(data, "files", bool, optional=True, where="tokenizer.")
        return cls(eos_token_id=eos, bos_token_id=_optional_int(data, "bos_token_id", "tokenizer."),
                   pad_token_id=_optional_int(data, "pad_token_id", "tokenizer."),
                   files=True if files is None else files)


@dataclass(frozen=True)
class CalibrationRecord:
    """The calibration file of an export (its name and digest) and how its scales were chosen.

    ``source`` is ``calibrated`` (then ``corpus``, ``tokens``, ``offset``, ``method`` and, for the percentile
    method, ``percentile`` say on what text and how) or ``given`` (the caller handed the scales in). ``weights``:
    the int blocks the model ran on while the scales were measured (``Calibration.weights``), ``measured_on`` the same
    in words; both left out for the model's own weights (as in every record written before they were recorded).
    """

    file: str
    digest: str
    source: str | None = None
    corpus: str | None = None
    tokens: int | None = None
    offset: int | None = None
    method: str | None = None
    percentile: float | None = None
    weights: Mapping[str, Any] | None = None
    measured_on: str | None = None

    @property
    def calibrated(self) -> bool:
        """Whether kvq chose the scales on calibration text (not given them)."""
        return self.source == "calibrated"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (unset fields left out)."""
        return _set_fields(self)

    @classmethod
    def from_dict(cls, data: Any) -> CalibrationRecord:
        """Parse :meth:`to_dict`'s form."""
        data = known_fields(data, cls, "calibration.")
        text = {name: _get(data, name, str, optional=name not in ("file", "digest"), where="calibration.")
                for name in ("file", "digest", "source", "corpus", "method", "measured_on")}
        return cls(**text, tokens=_optional_int(data, "tokens", "calibration."),
                   offset=_optional_int(data, "offset", "calibration."),
                   percentile=_get(data, "percentile", float, optional=True, where="calibration."),
                   weights=_get(data, "weights", dict, optional=True, where="calibration."))


@dataclass(frozen=True)
class FileChecksum:
    """What a loader verifies one file of the export against."""

    sha256: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"sha256": self.sha256, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FileChecksum:
        """Parse :meth:`to_dict`'s form; ``where`` names the file's entry in errors."""
        data = known_fields(data, cls, f"{where}.")
        return cls(sha256=_get(data, "sha256", str, where=f"{where}."),
                   bytes=_get(data, "bytes", int, where=f"{where}."))


def checksums(data: Any) -> dict[str, FileChecksum]:
    """The ``weights`` section: ``{file: checksum}``."""
    if not isinstance(data, Mapping):
        raise RuntimeInputError(f"field 'weights' must be an object, got {type(data).__name__}")
    return {name: FileChecksum.from_dict(entry, f"weights.{name}") for name, entry in data.items()}


@dataclass(frozen=True)
class BuildRecord:
    """What built an export: kvq's source digest, the request, and the model source's identity.

    ``request`` is :meth:`kvq_export.request.ExportRequest.to_dict`'s form (reuse compares it as written);
    ``source`` the model's content identity (:func:`kvq_export.model_digest.model_identity`), ``source_digest`` its
    digest when the model was named by a spec; ``static`` the digest of scales the caller gave, if any.
    """

    kvq_code: str
    request: dict[str, Any]
    source: dict[str, Any] | None = None
    source_digest: str | None = None
    static: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``source`` and ``source_digest`` always, ``static`` only when set)."""
        return _set_fields(self, keep_none=("source", "source_digest"))

    @classmethod
    def from_dict(cls, data: Any) -> BuildRecord:
        """Parse :meth:`to_dict`'s form."""
        data = known_fields(data, cls, "build.")
        return cls(kvq_code=_get(data, "kvq_code", str, where="build."),
                   request=dict(_get(data, "request", dict, where="build.")),
                   source=_get(data, "source", dict, optional=True, where="build."),
                   source_digest=_get(data, "source_digest", str, optional=True, where="build."),
                   static=_get(data, "static", str, optional=True, where="build."))


@dataclass(frozen=True)
class RuntimeSupport:
    """Whether another runtime can serve the export: its files, or the reason it cannot."""

    supported: bool
    reason: str | None = None  # why not, when not supported
    config: str | None = None  # the runtime's config file in the export
    model: str | None = None  # the graph it loads
    past_present_share_buffer: bool | None = None
    engine_batches: bool | None = None  # whether a batch of requests of different lengths decodes right
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (unset fields left out)."""
        return _set_fields(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> RuntimeSupport:
        """Parse :meth:`to_dict`'s form; ``where`` names the entry in errors."""
        data = known_fields(data, cls, f"{where}.")
        text = {name: _get(data, name, str, optional=True, where=f"{where}.")
                for name in ("reason", "config", "model", "note")}
        flags = {name: _get(data, name, bool, optional=True, where=f"{where}.")
                 for name in ("past_present_share_buffer", "engine_batches")}
        return cls(supported=_get(data, "supported", bool, where=f"{where}."), **text, **flags)


def runtime_entries(data: Any) -> dict[str, RuntimeSupport]:
    """The ``runtimes`` section: ``{runtime: support}``."""
    if not isinstance(data, Mapping):
        raise RuntimeInputError(f"field 'runtimes' must be an object, got {type(data).__name__}")
    return {name: RuntimeSupport.from_dict(entry, f"runtimes.{name}") for name, entry in data.items()}
