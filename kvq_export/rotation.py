"""Orthonormal rotations of the head dimension that a scheme may apply before a stream is quantized.

A rotation ``R`` ([D, D], orthonormal: ``R @ R.T = I``) moves a stream into a basis where outliers are
spread over the head, so a per-group range wastes fewer levels. kvq applies it the way llama.cpp does
since it rotates its quantized caches:

* keys (``key.rotation``): q and k are both multiplied by ``R`` after RoPE, before k is quantized;
  ``(q R) . (k R) = q . k``, so attention scores are unchanged in exact arithmetic and the cache stores
  ``k R``;
* values (``value.rotation``): v is multiplied by ``R`` before it is quantized, so the cache stores
  ``v R``; attention then yields ``o R`` (a convex combination of rotated rows) and ``o = (o R) R.T``.

Row vectors throughout: a stored row is ``x @ R`` and the inverse is ``y @ R.T``. Code never relies on
``R`` being symmetric, so a non-symmetric orthogonal kind (a seeded random rotation) only needs a
builder in :data:`_BUILDERS` and a member of :class:`~kvq_export.vocab.Rotation`.

``hadamard``: the normalized Sylvester Hadamard matrix ``H_n = H_{n/2} (x) [[1, 1], [1, -1]] / sqrt(2)``
(entries ``+-1/sqrt(n)``, ``H = H.T = H^-1``). A head_dim that is not a power of two gets a
block-diagonal matrix whose blocks are the powers of two of head_dim's binary expansion, largest first
(96 -> 64 + 32, 80 -> 64 + 16): still symmetric, orthonormal and its own inverse. An odd head_dim is
refused (a 1-wide block would leave a channel unrotated; RoPE needs an even head_dim anyway).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from kvq_export.errors import SchemeError
from kvq_export.vocab import Part, Rotation

if TYPE_CHECKING:
    import torch


def hadamard(n: int) -> np.ndarray:
    """The normalized ``n x n`` Sylvester Hadamard matrix (float64); ``n`` a power of two."""
    if n < 1 or n & (n - 1):
        raise SchemeError(f"invalid Hadamard size {n}: allowed: a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard_blocks(head_dim: int) -> tuple[int, ...]:
    """Block sizes of the block-diagonal Hadamard for ``head_dim``: its binary expansion, largest first."""
    return tuple(1 << b for b in range(head_dim.bit_length() - 1, -1, -1) if head_dim >> b & 1)


def check_rotation(kind: str, head_dim: int, where: str) -> None:
    """Raise a :class:`SchemeError` when ``kind`` cannot rotate a head of ``head_dim`` channels."""
    if kind not in tuple(Rotation):
        raise SchemeError(f"invalid {where}.rotation={kind!r}: allowed: {', '.join(Rotation)}")
    if kind == Rotation.HADAMARD and head_dim % 2:
        raise SchemeError(
            f"invalid {where}.rotation='hadamard': head_dim={head_dim} is odd (a block-diagonal Hadamard over "
            "power-of-two blocks needs an even head_dim); allowed here: none"
        )


def _block_hadamard(head_dim: int) -> np.ndarray:
    out = np.zeros((head_dim, head_dim))
    start = 0
    for size in hadamard_blocks(head_dim):
        out[start:start + size, start:start + size] = hadamard(size)
        start += size
    return out


_BUILDERS = {Rotation.HADAMARD: _block_hadamard}


@lru_cache(maxsize=16)
def _matrix(kind: str, head_dim: int) -> np.ndarray:
    check_rotation(kind, head_dim, "stream")
    matrix = _BUILDERS[kind](head_dim)
    matrix.setflags(write=False)
    return matrix


def rotation_matrix(kind: str, head_dim: int) -> np.ndarray | None:
    """``R`` ([D, D] float64, read-only) for ``kind``, or None for ``none`` (the identity, never applied)."""
    return None if kind == Rotation.NONE else _matrix(kind, head_dim)


def describe_rotation(kind: str, head_dim: int) -> str:
    """Human text for a manifest: the kind and, for Hadamard, its blocks."""
    if kind == Rotation.NONE:
        return "none"
    blocks = hadamard_blocks(head_dim)
    if len(blocks) == 1:
        return f"hadamard {head_dim}x{head_dim}"
    return f"block-diagonal hadamard ({' + '.join(str(b) for b in blocks)})"


# -- applying it ----------------------------------------------------------------------------------------
def rotate_torch(x: torch.Tensor, matrix: np.ndarray | None, *, inverse: bool = False) -> torch.Tensor:
    """``x @ R`` (or ``x @ R.T`` with ``inverse``) over the last axis, in float32; ``x`` unchanged for None.

    float32 like the exported graphs (a MatMul by an fp32 ``R``), whatever ``x``'s dtype.
    """
    if matrix is None:
        return x
    import torch

    r = torch.from_numpy(np.ascontiguousarray(matrix.T if inverse else matrix, dtype=np.float32)).to(x.device)
    return torch.matmul(x.float(), r)


def rotate_numpy(x: np.ndarray, matrix: np.ndarray | None, *, inverse: bool = False) -> np.ndarray:
    """``x @ R`` (or ``x @ R.T``) over the last axis in ``x``'s float dtype (float64 stays float64)."""
    if matrix is None:
        return x
    r = matrix.T if inverse else matrix
    dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float32
    return np.asarray(x, dtype=dtype) @ r.astype(dtype)


def stream_rotation(scheme, layer: int, part: Part, head_dim: int) -> np.ndarray | None:
    """``R`` of ``layer``'s ``key``/``value`` stream under ``scheme`` (a KVQuantScheme), or None."""
    key, value = scheme.for_layer(layer)
    return rotation_matrix((key if part == Part.KEY else value).rotation, head_dim)
