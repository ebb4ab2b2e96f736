#!/usr/bin/env bash
# Build llama2.c's run.c, the reference program for `bench/run.py --vs`.
#
#   git clone https://github.com/karpathy/llama2.c /tmp/llama2.c
#   bench/build_runc.sh /tmp/llama2.c            # -> bench/.cache/run
#   bench/build_runc.sh /tmp/llama2.c OUT_PATH
#
# Flags as llama2.c's `make runomp`: -Ofast (fast math), OpenMP over all cores (set
# OMP_NUM_THREADS to limit), -march=native (the binary is for this machine only).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 LLAMA2C_CHECKOUT [OUTPUT]   (default OUTPUT: bench/.cache/run)" >&2
  exit 2
fi
src="$1"
out="${2:-$(cd "$(dirname "$0")" && pwd)/.cache/run}"
if [[ ! -f "$src/run.c" ]]; then
  echo "$0: no run.c in $src (git clone https://github.com/karpathy/llama2.c)" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
gcc -Ofast -fopenmp -march=native "$src/run.c" -lm -o "$out"
echo "$out (from $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "$src"))"
