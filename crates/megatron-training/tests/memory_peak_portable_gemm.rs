//! Where our AVX-512 GEMM cannot run, the `gemm` crate multiplies, and its packing buffers grew
//! with the output's rows up to the L3 cache's size: `--log-memory` missed most of that on a
//! vocabulary large beside the hidden size (a 32000-word output layer's weight gradient). This
//! binary hides our kernel (`MEGATRON_NO_AVX512_GEMM`) so the portable path runs on every
//! machine, and holds the prediction of such a model to 2 %.

mod common;

use common::*;
use megatron_tensor::alloc::RankAllocator;
use megatron_training::pretrain;

#[global_allocator]
static ALLOCATOR: RankAllocator<std::alloc::System> = RankAllocator(std::alloc::System);

#[test]
fn measured_peak_of_a_large_vocabulary_on_the_portable_gemm_matches_the_prediction() {
    // The only test in this binary, and nothing has multiplied yet: the variable is read once,
    // at the first product.
    std::env::set_var("MEGATRON_NO_AVX512_GEMM", "1");
    let dir = tmpdir("memory-peak-portable");
    let metrics = dir.join("metrics.jsonl");
    let v = [
        "--vocab-size",
        "32000",
        "--num-layers",
        "2",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "256",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "4",
        "--train-iters",
        "2",
        "--log-interval",
        "2",
        "--eval-iters",
        "0",
        "--log-memory",
        "--metrics-file",
        metrics.to_str().unwrap(),
    ];
    pretrain(&args(&v)).unwrap();
    assert_peak_matches_prediction(&metrics, 0.02, "hidden 256, vocabulary 32000");
    let _ = std::fs::remove_dir_all(dir);
}
