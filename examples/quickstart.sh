#!/usr/bin/env bash
# Quick start: train a small byte-level GPT on the bundled State of the Union corpus, save a
# checkpoint, and generate a sample from it. A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
OUT=${OUT:-runs/quickstart}
rm -rf "$OUT"
./target/release/megatron train \
  --data-path examples/sotu --tokenizer-type ByteLevelTokenizer --split 969,30,1 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --micro-batch-size 16 --global-batch-size 16 --train-iters ${TRAIN_ITERS:-800} \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 50 \
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --log-interval 50 --eval-interval 200 --eval-iters 4 \
  --save "$OUT" --save-interval 400 --metrics-file "$OUT/metrics.jsonl"
echo
echo "--- sample (megatron generate --load $OUT) ---"
./target/release/megatron generate --load "$OUT" --prompt "My fellow Americans, " \
  --max-new-tokens 120 --temperature 0.8 --top-k 40 --seed 1
