#!/usr/bin/env bash
# Quick start: train a BPE tokenizer on the bundled State of the Union addresses, preprocess them
# into Megatron's .bin/.idx, train a small GPT, save a checkpoint, and generate a sample.
# A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
M=./target/release/megatron
OUT=${OUT:-runs/quickstart}
rm -rf "$OUT"
$M train-tokenizer --input examples/sotu --vocab-size 1024 --output-dir "$OUT/tokenizer"
TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/tokenizer/vocab.json" --merge-file "$OUT/tokenizer/merges.txt")
$M preprocess --input examples/sotu --output-prefix "$OUT/data/sotu" "${TOK[@]}" --append-eod --workers 2
$M train \
  --data-path "$OUT/data/sotu_text_document" --split 90,10,0 "${TOK[@]}" \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --micro-batch-size 16 --global-batch-size 16 --train-iters ${TRAIN_ITERS:-800} \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 50 \
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --hidden-dropout 0.1 --attention-dropout 0.1 \
  --log-interval 50 --eval-interval 200 --eval-iters 4 \
  --save "$OUT/checkpoints" --save-interval 400 --metrics-file "$OUT/metrics.jsonl"
echo
echo "--- sample (megatron generate --load $OUT/checkpoints) ---"
$M generate --load "$OUT/checkpoints" --prompt "My fellow Americans, " \
  --max-new-tokens 60 --temperature 0.8 --top-k 40 --seed 1
