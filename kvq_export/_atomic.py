"""Atomic file writes: a temporary file beside the target, then one rename, so a reader never sees half a file.

``tempfile.mkstemp`` creates files readable by their owner only; a finished file gets the permissions an
ordinary ``open()`` would have given it (``0o666`` minus the umask), so exports, reports and engines written
by one user can be served by another.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing (``"w"`` or ``"wb"``); on success rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically; return the path."""
    with atomic_writer(path, "wb" if isinstance(data, bytes) else "w") as handle:
        handle.write(data)
    return Path(path)
