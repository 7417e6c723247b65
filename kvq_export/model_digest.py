"""Which model an export came from, by content: a digest of the model's files, not of its name.

Two models both called ``tiny``, a model edited in place, and one path read from two working directories
are told apart by :func:`model_digest`: the sha256 of every file of the source (a Hugging Face directory's
config, weights and tokenizer files; a GGUF file), each file hashed once per process and file version by
:func:`kvq_export._read.file_sha256`, the memo every content check of kvq shares. The exporter records it
(``build.source_digest`` of ``kvq.json``), and the automatic baselines of validation and the demo are keyed and
checked by it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvq_export._read import file_sha256
from kvq_export.errors import KVQError, ModelError
from kvq_export.model_source import canonical_spec, resolve_spec, weights_digest

#: Hex digits of a model digest (64 bits: collisions among one user's models are not a concern).
DIGEST_CHARS = 16


def source_files(spec: str | os.PathLike[str]) -> list[Path]:
    """The files whose content is the model: a GGUF file, or every regular file of a model directory."""
    source = resolve_spec(spec)  # a missing or unusable source is a one-line ModelError
    if source.kind == "gguf":
        return [source.path]
    files = []
    for dirpath, dirnames, filenames in os.walk(source.path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .cache/.git: not the model
        files += [Path(dirpath) / name for name in sorted(filenames) if not name.startswith(".")]
    return [path for path in files if path.is_file()]


def model_digest(spec: str | os.PathLike[str]) -> str:
    """Digest of the model ``spec`` names (its files' relative names and contents).

    Raises :class:`ModelError` when the spec names no usable model (gone, or not a model).
    """
    root = resolve_spec(spec).path
    h = hashlib.sha256()
    for path in source_files(spec):
        name = path.name if path == root else str(path.relative_to(root))
        h.update(name.encode() + b"\0" + _file_sha256(path).encode() + b"\n")
    return h.hexdigest()[:DIGEST_CHARS]


def model_identity(model) -> dict[str, str]:
    """What a result derived from ``model`` is keyed and recorded by: its content, never its name.

    A spec gives its absolute path and :func:`model_digest` (every file of the source); a loaded model the
    sha256 of its config and tensors.
    """
    if not isinstance(model, (str, os.PathLike)):
        return {"weights": weights_digest(model)}
    return {"spec": canonical_spec(model), "digest": model_digest(model)}


def recorded_source(manifest) -> tuple[str, str]:
    """(source spec, digest) of the model an export was made from, refused unless that model is still there as it was.

    Whatever re-exports "the same model" for an export (validation's baseline, TensorRT's reference) must read
    the weights the export was made from: a source that is gone, was edited in place, or is recorded without its
    digest (an older kvq) is a one-line :class:`KVQError`, never a guess.
    """
    source, want = manifest.model.source, manifest.source_digest
    if not source:
        raise KVQError("this export does not record its model source; pass the other export directory "
                       "(--baseline DIR for validation)")
    if want is None:
        raise KVQError(f"this export does not record the content digest of its model source {source} (exported by "
                       "an older kvq): export it again, or pass the other export directory (--baseline DIR)")
    try:
        got = model_digest(source)
    except ModelError as err:
        raise KVQError(f"the model source of this export is gone ({err}); pass the other export directory "
                       "(--baseline DIR)") from None
    if got != want:
        raise KVQError(f"the model at {source} changed since this export was made (content digest {got}, the export "
                       f"recorded {want}): export it again, or pass the other export directory (--baseline DIR)")
    return source, want


def _file_sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as err:
        raise ModelError(f"cannot read the model file {path}: {err.strerror or err}") from None
