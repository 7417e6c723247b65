"""Atomic writes: a temporary file or directory beside the target, then one rename, so a reader never sees half.

``tempfile.mkstemp`` creates files readable by their owner only; a finished file gets the permissions an
ordinary ``open()`` would have given it (``0o666`` minus the umask), so exports, reports and engines written
by one user can be served by another.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kvq_export.errors import ExportError, OutputWriteError

logger = logging.getLogger(__name__)


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


_SPECIAL_KINDS = ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"),
                  (stat.S_ISSOCK, "socket"))


def _cannot_write(target: Path, err: OSError) -> OutputWriteError:
    where = f" ({err.filename})" if err.filename and os.fspath(err.filename) != os.fspath(target) else ""
    return OutputWriteError(f"cannot write {target}: {err.strerror or err}{where}", errno=err.errno,
                            filename=os.fspath(target))


def refuse_special_target(path: str | os.PathLike[str], what: str = "output", *, directory_ok: bool = False) -> None:
    """Refuse an output path naming what a new file must not replace: a device, FIFO or socket (or directory).

    Directly or through a link; a directory passes when ``directory_ok``. kvq writes a file beside the target and
    renames it into place: over ``/dev/null`` that would replace the device with a plain file (as root, for every
    program on the machine). Raises :class:`OutputWriteError`.
    """
    target = Path(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as err:  # a parent that is a file (ENOTDIR), a loop of links: nothing can be written there
        raise _cannot_write(target, err) from None
    if stat.S_ISDIR(mode):
        if not directory_ok:
            raise OutputWriteError(f"{what} {target} is a directory; give a file path", errno=errno.EISDIR,
                                   filename=os.fspath(target))
        return
    kind = next((name for test, name in _SPECIAL_KINDS if test(mode)), None)
    if kind is not None:
        raise OutputWriteError(f"{what} {target} is a {kind}, not a regular file: kvq writes a new file and renames "
                               "it into place, which would replace it; give a file path", errno=errno.EEXIST,
                               filename=os.fspath(target))


@contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing (``"w"`` or ``"wb"``); on success rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was. A target that is a device, FIFO,
    socket or directory is refused before anything is written, and a step of the file system's own that fails
    (a parent that is a file, a full disk at close, no permission) is one :class:`OutputWriteError` line; what the
    caller's block raises passes through unchanged.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    target = Path(path)
    refuse_special_target(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{aside_name(target.name)}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise _cannot_write(target, err) from None
    try:
        handle = os.fdopen(fd, mode)
        try:
            yield handle
        except BaseException:
            handle.close()
            raise
        try:
            handle.close()  # flushes: a full disk shows here
            os.chmod(tmp, file_mode())
            os.replace(tmp, target)
        except OSError as err:
            raise _cannot_write(target, err) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically; return the path (or :class:`OutputWriteError`)."""
    with atomic_writer(path, "wb" if isinstance(data, bytes) else "w") as handle:
        try:
            handle.write(data)
        except OSError as err:
            raise _cannot_write(Path(path), err) from None
    return Path(path)


