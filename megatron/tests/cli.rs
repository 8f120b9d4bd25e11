//! The `megatron` binary as a command-line tool.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// `megatron train ... | head -1`: once the reader is gone the process ends like any Unix tool
/// (SIGPIPE), not with a "failed printing to stdout" panic and its backtrace.
#[test]
fn output_piped_into_a_reader_that_closes_ends_without_a_panic() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_megatron"))
        .args([
            "train",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "63",
            "--num-layers",
            "1",
            "--hidden-size",
            "16",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "8",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--train-iters",
            "100000",
            "--lr",
            "1e-3",
            "--log-interval",
            "1",
            "--eval-iters",
            "0",
            "--no-progress-bar",
            "--num-threads",
            "1",
            "--peak-tflops",
            "1",
        ])
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .env_remove("PMI_RANK")
        .env_remove("PMIX_RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start megatron");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a first line").expect("utf-8");
    assert!(!first.is_empty());
    drop(lines);
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked"),
        "the process panicked after its reader closed: {stderr}"
    );
    assert!(
        !out.status.success(),
        "100000 iterations cannot have finished: the write to the closed pipe must end the run"
    );
}
