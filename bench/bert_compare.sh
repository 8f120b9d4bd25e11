#!/usr/bin/env bash
# Side-by-side benchmark: `megatron train --model bert` (post-LN, GELU tanh, binary head, on the
# bundled corpus's BERT samples) against transformers' BertForPreTraining in PyTorch eager
# (bench/torch_bert.py) on the same shapes, alternating runs in one invocation.
# Usage: bench/bert_compare.sh [runs] ; PYTHON=path/to/python with torch and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}; PYTHON=${PYTHON:-python3}
L=4; H=256; A=4; T=128; B=8; V=30522; WARM=3; STEPS=15
cargo build --release --quiet
OUT=$(mktemp -d)
M=./target/release/megatron
$M preprocess --input examples/sotu --output-prefix "$OUT/sotu" --split-sentences \
  --tokenizer-type BertWordPieceLowerCase --vocab-file examples/bert/vocab.txt > /dev/null
echo "# BERT: layers $L hidden $H heads $A seq $T micro-batch $B vocab $V; $RUNS runs each, alternating"
echo "# load before start: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$RUNS"); do
  rm -f "$OUT/m.jsonl"
  /usr/bin/time -f "%M" -o "$OUT/rss" $M train --model bert --data-path "$OUT/sotu_text_sentence" \
    --split 95,5,0 --tokenizer-type BertWordPieceLowerCase --vocab-file examples/bert/vocab.txt \
    --transformer-block-type post_ln --num-layers $L --hidden-size $H --num-attention-heads $A \
    --seq-length $T --micro-batch-size $B --global-batch-size $B --train-iters $((WARM + STEPS)) \
    --lr 1e-4 --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 \
    --log-interval 1 --eval-interval 100000 --eval-iters 0 --metrics-file "$OUT/m.jsonl" \
    --no-progress-bar --num-threads 2 > "$OUT/log"
  python3 - "$OUT/m.jsonl" "$WARM" "$B" "$T" "$(cat "$OUT/rss")" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"lm_loss"' in l]
warm, b, t, rss_kb = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ms = statistics.median(r["ms_per_iter"] for r in rows[warm:])
print(json.dumps({"impl": "megatron-rs", "step_s": ms / 1e3, "tokens_per_sec": b * t / (ms / 1e3),
                  "peak_rss_bytes": rss_kb * 1024, "first_loss": rows[0]["lm_loss"], "last_loss": rows[-1]["lm_loss"]}))
PY
  /usr/bin/time -f "%M" -o "$OUT/rss" "$PYTHON" bench/torch_bert.py --layers $L --hidden $H --heads $A \
    --seq $T --batch $B --vocab $V --warmup $WARM --steps $STEPS --threads 2
done | tee "$OUT/rows"
python3 bench/pair_ratios.py "$OUT/rows"
rm -rf "$OUT"
