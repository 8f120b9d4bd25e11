#!/usr/bin/env bash
# Muon at data-parallel size 2: replicated state (every rank orthogonalizes every matrix) against
# megatron-core's layer-wise distributed optimizer (`--use-distributed-optimizer`: each rank
# orthogonalizes the matrices it owns), alternating runs in one invocation so both see the same
# load. Usage: bench/muon_layer_wise.sh [S|M] [pairs]; MUON_PREC=high|medium (default high: f32
# Newton-Schulz products); LW_FLAGS adds flags to the layer-wise runs (e.g. LW_FLAGS="--ddp-bucket-size
# 10000000"). Two thread ranks share --num-threads 2; global batch = 2 micro-batches.
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-S}; RUNS=${2:-2}
case "$CFG" in
  S) L=4;  H=256; A=4;  T=256; B=8; V=8192;  WARM=2; STEPS=8 ;;
  M) L=12; H=768; A=12; T=512; B=4; V=50304; WARM=1; STEPS=3 ;;
  *) echo "config S or M" >&2; exit 2 ;;
esac
cargo build --release --quiet
OUT=$(mktemp -d)
echo "# config $CFG: layers $L hidden $H heads $A seq $T micro-batch $B vocab $V; DP 2 (thread ranks), $RUNS pairs, alternating"
echo "# load before start: $(cut -d' ' -f1-3 /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)," \
  "family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2- | tr -d ' ') model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2- | tr -d ' ')"
for r in $(seq 1 "$RUNS"); do
  for mode in replicated layer-wise; do
    extra=""
    [ "$mode" = layer-wise ] && extra="--use-distributed-optimizer ${LW_FLAGS:-}"
    rm -f "$OUT/m.jsonl"
    /usr/bin/time -f "%M" -o "$OUT/rss" ./target/release/megatron train --mock-data \
      --tokenizer-type NullTokenizer --vocab-size $((V - 1)) --num-layers $L --hidden-size $H \
      --num-attention-heads $A --seq-length $T --micro-batch-size $B --global-batch-size $((2 * B)) \
      --train-iters $((WARM + STEPS)) --lr 3e-4 --weight-decay 0.1 --clip-grad 1.0 \
      --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 100000 \
      --eval-iters 0 --metrics-file "$OUT/m.jsonl" --no-progress-bar --num-threads 2 \
      --nproc-per-node 2 --optimizer muon --muon-no-split-qkv \
      --muon-fp32-matmul-prec "${MUON_PREC:-high}" $extra > "$OUT/log"
    python3 - "$OUT/m.jsonl" "$WARM" "$B" "$T" "$(cat "$OUT/rss")" "$mode" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"lm_loss"' in l]
warm, b, t, rss_kb = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ms = statistics.median(r["ms_per_iter"] for r in rows[warm:])
print(json.dumps({"mode": sys.argv[6], "step_s": round(ms / 1e3, 3),
                  "tokens_per_sec": round(2 * b * t / (ms / 1e3)), "peak_rss_gb": round(rss_kb / 1e6, 2),
                  "last_loss": rows[-1]["lm_loss"]}))
PY
  done
done | tee "$OUT/rows"
python3 - "$OUT/rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rep = [r["step_s"] for r in rows if r["mode"] == "replicated"]
lw = [r["step_s"] for r in rows if r["mode"] == "layer-wise"]
ratios = [a / b for a, b in zip(rep, lw)]
print(f"replicated / layer-wise step time per pair: {', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x")
PY
rm -rf "$OUT"
