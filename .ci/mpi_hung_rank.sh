#!/usr/bin/env bash
# A rank that stops arriving under MPI ends the job with the named error and a non-zero exit,
# never a silent hang (issue 14): 2 data-parallel MPI ranks, one SIGSTOPped mid-training; with
# --distributed-timeout-minutes 0.1 (6 s) the other must report the timeout (group, operation,
# missing rank) and the job must end within the timeout plus a margin.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=./target/release/megatron
out=$(mktemp)
start=$(date +%s)
mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" train --mock-data --tokenizer-type NullTokenizer \
  --vocab-size 61 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 \
  --micro-batch-size 2 --global-batch-size 4 --train-iters 1000000 --log-interval 1 --eval-interval 1000000 \
  --eval-iters 0 --no-progress-bar --peak-tflops 1 --num-threads 1 --seed 4242 \
  --distributed-timeout-minutes 0.1 > "$out" 2>&1 &
job=$!
# Wait until training runs (past the start-up health checks), then stop one rank.
for _ in $(seq 1 120); do
  grep -q 'iteration *3/' "$out" && break
  sleep 0.5
done
victim=$(pgrep -f "megatron train .*--seed 4242" | sort -n | tail -1)
if [ -z "$victim" ]; then echo "hung-rank test: no rank process found" >&2; cat "$out" >&2; exit 1; fi
kill -STOP "$victim"
stopped=$(date +%s)
# Timeout 6 s, a quarter-timeout arrival notice, abort: well under 60 s.
for _ in $(seq 1 120); do
  kill -0 "$job" 2>/dev/null || break
  sleep 0.5
done
if kill -0 "$job" 2>/dev/null; then
  echo "hung-rank test: the job still runs 60 s after a rank was stopped" >&2
  kill -KILL "$victim" 2>/dev/null; kill -KILL "$job" 2>/dev/null
  tail -5 "$out" >&2; exit 1
fi
wait "$job"; rc=$?
kill -KILL "$victim" 2>/dev/null
took=$(( $(date +%s) - stopped ))
grep -E 'error: rank [0-9]+: .*timed out after .*did not arrive' "$out" | head -2
if [ "$rc" -eq 0 ]; then echo "hung-rank test: exit status 0" >&2; tail -5 "$out" >&2; exit 1; fi
if ! grep -qE 'error: rank [0-9]+: .*timed out after .*did not arrive' "$out"; then
  echo "hung-rank test: no error naming the timeout and the missing rank" >&2; tail -20 "$out" >&2; exit 1
fi
echo "hung-rank test: job ended with status $rc ${took}s after a rank was stopped (started $(( stopped - start ))s in)"
rm -f "$out"
