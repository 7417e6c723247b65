"""One exception family for kvq.

The CLI turns any :class:`KVQError` into a one-line message and exit code 1; every other exception
keeps its traceback because it is a bug, not bad input.
"""

from __future__ import annotations


class KVQError(Exception):
    """Base of every error kvq raises on purpose (bad input, missing dependency, bad file).

    ``cli`` is the same message in the command line's words (``--force`` where the API says ``force=True``);
    the CLI prints :meth:`for_cli`, a Python caller sees the message itself.
    """

    def __init__(self, *args: object, cli: str | None = None) -> None:
        super().__init__(*(one_line(arg) for arg in args))
        self.cli = None if cli is None else one_line(cli)

    def for_cli(self) -> str:
        """The message as the command line says it."""
        return self.cli or str(self)


def one_line(text: object) -> object:
    """A message's lines joined by spaces (a reason quoted from another library may span lines); others as given."""
    if isinstance(text, str) and ("\n" in text or "\r" in text):
        return " ".join(line.strip() for line in text.splitlines() if line.strip())
    return text


class SchemeError(KVQError, ValueError):
    """A quantization scheme (or preset name) is invalid."""


class ModelError(KVQError):
    """A model cannot be found, loaded or is of an unsupported architecture."""


class ExportError(KVQError):
    """Exporting a model to ONNX failed or was refused."""


class RuntimeInputError(KVQError):
    """Inputs given to an exported model do not match its manifest."""


class StoredPrefillError(RuntimeInputError):
    """An export whose graph cannot attend over its stored codes on every call (it predates the switch)."""


class QuantizationError(KVQError, ValueError):
    """Values cannot be quantized (NaN/Inf, wrong shape)."""


class DependencyError(KVQError, ImportError):
    """An optional dependency (TensorRT, Triton, a GPU stack) is not installed."""


class GateError(KVQError):
    """A run finished but missed a threshold the user set (``kvq validate --max-ppl-delta`` ...)."""


class OutputPathError(KVQError):
    """An output path is refused (it lies inside an export directory, whose files are checksummed)."""


class OutputWriteError(OutputPathError, OSError):
    """An output file cannot be written there: a device or directory in its place, a file as parent, a full disk.

    Also an :class:`OSError` with the file system's ``errno``, so a caller that handles file-system errors (the
    exporter's "nothing was written or replaced") still does; its text is the one-line message.
    """

    def __init__(self, message: str, *, errno: int | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.errno, self.strerror, self.filename = errno, message, filename

    def __str__(self) -> str:
        return str(self.args[0])


class CalibrationWeightsError(KVQError):
    """A calibration measured on other weights than the ones an export runs (fp32 scales for int4 weights)."""
