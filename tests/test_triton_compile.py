"""Every Triton kernel compiles for real NVIDIA targets, on CPU (no GPU needed to compile).

In a subprocess without ``TRITON_INTERPRET`` (the kernels must be jitted for compilation), Triton compiles
the fused attention kernel as the TensorRT AOT implementation hands it over (PTX with exactly the
parameters TensorRT passes: plugin inputs, int32 region lengths, output), and that PTX is assembled
again with the ptxas Triton ships; the split reduction and both quantize kernels compile to cubin.
This proves the GPU code paths compile (sm_80 and sm_90); it does not run them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

if find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install 'kvq[triton]')", allow_module_level=True)

SCRIPT = r"""
import json, subprocess, sys, tempfile
from pathlib import Path

from triton.backends.nvidia.compiler import get_ptxas

from kvq_export.model_facts import ModelFacts, RopeFacts
from kvq_export.presets import PRESETS
from kvq_export.scheme import KVQuantScheme, TensorQuant
from kvq_export.flavors.trt.signature import plugin_signature
from kvq_plugins import triton_kernels as tk
from kvq_plugins.layout import StreamLayout
from kvq_plugins.quantize import quantize_constants
from kvq_plugins.trt_plugin import aot_kernel

out = {"aot": [], "other": []}
facts = ModelFacts(model_type="llama", num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                   vocab_size=128, max_position_embeddings=4096, tie_word_embeddings=False, scaling=128**-0.5,
                   sliding_windows=(256,), rope=RopeFacts("default", 1.0, {"rope_theta": 10000.0}))
work = Path(tempfile.mkdtemp())
mixed = KVQuantScheme(key=TensorQuant.fp16(), value=TensorQuant(format="fp8_e4m3", bits=8, axis="channel",
                      group_size=16, scale_dtype="fp32"), residual_length=16, sink_tokens=4)
high6 = KVQuantScheme(key=TensorQuant(format="int", bits=4, axis="channel", group_size=128, high_channels=8),
                      value=TensorQuant(format="int_sym", bits=6, group_size=32))
int3 = KVQuantScheme(key=TensorQuant(format="int", bits=3, axis="channel", group_size=128, high_channels=8),
                     value=TensorQuant(format="int", bits=3, group_size=64, clip=0.9))
cases = [("high-int6", high6, "fp16", 90), ("int3", int3, "fp16", 80),
         ("kivi-2", PRESETS["kivi-2"][0], "fp16", 90), ("int4-sym-g32", PRESETS["int4-sym-g32"][0], "fp32", 80),
         ("ort-int4", PRESETS["ort-int4"][0], "fp16", 80), ("fp8", PRESETS["fp8"][0], "fp16", 90),
         ("mixed", mixed, "fp32", 90), ("ort-int4-hc16", PRESETS["ort-int4-hc16"][0], "fp16", 90)]
for name, scheme, dtype, arch in cases:
    sig = plugin_signature(scheme, 0, facts, dtype=dtype)
    kernel = aot_kernel(sig, target=("cuda", arch))
    entry = kernel.ptx[kernel.ptx.index(".entry"):]
    entry = entry[: entry.index(")")]
    ptx = work / f"{name}.ptx"
    ptx.write_text(kernel.ptx)
    sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"  # Triton targets sm_90a on Hopper
    proc = subprocess.run([get_ptxas(arch).path, f"-arch={sm}", str(ptx), "-o", str(work / f"{name}.cubin")],
                          capture_output=True, text=True)
    out["aot"].append({"case": name, "params": entry.count(".param"), "expected": len(sig.inputs) + 8,
                       "ptxas": proc.returncode, "stderr": proc.stderr[-500:]})
streams = [("high-int6", high6), ("int3", int3)]
streams += [(n, PRESETS[n][0]) for n in ("kivi-2", "int4-g32", "fp8", "ort-int8", "ort-int4-hc16")]
for scheme_name, scheme in streams:
    for part, tq in zip(("key", "value"), scheme.for_layer(0)):
        layout = StreamLayout.of(tq, scheme, 128)
        name, consts = quantize_constants(layout, 8)
        sdt = "*fp16" if layout.scale_dtype == "fp16" else "*fp32"
        types = {"x_ptr": "*fp16", "counts_ptr": "*i64", "codes_ptr": "*u8", "scales_ptr": sdt, "F_LEN": "i32"}
        if layout.has_zero:
            types["zeros_ptr"] = sdt
        else:
            consts["zeros_ptr"] = None
        if name != "_quantize_ggml_kernel":
            if layout.high:
                types["order_ptr"] = "*i32"
            else:
                consts["order_ptr"] = None
        compiled = tk.compile_kernel(name, types, consts, target=("cuda", 90), enable_fp_fusion=False)
        out["other"].append({"kernel": f"{name}[{scheme_name}.{part}]", "cubin": len(compiled.asm["cubin"])})
compiled = tk.compile_kernel("_reduce_kernel", {"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*fp16"},
                             {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 5, "BLOCK_S": 8}, target=("cuda", 80))
out["other"].append({"kernel": "_reduce_kernel", "cubin": len(compiled.asm["cubin"])})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compile for real, not from cache
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_aot_ptx_takes_exactly_what_tensorrt_passes_and_assembles(compiled):
    assert len(compiled["aot"]) == 8
    for case in compiled["aot"]:
        assert case["params"] == case["expected"], case  # inputs + 7 int32 lengths + output; no scratch pointers
        assert case["ptxas"] == 0, case


def test_reduce_and_quantize_kernels_compile(compiled):
    assert len(compiled["other"]) == 15
    assert all(item["cubin"] > 0 for item in compiled["other"]), compiled["other"]
