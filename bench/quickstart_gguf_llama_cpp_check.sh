#!/usr/bin/env bash
# A GPT trained here (examples/quickstart.sh: Megatron's GPT, our own GPT2BPETokenizer files)
# exported with `convert --to gguf` and run by llama.cpp: its greedy text must equal
# `megatron generate --greedy`. Usage (from the repository root, after building llama.cpp's
# llama-simple): LLAMA_CPP_BIN=.../build/bin bash bench/quickstart_gguf_llama_cpp_check.sh [RUN_DIR]
set -euo pipefail
M=./target/release/megatron
RUN=${1:-runs/quickstart}
[ -d "$RUN/checkpoints" ] || OUT="$RUN" TRAIN_ITERS=${TRAIN_ITERS:-200} bash examples/quickstart.sh
$M convert --to gguf --input "$RUN/checkpoints" --output "$RUN/model-f32.gguf" --outtype f32
fail=0
for p in "My fellow Americans, " "The budget" "We will"; do
  # llama-simple -n 30 gives 29 new tokens, so its text must be a prefix of ours (30).
  theirs=$("$LLAMA_CPP_BIN/llama-simple" -m "$RUN/model-f32.gguf" -n 30 "$p" 2>/dev/null)
  ours=$($M generate --load "$RUN/checkpoints" --prompt "$p" --greedy --max-new-tokens 30 2>/dev/null)
  if [[ "$ours" == "$theirs"* ]]; then echo "same: $theirs"; else echo "DIFFER: llama.cpp '$theirs' vs ours '$ours'"; fail=1; fi
done
exit $fail
