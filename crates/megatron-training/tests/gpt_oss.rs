//! gpt-oss on the engine: megatron-core's attention sinks (`--softmax-type learnable`), the
//! clamped Quick-GEGLU with its linear offset, biases on the router and the experts, windowed
//! and full layers in turn, YaRN. A Megatron-LM run of that model continued here follows
//! Megatron-LM's own log; the parallel layouts train the one-rank model.

mod common;

use common::megatron_resume::*;

/// The fixture script's `GPT_OSS` (bench/make_megatron_optim_fixtures.py).
const GPT_OSS: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "48",
    "--normalization",
    "RMSNorm",
    "--quick-geglu",
    "--glu-linear-offset",
    "1.0",
    "--activation-func-clamp-value",
    "1.0",
    "--no-bias-gelu-fusion",
    "--softmax-type",
    "learnable",
    "--window-size",
    "3,0",
    "--window-attn-skip-freq",
    "2",
    "--position-embedding-type",
    "yarn",
    "--rotary-base",
    "10000",
    "--rotary-scaling-factor",
    "4",
    "--yarn-original-max-position-embeddings",
    "8",
    "--yarn-beta-fast",
    "32",
    "--yarn-beta-slow",
    "1",
    "--mscale",
    "1.0",
    "--mscale-all-dim",
    "0.0",
    "--no-yarn-correction-range-round-to-int",
    "--untie-embeddings-and-output-weights",
    "--norm-epsilon",
    "1e-5",
    "--no-rope-fusion",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-router-dtype",
    "fp32",
];

#[test]
fn a_megatron_lm_gpt_oss_run_continues_with_the_losses_megatron_lm_logs() {
    follows_megatron_lm("gpt_oss_adam", "world1", GPT_OSS, &[], FP32);
}
