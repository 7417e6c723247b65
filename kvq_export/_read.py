"""Bounded reads of the small files kvq parses: text, JSON, tokenizer and calibration files.

Every such file is read through :func:`read_bytes`, which never takes more than a limit: a device
(``/dev/zero``), a pipe or a sparse file of many GiB named as a prompts file, a scheme or an export's
``kvq.json`` is a one-line error that states the limit, not an exhausted memory. JSON is parsed by
:func:`parse_json`, which also bounds integer literals and nesting (Python's own limits raise a plain
``ValueError`` or ``RecursionError``).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvq_export.errors import KVQError

logger = logging.getLogger(__name__)

MiB = 1 << 20
#: a prompts file, a scheme or a manifest: text a person writes or kvq writes, far below this
TEXT_LIMIT = 64 * MiB
#: a calibration or perplexity corpus (kvq's britannica text is 285 KB)
CORPUS_LIMIT = 512 * MiB
#: tokenizer.json and friends (large vocabularies are tens of MiB)
TOKENIZER_LIMIT = 256 * MiB
#: an export's calibration.npz (a 80-layer model's per-channel scales are about 1 MiB)
CALIBRATION_LIMIT = 64 * MiB
#: digits of a JSON integer kvq accepts (a 64-bit integer has 20)
JSON_INT_DIGITS = 20

#: the files a Hugging Face tokenizer reads from its directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja")


def _size_label(limit: int) -> str:
    return f"{limit // MiB} MiB" if limit >= MiB and limit % MiB == 0 else f"{limit} bytes"


def read_bytes(path: str | os.PathLike[str], what: str, *, limit: int = TEXT_LIMIT,
               error: type[KVQError] = KVQError) -> bytes:
    """The bytes of ``path`` (``what`` names it in errors), refused beyond ``limit`` bytes without reading them."""
    try:
        with open(path, "rb") as handle:
            st = os.fstat(handle.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size > limit:
                raise error(f"{what} {os.fspath(path)} is {st.st_size} bytes; kvq reads at most "
                            f"{_size_label(limit)} of it")
            data = handle.read(limit + 1)  # a device or a pipe has no size: read one byte past the limit
    except OSError as err:
        raise error(f"cannot read {what} {os.fspath(path)}: {err.strerror or err}") from None
    if len(data) > limit:
        raise error(f"{what} {os.fspath(path)} holds more than {_size_label(limit)}; kvq reads at most that")
    return data


def read_text(path: str | os.PathLike[str], what: str, *, limit: int = TEXT_LIMIT,
              error: type[KVQError] = KVQError) -> str:
    """:func:`read_bytes` decoded as UTF-8 with ``\\r\\n`` and ``\\r`` read as ``\\n`` (as ``open()`` does).

    Bytes that are not UTF-8 are a one-line error.
    """
    data = read_bytes(path, what, limit=limit, error=error)
    try:
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as err:
        raise error(f"{what} {os.fspath(path)} is not UTF-8 text ({err.reason} at byte {err.start})") from None


class _LongInteger(ValueError):
    pass


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > JSON_INT_DIGITS:
        raise _LongInteger(f"an integer of {len(text.lstrip('-'))} digits (at most {JSON_INT_DIGITS})")
    return int(text)


def parse_json(text: str | bytes, what: str, *, error: type[KVQError] = KVQError) -> Any:
    """``json.loads`` with integers of at most :data:`JSON_INT_DIGITS` digits and a bounded nesting depth."""
    try:
        return json.loads(text, parse_int=_bounded_int)
    except _LongInteger as err:
        raise error(f"{what} is not valid: {err}") from None
    except RecursionError:
        raise error(f"{what} is not valid JSON: nested too deeply") from None
    except json.JSONDecodeError as err:
        raise error(f"{what} is not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise error(f"{what} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def read_json(path: str | os.PathLike[str], what: str, *, limit: int = TEXT_LIMIT,
              error: type[KVQError] = KVQError) -> Any:
    """A JSON file through :func:`read_text` and :func:`parse_json`."""
    return parse_json(read_text(path, what, limit=limit, error=error), f"{what} {os.fspath(path)}", error=error)


_DIGESTS: dict[tuple[int, ...], str] = {}


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's content, hashed once per process and file version.

    The version is the inode with size, mtime and ctime: every write changes ctime, even one that restores the
    size and the mtime, so a rewritten file is hashed again.
    """
    st = os.stat(path)
    version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if version not in _DIGESTS:
        import hashlib

        with open(path, "rb") as handle:
            _DIGESTS[version] = hashlib.file_digest(handle, "sha256").hexdigest()
    return _DIGESTS[version]


def check_sizes(directory: str | os.PathLike[str], names: Iterable[str], what: str, *, limit: int,
                error: type[KVQError] = KVQError) -> None:
    """Refuse, before a library reads them whole, files in ``directory`` that are not plain files within ``limit``.

    For files another library opens itself (transformers' tokenizer, onnxruntime-genai): kvq cannot hand it
    a capped reader, so it checks what the library will find.
    """
    for name in names:
        path = Path(directory) / name
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        except OSError as err:
            raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is not a regular file")
        if st.st_size > limit:
            raise error(f"{what} {path} is {st.st_size} bytes; kvq reads at most {_size_label(limit)} of it")


_warned_shadowed: set[tuple[str, str]] = set()


def warn_shadowed(name: str, meaning: str) -> None:
    """Log that a bare ``name`` kvq reads as ``meaning`` is also a path here, which is then not used.

    The name always wins, wherever the command runs; the warning says so, and how to name the path instead.
    """
    key = (name, os.getcwd())
    if key not in _warned_shadowed and os.path.lexists(name):
        _warned_shadowed.add(key)  # once per name and directory: a name is resolved many times in one command
        logger.warning("%r names %s; %s in the current directory is not used (give ./%s to use it)", name, meaning,
                       name, name)
