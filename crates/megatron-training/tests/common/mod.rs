//! Helpers shared by the training test files: Megatron-style flags for a tiny mock-data run.
#![allow(dead_code)]

use clap::Parser;
use megatron_training::TrainArgs;
use std::path::PathBuf;

#[derive(Parser)]
#[command(args_override_self = true)]
struct Wrap {
    #[command(flatten)]
    args: TrainArgs,
}

/// A tiny GPT on mock data (2 layers, hidden 32, 4 heads, seq 16, vocab 61), 2 GEMM threads,
/// with `extra` flags appended (later flags override earlier ones).
pub fn args(extra: &[&str]) -> TrainArgs {
    let mut v = vec![
        "megatron",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "61",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "2",
        "--lr-decay-style",
        "cosine",
        "--eval-iters",
        "1",
        "--eval-interval",
        "3",
        "--log-interval",
        "1",
        "--peak-tflops",
        "1",
        "--no-progress-bar",
        "--num-threads",
        "2",
    ];
    v.extend_from_slice(extra);
    Wrap::try_parse_from(v).expect("flags parse").args
}

/// A fresh directory under the system temp dir, unique to this process.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("megatron-rs-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
