#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-quantize, llama-perplexity, llama-simple, llama-cli and
# llama-server, the
# reference programs in bench/NOTES.md ("llama.cpp on this machine").
#
#   pip download --no-deps --no-binary :all: llama-cpp-python   (its vendor/llama.cpp), or
#   git clone https://github.com/ggml-org/llama.cpp /tmp/llama.cpp
#   bench/build_llamacpp.sh /tmp/llama.cpp            # -> bench/.cache/llama.cpp-build/bin/
#   bench/build_llamacpp.sh /tmp/llama.cpp BUILD_DIR
#   JLLAMA_LLAMACPP_ARCH=x86-64-v3 bench/build_llamacpp.sh /tmp/llama.cpp BUILD_DIR
#
# CPU only, OpenMP, static libraries (the binaries can be copied), no curl. By default
# -march=native (GGML_NATIVE; the binaries are for this machine only). With
# JLLAMA_LLAMACPP_ARCH=x86-64-v3 it builds the AVX2 + FMA + F16C + BMI2 path only (no AVX-512,
# no VNNI), which is what an AVX2-only CPU runs: the build jllama's x86-64-v3 kernels are
# compared against. JLLAMA_LLAMACPP_ARCH=avx512 builds AVX-512 (F, BW, VL, VNNI, VBMI, BF16) and
# AVX-VNNI without AMX: on this project's Sapphire Rapids VM the native build's AMX matrix
# product (ggml_backend_amx_mul_mat) crashes with a segmentation fault on 2 threads for Q8_0 and
# Q4_K_M prompts (llama.cpp 0c1e570, 2026-12-01), so native can time decode only there. Takes ~4 min on 2 cores; runs under `nice` because others share the machine.
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
arch="${JLLAMA_LLAMACPP_ARCH:-native}"
case "$arch" in
  native) isa=(-DGGML_NATIVE=ON) ;;
  avx512) isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
               -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON) ;;
  x86-64-v3) isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                  -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "$0: JLLAMA_LLAMACPP_ARCH must be native, avx512 or x86-64-v3, not '$arch'" >&2; exit 2 ;;
esac
mkdir -p "$out"
nice -n 10 cmake -S "$src" -B "$out" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
  -DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
nice -n 10 cmake --build "$out" -j "$(nproc)" \
  --target llama-bench llama-quantize llama-perplexity llama-simple llama-cli llama-server >/dev/null
echo "$out/bin/llama-{bench,quantize,perplexity,simple,cli,server}" \
  "($arch, from $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "$src"))"