# -- whole directories: built aside, then swapped in ---------------------------------------------------------
def temp_dir_beside(target: str | os.PathLike[str]) -> Path:
    """A new hidden directory ``.<name>.tmp-XXXX`` beside ``target``, to fill and then move into place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{aside_name(target.name)}.tmp-", dir=target.parent))


def seal_dir(directory: str | os.PathLike[str]) -> None:
    """Give a filled temporary directory the permissions an ordinary ``mkdir()`` would have."""
    os.chmod(directory, dir_mode())  # mkdtemp makes it 0700; the files inside follow the umask, so does it


def move_dir_into_place(new: Path, target: Path, *, replaceable: Callable[[Path], bool]) -> None:
    """Put the complete directory ``new`` at ``target``: at every instant ``target`` is the old or the new one.

    A non-empty ``target`` is replaced only when ``replaceable(target)``: swapped with ``new`` in one atomic
    exchange, then removed; where the platform has no exchange, two renames with the old one kept aside
    (``.<name>.old-<pid>``) until the new one is in place (:func:`clean_leftovers` restores it if the process dies
    in between). An empty ``target`` is replaced; one that appears meanwhile never is.

    Raises:
        FileExistsError: ``target`` holds a directory ``replaceable`` refuses, or appeared while ``new`` was built.
    """
    if target.is_dir() and any(target.iterdir()):
        if not replaceable(target):
            raise FileExistsError(errno.EEXIST, "filled by someone else", str(target))
        if exchange(new, target):
            shutil.rmtree(new, ignore_errors=True)  # ``new`` now names the old directory
            return
        trash = target.with_name(f".{aside_name(target.name)}.old-{os.getpid()}")
        os.replace(target, trash)
        os.replace(new, target)
        shutil.rmtree(trash, ignore_errors=True)
        return
    if target.is_dir():
        target.rmdir()  # empty: nothing to lose
    rename_noreplace(new, target)


def clean_leftovers(target: Path, *, complete: Callable[[Path], bool]) -> None:
    """Remove what an interrupted :func:`move_dir_into_place` of ``target`` left; call it holding the target's lock.

    A directory swapped aside (``.<name>.old-*``) while ``target`` is missing is put back first when
    ``complete(it)``: a crash between the two renames of the fallback swap then costs nothing.
    """
    name = glob.escape(aside_name(target.name))  # a name like "run[1]" is not a pattern
    for old in sorted(target.parent.glob(f".{name}.old-*")):
        if not os.path.lexists(target) and complete(old):
            logger.warning("restoring %s from %s (it was interrupted while being replaced)", target, old.name)
            os.rename(old, target)
        else:
            logger.info("removing %s, left by an interrupted write", old)
            shutil.rmtree(old, ignore_errors=True)
    for tmp in target.parent.glob(f".{name}.tmp-*"):
        logger.info("removing %s, left by an interrupted write", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def write_dir_atomically(target: Path, write: Callable[[Path], None], *, stale_after_s: float = 3600.0) -> None:
    """Fill a temporary directory beside ``target`` with ``write`` and rename it into place.

    A killed or failed ``write`` never leaves a ``target`` that looks complete. If another process finished
    ``target`` first, its copy is kept. Temporary directories older than ``stale_after_s`` (abandoned by a
    killed writer; no lock tells a live one apart) are removed first.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(aside_name(target.name))}.tmp-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > stale_after_s:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = temp_dir_beside(target)
    try:
        write(tmp)
        seal_dir(tmp)
        os.replace(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
        logger.info("%s was written concurrently; keeping that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def target_lock(out: Path, *, wait: bool = False) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``out`` for the whole export.

    A second export of ``out`` fails at once, or with ``wait`` blocks until the first has finished. The lock is
    never a symbolic link (opening one would create or lock the file it points to) and never anything but a
    plain file of one link; a directory that cannot hold it is one ExportError.
    """
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{aside_name(out.name)}.lock"
    while True:
        try:  # O_NONBLOCK: a FIFO or a device put there must not hang the open
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, file_mode())
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise ExportError(f"the lock file {lock} is a symbolic link; kvq never follows one: remove it "
                                  "if no kvq export is running") from None
            if err.errno == errno.EISDIR:
                raise ExportError(f"the lock file {lock} is a directory; remove it if no kvq export is running"
                                  ) from None
            raise ExportError(f"cannot create the lock file {lock} ({err.strerror}): the directory that holds "
                              "the export must be writable") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise ExportError(f"the lock file {lock} is not a plain file of its own; remove it if no kvq export "
                              "is running")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise ExportError(f"another kvq export is writing {out} right now; run again when it has finished"
                              ) from None
        try:  # the holder before us may have removed the file after we opened it: lock the current one
            if info.st_ino == os.lstat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
