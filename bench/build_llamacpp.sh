#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-quantize, the reference figures in bench/NOTES.md
# ("llama.cpp on this machine").
#
#   git clone https://github.com/ggml-org/llama.cpp /tmp/llama.cpp
#     (or the copy vendored in llama-cpp-python's sdist: vendor/llama.cpp)
#   bench/build_llamacpp.sh /tmp/llama.cpp            # -> bench/.cache/llama.cpp-build/bin/
#   bench/build_llamacpp.sh /tmp/llama.cpp BUILD_DIR
#
# CPU only: -march=native (GGML_NATIVE; the binaries are for this machine only), OpenMP,
# static libraries (the binaries can be copied), no curl. Takes ~3.5 min on 2 cores; runs
# under `nice` because others share the machine.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 LLAMACPP_CHECKOUT [BUILD_DIR]   (default BUILD_DIR: bench/.cache/llama.cpp-build)" >&2
  exit 2
fi
src="$1"
out="${2:-$(cd "$(dirname "$0")" && pwd)/.cache/llama.cpp-build}"
if [[ ! -f "$src/tools/llama-bench/llama-bench.cpp" ]]; then
  echo "$0: no tools/llama-bench in $src (git clone https://github.com/ggml-org/llama.cpp)" >&2
  exit 1
fi
mkdir -p "$out"
nice -n 10 cmake -S "$src" -B "$out" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
nice -n 10 cmake --build "$out" -j "$(nproc)" --target llama-bench llama-quantize >/dev/null
echo "$out/bin/llama-bench $out/bin/llama-quantize" \
  "(from $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "$src"))"
