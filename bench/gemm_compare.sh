#!/usr/bin/env bash
# The CPU GEMM candidates on the three GEMMs of a transformer linear layer, alternating in one
# invocation: the engine's own AVX-512 sgemm against the gemm crate (its portable fallback; the two
# alternate call by call), matrixmultiply, and OpenBLAS through numpy
# (PYTHON must have numpy and threadpoolctl). Usage: bench/gemm_compare.sh [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}; PYTHON=${PYTHON:-python3}
cargo build --release --quiet
echo "# load before start: $(cut -d' ' -f1-3 /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo)"
for r in $(seq 1 "$ROUNDS"); do
  for shape in "4096 768 3072" "2048 256 1024"; do
    set -- $shape
    ./target/release/megatron bench gemm --tokens $1 --hidden $2 --ffn $3 --gemm-impl versus
    ./target/release/megatron bench gemm --tokens $1 --hidden $2 --ffn $3 --gemm-impl matrixmultiply
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$PYTHON" bench/gemm_openblas.py --tokens $1 --hidden $2 --ffn $3
    "$PYTHON" bench/gemm_openblas.py --tokens $1 --hidden $2 --ffn $3 | sed 's/^numpy/[machine env] numpy/'
  done
done
./target/release/megatron bench peak --repeats 5
