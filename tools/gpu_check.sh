#!/usr/bin/env bash
# One prepared GPU check for a CUDA machine with no network (about 5 minutes on one H100/H200-class GPU):
#   1. the gpu-marked tests and the Triton kernel tests (compiled for the device, not interpreted);
#   2. tools/bench_kernel.py: fused 4-bit decode attention vs torch SDPA over an fp16 cache at 8k and 32k
#      tokens, with achieved bandwidth as a fraction of the device's measured copy bandwidth.
# Everything goes to a dated log (and the bench rows to JSON) under $OUT (default ./gpu-check-logs).
#
# Usage: tools/gpu_check.sh            (uses python3 on PATH; PYTHON=... to choose another)
# Needs: torch with CUDA, triton, pytest, numpy, onnx/onnx-ir/onnxruntime, transformers (the device's own
# stack is fine: the checkout is put on PYTHONPATH, nothing is installed).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-check-logs}
mkdir -p "$OUT"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
log="$OUT/gpu_check-$stamp.log"

# kvq_plugins lives in plugins/; expose it under its package name without installing anything.
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
ln -s "$PWD/plugins" "$shim/kvq_plugins"
export PYTHONPATH="$PWD:$shim${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1

status=0
{
  echo "# kvq gpu_check $stamp"
  echo "## device"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
  "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  echo "## tests (gpu-marked + Triton kernels on the device)"
} >"$log" 2>&1

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device visible to $PYTHON: nothing to check" | tee -a "$log"
  exit 2
fi

timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider \
  tests/test_triton_kernels.py tests/test_triton_layout.py tests/test_triton_compile.py >>"$log" 2>&1 || status=1

echo "## bench_kernel (fused 4-bit vs fp16 SDPA decode, 8k/32k; the fast path's static high channels too)" >>"$log"
timeout 200 "$PYTHON" tools/bench_kernel.py --scheme kivi-4 --scheme ort-int4-hc16 --contexts 8192,32768 --batches 1,8 \
  --warmup 10 --iters 50 --json "$OUT/bench_kernel-$stamp.json" >>"$log" 2>&1 || status=1

echo "## exit status $status" >>"$log"
tail -n 40 "$log"
echo "log: $log"
exit $status
