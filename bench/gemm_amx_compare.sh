#!/usr/bin/env bash
# bf16 GEMMs on the three GEMMs of a transformer linear layer, alternating in one invocation:
# the engine's AMX, dot-product and rounded-operand f32 kernels (alternating call by call), then
# PyTorch's bf16 matmul (bench/gemm_torch_bf16.py), then the engine's f32 GEMM, and the units'
# peaks. Usage: bench/gemm_amx_compare.sh [rounds]; PYTHON must have torch.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}; PYTHON=${PYTHON:-python3}
cargo build --release --quiet
echo "# load before start: $(cut -d' ' -f1-3 /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo);" \
  "$(grep -o -w -E 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for r in $(seq 1 "$ROUNDS"); do
  ./target/release/megatron bench gemm --tokens 2048 --gemm-impl bf16-versus
  "$PYTHON" bench/gemm_torch_bf16.py --tokens 2048
  ./target/release/megatron bench gemm --tokens 2048
done
./target/release/megatron bench peak --repeats 3 --threads 1
./target/release/megatron bench peak --repeats 3 --threads 2
