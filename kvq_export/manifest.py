"""``kvq.json``: the contract between an export directory and the runtimes that serve it.

It records the scheme, the model facts, opset, flavour and kvq version, the graph inputs, and for every
cache input/output its name, layer, key/value, role, dtype, symbolic shape, packing order, group axis
and size (from its cache layout, :mod:`kvq_export.cache_layout`). :func:`decode_cache` turns cache tensors back
into K/V using nothing but the manifest (and the calibration file it names), which is how a production
runtime can check its own decoder.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export._atomic import atomic_write
from kvq_export._read import file_sha256, parse_json, read_bytes, read_text
from kvq_export.cache_layout import REGIONS, CacheLayout, layout_named
from kvq_export.calibration.artifact import Calibration
from kvq_export.dtypes import COMPUTE_DTYPES
from kvq_export.errors import KVQError, OutputPathError, RuntimeInputError
from kvq_export.manifest_sections import (
    BuildRecord,
    CalibrationRecord,
    FileChecksum,
    GraphValue,
    RuntimeSupport,
    TokenizerFacts,
    checksums,
    graph_values,
    runtime_entries,
)
from kvq_export.model_facts import ModelFacts, refuse_unknown
from kvq_export.model_facts import json_field as _get
from kvq_export.naming import PARTS, CacheTensor, tensor_name
from kvq_export.rotation import describe_rotation, rotate_torch, rotation_matrix
from kvq_export.scheme import KVQuantScheme
from kvq_export.vocab import Basis, LayoutName, Rotation, parse_enum

MANIFEST_NAME = "kvq.json"
MODEL_NAME = "model.onnx"
CALIBRATION_NAME = "calibration.npz"
FORMAT_VERSION = 1
#: The graph and weight files of an export (``model.genai.onnx``: the onnxruntime-genai entry graph of an ort-gqa
#: export). The manifest checksums these and every other file of the export (tokenizer, calibration, the
#: onnxruntime-genai config), in subfolders too; only ``kvq.json`` itself is not listed.
WEIGHT_FILES = (MODEL_NAME, MODEL_NAME + ".data", "model.genai.onnx")
#: The top-level fields of ``kvq.json`` (what :meth:`Manifest.to_dict` writes; any other is refused on load).
MANIFEST_FIELDS = ("format_version", "kvq_version", "flavor", "opset", "dtype", "model", "scheme", "tokenizer",
                   "calibration", "inputs", "outputs", "weights", "build", "runtimes", "plan", "cache")
#: Compute dtypes an export can have.

#: How a rotated stream (``rotation`` of a scheme stream) is stored and decoded; repeated in every manifest.
ROTATION_RULES = (
    "A stream whose scheme sets rotation='hadamard' stores every row as x @ R instead of x (x: a post-RoPE key "
    "or a value row of head_dim D, before quantization; R: the normalized Sylvester Hadamard matrix of size D, "
    "entries +-1/sqrt(D), built as H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2); for a D that is not a power of "
    "two the block-diagonal matrix of such blocks over D's binary expansion, largest first, e.g. 96 = 64 + 32; "
    "R = R^T = R^-1). Decoding the regions/buffer as described yields rows in this stored basis; multiply by "
    "R^T to get the model's basis. Keys: the graph multiplies queries by the same R after RoPE, so scores over "
    "stored keys need q @ R. Values: R is folded into the exported v_proj rows and o_proj columns (an "
    "architecture that cannot fold it rotates v and un-rotates the attention output in the graph), so attention "
    "over stored values yields o @ R and o_proj rotates it back. Rotation costs no bytes. rotation='none' "
    "streams are stored in the model's basis."
)


@dataclass(frozen=True)
class Manifest:
    """The parsed ``kvq.json`` of one export directory."""

    scheme: KVQuantScheme
    model: ModelFacts
    flavor: str
    opset: int
    dtype: str
    kvq_version: str
    inputs: tuple[GraphValue, ...]
    outputs: tuple[GraphValue, ...]
    tokenizer: TokenizerFacts = field(default_factory=TokenizerFacts)
    calibration: CalibrationRecord | None = None
    format_version: int = FORMAT_VERSION
    layout: LayoutName = REGIONS.name  # the cache layout's name (the exporter records its flavour's)
    weights: dict[str, FileChecksum] | None = None  # every file's checksum, recorded at export
    #: kvq's source digest, what shaped the export, the model's content identity (None: an older export)
    build: BuildRecord | None = None
    #: other runtimes that can serve the export: name -> whether they can (their files, or the reason)
    runtimes: dict[str, RuntimeSupport] = field(default_factory=dict)
    #: how a scheme planned under a bit budget was chosen (budget, bits achieved, per-layer choices, the kvq plan
    #: command that writes it again); None when the request named its scheme
    plan: dict[str, Any] | None = None

    @property
    def source_digest(self) -> str | None:
        """Content digest of the model this export was made from (:func:`kvq_export.model_digest.model_digest`).

        None for an in-memory model or an export made before kvq recorded it.
        """
        return self.build.source_digest if self.build is not None else None

    # -- the cache ------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return self.model.num_layers

    @property
    def cache_layout(self) -> CacheLayout:
        """The cache layout (see :data:`kvq_export.cache_layout.LAYOUTS`)."""
        return layout_named(self.layout)

    def cache(self, direction: str = "past") -> list[CacheTensor]:
        """Cache tensors for ``direction`` (recomputed from the scheme: the single naming function)."""
        return self.cache_layout.tensors(self.scheme, self.model, direction)

    # -- (de)serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "format_version": self.format_version,
            "kvq_version": self.kvq_version,
            "flavor": self.flavor,
            "opset": self.opset,
            "dtype": self.dtype,
            "model": self.model.to_dict(),
            "scheme": self.scheme.to_dict(),
            "tokenizer": self.tokenizer.to_dict(),
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "inputs": [value.to_dict() for value in self.inputs],
            "outputs": [value.to_dict() for value in self.outputs],
            "weights": {name: c.to_dict() for name, c in self.weights.items()} if self.weights is not None else None,
            "build": self.build.to_dict() if self.build is not None else None,
            "runtimes": {name: entry.to_dict() for name, entry in self.runtimes.items()},
            **({"plan": self.plan} if self.plan is not None else {}),
            "cache": {
                "layout": self.cache_layout.rules,
                "layout_name": str(self.layout),
                "rotation": {"rule": ROTATION_RULES, "layers": self._rotations()},
                "past": [t.to_dict() for t in self.cache("past")],
                "present": [t.to_dict() for t in self.cache("present")],
            },
        }

    def _rotations(self) -> list[dict[str, Any]]:
        """Per layer with any rotated stream: the matrix each stream is stored with (empty: none rotated)."""
        head_dim = self.model.head_dim
        return [{"layer": layer, "key": describe_rotation(key.rotation, head_dim),
                 "value": describe_rotation(value.rotation, head_dim)}
                for layer, (key, value) in enumerate(self.scheme.streams(self.num_layers))
                if key.rotation != Rotation.NONE or value.rotation != Rotation.NONE]

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``kvq.json`` atomically into ``directory``."""
        return atomic_write(Path(directory) / MANIFEST_NAME, json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """Parse and check a manifest dict: every field's type, the scheme against the model, the cache section.

        Anything malformed is a :class:`RuntimeInputError` naming the field, never another exception.
        """
        try:
            return cls._from_dict(data)
        except KVQError as err:
            raise RuntimeInputError(f"invalid manifest: {err}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as err:
            raise RuntimeInputError(f"invalid manifest: malformed content ({type(err).__name__}: {err})") from None

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        if not isinstance(data, Mapping):
            raise RuntimeInputError(f"expected a JSON object, got {type(data).__name__}")
        version = _get(data, "format_version", int)
        if version != FORMAT_VERSION:
            raise RuntimeInputError(f"format_version {version} is not supported (expected {FORMAT_VERSION})")
        refuse_unknown(data, MANIFEST_FIELDS, "")
        model = ModelFacts.from_dict(_get(data, "model", dict))
        dtype = _get(data, "dtype", str)
        if dtype not in COMPUTE_DTYPES:
            raise RuntimeInputError(f"field 'dtype' is {dtype!r}; allowed: {', '.join(COMPUTE_DTYPES)}")
        cache = _get(data, "cache", dict, optional=True) or {}
        calibration = _get(data, "calibration", dict, optional=True)
        calibration = CalibrationRecord.from_dict(calibration) if calibration is not None else None
        weights = _get(data, "weights", dict, optional=True)
        build = _get(data, "build", dict, optional=True)
        scheme = KVQuantScheme.from_dict(_get(data, "scheme", dict))
        scheme.check_model(model)
        manifest = cls(
            scheme=scheme, model=model, flavor=_get(data, "flavor", str), opset=_get(data, "opset", int),
            dtype=dtype, kvq_version=_get(data, "kvq_version", str), inputs=graph_values(data, "inputs"),
            outputs=graph_values(data, "outputs"),
            tokenizer=TokenizerFacts.from_dict(_get(data, "tokenizer", dict, optional=True) or {}),
            calibration=calibration, format_version=version,
            layout=layout_named(_get(cache, "layout_name", str, optional=True, where="cache.") or REGIONS.name).name,
            weights=checksums(weights) if weights is not None else None,
            build=BuildRecord.from_dict(build) if build is not None else None,
            runtimes=runtime_entries(_get(data, "runtimes", dict, optional=True) or {}),
            plan=_get(data, "plan", dict, optional=True),
        )
        if scheme.needs_calibration and calibration is None:
            raise RuntimeInputError("the scheme uses static scales or calibrated high channels but no calibration "
                                    "file is named")
        listed = [t.get("name") if isinstance(t, dict) else t for t in _list_of_objects(cache, "past", "cache.")] \
            if "past" in cache else []
        expected = [t.name for t in manifest.cache("past")]
        if listed != expected:
            raise RuntimeInputError("cache section does not match its scheme: "
                                    f"{len(listed)} listed vs {len(expected)} expected tensors")
        return manifest

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Manifest:
        """Read ``DIR/kvq.json`` and check that every file it names lies inside ``DIR``."""
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise RuntimeInputError(f"{directory} is not a kvq export directory: {MANIFEST_NAME} is missing")
        # capped: a sparse or endless kvq.json is refused before it is read
        data = parse_json(read_text(path, "manifest", error=RuntimeInputError), str(path), error=RuntimeInputError)
        manifest = cls.from_dict(data)
        check_export_files(directory, manifest)
        return manifest


def _list_of_objects(data: Mapping[str, Any], name: str, where: str = "") -> list[dict[str, Any]]:
    items = _get(data, name, list, where=where)
    if not all(isinstance(item, dict) for item in items):
        raise RuntimeInputError(f"field {where + name!r} must be a list of objects")
    return list(items)


# -- the export directory's files ------------------------------------------------------------------------
def resolve_inside(directory: str | os.PathLike[str], name: str) -> Path:
    """``DIR/name`` resolved, refused unless it lies inside ``DIR`` (no ``..``, absolute path or symlink out)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise RuntimeInputError(f"{directory}: the file name {name!r} is not a plain name inside the export")
    root = Path(directory).resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise RuntimeInputError(f"{directory}: {name} resolves to {path}, outside the export directory; an "
                                "export may only use its own files")
    return path


def export_identity(directory: str | os.PathLike[str]) -> tuple[int, int, str]:
    """What tells two exports at one path apart: the directory's (device, inode) and the manifest's sha256.

    An export replaced in place (``--force``) is a new directory swapped in, and its manifest records other
    checksums or another build; a session compares this before and after it reads anything lazily.
    """
    st = os.stat(directory)
    path = Path(directory) / MANIFEST_NAME
    # capped like Manifest.load: a sparse or endless kvq.json is refused, not read whole to be hashed
    manifest = read_bytes(path, "manifest", error=RuntimeInputError) if os.path.lexists(path) else b""
    return st.st_dev, st.st_ino, hashlib.sha256(manifest).hexdigest()


def check_same_export(directory: str | os.PathLike[str], opened: tuple[int, int, str], when: str) -> None:
    """Refuse to go on when the export at ``directory`` is no longer the one :func:`export_identity` saw."""
    try:
        now = export_identity(directory)
    except OSError:
        now = None
    if now != opened:
        raise RuntimeInputError(f"{directory} was replaced or changed {when}: its graph and its manifest, tokenizer "
                                "or calibration would come from two exports; open it again")


def export_containing(path: str | os.PathLike[str]) -> Path | None:
    """The export directory ``path`` lies inside (a ``kvq.json`` in one of its resolved parents), or None."""
    resolved = Path(path).expanduser().resolve()
    return next((parent for parent in resolved.parents if (parent / MANIFEST_NAME).is_file()), None)


def check_output_path(path: str | os.PathLike[str], what: str = "output") -> Path:
    """Refuse an output path inside any export directory; return it.

    An export's files are checksummed and run as they are: a report, an engine or a JSON written over
    ``kvq.json``, ``model.onnx`` or beside them would corrupt or change what the export is.
    """
    inside = export_containing(path)
    if inside is not None:
        raise OutputPathError(f"{what} {path} lies inside the kvq export {inside}: kvq never writes into an export "
                              "directory; choose a path outside it")
    return Path(path)


def check_export_files(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    """Every file the manifest names, and every entry of the directory, subfolders included, lies inside it.

    An export holds directories and regular files only: a symbolic link (even one that stays inside, which could
    make a runtime read another model's files under a checksummed name) or a device, socket or FIFO is refused.
    """
    for name in [*(manifest.weights or {}), *([manifest.calibration.file] if manifest.calibration else [])]:
        resolve_inside(directory, name)
    export_files(directory)


def export_files(directory: str | os.PathLike[str]) -> list[str]:
    """Relative names (``/``-separated) of every file of an export but ``kvq.json``; refuses links and specials."""
    root = Path(directory)
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in sorted(dirnames) + sorted(filenames):
            path = here / name
            relative = path.relative_to(root).as_posix()
            resolve_inside(root, relative)  # a link out of the export: named as such
            if path.is_symlink():
                raise RuntimeInputError(f"{directory}: {relative} is a symbolic link; an export holds its own "
                                        "regular files only (copy the file in, or export again)")
            if name in dirnames:
                continue
            if not path.is_file():
                raise RuntimeInputError(f"{directory}: {relative} is not a regular file; an export holds regular "
                                        "files only")
            if relative != MANIFEST_NAME:
                names.append(relative)
    return sorted(names)


def weight_checksums(directory: str | os.PathLike[str]) -> dict[str, FileChecksum]:
    """The checksum of every file of the export but ``kvq.json`` (what a loader verifies), by relative name."""
    directory = Path(directory)
    return {name: FileChecksum(sha256=file_sha256(directory / name), bytes=(directory / name).stat().st_size)
            for name in export_files(directory)}


def verify_weights(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    """Raise unless every file of the export matches the checksum the manifest recorded, and has one."""
    if not manifest.weights:
        raise RuntimeInputError(f"{directory}: the manifest records no weight checksums (exported by an older "
                                "kvq?): export it again, or skip the check (verify_weights=False / --no-verify)")
    for name, want in manifest.weights.items():
        path = resolve_inside(directory, name)
        if not path.is_file():
            raise RuntimeInputError(f"{directory}: {name} is missing")
        size = path.stat().st_size
        if size != want.bytes:
            raise RuntimeInputError(f"{path} has {size} bytes, the export wrote {want.bytes}: truncated or "
                                    "replaced; export again (or skip the check: verify_weights=False / --no-verify)")
        if file_sha256(path) != want.sha256:
            raise RuntimeInputError(f"{path} does not match its sha256 in {MANIFEST_NAME}: corrupted or edited; "
                                    "export again (or skip the check: verify_weights=False / --no-verify)")
    unlisted = [name for name in export_files(directory) if name not in manifest.weights]
    if unlisted:
        raise RuntimeInputError(f"{directory}: {unlisted[0]} has no checksum in {MANIFEST_NAME} (added after the "
                                "export, or exported by an older kvq); an export runs only files it recorded: "
                                "remove it or export again (or skip the check: verify_weights=False / --no-verify)")


def load_static(directory: str | os.PathLike[str], manifest: Manifest) -> Calibration | None:
    """The calibration the manifest names (None without one), checked against its digest, scheme and model.

    Read within :data:`~kvq_export._read.CALIBRATION_LIMIT` bytes. The graph holds the truth: a runtime also
    compares the arrays with the graph's constants (:func:`kvq_export.graph_facts.check_graph_calibration`).
    """
    if not manifest.calibration:
        return None
    path = resolve_inside(directory, manifest.calibration.file)
    calibration = Calibration.load(path, error=RuntimeInputError)
    want = manifest.calibration.digest
    got = calibration.digest(len(want)) if want else ""
    if got != want:
        raise RuntimeInputError(f"{path} does not match the calibration digest in {MANIFEST_NAME} "
                                f"({got or 'empty'} != {want}): the scales were edited or replaced; export again")
    try:
        calibration.check(manifest.scheme, manifest.model)
    except KVQError as err:
        raise RuntimeInputError(f"{path} does not fit the export's scheme: {err}") from None
    return calibration


def decode_cache(
    manifest: Manifest, tensors: Mapping[str, np.ndarray], *, direction: str = "present", static: Mapping | None = None,
    basis: Basis = Basis.STORED,
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Dequantize a cache using only the manifest: ``[row][layer] -> (K, V)`` each float32 ``[H, n_row, D]``.

    ``tensors`` maps cache tensor names to arrays (fp8 codes may be given as raw uint8 bits). Static
    scales come from ``static`` (see :func:`load_static`). ``basis``: ``stored`` returns rotated streams as
    stored (``x @ R``, the basis of the graph's attention and ``probe.*`` values, see :data:`ROTATION_RULES`);
    ``model`` multiplies them by ``R.T`` (float32), e.g. to compare exports whose rotations differ.
    """
    basis = parse_enum(Basis, basis, "basis", RuntimeInputError)
    rows = _decode_stored(manifest, tensors, direction, static)
    if basis is Basis.STORED:
        return rows
    import torch

    head_dim = manifest.model.head_dim
    for layer, streams in enumerate(manifest.scheme.streams(manifest.num_layers)):
        matrices = [rotation_matrix(tq.rotation, head_dim) for tq in streams]
        for row in rows:
            row[layer] = tuple(x if r is None else rotate_torch(torch.from_numpy(x), r, inverse=True).numpy()
                               for x, r in zip(row[layer], matrices))
    return rows


def _decode_stored(manifest: Manifest, tensors: Mapping[str, np.ndarray], direction: str,
                   static: Mapping | None) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """:func:`decode_cache` in the stored basis."""
    layout = manifest.cache_layout
    lengths = np.asarray(tensors[tensor_name(direction, None, None, "seq_lengths")]).astype(np.int64)
    by_stream: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for spec in manifest.cache(direction)[1:]:
        by_stream.setdefault((spec.layer, spec.part), {})[spec.role] = tensors.get(spec.name)
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in lengths]
    for layer, streams in enumerate(manifest.scheme.streams(manifest.num_layers)):
        for row, n in enumerate(lengths):
            k, v = (layout.decode_stream(manifest.scheme, tq, by_stream[layer, part], row, int(n),
                                         (static or {}).get(layer, {}).get(part))
                    for part, tq in zip(PARTS, streams))
            rows[row].append((k, v))
    return rows
