//! `--rampup-batch-size` under `--train-samples`: the batch sizes Megatron's calculator gives,
//! the same model at every layout, and a resume in the middle of the ramp.

mod common;

use common::{args, assert_losses_close, tmpdir};
use megatron_training::{pretrain, TrainArgs, TrainSummary};

/// 60 samples of 4 layers at micro-batch 1 with dropout, the learning rate warmed up over 8
/// samples: sample-based training, as Megatron requires for a ramp.
fn sample_based(extra: &[&str]) -> TrainArgs {
    let flags = [
        &[
            "--micro-batch-size",
            "1",
            "--num-layers",
            "4",
            "--hidden-dropout",
            "0.1",
        ],
        extra,
    ]
    .concat();
    let mut a = args(&flags);
    a.lr_warmup_iters = None;
    a.lr_warmup_samples = Some(8);
    a.train_samples = Some(60);
    a
}

/// Global batch 8 reached from 2 in steps of 2 over the first 24 samples (8 per step), 60
/// samples in all: batches 2, 2, 2, 2, 4, 4, 6, 6 (28 samples, past the ramp) then 8 x 4.
fn ramped(extra: &[&str]) -> TrainArgs {
    let mut a = sample_based(&[&["--global-batch-size", "8"][..], extra].concat());
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

/// `--step-batch-size-schedule` against megatron-core's `StepBatchsizeNumMicroBatchesCalculator`
/// (`bench/make_step_batch_schedule_fixture.py`): the parsed steps (thresholds in tokens turned
/// into samples, suffixes, commas, unsorted entries), each iteration's global batch size and the
/// iterations of `--train-samples` training, for the GPT-3 175B example's schedule and two more.
#[test]
fn a_step_schedule_gives_megatron_cores_batch_sizes() {
    use megatron_training::num_microbatches::{parse_step_schedule, BatchSizeSchedule};
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/step_batch_size_schedule.json"
    );
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let u = |v: &serde_json::Value| v.as_u64().unwrap();
    let list =
        |v: &serde_json::Value| -> Vec<u64> { v.as_array().unwrap().iter().map(u).collect() };
    for c in cases.as_array().unwrap() {
        let text = c["schedule"].as_str().unwrap();
        let steps = parse_step_schedule(text, u(&c["seq_length"])).unwrap();
        let want: Vec<(u64, u64)> = c["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (u(&s[0]), u(&s[1])))
            .collect();
        assert_eq!(steps, want, "{text}");
        let micro_times_dp = u(&c["micro_batch_size"]) * u(&c["data_parallel_size"]);
        let b = BatchSizeSchedule::stepped(steps, micro_times_dp);
        let samples = u(&c["train_samples"]);
        let iters = b.train_iters(samples);
        assert_eq!(iters, u(&c["train_iters"]), "{text}");
        let mut consumed = 0;
        let mut sizes = Vec::new();
        for _ in 0..iters {
            let s = b.global_batch_size(consumed);
            sizes.push(s);
            consumed += s;
        }
        assert_eq!(
            sizes[..sizes.len().min(64)],
            list(&c["first_sizes"])[..],
            "{text}"
        );
        assert_eq!(
            sizes[sizes.len() - 8..],
            list(&c["last_sizes"])[..],
            "{text}"
        );
    }
}

/// A stepped run: batch 2 from the start, 4 from 64 tokens (4 samples of 16), 8 from 160 tokens
/// (10 samples); 60 samples in all.
fn stepped(extra: &[&str]) -> TrainArgs {
    let mut a = sample_based(extra);
    a.global_batch_size = None;
    a.step_batch_size_schedule = Some("0:2 64:4 160:8".into());
    a
}

#[test]
fn a_stepped_batch_size_trains_the_same_model_at_every_layout_and_resumes_bit_identically() {
    let one = run(&stepped(&[]));
    // Batches 2, 2, 4, 4, then 8 x 6: 60 samples in 10 iterations.
    assert_eq!(one.losses.len(), 10);
    let two = run(&stepped(&["--nproc-per-node", "2"]));
    assert_losses_close("DP 2", &one.losses, &two.losses, 1e-5);
    let dir = tmpdir("step-schedule-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let mut first = stepped(&["--save", s, "--save-interval", "3"]);
    first.exit_interval = Some(3);
    assert_eq!(run(&first).losses.len(), 3);
    let resumed = run(&stepped(&["--load", s]));
    assert_eq!(resumed.losses, one.losses[3..].to_vec());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn step_schedule_flags_are_checked_as_megatron_checks_them() {
    let err = |a: TrainArgs| pretrain(&a).unwrap_err().to_string();
    let mut a = stepped(&[]);
    a.global_batch_size = Some(8);
    let e = err(a);
    assert!(
        e.contains("--step-batch-size-schedule and --global-batch-size"),
        "{e}"
    );
    let mut a = stepped(&[]);
    a.rampup_batch_size = Some(vec![2, 2, 24]);
    assert!(err(a).contains("--rampup-batch-size"));
    for bad in ["160:2 320:4", "0:2 8:4", "0:2 x:4", "0:0", "0-2"] {
        let mut a = stepped(&[]);
        a.step_batch_size_schedule = Some(bad.into());
        let e = err(a);
        assert!(e.contains("--step-batch-size-schedule"), "{bad}: {e}");
    }
    // Batch 2 over 2 data-parallel ranks of micro-batch 2, refused when reached.
    let e = err(stepped(&[
        "--nproc-per-node",
        "2",
        "--micro-batch-size",
        "2",
    ]));
    assert!(
        e.contains("global batch size 2") && e.contains("--step-batch-size-schedule"),
        "{e}"
    );
}
