"""A GGUF file's header, read without its tensor data and without trusting a single length it states.

:func:`read_gguf_header` streams the header with the gguf package's type codes and skips its arrays:
``gguf.GGUFReader`` would also decode every vocabulary entry, tens of thousands of strings in a real model
(docs/design/decoder.md). Every length, count and tensor size the header states is checked against the bytes the
file holds before anything is read or allocated (:class:`_HeaderStream`), and arrays nest at most
:data:`GGUF_MAX_ARRAY_DEPTH` deep, so a hostile header costs no memory and no recursion. The gguf package and numpy
are imported only when a header is read.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

#: deepest array-of-arrays a GGUF header may hold (llama.cpp writes flat arrays)
GGUF_MAX_ARRAY_DEPTH = 4
#: most dimensions of a GGUF tensor (ggml's GGML_MAX_DIMS)
GGUF_MAX_DIMS = 4

Scalar = str | int | float | bool


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file's header says: its scalar metadata (arrays such as the vocabulary skipped) and tensor names."""

    metadata: dict[str, Scalar]
    tensor_names: tuple[str, ...]

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (llama.cpp's architecture name), or None when the file states none."""
        arch = self.metadata.get("general.architecture")
        return None if arch is None else str(arch)

    def arch_key(self, name: str) -> Scalar | None:
        """The architecture's own key ``<arch>.<name>`` (``rope.freq_base``, ...), or None."""
        return self.metadata.get(f"{self.architecture}.{name}")


def read_gguf_header(path: Path) -> GgufHeader:
    """Read a GGUF file's header: scalar metadata and tensor names, no tensor data.

    Bad or short bytes raise ``ValueError``/``EOFError``; a header that passes describes a file every later
    reader (transformers' GGUF loader) can read within its size.
    """
    from gguf import GGUF_DEFAULT_ALIGNMENT

    with open(path, "rb") as handle:
        stream = _HeaderStream(handle)
        tensor_count, kv_count = stream.number("Q"), stream.number("Q")
        stream.claim(kv_count * 12, f"{kv_count} metadata entries")  # each at least a key length and a type
        stream.claim(tensor_count * 24, f"{tensor_count} tensors")  # name length, dims count, type, offset
        metadata = _read_metadata(stream, kv_count)
        extents = [_read_tensor_info(stream) for _ in range(tensor_count)]
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"GGUF general.alignment {alignment!r} is not a power of two")
        data_start = -(-handle.tell() // alignment) * alignment
        for name, offset, size in extents:
            if data_start + offset + size > stream.file_size:
                raise ValueError(f"GGUF tensor {name!r} claims {size} bytes at offset {offset} of its data, "
                                 f"beyond the file's {stream.file_size} bytes")
        return GgufHeader(metadata, tuple(name for name, _, _ in extents))


class _HeaderStream:
    """Reads a GGUF header's values in its byte order; a length beyond the file's end is refused before use."""

    def __init__(self, handle: IO[bytes]) -> None:
        import numpy as np
        from gguf import GGUF_MAGIC, GGUFReader

        self.handle = handle
        self.file_size = os.fstat(handle.fileno()).st_size
        magic, version = struct.unpack("<II", self.read(8))
        if magic != GGUF_MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads byte-swapped
        version = struct.unpack(self.order + "I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self.scalars: dict[Any, Any] = {kind: np.dtype(dtype).newbyteorder(self.order)
                                        for kind, dtype in GGUFReader.gguf_scalar_to_np.items()}

    def left(self) -> int:
        return self.file_size - self.handle.tell()

    def claim(self, size: int, what: str) -> int:
        """``size``, once the file is known to hold that many more bytes."""
        if size > self.left():
            raise ValueError(f"the GGUF header states {what} of {size} bytes at offset {self.handle.tell()}, "
                             f"but the file has {self.left()} bytes left")
        return size

    def read(self, size: int) -> bytes:
        data = self.handle.read(size)
        if len(data) != size:
            raise EOFError("the file ends inside its GGUF header")
        return data

    def skip(self, size: int, what: str) -> None:
        self.handle.seek(self.claim(size, what), os.SEEK_CUR)

    def number(self, fmt: str) -> int:
        return struct.unpack(self.order + fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self, what: str) -> str:
        return self.read(self.claim(self.number("Q"), what)).decode("utf-8")

    def scalar(self, kind: Any) -> Scalar:
        import numpy as np

        dtype = self.scalars[kind]
        return np.frombuffer(self.read(dtype.itemsize), dtype)[0].item()

    def skip_array(self) -> None:
        """Skip an array value (item type, count, items), nested arrays included, without recursion."""
        from gguf import GGUFValueType

        pending = [1]  # arrays still to skip, per nesting level
        while pending:
            if not pending[-1]:
                pending.pop()
                continue
            pending[-1] -= 1
            kind, count = GGUFValueType(self.number("I")), self.number("Q")
            if kind == GGUFValueType.ARRAY:
                if len(pending) >= GGUF_MAX_ARRAY_DEPTH:
                    raise ValueError(f"the GGUF header nests arrays deeper than {GGUF_MAX_ARRAY_DEPTH} levels")
                self.claim(count * 12, f"an array of {count} arrays")  # each at least a type and a count
                pending.append(count)
            elif kind == GGUFValueType.STRING:
                self.claim(count * 8, f"an array of {count} strings")  # each at least its length
                for _ in range(count):
                    self.skip(self.number("Q"), "a string")
            else:
                self.skip(count * self.scalars[kind].itemsize, f"an array of {count} numbers")


def _read_metadata(stream: _HeaderStream, count: int) -> dict[str, Scalar]:
    """``count`` key/value entries: strings and numbers kept, arrays (the vocabulary, ...) skipped."""
    from gguf import GGUFValueType

    metadata: dict[str, Scalar] = {}
    for _ in range(count):
        key = stream.string("a metadata key")
        kind = GGUFValueType(stream.number("I"))
        if kind == GGUFValueType.STRING:
            metadata[key] = stream.string(f"the value of {key}")
        elif kind == GGUFValueType.ARRAY:
            stream.skip_array()
        else:
            metadata[key] = stream.scalar(kind)
    return metadata


def _read_tensor_info(stream: _HeaderStream) -> tuple[str, int, int]:
    """One tensor's entry (name, n_dims, dims, ggml type, offset): its name, data offset and size in bytes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = stream.string("a tensor name")
    n_dims = stream.number("I")
    if n_dims > GGUF_MAX_DIMS:
        raise ValueError(f"GGUF tensor {name!r} has {n_dims} dimensions; at most {GGUF_MAX_DIMS}")
    dims = [stream.number("Q") for _ in range(n_dims)]
    kind, offset = GGMLQuantizationType(stream.number("I")), stream.number("Q")
    if kind not in GGML_QUANT_SIZES:
        raise ValueError(f"GGUF tensor {name!r} has ggml type {kind.name}, which has no known size")
    block, block_bytes = GGML_QUANT_SIZES[kind]
    if dims and dims[0] % block:
        raise ValueError(f"GGUF tensor {name!r}: its first dimension {dims[0]} is not a multiple of "
                         f"{kind.name}'s block of {block}")
    return name, offset, math.prod(dims) // block * block_bytes
