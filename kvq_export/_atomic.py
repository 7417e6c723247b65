"""Atomic file writes: a temporary file beside the target, then one rename, so a reader never sees half a file.

``tempfile.mkstemp`` creates files readable by their owner only; a finished file gets the permissions an
ordinary ``open()`` would have given it (``0o666`` minus the umask), so exports, reports and engines written
by one user can be served by another.
"""

from __future__ import annotations

import errno
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


def file_mode() -> int:
    """Permissions an ordinary ``open()`` gives a new file under the current umask."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """Permissions an ordinary ``mkdir()`` gives a new directory under the current umask."""
    return 0o777 & ~_umask()


#: longest name whose companions (``.<name>.tmp-XXXXXXXX``, ``.<name>.old-<pid>``, ``.<name>.lock``) fit in
#: the 255 bytes a file name may have
_ASIDE_MAX = 255 - len("..tmp-XXXXXXXX")


def aside_name(name: str) -> str:
    """The stem of the hidden files kept beside ``name``: ``name`` itself, or a short digest of a long one."""
    if len(os.fsencode(name)) <= _ASIDE_MAX:
        return name
    import hashlib

    return "kvq-" + hashlib.sha256(os.fsencode(name)).hexdigest()[:16]


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``; False where the C library or the filesystem does not offer it."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if call(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(dst))


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap two existing paths in one atomic step (a reader sees one or the other, never neither).

    Returns False where the platform cannot (the caller then falls back to two renames).
    """
    return _renameat2(Path(a), Path(b), _RENAME_EXCHANGE)


def rename_noreplace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename ``src`` to ``dst``; raise :class:`FileExistsError` if ``dst`` exists, even if created meanwhile."""
    if _renameat2(Path(src), Path(dst), _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):  # no atomic no-replace here: the check then the rename is the best available
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    os.rename(src, dst)


@contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing (``"w"`` or ``"wb"``); on success rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{aside_name(target.name)}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.chmod(tmp, file_mode())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically; return the path."""
    with atomic_writer(path, "wb" if isinstance(data, bytes) else "w") as handle:
        handle.write(data)
    return Path(path)
