#!/usr/bin/env bash
# Crash safety of checkpoints (issue 14): training that saves every iteration is killed with
# SIGKILL at random moments (so often in the middle of a save), synchronous and --async-save,
# over rank threads and (with `mpi` as $1) MPI processes. After every kill, `--load` must pick a
# complete checkpoint (never the broken one) and the resumed run must log exactly the losses of
# an uninterrupted run. Usage: .ci/crash_safety.sh [threads|mpi] [kills per mode]
set -uo pipefail
cd "$(dirname "$0")/.."
backend=${1:-threads}; kills=${2:-5}
bin=./target/release/megatron
work=$(mktemp -d)
model=(train --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 4 --hidden-size 256
       --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 40
       --lr-decay-iters 40 --log-interval 1 --eval-interval 1000 --eval-iters 0 --no-progress-bar
       --peak-tflops 1 --num-threads 2 --seed 777 --save-interval 1)
launch() {  # launch OUT_DIR METRICS [extra flags]: runs in the background, pid in $job
  local dir=$1 metrics=$2; shift 2
  if [ "$backend" = mpi ]; then
    mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" "${model[@]}" --save "$dir" --metrics-file "$metrics" "$@" > "$work/log" 2>&1 &
  else
    "$bin" "${model[@]}" --nproc-per-node 2 --save "$dir" --metrics-file "$metrics" "$@" > "$work/log" 2>&1 &
  fi
  job=$!
}
losses() { grep '"lm_loss"' "$1" | python3 -c 'import json,sys; [print(r["iteration"], repr(r["lm_loss"])) for r in map(json.loads, sys.stdin)]'; }
fail() { echo "crash-safety ($backend, $mode): $*" >&2; tail -5 "$work/log" >&2; exit 1; }
for mode in sync async; do
  flags=(); [ "$mode" = async ] && flags=(--async-save)
  launch "$work/ref" "$work/ref.jsonl" "${flags[@]}"; wait "$job" || fail "reference run failed"
  losses "$work/ref.jsonl" > "$work/ref.txt"
  for k in $(seq 1 "$kills"); do
    rm -rf "$work/ck" "$work/a.jsonl" "$work/b.jsonl"
    launch "$work/ck" "$work/a.jsonl" "${flags[@]}"
    sleep "$(python3 -c "import random; print(round(random.uniform(0.5, 5.0), 2))")"
    pkill -KILL -f -- "--seed 777" ; wait "$job" 2>/dev/null || true
    if ! ls "$work/ck"/iter_[0-9]*[0-9] > /dev/null 2>&1; then continue; fi  # killed before the first save
    midsave=no; ls -d "$work/ck"/*.partial > /dev/null 2>&1 && midsave=yes
    launch "$work/ck" "$work/b.jsonl" "${flags[@]}" --load "$work/ck"
    wait "$job" || fail "kill $k: resuming failed"
    from=$(grep -o 'loaded checkpoint .* at iteration [0-9]*' "$work/log" | grep -o '[0-9]*$')
    [ -n "$from" ] || fail "kill $k: no checkpoint loaded"
    if [ "$from" = 40 ]; then echo "crash-safety ($backend, $mode): kill $k: the run had finished"; continue; fi
    losses "$work/b.jsonl" > "$work/b.txt"
    # Every resumed iteration logs the uninterrupted run's loss, bit for bit.
    if ! grep -qxFf "$work/b.txt" "$work/ref.txt" || [ "$(grep -cxFf "$work/ref.txt" "$work/b.txt")" != "$(wc -l < "$work/b.txt")" ]; then
      diff "$work/ref.txt" "$work/b.txt" >&2; fail "kill $k: resumed from $from, losses differ"
    fi
    echo "crash-safety ($backend, $mode): kill $k: resumed from iteration $from, $(wc -l < "$work/b.txt") iterations identical (killed mid-save: $midsave)"
  done
done
rm -rf "$work"
