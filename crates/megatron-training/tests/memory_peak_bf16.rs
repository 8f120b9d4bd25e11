//! `--log-memory`'s prediction under `--bf16`, on each kind of bf16 matmul this CPU runs: the
//! f32 GEMM on rounded operands (`--bf16-matmul-kernel fma`, every CPU) and the packed kernel
//! (`dot`, where the CPU has AVX512_BF16), whose packing buffers, packed output weight and
//! bf16 logit-gradient chunk stay allocated between steps. A vocabulary large beside the hidden
//! size and a wide MLP, so the output layer's and the layers' working sets both matter.
//!
//! One test in this binary: rank threads count in per-rank slots of the process.

mod common;

use common::*;
use megatron_tensor::alloc::RankAllocator;
use megatron_training::pretrain;

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
    "--train-iters",
    "2",
    "--log-interval",
    "2",
    "--eval-iters",
    "0",
    "--bf16",
    "--log-memory",
];

#[test]
fn measured_bf16_peak_per_rank_matches_the_prediction_on_each_bf16_kernel() {
    let mut kernels = vec!["fma"];
    if std::arch::is_x86_feature_detected!("avx512bf16") {
        kernels.push("dot");
    } else {
        println!("skipped --bf16-matmul-kernel dot: this CPU has no AVX512_BF16 (fma tested)");
    }
    let layouts: [&[&str]; 2] = [
        &[],
        &[
            "--nproc-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ];
    let tolerance = 0.02;
    let dir = tmpdir("memory-peak-bf16");
    for kernel in kernels {
        for (i, layout) in layouts.iter().enumerate() {
            let metrics = dir.join(format!("metrics-{kernel}-{i}.jsonl"));
            let m = metrics.to_str().unwrap();
            let v = [
                MODEL,
                layout,
                &["--bf16-matmul-kernel", kernel, "--metrics-file", m],
            ]
            .concat();
            pretrain(&args(&v)).unwrap_or_else(|e| panic!("{kernel} {layout:?}: {e}"));
            assert_peak_matches_prediction(&metrics, tolerance, &format!("{kernel} {layout:?}"));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
