//! `--log-memory`'s prediction under `--bf16`, on each kind of bf16 matmul this CPU runs: the
//! f32 GEMM on rounded operands (`--bf16-matmul-kernel fma`, every CPU) and the packed kernel
//! (`dot`, where the CPU has AVX512_BF16), whose packing buffers, packed output weight and
//! bf16 logit-gradient chunk stay allocated between steps. A vocabulary large beside the hidden
//! size and a wide MLP, so the output layer's and the layers' working sets both matter.
//!
//! A second model is the other way round (a small vocabulary, an MLP 8x wide), so the layers'
//! working set sets the peak: there the norms and the MLP activation write bf16 for their
//! matmuls and backward reads the kept bf16 tensors in place, which the prediction must follow;
//! a third has multi-latent attention, whose backward sets the peak.
//!
//! One test in this binary: rank threads count in per-rank slots of the process.

mod common;

use common::*;
use megatron_tensor::alloc::RankAllocator;

#[global_allocator]
static ALLOCATOR: RankAllocator<std::alloc::System> = RankAllocator(std::alloc::System);

const MODEL: &[&str] = &[
    "--vocab-size",
    "8000",
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--ffn-hidden-size",
    "1024",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
];

/// Two steps under `--bf16`, logging the measured and predicted peaks.
const RUN: &[&str] = &[
    "--train-iters",
    "2",
    "--log-interval",
    "2",
    "--eval-iters",
    "0",
    "--bf16",
    "--log-memory",
];

/// The layers' working set dominates: vocabulary 1000 against an MLP of 2048 on hidden 256
/// (with [`SMALL_VOCAB_LAYERS`]).
const WIDE_MLP: &[&str] = &["--ffn-hidden-size", "2048", "--global-batch-size", "4"];

/// Multi-latent attention, where attention's backward (its widened QKV, the padded kernel
/// output) outweighs the MLP's (with [`SMALL_VOCAB_LAYERS`]).
const MLA: &[&str] = &[
    "--ffn-hidden-size",
    "1024",
    "--global-batch-size",
    "4",
    "--multi-latent-attention",
    "--q-lora-rank",
    "128",
    "--kv-lora-rank",
    "64",
    "--qk-head-dim",
    "64",
    "--qk-pos-emb-head-dim",
    "32",
    "--v-head-dim",
    "64",
    "--position-embedding-type",
    "rope",
];

#[test]
fn measured_bf16_peak_per_rank_matches_the_prediction_on_each_bf16_kernel() {
    let mut kernels = vec!["fma"];
    if std::arch::is_x86_feature_detected!("avx512bf16") {
        kernels.push("dot");
    } else {
        println!("skipped --bf16-matmul-kernel dot: this CPU has no AVX512_BF16 (fma tested)");
    }
    let tp2_sp: &[&str] = &[
        "--nproc-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ];
    let swiglu_tp2_sp = [&["--swiglu"][..], tp2_sp].concat();
    let wide_mlp = [SMALL_VOCAB_LAYERS, WIDE_MLP].concat();
    let mla = [SMALL_VOCAB_LAYERS, MLA].concat();
    let runs: [(&[&str], &[&str]); 6] = [
        (MODEL, &[]),
        (MODEL, tp2_sp),
        (&wide_mlp, &[]),
        (&wide_mlp, &["--swiglu"]),
        (&wide_mlp, &swiglu_tp2_sp),
        (&mla, &[]),
    ];
    let tolerance = 0.02;
    let dir = tmpdir("memory-peak-bf16");
    for kernel in kernels {
        for (i, (model, layout)) in runs.iter().enumerate() {
            let flags = [*model, RUN, *layout, &["--bf16-matmul-kernel", kernel]].concat();
            let what = format!("{kernel} run {i} {layout:?}");
            train_and_assert_peak(&dir, &format!("{kernel}-{i}"), &flags, tolerance, &what);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
