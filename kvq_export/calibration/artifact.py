"""The calibration artifact: one frozen :class:`Calibration` owns every calibrated array of an export.

Per (layer, ``key``|``value``) stream it holds the roles ``scales`` and ``zero_points`` (float32 ``[kv_heads, n]``,
static-scale streams; zero points only for the asymmetric ``int`` format) and ``high_channels`` (int32
``[kv_heads, n]`` ascending channel indices, streams that keep 8-bit channels). It reads like the nested mapping
``{layer: {"key"|"value": {role: array}}}`` the exporters, the reference cache and the runtimes index, and it is
the only reader and writer of ``calibration.npz`` (keys ``"<layer>.<key|value>.<role>"``):

* :meth:`Calibration.save` writes the file atomically; :meth:`Calibration.load` reads it within
  :data:`CALIBRATION_LIMIT` bytes, member by member, refusing anything but 2-D float32/int32 arrays with a
  one-line error (never a ``MemoryError`` for a file that claims a huge array);
* :meth:`Calibration.digest` fingerprints it for ``kvq.json`` and the graph's metadata;
* :attr:`Calibration.weights` says which weights the model ran on while it was measured: None for the model's own
  (as loaded), else the int block settings of :func:`kvq_export.calibration.weights.dequantized_model` (the weights an
  int4 / int8 export computes with); it is part of the digest and of the file (member ``kvq.weights``), and
  :meth:`Calibration.check_weights` refuses the calibration for an export that runs other weights;
* :meth:`Calibration.check` refuses it for a scheme and model it does not fit (at export and at load).

How it is compared with the constants of the graph built from it: :mod:`kvq_export.calibration.graph_check`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_export._atomic import atomic_writer
from kvq_export._read import CALIBRATION_LIMIT, read_bytes
from kvq_export.errors import CalibrationWeightsError, KVQError, SchemeError
from kvq_export.model_facts import CacheGeometry
from kvq_export.vocab import Part

if TYPE_CHECKING:
    import torch

    from kvq_export.scheme import KVQuantScheme, TensorQuant

logger = logging.getLogger(__name__)

PARTS = tuple(Part)
META_ROLES = ("scales", "zero_points")
#: calibration role holding a stream's chosen 8-bit channels ``[kv_heads, n]`` (integer indices)
HIGH_CHANNELS = "high_channels"
ROLES = (*META_ROLES, HIGH_CHANNELS)
#: arrays a calibration file may hold (two parts and three roles per layer of a very deep model)
MAX_ARRAYS = 6 * 4096
#: file member holding :attr:`Calibration.weights` (UTF-8 JSON bytes); absent: the model's own weights
WEIGHTS_MEMBER = "kvq.weights"
#: the keys of :attr:`Calibration.weights`, and their types
WEIGHTS_FIELDS = {"format": str, "block_size": int, "symmetric": bool}

StaticLike = Mapping[int, Mapping[str, Mapping[str, Any]]]
"""``{layer: {"key"|"value": {role: array}}}`` with numpy arrays, torch tensors or nested lists."""


def static_streams(scheme: KVQuantScheme, num_layers: int) -> list[tuple[int, Part, TensorQuant]]:
    """(layer, ``key``|``value``, stream) for every quantized stream with static scales."""
    return [(layer, part, tq) for layer, streams in enumerate(scheme.streams(num_layers))
            for part, tq in zip(PARTS, streams, strict=True) if tq.quantized and tq.scales == "static"]


def high_channel_streams(scheme: KVQuantScheme, num_layers: int) -> list[tuple[int, Part, TensorQuant]]:
    """(layer, ``key``|``value``, stream) for every stream that keeps calibrated high channels."""
    return [(layer, part, tq) for layer, streams in enumerate(scheme.streams(num_layers))
            for part, tq in zip(PARTS, streams, strict=True) if tq.quantized and tq.high_channels]


def static_name(layer: int, part: str, role: str) -> str:
    """Name of a graph constant made from one calibrated stream (``static.0.key.scales``).

    ``scales`` / ``zero_points`` of a static-scale stream, ``channel_order`` and ``high_channels.*`` of a
    high-channel stream, and the forms a flavour derives from them (``offset``, ...). ``part``: a :class:`Part`, or
    the name of a constant both streams share (``packed``, ``kv``, ``qkv``), hence a plain ``str``.
    """
    return f"static.{layer}.{part}.{role}"


def _role_dtype(role: str) -> type[np.generic]:
    return np.int32 if role == HIGH_CHANNELS else np.float32


def _split_name(name: str) -> tuple[int, Part, str] | None:
    """``"3.key.scales"`` -> (3, Part.KEY, "scales"); None for any other name."""
    layer, _, rest = name.partition(".")
    part, _, role = rest.partition(".")
    if not layer.isdigit() or part not in PARTS or role not in ROLES:
        return None
    return int(layer), Part(part), role


def describe_weights(weights: Mapping[str, Any] | None) -> str:
    """``"the model's own weights"`` or ``"int4 weights (blocks of 32, symmetric)"``."""
    if weights is None:
        return "the model's own weights"
    if set(weights) == {"format"}:
        return f"{weights['format']} weights (int8 per output channel)"
    return (f"{weights['format']} weights (blocks of {weights['block_size']}, "
            f"{'symmetric' if weights['symmetric'] else 'asymmetric'})")


def _checked_weights(weights: Any) -> dict[str, Any] | None:
    """``weights`` as :attr:`Calibration.weights` holds it, or a one-line :class:`KVQError`."""
    if weights is None:
        return None
    if isinstance(weights, Mapping) and dict(weights) == {"format": "w8a8"}:
        return {"format": "w8a8"}
    if not isinstance(weights, Mapping) or set(weights) != set(WEIGHTS_FIELDS) or not all(
            type(weights[name]) is kind for name, kind in WEIGHTS_FIELDS.items()):
        raise KVQError(f"invalid calibration weights {weights!r}: allowed: None (the model's own weights), "
                       "{'format': 'w8a8'} or {'format': 'int4'|'int8', 'block_size': int, 'symmetric': bool}")
    if weights["format"] not in ("int4", "int8"):
        raise KVQError(f"invalid calibration weights format {weights['format']!r}: allowed: int4, int8")
    return {name: weights[name] for name in WEIGHTS_FIELDS}


class Calibration(Mapping[int, Mapping[str, Mapping[str, np.ndarray]]]):
    """The calibrated arrays of one scheme on one model; a read-only mapping, compared by content.

    Build it with :meth:`of` (from a nested mapping) or :meth:`load` (from a file); index it as
    ``calibration[layer][part][role]``. Arrays are the artifact's own 2-D copies, float32 (``scales``,
    ``zero_points``) or int32 (``high_channels``); they stay writable because torch warns on every read-only
    array it wraps, so treat them as constants. :attr:`weights` names the weights they were measured on.
    """

    __slots__ = ("_arrays", "_tree", "_weights")

    def __init__(self, arrays: Mapping[str, np.ndarray], *, weights: Mapping[str, Any] | None = None) -> None:
        """``arrays``: ``{"<layer>.<part>.<role>": 2-D array}`` (see :meth:`of` for the nested form).

        ``weights``: the weights the model ran on while they were measured (:attr:`weights`).
        """
        self._weights = _checked_weights(weights)
        flat: dict[tuple[int, Part, str], np.ndarray] = {}
        for name, array in arrays.items():
            where = _split_name(name)
            if where is None:
                raise KVQError(f"the calibration has an unexpected array {name!r}; expected names like "
                               "'3.key.scales', '3.value.zero_points' or '3.key.high_channels'")
            dtype = _role_dtype(where[2])
            if where[2] == HIGH_CHANNELS and not np.issubdtype(np.asarray(array).dtype, np.integer):
                raise KVQError(f"calibration array {name!r} must hold integer channel indices, got "
                               f"{np.asarray(array).dtype}")
            try:
                value = np.array(array, dtype=dtype, copy=True)
            except (TypeError, ValueError) as err:
                raise KVQError(f"calibration array {name!r} is not numeric: {err}") from None
            if value.ndim != 2:
                raise KVQError(f"calibration array {name!r} must be 2-D, got shape {list(value.shape)}")
            flat[where] = value
        ordered = sorted(flat, key=lambda k: (k[0], PARTS.index(k[1]), ROLES.index(k[2])))
        self._arrays: dict[str, np.ndarray] = {f"{layer}.{part}.{role}": flat[layer, part, role]
                                               for layer, part, role in ordered}
        tree: dict[int, dict[Part, dict[str, np.ndarray]]] = {}
        for layer, part, role in ordered:
            tree.setdefault(layer, {}).setdefault(part, {})[role] = flat[layer, part, role]
        self._tree = MappingProxyType({layer: MappingProxyType({part: MappingProxyType(roles)
                                                                for part, roles in parts.items()})
                                       for layer, parts in tree.items()})

    @classmethod
    def of(cls, static: StaticLike | Calibration, *, weights: Mapping[str, Any] | None = None) -> Calibration:
        """A calibration from the nested mapping ``{layer: {part: {role: array}}}`` (itself when it is one).

        ``weights``: what a nested mapping was measured on (:attr:`weights`); a calibration keeps its own.
        """
        if isinstance(static, Calibration):
            return static
        flat: dict[str, Any] = {}
        for layer, parts in static.items():
            for part, roles in parts.items():
                for role, array in roles.items():
                    if array is not None:
                        flat[f"{layer}.{part}.{role}"] = _as_numpy(array)
        return cls(flat, weights=weights)

    # -- the mapping -----------------------------------------------------------------------------------------
    def __getitem__(self, layer: int) -> Mapping[str, Mapping[str, np.ndarray]]:
        return self._tree[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tree)

    def __len__(self) -> int:
        return len(self._tree)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Calibration):
            return NotImplemented
        return self._weights == other._weights and self._arrays.keys() == other._arrays.keys() and all(
            np.array_equal(a, other._arrays[name]) for name, a in self._arrays.items())

    def __hash__(self) -> int:
        return hash(self.digest())

    def __repr__(self) -> str:
        on = "" if self._weights is None else f", measured on {describe_weights(self._weights)}"
        return f"Calibration({len(self._arrays)} arrays over {len(self)} layers{on}, digest {self.digest()})"

    @property
    def weights(self) -> Mapping[str, Any] | None:
        """The weights the model ran on while this was measured.

        None: the model's own weights, as loaded (every calibration file without a record is one); else
        ``{"format": "int4"|"int8", "block_size": n, "symmetric": bool}`` or ``{"format": "w8a8"}``: the model with
        its weights replaced by what an export storing them so computes with
        (:func:`kvq_export.calibration.weights.dequantized_model`; w8a8: smoothed first).
        """
        return None if self._weights is None else MappingProxyType(self._weights)

    def check_weights(self, weights: Mapping[str, Any] | None, *,
                      error: type[KVQError] = CalibrationWeightsError) -> None:
        """Refuse, in one ``error`` line, a calibration measured on other weights than ``weights`` (as :attr:`weights`).

        Keys and values of a model with int4 weights differ from those of its own weights: static scales measured on
        one and run on the other clip or waste codes where the two differ.
        """
        want = _checked_weights(weights)
        if want != self._weights:
            raise error(f"the calibration was measured on {describe_weights(self._weights)}, but the export runs "
                        f"{describe_weights(want)}: calibrate on the weights that run (kvq calibrate --format npz "
                        "with the export's --weights options), or let the export calibrate")

    @property
    def arrays(self) -> Mapping[str, np.ndarray]:
        """``{"<layer>.<part>.<role>": array}`` in (layer, part, role) order: what the file holds."""
        return MappingProxyType(self._arrays)

    def to_torch(self) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
        """The nested mapping as torch tensors (float32; int64 high channels), as the reference cache takes it."""
        import torch

        # copies: the tensors are the caller's to change
        return {layer: {part: {role: torch.from_numpy(np.array(a, dtype=np.int64 if role == HIGH_CHANNELS
                                                               else np.float32))
                               for role, a in roles.items()} for part, roles in parts.items()}
                for layer, parts in self._tree.items()}

    # -- identity ----------------------------------------------------------------------------------------
    def digest(self, length: int = 16) -> str:
        """Short sha256 hex digest of the arrays (names, shapes and float32 bytes), for manifests and graphs."""
        digest = hashlib.sha256()
        for name, array in self._arrays.items():
            digest.update(f"{name}:{'x'.join(map(str, array.shape))}:".encode())
            digest.update(array.astype("<f4", copy=False).tobytes())
        if self._weights is not None:  # (the model's own weights keep the digests of files written before the record)
            digest.update(f"{WEIGHTS_MEMBER}:{self._weights_json()}".encode())
        return digest.hexdigest()[:length]

    def _weights_json(self) -> str:
        return json.dumps(self._weights, sort_keys=True, separators=(",", ":"))

    # -- files -------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write one ``.npz`` (keys ``"3.key.scales"``) atomically; return the path (used as given).

        The file is written to a temporary name beside ``path`` and renamed over it, so a reader never sees a
        partial file.
        """
        if not self._arrays:
            raise KVQError("nothing to save: the calibration has no arrays")
        target = Path(path)
        members = dict(self._arrays)
        if self._weights is not None:
            members[WEIGHTS_MEMBER] = np.frombuffer(self._weights_json().encode(), dtype=np.uint8)
        with atomic_writer(target, "wb") as handle:
            np.savez(handle, **members)
        logger.info("saved calibration (%d array(s), digest %s) to %s", len(self._arrays), self.digest(), target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, limit: int = CALIBRATION_LIMIT,
             error: type[KVQError] = KVQError) -> Calibration:
        """Read a file :meth:`save` wrote, within ``limit`` bytes; anything else is one ``error`` line."""
        source = Path(path)
        if not source.is_file():
            raise error(f"calibration file {str(source)!r} does not exist")
        data = read_bytes(source, "calibration file", limit=limit, error=error)
        try:
            arrays = _read_npz(data, limit)
            weights = _read_weights(arrays.pop(WEIGHTS_MEMBER, None))
        except _Unreadable as err:
            raise error(f"{source} is not a readable calibration file: {err}") from None
        for name, array in arrays.items():  # the file keeps each role's own dtype: nothing is converted on read
            where = _split_name(name)
            if where is not None and (array.dtype != _role_dtype(where[2]) or array.ndim != 2):
                raise error(f"{source}: calibration array {name!r} must be 2-D "
                            f"{np.dtype(_role_dtype(where[2])).name}, got {array.dtype} {list(array.shape)}")
        try:
            calibration = cls(arrays, weights=weights)
        except KVQError as err:
            raise error(f"{source}: {err}") from None
        if not calibration:
            raise error(f"calibration file {str(source)!r} holds no arrays")
        return calibration

    # -- checks ------------------------------------------------------------------------------------------
    def check(self, scheme: KVQuantScheme, facts: CacheGeometry) -> None:
        """Raise a one-line :class:`SchemeError` unless every array the scheme needs is here and fits the model.

        Checks presence, shape ``[num_kv_heads, n]``, finiteness, strictly positive scales and strictly ascending
        high channels. Shapes cannot tell two schemes with the same layout apart (ort-int8 vs ort-int4): compare
        digests for that.
        """
        layers, heads, head_dim = facts.num_layers, facts.num_kv_heads, facts.head_dim
        used = {f"{layer}.{part}.{HIGH_CHANNELS}" for layer, part, _ in high_channel_streams(scheme, layers)} | {
            f"{layer}.{part}.{role}" for layer, part, tq in static_streams(scheme, layers)
            for role in (META_ROLES if tq.has_zero_point else ("scales",))}
        unused = [name for name in self._arrays if name not in used]
        if unused:
            raise SchemeError(f"calibration {unused[0]} belongs to no stream of the scheme that needs it (a "
                              "calibration of another scheme or model)")
        for layer, part, tq in high_channel_streams(scheme, layers):
            chosen = self._role(layer, part, HIGH_CHANNELS)
            if chosen is None:
                raise SchemeError(f"the calibration lacks high_channels for layer {layer} {part} "
                                  f"({tq.high_channels} 8-bit channels per head)")
            if chosen.shape != (heads, tq.high_channels):
                raise SchemeError(f"calibration {layer}.{part}: high_channels must be integer indices of shape "
                                  f"[kv_heads={heads}, {tq.high_channels}], got {list(chosen.shape)}")
            if (chosen < 0).any() or (chosen >= head_dim).any() or (np.diff(chosen, axis=1) <= 0).any():
                raise SchemeError(f"calibration {layer}.{part}: high_channels must be strictly ascending channel "
                                  f"indices in [0, {head_dim}) per head")
        for layer, part, tq in static_streams(scheme, layers):
            if layer not in self or part not in self[layer]:
                raise SchemeError(f"the calibration has no entry for layer {layer} {part} (a static-scale stream)")
            n = tq.metadata_shape(head_dim)[1]
            for role in META_ROLES if tq.has_zero_point else ("scales",):
                array = self._role(layer, part, role)
                if array is None:
                    raise SchemeError(f"the calibration lacks {role} for layer {layer} {part}")
                if array.shape != (heads, n):
                    raise SchemeError(f"calibration {layer}.{part}.{role} has shape {list(array.shape)}; the scheme "
                                      f"needs [kv_heads={heads}, {n}]")
                if not np.isfinite(array).all() or (role == "scales" and not (array > 0).all()):
                    raise SchemeError(f"calibration {layer}.{part}.{role} has non-finite or non-positive values")

    def _role(self, layer: int, part: Part, role: str) -> np.ndarray | None:
        return self._arrays.get(f"{layer}.{part}.{role}")


