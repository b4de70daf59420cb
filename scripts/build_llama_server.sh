#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the peer of `python -m scripts.bench peer`), llama-bench and
# llama-quantize (a model's K-quant files, e.g. `llama-quantize --allow-requantize IN.gguf OUT.gguf
# Q4_K_M`), from the llama.cpp source vendored in the PyPI sdist of llama-cpp-python (a pinned
# version; only its source is used). Nothing lands in this repo.
#
#   scripts/build_llama_server.sh [BUILD_DIR]      (default: ~/.cache/splitserve/llama.cpp)
#
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default: all cores), PYTHON (a Python
# with pip). Needs cmake and a C++ compiler. Prints the folder holding the binaries last.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BUILD_DIR="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve/llama.cpp}"
JOBS="${JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found (apt-get install cmake g++)" >&2; exit 1; }
done

mkdir -p "$BUILD_DIR"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
SRC="$BUILD_DIR/llama_cpp_python-$VERSION"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  # The sdist, not a wheel: it carries the vendored llama.cpp source tree.
  "$PYTHON" -m pip download --no-binary :all: --no-deps -q -d "$BUILD_DIR" \
    "llama-cpp-python==$VERSION"
  tar xzf "$BUILD_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD_DIR"
fi

# Static, native (this CPU's AVX-512/VNNI kernels, as llama.cpp's own default), Release;
# no web UI (its prebuilt assets would be fetched from a model hub), no network code.
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD_DIR/build" \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  >"$BUILD_DIR/cmake.log"
cmake --build "$BUILD_DIR/build" --config Release -j "$JOBS" --target llama-server llama-bench llama-quantize

BIN="$BUILD_DIR/build/bin"
"$BIN/llama-server" --version 2>&1 | head -n 2 >&2
echo "$BIN"
