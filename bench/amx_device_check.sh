#!/usr/bin/env bash
# AMX check of the packed bf16 GEMM (issue 19) on a lent device machine whose CPU has AMX (the
# H200 hosts' Xeons do): unit tests on both packed kernels, the bf16 training tests, peaks,
# GEMMs, attention, and GPT M --bf16 against PyTorch autocast (the device image has torch).
# The device has no cargo: build here, carry the binaries.
#   cargo build --release -p megatron
#   cargo test --release --no-run -p megatron-tensor --test backend_cpu_matmul_packed \
#     --test backend_cpu_attention_packed --test backend_cpu_matmul_bf16 \
#     --test backend_cpu_cross_entropy -p megatron-training --test training
#   copy those test executables (target/release/deps/<name>-<hash>) to devbin/{mp,ap,mb,ce,tr},
#   put /devbin/ in .git/info/exclude, then run `bash bench/amx_device_check.sh` with
#   carry ["devbin", "target/release/megatron"] (about 6 minutes of device time).
mkdir -p /work && ln -sfn "$PWD" /work/main && cd /work/main   # tests know their build path
OUT=${OUT:-/tmp/amx_out}; mkdir -p "$OUT"
grep -m1 'model name' /proc/cpuinfo; grep -q -w amx_bf16 /proc/cpuinfo || { echo "no AMX here"; exit 0; }
T=devbin
{ for b in mp ap mb ce; do $T/$b --test-threads 2 --nocapture 2>&1 | grep -E 'test |result|panick|setting|testing|skipped'; done; } > $OUT/unit.txt 2>&1
timeout 120 $T/tr bf16_and_fp16_track bf16_distributed_optimizer precision_flags bf16_and_fp16_keep --test-threads 3 > $OUT/train.txt 2>&1
grep -E 'test |result|panick' $OUT/unit.txt $OUT/train.txt | grep -v ' ok$'; grep -c ' ok$' $OUT/unit.txt $OUT/train.txt
./target/release/megatron bench peak --repeats 3 --threads 2 2>&1 | tee $OUT/bench.txt
./target/release/megatron bench gemm --gemm-impl bf16-versus --tokens 2048 --threads 2 2>&1 | tee -a $OUT/bench.txt
for mib in 24 64 256; do echo "chunk $mib MiB: $(./target/release/megatron bench kernels --bf16 --grad-chunk-mib $mib --tokens 2048 --threads 2 --repeats 3 2>&1 | grep classifier)"; done | tee -a $OUT/bench.txt
mkdir -p /tmp/fb; printf '#!/bin/sh\nexit 0\n' > /tmp/fb/cargo; chmod +x /tmp/fb/cargo   # compare.sh builds first
PATH=/tmp/fb:$PATH PYTHON=python3 TORCH_BF16=1 MEGATRON_FLAGS=--bf16 timeout 260 bench/compare.sh M 2 2>&1 | tee $OUT/m.txt
