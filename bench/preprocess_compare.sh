#!/usr/bin/env bash
# `megatron preprocess` against a Python baseline doing what Megatron's tools/preprocess_data.py
# does (bench/preprocess_megatron_baseline.py), same corpus, same GPT-2 tokenizer files, 1 and 2
# workers, alternating in one invocation; checks the outputs are byte-identical.
# Usage: PYTHON=<python with megatron-core, torch, tokenizers> bench/preprocess_compare.sh CORPUS.jsonl [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS=$1; ROUNDS=${2:-1}; PYTHON=${PYTHON:-python3}
G=crates/megatron-data/tests/fixtures/gpt2
OUT=$(mktemp -d)
cargo build --release --quiet
echo "# corpus $CORPUS: $(du -m "$CORPUS" | cut -f1) MB, $(wc -l < "$CORPUS") documents; load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  for w in 1 2; do
    /usr/bin/time -f "megatron-rs workers $w: %e s wall, peak RSS %M KB" ./target/release/megatron preprocess --input "$CORPUS" \
      --output-prefix "$OUT/rs$w" --tokenizer-type GPT2BPETokenizer --vocab-file $G/vocab.json --merge-file $G/merges.txt \
      --append-eod --workers $w --log-interval 0
    /usr/bin/time -f "python baseline workers $w: %e s wall (incl. imports), peak RSS of the main process %M KB" "$PYTHON" \
      bench/preprocess_megatron_baseline.py --input "$CORPUS" --output-prefix "$OUT/py$w" \
      --vocab-file $G/vocab.json --merge-file $G/merges.txt --workers $w 2>&1 | grep -v -i warn
    cmp "$OUT/rs${w}_text_document.bin" "$OUT/py${w}_text_document.bin" && cmp "$OUT/rs${w}_text_document.idx" "$OUT/py${w}_text_document.idx" && echo "outputs byte-identical"
  done
done
rm -rf "$OUT"
