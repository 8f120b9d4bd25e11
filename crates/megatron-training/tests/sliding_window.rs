//! `--window-size` and `--window-attn-skip-freq` (megatron-core's sliding-window attention):
//! the windowed model trains the same at TP 2 + SP, PP 2 and context parallelism (ring and
//! all-to-all) as on one rank; a window over the whole sequence is full
//! attention; the flags are checked by name. The kernel is checked against a naive window in
//! the tensor crate, decoding and gradients in the core crate, the Mistral conversion in
//! `convert.rs`.

mod common;

use common::*;
use megatron_core::transformer::config::LayerPattern;
use megatron_training::layer_pattern::{parse_layer_pattern, parse_window_size};
use megatron_training::pretrain;

#[test]
fn sliding_window_layouts_match_one_rank() {
    let dir = tmpdir("sliding-window");
    // Windows of 5 earlier tokens in 32 (8 layers), the second layer full (1-based: every 2nd), with
    // attention dropout; each context-parallel chunk cuts its window at its place in the
    // whole sequence (with documents too: `indexed_data.rs`).
    let window = ["--window-size", "(5,0)", "--window-attn-skip-freq", "2"];
    let rest = ["--attention-dropout", "0.1"];
    let windowed = [LLAMA, &window, &rest].concat();
    let serial = train_and_load(&dir, "serial", &windowed);
    let full = train_and_load(&dir, "no-window", &[LLAMA, &rest].concat());
    let last = |s: &megatron_training::TrainSummary| s.losses.last().unwrap().1;
    assert!(
        (last(&serial.0) - last(&full.0)).abs() > 1e-4,
        "the window changes the model"
    );
    // The pattern spelled as a list is the same model.
    let listed = [LLAMA, &window[..3], &["[1,0]*4"], &rest].concat();
    let same = train_and_load(&dir, "listed", &listed);
    assert_eq!(serial.0.losses, same.0.losses, "skip freq 2 and [1,0]*4");
    for (name, layout) in [
        (
            "tp2 sp",
            &[
                "--nproc-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ][..],
        ),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
        (
            "cp2 ring",
            &[
                "--nproc-per-node",
                "2",
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "p2p",
            ][..],
        ),
        (
            "cp2 all-to-all",
            &[
                "--nproc-per-node",
                "2",
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "a2a",
            ][..],
        ),
    ] {
        let other = train_and_load(
            &dir,
            &name.replace(' ', "-"),
            &[&windowed[..], layout].concat(),
        );
        assert_same_training(&format!("window {name}"), &serial, &other, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_window_covering_the_sequence_is_full_attention() {
    let full = pretrain(&args(&["--train-iters", "4"])).unwrap();
    let covering = pretrain(&args(&["--train-iters", "4", "--window-size", "(15,0)"])).unwrap();
    assert_eq!(full.losses, covering.losses);
    let infinite = pretrain(&args(&["--train-iters", "4", "--window-size", "-1,0"])).unwrap();
    assert_eq!(full.losses, infinite.losses);
    let narrow = pretrain(&args(&["--train-iters", "4", "--window-size", "(3,0)"])).unwrap();
    assert_ne!(full.losses, narrow.losses);
}

#[test]
fn window_flags_are_checked_by_name() {
    let fails = |extra: &[&str], want: &str| {
        let mut flags = vec!["--train-iters", "4"];
        flags.extend_from_slice(extra);
        let e = pretrain(&args(&flags)).unwrap_err().to_string();
        assert!(e.contains(want), "{extra:?}: {e}");
    };
    fails(
        &["--window-size", "(4,2)"],
        "--window-size '(4,2)': the right side must be 0",
    );
    fails(&["--window-size", "4"], "expected two integers");
    fails(&["--window-size", "(-3,0)"], "at least 0");
    fails(&["--window-attn-skip-freq", "2"], "it needs --window-size");
    fails(
        &[
            "--window-size",
            "(4,0)",
            "--window-attn-skip-freq",
            "[1,0,1]",
        ],
        "has 3 entries for 2 layers",
    );
    fails(
        &["--window-size", "(4,0)", "--window-attn-skip-freq", "0"],
        "--window-attn-skip-freq '0'",
    );
    let e = pretrain(&bert_args(&[
        "--train-iters",
        "3",
        "--window-size",
        "(4,0)",
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("--model bert: --window-size"), "{e}");
}

#[test]
fn layer_patterns_read_megatrons_list_expressions() {
    let p = |s: &str| parse_layer_pattern("--window-attn-skip-freq", s);
    assert_eq!(p("4").unwrap(), LayerPattern::Every(4));
    let list = |v: &[u8]| LayerPattern::List(v.iter().map(|&x| x == 1).collect());
    assert_eq!(p("[1,1,0]").unwrap(), list(&[1, 1, 0]));
    assert_eq!(p("[1,1,1,0]*2").unwrap(), list(&[1, 1, 1, 0, 1, 1, 1, 0]));
    assert_eq!(
        p("([1]*3+[0]*2)*2").unwrap(),
        list(&[1, 1, 1, 0, 0, 1, 1, 1, 0, 0])
    );
    assert_eq!(p(" [0] + [1] * 3 ").unwrap(), list(&[0, 1, 1, 1]));
    for bad in ["[1,2]", "[1,0", "[1]*", "[1]x", "0", "-2", "two"] {
        let e = p(bad).unwrap_err();
        assert!(
            e.starts_with(&format!("--window-attn-skip-freq '{bad}'")),
            "{bad}: {e}"
        );
    }
    assert_eq!(parse_window_size("(4096,0)").unwrap(), Some(4096));
    assert_eq!(parse_window_size("4096, -1").unwrap(), Some(4096));
    assert_eq!(parse_window_size("(-1,-1)").unwrap(), None);
}
