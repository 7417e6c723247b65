"""The Triton kernels built once for the tests: on CUDA where there is a GPU, else in Triton's CPU interpreter.

Importing this module skips the importing test module where the kernels cannot run.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvq_plugins import get_kernel
from kvq_plugins import triton_kernels as tk
from triton_harness import ALL, SMALL, float64_attention

CUDA = torch.cuda.is_available()
INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    tk.build()
finally:
    if INTERPRET_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = INTERPRET_BEFORE
DEVICE = tk.device_type()
if DEVICE == "cuda" and not CUDA:
    pytest.skip("the kernels were already built for CUDA in this process, and there is no CUDA device",
                allow_module_level=True)

TOLERANCE = 2e-3  # ‖out − ref‖ / ‖ref‖
PRESETS = sorted(name for name in ALL if name not in SMALL)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    DEVICE != "cuda", reason="needs a CUDA GPU (torch.cuda.is_available() is False); on CPU the same kernels "
    "run in the Triton interpreter at small sizes in the other tests of this module")


def run_attention(case, q, *, scale, window=None, num_splits=None):
    """The kernel into a NaN-poisoned output (every element must be written) and the float64 reference."""
    out = torch.full_like(q, float("nan"))
    got = get_kernel("decode_attention")(q, case.seq_lengths, case.key, case.value, case.key_layout,
                                         case.value_layout, scale=scale, window=window, num_splits=num_splits,
                                         out=out)
    assert got is out
    assert bool(torch.isfinite(out).all()), "an output element was not written"
    return out, float64_attention(q.cpu(), case, scale, window)
