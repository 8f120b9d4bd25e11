#!/usr/bin/env bash
# Step time and peak RSS of `megatron train` on bench/compare.sh M's GPT (12 layers, hidden 768,
# seq 512, micro-batch 4, vocab 50304) with and without multi-token prediction
# (--mtp-num-layers D), alternating runs in one invocation. Usage: bench/mtp_overhead.sh [D] [runs]
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-1}; RUNS=${2:-2}; WARM=2; STEPS=4
cargo build --release --quiet
OUT=$(mktemp -d)
echo "# GPT M, --mtp-num-layers $D vs none; $RUNS runs each, alternating; load before start: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$RUNS"); do
  for mtp in "" "--mtp-num-layers $D"; do
    rm -f "$OUT/m.jsonl"
    /usr/bin/time -f "%M" -o "$OUT/rss" ./target/release/megatron train --mock-data --tokenizer-type NullTokenizer \
      --vocab-size 50303 --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 512 \
      --micro-batch-size 4 --global-batch-size 4 --train-iters $((WARM + STEPS)) --lr 3e-4 \
      --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 100000 --eval-iters 0 \
      --metrics-file "$OUT/m.jsonl" --no-progress-bar --num-threads 2 $mtp > "$OUT/log"
    python3 - "$OUT/m.jsonl" "$WARM" "$(cat "$OUT/rss")" "$mtp" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"lm_loss"' in l]
warm = int(sys.argv[2])
ms = statistics.median(r["ms_per_iter"] for r in rows[warm:])
print(json.dumps({"mtp": sys.argv[4] or "none", "step_ms": round(ms, 1),
                  "peak_rss_gb": round(int(sys.argv[3]) * 1024 / 1e9, 2),
                  "mfu": round(statistics.median(r["mfu"] for r in rows[warm:]), 3),
                  "mtp_losses": rows[-1].get("mtp_losses")}))
PY
  done
done
rm -rf "$OUT"