def _as_numpy(array: Any) -> np.ndarray:
    """A numpy view of a numpy array, a torch tensor (on any device) or nested lists."""
    if hasattr(array, "detach"):
        return array.detach().cpu().numpy()
    return np.asarray(array)


class _Unreadable(Exception):
    """Why bytes are not a calibration ``.npz`` (becomes the caller's one-line error)."""


def _read_npz(data: bytes, limit: int) -> dict[str, np.ndarray]:
    """The arrays of an uncompressed or deflated ``.npz``, each checked against its header before it is read.

    ``np.load`` allocates what a member's header claims before reading it: a small file claiming a huge array
    would exhaust memory. Here every member's uncompressed size counts against ``limit`` and must match its
    header's shape and dtype (float32 or int32, no objects).
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise _Unreadable(str(err) or type(err).__name__) from None
    if len(members) > MAX_ARRAYS:
        raise _Unreadable(f"{len(members)} members; kvq reads at most {MAX_ARRAYS}")
    total = sum(m.file_size for m in members)
    if total > limit:
        raise _Unreadable(f"its arrays unpack to {total} bytes; kvq reads at most {limit}")
    arrays: dict[str, np.ndarray] = {}
    for member in members:
        if not member.filename.endswith(".npy"):
            raise _Unreadable(f"member {member.filename!r} is not a .npy array")
        try:
            with archive.open(member) as handle:
                raw = handle.read(member.file_size + 1)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError) as err:
            raise _Unreadable(f"member {member.filename!r}: {err}") from None
        arrays[member.filename[:-4]] = _read_npy(raw, member.filename)
    return arrays


def _read_weights(member: np.ndarray | None) -> dict[str, Any] | None:
    """:attr:`Calibration.weights` from its file member (None: no member, the model's own weights)."""
    if member is None:
        return None
    try:
        return _checked_weights(json.loads(member.tobytes().decode()))
    except (ValueError, KVQError) as err:
        raise _Unreadable(f"member {WEIGHTS_MEMBER!r} does not name the weights it was measured on: {err}") from None


def _read_npy(raw: bytes, name: str) -> np.ndarray:
    """One ``.npy`` member whose header must describe exactly the bytes that follow it."""
    fmt = np.lib.format
    handle = io.BytesIO(raw)
    try:
        version = fmt.read_magic(handle)
        header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = header(handle)
    except (ValueError, OSError, EOFError, SyntaxError) as err:
        raise _Unreadable(f"member {name!r} has no valid .npy header: {err}") from None
    allowed = (np.dtype("u1"),) if name == WEIGHTS_MEMBER + ".npy" else (np.dtype("<f4"), np.dtype("<i4"))
    if dtype.hasobject or dtype.newbyteorder("<") not in allowed:
        raise _Unreadable(f"member {name!r} holds {dtype}; calibration arrays are float32 or int32 (and "
                          f"{WEIGHTS_MEMBER} uint8 text)")
    count = int(np.prod(shape, dtype=np.int64))
    body = raw[handle.tell():]
    if len(body) != count * dtype.itemsize:
        raise _Unreadable(f"member {name!r} claims shape {list(shape)} ({count * dtype.itemsize} bytes) but holds "
                          f"{len(body)} bytes")
    array = np.frombuffer(body, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return array.astype(dtype.newbyteorder("="), copy=True)
