"""Opening ONNX Runtime for kvq: providers, intra-op threads, session options, values, and loading a graph.

Every kvq session (:class:`~kvq_export.runtime.session.KVQSession`, the probed session of the validator) opens
ONNX Runtime through these, so providers are checked, threads follow ``OMP_NUM_THREADS`` and an unloadable model
is one line. ONNX Runtime is imported inside each function: importing this module stays light.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvq_export.dtypes import DType
from kvq_export.errors import RuntimeInputError, StoredPrefillError
from kvq_export.naming import EXACT_PREFILL

logger = logging.getLogger(__name__)


def choose_providers(requested: Sequence[str] | None = None) -> list[str]:
    """ONNX Runtime providers: the requested ones (checked), else CUDA when usable, else CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise RuntimeInputError(
                f"provider(s) {', '.join(missing)} not available; available: {', '.join(available)}")
        return list(requested)
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def default_threads() -> int | None:
    """Intra-op threads for a session that names none: ``OMP_NUM_THREADS`` when set, else None (the runtime's choice).

    torch and the BLAS libraries honour that variable and ONNX Runtime does not, so without this a process told
    to use one core would still start one ONNX Runtime worker per core. A value that is not a positive integer
    is ignored with a warning, as torch does.
    """
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not text:
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    logger.warning("OMP_NUM_THREADS=%r is not a positive integer; ignored (ONNX Runtime picks its threads)", text)
    return None


def session_options(threads: int | None = None, *, spinning: bool = False):
    """ONNX Runtime session options every kvq session uses.

    ``threads``: intra-op threads (None = :func:`default_threads`). ``spinning``: let idle intra-op workers spin
    between runs (ONNX Runtime's default). Off by default, as in onnxruntime-genai's loop: a generation loop
    does Python work between steps, and workers that spin through it compete with it for the cores, which slows
    every step on a machine whose cores are busy (docs/design/serving.md).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    threads = threads or default_threads()
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def attend_stored(model_path: Path, options, model=None) -> list:
    """Set the graph's :data:`~kvq_export.naming.EXACT_PREFILL` false in ``options``; returns the values it holds.

    Every call of a quantized ``buffer``-layout graph then attends over the stored codes. Keep the values alive as
    long as the session. ``model``: the graph already loaded (a rewrite of ``model_path``'s), read instead of the file.
    """
    import onnx
    import onnxruntime as ort

    graph = (model or onnx.load(str(model_path), load_external_data=False)).graph
    names = {init.name for init in graph.initializer}
    if EXACT_PREFILL not in names:
        raise StoredPrefillError(f"{model_path}: the graph has no {EXACT_PREFILL} switch, so a prompt always attends "
                                "over its own exact keys and values; export it again with this kvq")
    value = ort.OrtValue.ortvalue_from_numpy(np.array(False))
    options.add_initializer(EXACT_PREFILL, value)
    return [value]


def ort_value(array: np.ndarray, dtype: str):
    """An OrtValue holding ``array`` as the manifest element type ``dtype`` (fp8: from raw uint8 bits)."""
    import onnxruntime as ort

    if dtype == "float8e4m3fn":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array).view(np.uint8),
                                                               DType.get(dtype).proto)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype=DType.get(dtype).bits_numpy))


def open_onnx(path: Path, options, providers: Sequence[str], model=None):
    """An ONNX Runtime session of ``path``; a file it cannot load is a one-line :class:`RuntimeInputError`.

    ``model``: a ``ModelProto`` to run instead of the file (a rewrite of it), whose external data ONNX Runtime reads
    from ``path``'s folder.
    """
    import onnxruntime as ort

    try:
        if model is not None:
            from kvq_export.runtime.last_logits import EXTERNAL_DATA_FOLDER

            options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(Path(path).parent))
            return ort.InferenceSession(model.SerializeToString(), options, providers=list(providers))
        return ort.InferenceSession(str(path), options, providers=list(providers))
    except Exception as err:  # noqa: BLE001 - ONNX Runtime raises its own untyped errors for unreadable models
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeInputError(f"ONNX Runtime cannot load {path}: {first}") from None
