"""Drive an export directory on ONNX Runtime: quantized cache kept between steps, prefill + decode.

:func:`open_session` opens one as a :class:`~kvq_export.runtime.base.Session`: kvq's own loop (``kvq``,
:class:`~kvq_export.runtime.session.KVQSession`) or onnxruntime-genai's (``genai``,
:class:`~kvq_export.runtime.genai.GenaiSession`, ``--flavor ort-gqa`` exports).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvq_export.errors import RuntimeInputError

if TYPE_CHECKING:  # the package stays light: a session's module is imported when one opens
    from kvq_export.runtime.base import Session

def _open_kvq(directory: str | os.PathLike[str], **kwargs: Any) -> Session:
    from kvq_export.runtime.session import KVQSession  # lazy: the package stays light; a runtime loads when opened

    return KVQSession(directory, **kwargs)


def _open_genai(directory: str | os.PathLike[str], *, threads: int | None, verify_weights: bool,
                providers: Sequence[str] | None, **options: Any) -> Session:
    if options:
        raise RuntimeInputError(f"runtime genai takes no {', '.join(sorted(options))}; allowed: threads, "
                                "verify_weights, providers")
    from kvq_export.runtime.genai import GenaiSession  # lazy: the package stays light; a runtime loads when opened

    return GenaiSession(directory, threads=threads, verify_weights=verify_weights, providers=providers)


#: How each runtime opens a directory, by the name ``open_session``, ``kvq generate --runtime`` and
#: :attr:`Session.runtime <kvq_export.runtime.base.Session.runtime>` know it (its module is imported only then).
_OPENERS: dict[str, Callable[..., Session]] = {"kvq": _open_kvq, "genai": _open_genai}
#: the runtimes :func:`open_session` knows
RUNTIMES = tuple(_OPENERS)


def open_session(directory: str | os.PathLike[str], runtime: str = "kvq", *, threads: int | None = None,
                 verify_weights: bool = True, providers: Sequence[str] | None = None, **options: Any) -> Session:
    """An export directory opened on ``runtime`` (one of :data:`RUNTIMES`).

    ``providers``: ONNX Runtime providers (:func:`~kvq_export.runtime.device.providers_for`; None: the runtime's
    default). ``options`` (capacity, spinning) go to :class:`~kvq_export.runtime.session.KVQSession`, which alone
    takes them.
    """
    opener = _OPENERS.get(runtime)
    if opener is None:
        raise RuntimeInputError(f"unknown runtime {runtime!r}; allowed: {', '.join(RUNTIMES)}")
    return opener(directory, threads=threads, verify_weights=verify_weights, providers=providers, **options)
