//! The dynamic loss scaler in training (`--fp16`): its scale and trackers are checkpointed with
//! the optimizer state, so a resumed run skips the steps the uninterrupted run skips, and the
//! log counts skipped steps per interval, as Megatron's `training_log` does.

mod common;

use common::*;
use megatron_training::checkpointing::TRACKER;
use megatron_training::pretrain;

/// From 2^18 the tiny model's scale doubles every two steps until its gradients overflow f16 at
/// 2^21 (iterations 7 and 11 here), then backs off after the second overflow (hysteresis 2): a
/// run that restarted the scaler at resume would neither skip where this one does nor halve.
const FP16_DYNAMIC: &[&str] = &[
    "--fp16",
    "--initial-loss-scale",
    "262144",
    "--loss-scale-window",
    "2",
    "--hysteresis",
    "2",
    "--train-iters",
    "12",
    "--eval-interval",
    "100",
];

/// Iterations of `1..=iters` without a gradient norm: the skipped ones.
fn skipped(s: &megatron_training::TrainSummary, from: u64, iters: u64) -> Vec<u64> {
    (from + 1..=iters)
        .filter(|i| !s.grad_norms.iter().any(|(it, _)| it == i))
        .collect()
}

#[test]
fn an_fp16_run_resumes_its_dynamic_loss_scale_and_skips_the_same_steps() {
    let dir = tmpdir("grad-scaler-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let full = pretrain(&args(
        &[FP16_DYNAMIC, &["--save", s, "--save-interval", "7"]].concat(),
    ))
    .unwrap();
    let after_7 = skipped(&full, 7, 12);
    assert!(
        skipped(&full, 0, 7).contains(&7) && !after_7.is_empty(),
        "the scale must overflow before and after the checkpoint: {:?}",
        skipped(&full, 0, 12)
    );
    // Iteration 7 overflowed once: the checkpoint holds the hysteresis in progress.
    std::fs::write(save.join(TRACKER), "7\n").unwrap();
    let shown = megatron_training::checkpoint_tool::inspect(&save).unwrap();
    assert!(
        shown.contains(
            "loss scale: 2097152 (dynamic; 0 steps since the last change, 1 overflows left"
        ),
        "{shown}"
    );
    for (name, layout) in [
        ("one rank", &[][..]),
        (
            "pp2",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ][..],
        ),
    ] {
        let resumed = pretrain(&args(&[FP16_DYNAMIC, &["--load", s], layout].concat())).unwrap();
        assert_eq!(resumed.start_iteration, 7, "{name}");
        assert_eq!(skipped(&resumed, 7, 12), after_7, "{name}: skipped steps");
        assert_eq!(
            resumed.skipped_iterations,
            after_7.len() as u64,
            "{name}: the run's count"
        );
        assert_eq!(resumed.loss_scale, full.loss_scale, "{name}: final scale");
        if layout.is_empty() {
            for (a, b) in full.losses[7..].iter().zip(&resumed.losses) {
                assert_eq!(a.0, b.0);
                assert_eq!(a.1.to_bits(), b.1.to_bits(), "iteration {}", a.0);
            }
        } else {
            assert_losses_close(name, &full.losses[7..], &resumed.losses, 1e-5);
        }
    }
    // --no-load-optim restarts the optimizer state, the scaler with it.
    let restarted = pretrain(&args(
        &[FP16_DYNAMIC, &["--load", s, "--no-load-optim"]].concat(),
    ))
    .unwrap();
    assert_ne!(
        skipped(&restarted, 7, 12),
        after_7,
        "a restarted scaler starts at --initial-loss-scale"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_log_counts_skipped_steps_per_interval_and_averages_the_loss_over_steps_taken() {
    let dir = tmpdir("grad-scaler-log");
    let f = dir.join("metrics.jsonl");
    let s = pretrain(&args(
        &[
            FP16_DYNAMIC,
            &["--log-interval", "3", "--metrics-file", f.to_str().unwrap()],
        ]
        .concat(),
    ))
    .unwrap();
    let (rows, _) = metrics_rows(&f);
    let all = skipped(&s, 0, 12);
    for row in &rows {
        let it = row["iteration"].as_u64().unwrap();
        let interval = it - 2..=it;
        let in_interval: Vec<u64> = all
            .iter()
            .copied()
            .filter(|i| interval.contains(i))
            .collect();
        assert_eq!(
            row["skipped_iterations"].as_u64().unwrap(),
            in_interval.len() as u64,
            "iteration {it}: skipped {all:?}"
        );
        assert_eq!(row["nan_iterations"].as_u64().unwrap(), 0);
        let taken: Vec<f64> = s
            .losses
            .iter()
            .filter(|(i, _)| interval.contains(i) && !in_interval.contains(i))
            .map(|(_, l)| *l)
            .collect();
        if !taken.is_empty() {
            let mean = taken.iter().sum::<f64>() / taken.len() as f64;
            let logged = row["lm_loss"].as_f64().unwrap();
            assert!(
                (logged - mean).abs() <= 1e-12 * mean.abs(),
                "iteration {it}: {logged} vs {mean} over the steps taken"
            );
        }
    }
    assert!(
        rows.iter()
            .any(|r| r["skipped_iterations"].as_u64().unwrap() > 0),
        "some interval skipped: {all:?}"
    );
    let total: u64 = rows
        .iter()
        .map(|r| r["skipped_iterations"].as_u64().unwrap())
        .sum();
    assert_eq!(total, s.skipped_iterations);
    let _ = std::fs::remove_dir_all(dir);
}
