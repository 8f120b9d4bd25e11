#!/usr/bin/env bash
# The MoE layer against PyTorch (transformers' MixtralSparseMoeBlock, fp32), alternating the two
# processes ROUNDS times; each prints medians of REPEATS steps. Usage:
#   bash bench/moe_compare.sh [ROUNDS] [TOKENS HIDDEN EXPERTS TOPK MOE_FFN]
set -euo pipefail
rounds=${1:-3}; n=${2:-4096}; h=${3:-512}; e=${4:-8}; k=${5:-2}; f=${6:-512}
py=${PYTHON:-/work/.venv-ref/bin/python}
cargo build --release -q -p megatron
for r in $(seq "$rounds"); do
  echo "round $r"
  "$py" bench/torch_moe.py "$n" "$h" "$e" "$k" "$f" 2 5
  ./target/release/megatron bench moe --tokens "$n" --hidden "$h" --experts "$e" --topk "$k" \
    --moe-ffn "$f" --repeats 5 | sed -n '4,6p'
done
