//! `--rampup-batch-size` under `--train-samples`: the batch sizes Megatron's calculator gives,
//! the same model at every layout, and a resume in the middle of the ramp.

mod common;

use common::{args, assert_losses_close, tmpdir};
use megatron_training::{pretrain, TrainArgs, TrainSummary};

/// Global batch 8 reached from 2 in steps of 2 over the first 24 samples (8 per step), 60
/// samples in all: batches 2, 2, 2, 2, 4, 4, 6, 6 (28 samples, past the ramp) then 8 x 4.
fn ramped(extra: &[&str]) -> TrainArgs {
    let flags = [
        &[
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "8",
            "--num-layers",
            "4",
            "--hidden-dropout",
            "0.1",
        ],
        extra,
    ]
    .concat();
    let mut a = args(&flags);
    // Sample-based training, as Megatron requires for a ramp.
    a.lr_warmup_iters = None;
    a.lr_warmup_samples = Some(8);
    a.train_samples = Some(60);
    a.rampup_batch_size = Some(vec![2, 2, 24]);
    a
}

fn run(a: &TrainArgs) -> TrainSummary {
    pretrain(a).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_ramped_batch_size_trains_the_same_model_at_every_layout() {
    let one = run(&ramped(&[]));
    assert_eq!(
        one.losses.len(),
        12,
        "8 ramp iterations and 4 at the final batch"
    );
    assert!(one.losses.iter().all(|l| l.1.is_finite()));
    for (what, layout) in [
        ("DP 2", &["--nproc-per-node", "2"][..]),
        (
            "TP 2 x DP 2",
            &[
                "--nproc-per-node",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                // The one-rank run's padded vocabulary: 128 = 64 x TP 2.
                "--make-vocab-size-divisible-by",
                "64",
            ][..],
        ),
        (
            "PP 2 interleaved",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ][..],
        ),
    ] {
        let other = run(&ramped(layout));
        assert_losses_close(what, &one.losses, &other.losses, 1e-5);
        assert_losses_close(what, &one.val_losses, &other.val_losses, 1e-5);
    }
}

#[test]
fn a_run_resumed_in_the_middle_of_the_ramp_continues_bit_identically() {
    let dir = tmpdir("rampup-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let full = run(&ramped(&[]));
    // Stopped after iteration 5 (14 samples consumed, batch 4 of the ramp), then resumed.
    let mut first = ramped(&["--save", s, "--save-interval", "5"]);
    first.exit_interval = Some(5);
    let part = run(&first);
    assert_eq!(part.losses.len(), 5);
    let resumed = run(&ramped(&["--load", s]));
    assert_eq!(resumed.losses.first().map(|l| l.0), Some(6));
    assert_eq!(resumed.losses, full.losses[5..].to_vec());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ramp_up_flags_are_checked_as_megatron_checks_them() {
    let err = |a: TrainArgs| pretrain(&a).unwrap_err().to_string();
    // Iteration-based training has no ramp.
    let mut a = args(&["--train-iters", "4"]);
    a.rampup_batch_size = Some(vec![2, 2, 8]);
    let e = err(a);
    assert!(
        e.contains("--rampup-batch-size needs sample-based training"),
        "{e}"
    );
    // Sample-based training takes the sample-based learning-rate flags.
    let mut a = ramped(&[]);
    a.lr_warmup_iters = Some(2);
    a.lr_warmup_samples = None;
    let e = err(a);
    assert!(e.contains("--lr-warmup-iters is for --train-iters"), "{e}");
    // A ramp size that does not split over 2 data-parallel ranks of micro-batch 2.
    let mut a = ramped(&["--nproc-per-node", "2", "--micro-batch-size", "2"]);
    a.rampup_batch_size = Some(vec![2, 2, 24]);
    let e = err(a);
    assert!(e.contains("the ramp's global batch size 2"), "{e}");
}
