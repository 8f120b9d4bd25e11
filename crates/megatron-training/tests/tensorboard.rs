//! TensorBoard event files: the framing and messages round-trip through the project's reader
//! with every CRC checked, a flipped byte is caught, and `megatron train --tensorboard-dir`
//! writes Megatron's tags with the values the log reports.

mod common;

use megatron_training::tensorboard::{read_scalars, record, Scalar, SummaryWriter};

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("megatron-tb-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    d
}

/// Trains the tiny model for 6 iterations (log interval 2) with `--tensorboard-dir` and
/// `extra`; returns the run and the scalars of its one event file.
fn train_with_tensorboard(
    name: &str,
    extra: &[&str],
) -> (megatron_training::TrainSummary, Vec<Scalar>) {
    let dir = temp_dir(name);
    let d = dir.display().to_string();
    let flags = [
        &[
            "--train-iters",
            "6",
            "--log-interval",
            "2",
            "--tensorboard-dir",
            &d,
        ][..],
        extra,
    ]
    .concat();
    let summary = megatron_training::pretrain(&common::args(&flags)).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one event file");
    let s = read_scalars(&files[0].path()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    (summary, s)
}

#[test]
fn masked_crc_matches_tensorflows_definition() {
    // CRC-32C of "123456789" is 0xE3069283 (the Castagnoli check value); TensorFlow masks it
    // as ((c >> 15) | (c << 17)) + 0xa282ead8.
    let c: u64 = 0xE306_9283;
    // The rotation written out in 64 bits (the high bits fall away in the cast).
    let masked = (((c >> 15) | (c << 17)) as u32).wrapping_add(0xa282_ead8);
    assert_eq!(record::masked_crc(b"123456789"), masked);
}

#[test]
fn scalars_round_trip_and_a_flipped_byte_is_caught() {
    let dir = temp_dir("roundtrip");
    let mut w = SummaryWriter::create(&dir).unwrap();
    for step in 1..=5u64 {
        w.add_scalar("lm loss", 10.0 / step as f64, step).unwrap();
        w.add_scalar("learning-rate", 1e-3 * step as f64, step)
            .unwrap();
    }
    w.flush().unwrap();
    let path = w.path().to_path_buf();
    drop(w);
    let name = path.file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let s = read_scalars(&path).unwrap();
    assert_eq!(s.len(), 10);
    let losses: Vec<(i64, f32)> = s
        .iter()
        .filter(|x| x.tag == "lm loss")
        .map(|x| (x.step, x.value))
        .collect();
    assert_eq!(losses[0], (1, 10.0));
    assert_eq!(losses[4], (5, 2.0));
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let err = read_scalars(&path).unwrap_err().to_string();
    assert!(err.contains("CRC"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn training_writes_megatrons_tags_with_the_logged_values() {
    let (summary, s) = train_with_tensorboard(
        "train",
        &[
            "--eval-interval",
            "3",
            "--log-timers-to-tensorboard",
            "--log-validation-ppl-to-tensorboard",
            "--log-memory-to-tensorboard",
            "--log-world-size-to-tensorboard",
        ],
    );
    let tag = |t: &str| -> Vec<(i64, f32)> {
        s.iter()
            .filter(|x| x.tag == t)
            .map(|x| (x.step, x.value))
            .collect()
    };
    // Megatron's cadence: each iteration's own loss every --tensorboard-log-interval (default 1)
    // iterations, whatever --log-interval.
    let loss = tag("lm loss");
    assert_eq!(
        loss.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5, 6]
    );
    for (&(step, v), &(it, l)) in loss.iter().zip(&summary.losses) {
        assert_eq!(step, it as i64);
        assert!((v as f64 - l).abs() < 1e-6 * l.abs(), "{v} vs {l}");
    }
    // Against consumed samples too (4 per iteration).
    let vs = tag("lm loss vs samples");
    assert_eq!(
        vs.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![4, 8, 12, 16, 20, 24]
    );
    for t in ["learning-rate", "grad-norm", "batch-size", "world-size"] {
        assert_eq!(tag(t).len(), 6, "{t}");
    }
    for (&(step, g), &(it, n)) in tag("grad-norm").iter().zip(&summary.grad_norms) {
        assert_eq!(step, it as i64);
        assert!((g as f64 - n).abs() < 1e-6 * n.abs(), "{g} vs {n}");
    }
    // Measured over a log interval: every 2 iterations.
    for t in [
        "throughput",
        "tokens-per-sec",
        "mfu",
        "iteration-time",
        "mem-peak-rss-bytes",
    ] {
        assert_eq!(
            tag(t).iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![2, 4, 6],
            "{t}"
        );
    }
    assert_eq!(tag("batch-size")[0].1, 4.0);
    let val = tag("lm loss validation");
    // Iterations 3 and 6, then the end of training (on the next samples), as Megatron writes.
    assert_eq!(val.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 6, 6]);
    for (&(_, l), &(_, p)) in val.iter().zip(&tag("lm loss validation ppl")) {
        assert!((l.exp() - p).abs() < 1e-3 * p, "{l} {p}");
    }
    for (i, &(step, l)) in val.iter().enumerate() {
        let (si, sl) = summary.val_losses[i];
        assert_eq!(step, si as i64);
        assert!((l as f64 - sl).abs() < 1e-5 * sl);
    }
    assert!(tag("loss-scale").is_empty(), "no loss scale without --fp16");
}

#[test]
fn tensorboard_log_interval_spaces_the_per_iteration_scalars() {
    let (summary, s) = train_with_tensorboard(
        "train-interval",
        &["--tensorboard-log-interval", "3", "--log-params-norm"],
    );
    let steps = |t: &str| -> Vec<i64> { s.iter().filter(|x| x.tag == t).map(|x| x.step).collect() };
    for t in ["lm loss", "learning-rate", "grad-norm", "params-norm"] {
        assert_eq!(steps(t), vec![3, 6], "{t}");
    }
    assert_eq!(steps("throughput"), vec![2, 4, 6]);
    let third = s.iter().find(|x| x.tag == "lm loss").unwrap().value as f64;
    assert!((third - summary.losses[2].1).abs() < 1e-6 * third.abs());
    let bad = megatron_training::pretrain(&common::args(&[
        "--train-iters",
        "2",
        "--tensorboard-log-interval",
        "0",
    ]))
    .unwrap_err()
    .to_string();
    assert!(bad.contains("--tensorboard-log-interval"), "{bad}");
}
