#!/usr/bin/env bash
# Side-by-side benchmark: `megatron train` against the PyTorch eager reference (bench/torch_gpt.py)
# on the same GPT shapes, alternating runs in one invocation so that both see the same machine
# load. Usage: bench/compare.sh [S|M] [runs] ; PYTHON=path/to/python with torch installed;
# TORCH_BF16=1 runs PyTorch under bf16 autocast; MEGATRON_FLAGS adds flags to megatron train
# (e.g. MEGATRON_FLAGS=--bf16). LLAMA: SmolLM2-135M's shape (RMSNorm, SwiGLU, RoPE, GQA 9/3, tied)
# against transformers' LlamaForCausalLM (bench/torch_llama.py). MLA: GPT M's size with DeepSeek-V3's
# multi-latent attention (query latent 384, key/value latent 256, heads of 64 + 32 rotary features,
# values 64), SwiGLU 2048, RMSNorm, untied, against transformers' DeepseekV3ForCausalLM, every layer
# dense (bench/torch_deepseek.py). GPTOSS: gpt-oss scaled down (8 layers, hidden 512, 8 heads of
# 64 in 2 groups with learned sinks, a 128-token window on every other layer, YaRN, biases, 16
# experts of 512 top-4 with the clamped Quick-GEGLU) against transformers' GptOssForCausalLM
# (bench/torch_gpt_oss.py). MUON=EO_DIR (GPT configs): both sides train with Muon,
# megatron-core's defaults, ours `--optimizer muon --muon-no-split-qkv`, PyTorch's NVIDIA
# emerging-optimizers `Muon` unpacked in EO_DIR (bench/torch_gpt.py --muon; its fused QKV is not
# split either); MUON_PREC=high runs both sides' Newton-Schulz products in f32 (default medium:
# bf16, megatron-core's default); MUON_KIND=adaptive_muon trains AdaMuon instead (ours
# `--optimizer adaptive_muon`, PyTorch's emerging-optimizers `AdaptiveMuon`, adamuon, beta2 0.95).
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-S}; RUNS=${2:-2}; PYTHON=${PYTHON:-python3}
case "$CFG" in
  S) L=4;  H=256; A=4;  T=256; B=8; V=8192;  WARM=3; STEPS=15 ;;
  M) L=12; H=768; A=12; T=512; B=4; V=50304; WARM=2; STEPS=6 ;;
  LLAMA) L=30; H=576; A=9; T=512; B=4; V=49152; WARM=2; STEPS=4 ;;
  MLA) L=12; H=768; A=12; T=512; B=4; V=32768; WARM=2; STEPS=4 ;;
  GPTOSS) L=8; H=512; A=8; T=512; B=4; V=32768; WARM=2; STEPS=4 ;;
  *) echo "config S, M, LLAMA, MLA or GPTOSS" >&2; exit 2 ;;
esac
MODEL_FLAGS=""
TORCH_SCRIPT=(bench/torch_gpt.py --layers $L --hidden $H --heads $A --seq $T --batch $B --vocab $V)
if [ "$CFG" = LLAMA ]; then
  MODEL_FLAGS="--group-query-attention --num-query-groups 3 --ffn-hidden-size 1536 --swiglu
    --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 100000
    --disable-bias-linear"
  TORCH_SCRIPT=(bench/torch_llama.py --layers $L --hidden $H --heads $A --kv-heads 3 --ffn 1536
    --seq $T --batch $B --vocab $V --rope-theta 100000)
fi
if [ "$CFG" = MLA ]; then
  MODEL_FLAGS="--multi-latent-attention --q-lora-rank 384 --kv-lora-rank 256 --qk-head-dim 64
    --qk-pos-emb-head-dim 32 --v-head-dim 64 --qk-layernorm --ffn-hidden-size 2048 --swiglu
    --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope
    --disable-bias-linear --untie-embeddings-and-output-weights"
  TORCH_SCRIPT=(bench/torch_deepseek.py --layers $L --hidden $H --heads $A --ffn 2048 --q-lora 384
    --kv-lora 256 --qk-head-dim 64 --rope-head-dim 32 --v-head-dim 64 --seq $T --batch $B --vocab $V)
