//! `--log-memory` predicts each rank's allocator high-water mark from the layout alone, and the
//! per-rank allocator (installed here as in the `megatron` binary) measures it: for five
//! layouts mixing TP, SP, PP, CP, recomputation and the distributed optimizer, every rank's
//! measured peak is within 5 % of its prediction, whichever GEMM runs: our AVX-512 kernel's
//! packing buffers are predicted exactly; the `gemm` crate's (elsewhere) are measured by a
//! probe on the layers' and the output layer's shapes, each call's packed operands counted in
//! the phase it runs in.
//!
//! One test in this binary: rank threads count in per-rank slots of the process, so layouts run
//! one after another.

mod common;

use common::*;
use megatron_tensor::alloc::RankAllocator;

#[global_allocator]
static ALLOCATOR: RankAllocator<std::alloc::System> = RankAllocator(std::alloc::System);

/// A model whose activations and transients are a real share of the peak: 4 layers, hidden
/// 128, seq 512, vocabulary 1000, micro-batch 2, 4 micro-batches.
const MODEL: &[&str] = &[
    "--vocab-size",
    "1000",
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "512",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "2",
    "--log-interval",
    "2",
    "--eval-iters",
    "0",
    "--log-memory",
];

#[test]
fn measured_peak_per_rank_is_within_a_few_percent_of_the_prediction() {
    let layouts: [&[&str]; 5] = [
        &[
            "--nproc-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--recompute-activations",
        ],
        &[
            "--nproc-per-node",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
        ],
        &[
            "--nproc-per-node",
            "2",
            "--context-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "2",
        ],
        &[
            "--nproc-per-node",
            "4",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            "a2a",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        &[
            "--nproc-per-node",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
        ],
    ];
    let tolerance = 0.05;
    let dir = tmpdir("memory-peak");
    for (i, layout) in layouts.iter().enumerate() {
        let flags = [MODEL, layout].concat();
        let what = format!("{layout:?}");
        let mem = train_and_assert_peak(&dir, &format!("metrics{i}"), &flags, tolerance, &what);
        let allocated = mem["allocated_peak"].as_u64().expect("allocator installed");
        // The reserved mark adds what the tensor pool keeps; it cannot be below what is in use.
        assert!(mem["reserved_peak"].as_u64().unwrap() >= allocated);
    }
    let _ = std::fs::remove_dir_all(dir);
}
