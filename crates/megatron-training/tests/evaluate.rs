//! Validation as Megatron's iterators read it: each evaluation takes the next `--eval-iters`
//! global batches of the validation split (the end of training included), a resumed run goes
//! on where the checkpoint's evaluations stopped, and `--start-eval-at-iter` holds
//! validation back.

mod common;

use common::*;
use megatron_training::{pretrain, TrainSummary};

/// A model that does not change (lr 0), so validation losses differ only by their samples.
const FROZEN: &[&str] = &["--lr", "0", "--lr-warmup-iters", "0", "--min-lr", "0"];

fn train(more: &[&str]) -> TrainSummary {
    pretrain(&args(&[FROZEN, more].concat())).unwrap()
}

#[test]
fn each_validation_reads_the_next_global_batches_of_the_split() {
    let every2 = train(&[
        "--train-iters",
        "6",
        "--eval-interval",
        "2",
        "--eval-iters",
        "2",
    ]);
    // Iterations 2, 4 and 6, then the end of training: four evaluations of 2 batches.
    let at: Vec<u64> = every2.val_losses.iter().map(|v| v.0).collect();
    assert_eq!(at, [2, 4, 6, 6]);
    let losses: Vec<f64> = every2.val_losses.iter().map(|v| v.1).collect();
    for (i, a) in losses.iter().enumerate() {
        for b in &losses[i + 1..] {
            assert_ne!(a, b, "two evaluations read the same samples: {losses:?}");
        }
    }
    // One evaluation of all 8 batches scores the same samples (every token counts the same).
    let once = train(&[
        "--train-iters",
        "6",
        "--eval-interval",
        "100",
        "--eval-iters",
        "8",
    ]);
    assert_eq!(once.val_losses.len(), 1);
    let mean = losses.iter().sum::<f64>() / 4.0;
    assert!(
        (mean - once.val_losses[0].1).abs() < 1e-6,
        "{mean} against {}",
        once.val_losses[0].1
    );
}

#[test]
fn a_resumed_run_validates_on_the_samples_the_uninterrupted_run_does() {
    let dir = tmpdir("eval-resume");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let flags = [
        "--train-iters",
        "6",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--lr",
        "1e-3",
        "--lr-decay-iters",
        "12",
    ];
    let straight = pretrain(&args(
        &[&flags[..], &["--save", c, "--save-interval", "4"]].concat(),
    ))
    .unwrap();
    let resumed = pretrain(&args(
        &[&flags[..], &["--load", c, "--ckpt-step", "4"]].concat(),
    ))
    .unwrap();
    assert_eq!(resumed.val_losses, straight.val_losses[2..]);
    // A checkpoint that does not record the samples read (an older one): counted from the
    // iteration, as Megatron does.
    let meta = ckpt.join("iter_0000004").join("metadata.json");
    let json = std::fs::read_to_string(&meta).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v["consumed_valid_samples"], 8,
        "2 evaluations of 1 batch of 4"
    );
    v.as_object_mut().unwrap().remove("consumed_valid_samples");
    std::fs::write(&meta, serde_json::to_string(&v).unwrap()).unwrap();
    // The manifest's checksums cover the shards, not itself.
    let older = pretrain(&args(
        &[&flags[..], &["--load", c, "--ckpt-step", "4"]].concat(),
    ))
    .unwrap();
    assert_eq!(older.val_losses, straight.val_losses[2..]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn start_eval_at_iter_holds_validation_back() {
    let s = train(&[
        "--train-iters",
        "6",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--start-eval-at-iter",
        "3",
    ]);
    let at: Vec<u64> = s.val_losses.iter().map(|v| v.0).collect();
    assert_eq!(at, [4, 6, 6]);
}