fi
if [ "$CFG" = GPTOSS ]; then
  MODEL_FLAGS="--group-query-attention --num-query-groups 2 --kv-channels 64 --ffn-hidden-size 512
    --normalization RMSNorm --norm-epsilon 1e-5 --quick-geglu --glu-linear-offset 1.0
    --activation-func-clamp-value 7.0 --no-bias-gelu-fusion --softmax-type learnable
    --window-size 127,0 --window-attn-skip-freq 2 --position-embedding-type yarn
    --rotary-base 150000 --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 4096
    --no-yarn-correction-range-round-to-int --untie-embeddings-and-output-weights
    --num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 512 --moe-router-dtype fp32"
  TORCH_SCRIPT=(bench/torch_gpt_oss.py --layers $L --hidden $H --heads $A --kv-heads 2
    --experts 16 --topk 4 --ffn 512 --window 128 --seq $T --batch $B --vocab $V)
fi
MUON_FLAGS=""; TORCH_MUON=()
if [ -n "${MUON:-}" ]; then
  MUON_FLAGS="--optimizer ${MUON_KIND:-muon} --muon-no-split-qkv --muon-fp32-matmul-prec ${MUON_PREC:-medium}"
  TORCH_MUON=(--muon "$MUON" --muon-prec "${MUON_PREC:-medium}" --muon-kind "${MUON_KIND:-muon}")
fi
cargo build --release --quiet
OUT=$(mktemp -d)
echo "# config $CFG: layers $L hidden $H heads $A seq $T micro-batch $B vocab $V; $RUNS runs each, alternating"
echo "# load before start: $(cut -d' ' -f1-3 /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)," \
  "family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2- | tr -d ' ') model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2- | tr -d ' ')," \
  "$(grep -q -w amx_bf16 /proc/cpuinfo && echo AMX || echo 'no AMX'), $(grep -q -w avx512_bf16 /proc/cpuinfo && echo AVX512_BF16 || echo 'no AVX512_BF16')"
for r in $(seq 1 "$RUNS"); do
  rm -f "$OUT/m.jsonl"
  # NullTokenizer's vocabulary is --vocab-size + 1 (its end-of-document id), padded to V.
  /usr/bin/time -f "%M" -o "$OUT/rss" ./target/release/megatron train --mock-data --tokenizer-type NullTokenizer \
    --vocab-size $((V - 1)) --num-layers $L --hidden-size $H --num-attention-heads $A --seq-length $T \
    --micro-batch-size $B --global-batch-size $B --train-iters $((WARM + STEPS)) --lr 3e-4 \
    --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 \
    --log-interval 1 --eval-interval 100000 --eval-iters 0 --metrics-file "$OUT/m.jsonl" \
    --no-progress-bar --num-threads 2 $MODEL_FLAGS $MUON_FLAGS ${MEGATRON_FLAGS:-} > "$OUT/log"
  python3 - "$OUT/m.jsonl" "$WARM" "$B" "$T" "$(cat "$OUT/rss")" "${MEGATRON_FLAGS:-} $MUON_FLAGS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"lm_loss"' in l]
warm, b, t, rss_kb = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ms = statistics.median(r["ms_per_iter"] for r in rows[warm:])
print(json.dumps({"impl": "megatron-rs" + ("-bf16" if "--bf16" in sys.argv[6] else "") + ("-adaptive_muon" if "adaptive_muon" in sys.argv[6] else "-muon" if "muon" in sys.argv[6] else ""), "step_s": ms / 1e3, "tokens_per_sec": b * t / (ms / 1e3),
                  "peak_rss_bytes": rss_kb * 1024, "mfu_vs_unit_peak": statistics.median(r["mfu"] for r in rows[warm:]),
                  "first_loss": rows[0]["lm_loss"], "last_loss": rows[-1]["lm_loss"]}))
PY
  /usr/bin/time -f "%M" -o "$OUT/rss" "$PYTHON" "${TORCH_SCRIPT[@]}" \
    --warmup $WARM --steps $STEPS --threads 2 ${TORCH_BF16:+--bf16} ${TORCH_MUON[@]+"${TORCH_MUON[@]}"}
done | tee "$OUT/rows"
python3 bench/pair_ratios.py "$OUT/rows"
rm -rf "$OUT"
