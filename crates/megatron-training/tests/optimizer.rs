//! `--optimizer sgd` (megatron-core's: torch's SGD with `--sgd-momentum` and L2 weight decay)
//! beside the default Adam: every layout trains the same model as one rank, the momentum
//! buffer is checkpointed and resumes under another layout, and a checkpoint of the other
//! optimizer is refused by name. The update itself is checked against torch's formula in the
//! tensor crate (`backend_cpu_sgd.rs`) and, sharded, in megatron-core.

mod common;

use common::*;
use megatron_training::checkpointing::{load_checkpoint, LoadedCheckpoint, TRACKER};
use megatron_training::{pretrain, TrainSummary};

/// 4 layers so that PP 2 splits them; vocabulary padding 64 at one rank and at TP 2.
const MODEL: &[&str] = &[
    "--num-layers",
    "4",
    "--make-vocab-size-divisible-by",
    "32",
    "--lr",
    "0.05",
];

fn run(dir: &std::path::Path, name: &str, flags: &[&str]) -> (TrainSummary, LoadedCheckpoint) {
    let save = dir.join(name);
    let s = save.to_str().unwrap().to_string();
    let v = [MODEL, &["--train-iters", "5", "--save", &s], flags].concat();
    let summary = pretrain(&args(&v)).unwrap();
    (summary, load_checkpoint(&save, None).unwrap())
}

#[test]
fn sgd_trains_the_same_model_in_every_layout_as_one_rank() {
    let dir = tmpdir("sgd-layouts");
    let sgd = ["--optimizer", "sgd"];
    let serial = run(&dir, "serial", &sgd);
    let adam = run(&dir, "adam", &[]);
    assert_ne!(
        serial.0.losses, adam.0.losses,
        "--optimizer sgd trained Adam"
    );
    let names: Vec<&String> = serial.1.tensors.keys().collect();
    assert!(names
        .iter()
        .any(|n| n.starts_with("optimizer.momentum_buffer.")));
    assert!(!names.iter().any(|n| n.starts_with("optimizer.exp_avg")));
    let n2 = ["--nproc-per-node", "2"];
    for (name, layout) in [
        ("dp2", &n2[..]),
        (
            "dp2-distopt",
            &[&n2[..], &["--use-distributed-optimizer"]].concat()[..],
        ),
        (
            "tp2-sp",
            &[
                &n2[..],
                &["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            ]
            .concat()[..],
        ),
        (
            "pp2",
            &[&n2[..], &["--pipeline-model-parallel-size", "2"]].concat()[..],
        ),
    ] {
        let other = run(&dir, name, &[&sgd[..], layout].concat());
        assert_same_training(name, &serial, &other, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_sgd_checkpoint_resumes_its_momentum_under_another_layout() {
    // Saved at DP 2 with the distributed optimizer (the buffer as its shards), resumed at one
    // rank: the uninterrupted run's losses. Without the buffer (restarted momentum) they differ.
    let dir = tmpdir("sgd-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let flags = [MODEL, &["--optimizer", "sgd", "--train-iters", "6"]].concat();
    let full = pretrain(&args(
        &[
            &flags[..],
            &[
                "--save",
                s,
                "--save-interval",
                "3",
                "--nproc-per-node",
                "2",
                "--use-distributed-optimizer",
            ],
        ]
        .concat(),
    ))
    .unwrap();
    std::fs::write(save.join(TRACKER), "3\n").unwrap();
    let resumed = pretrain(&args(&[&flags[..], &["--load", s]].concat())).unwrap();
    assert_eq!(resumed.start_iteration, 3);
    assert_losses_close("resumed", &full.losses[3..], &resumed.losses, 1e-5);
    let restarted = pretrain(&args(
        &[&flags[..], &["--load", s, "--no-load-optim"]].concat(),
    ))
    .unwrap();
    assert!(
        (restarted.losses[1].1 - full.losses[4].1).abs() > 1e-5,
        "the momentum buffer made no difference"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_checkpoint_of_the_other_optimizer_is_refused_unless_its_state_is_dropped() {
    let dir = tmpdir("sgd-vs-adam");
    let save = dir.join("adam");
    let s = save.to_str().unwrap();
    pretrain(&args(
        &[MODEL, &["--train-iters", "3", "--save", s]].concat(),
    ))
    .unwrap();
    let more = [
        "--train-iters",
        "5",
        "--load",
        s,
        "--override-opt_param-scheduler",
    ];
    let e = pretrain(&args(&[MODEL, &more[..], &["--optimizer", "sgd"]].concat()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--optimizer adam")
            && e.contains("--optimizer sgd")
            && e.contains("--no-load-optim"),
        "{e}"
    );
    let ok = pretrain(&args(
        &[MODEL, &more[..], &["--optimizer", "sgd", "--no-load-optim"]].concat(),
    ))
    .unwrap();
    assert_eq!(ok.start_iteration, 3);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sgd_without_momentum_keeps_no_state_and_differs_from_momentum() {
    let dir = tmpdir("sgd-plain");
    let plain = run(
        &dir,
        "plain",
        &["--optimizer", "sgd", "--sgd-momentum", "0"],
    );
    let momentum = run(&dir, "momentum", &["--optimizer", "sgd"]);
    assert!(plain.1.tensors.keys().all(|n| !n.starts_with("optimizer.")));
    assert_eq!(plain.0.losses[0], momentum.0.losses[0]);
    assert_ne!(plain.0.losses[4], momentum.0.losses[4]);
    // A plain-SGD checkpoint resumes (there is nothing to read but the step count).
    let s = dir.join("plain");
    let resumed = pretrain(&args(
        &[
            MODEL,
            &[
                "--optimizer",
                "sgd",
                "--sgd-momentum",
                "0",
                "--train-iters",
                "6",
                "--override-opt_param-scheduler",
                "--load",
                s.to_str().unwrap(),
            ],
        ]
        .concat(),
    ))
    .unwrap();
    assert_eq!(resumed.start_iteration, 5);
    let e = pretrain(&args(&[
        "--train-iters",
        "3",
        "--optimizer",
        "sgd",
        "--sgd-momentum",
        "-0.5",
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("--sgd-momentum"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
