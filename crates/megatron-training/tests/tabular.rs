//! `megatron train --model tabular`: every layout trains the same model as one rank, a resumed
//! run continues exactly, checkpoints refuse damage, and flags it cannot honour are refused.

mod common;

use common::{tabular_args, tmpdir};
use megatron_training::tabular::{pretrain_tabular, validate, TabularSummary};

fn train(extra: &[&str]) -> TabularSummary {
    pretrain_tabular(validate(&tabular_args(extra)).expect("valid flags")).expect("trains")
}

/// Losses within `tol` (relative, floor 1) and every parameter within `tol` (absolute).
fn assert_same_model(what: &str, a: &TabularSummary, b: &TabularSummary, tol: f64) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: iterations");
    for (x, y) in a.losses.iter().zip(&b.losses) {
        assert_eq!(x.0, y.0);
        assert!(
            (x.1 - y.1).abs() <= tol * x.1.abs().max(1.0),
            "{what} iteration {}: loss {} vs {}",
            x.0,
            x.1,
            y.1
        );
    }
    assert_eq!(a.params.len(), b.params.len());
    for ((n, p), (m, q)) in a.params.iter().zip(&b.params) {
        assert_eq!(n, m);
        let worst = p
            .iter()
            .zip(q)
            .map(|(u, v)| (u - v).abs() as f64)
            .fold(0.0, f64::max);
        assert!(worst <= tol, "{what}: {n} differs by {worst}");
    }
}

#[test]
fn tabular_training_lowers_the_loss_and_reports_every_iteration() {
    let s = train(&["--train-iters", "12", "--lr", "1e-2"]);
    assert_eq!(s.losses.len(), 12);
    let first: f64 = s.losses[..3].iter().map(|l| l.1).sum();
    let last: f64 = s.losses[9..].iter().map(|l| l.1).sum();
    assert!(
        last < first,
        "loss did not fall: first three {first}, last three {last}"
    );
}

#[test]
fn tabular_training_at_data_parallel_2_matches_one_rank() {
    let one = train(&[]);
    let two = train(&["--nproc-per-node", "2"]);
    assert_same_model("DP 2 vs 1", &one, &two, 2e-5);
}

#[test]
fn tabular_training_at_tensor_parallel_2_matches_one_rank() {
    let one = train(&[]);
    let two = train(&["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]);
    assert_same_model("TP 2 vs 1", &one, &two, 2e-5);
}

#[test]
fn tabular_training_with_rows_split_over_2_context_parallel_ranks_matches_one_rank() {
    let one = train(&[]);
    let two = train(&["--nproc-per-node", "2", "--context-parallel-size", "2"]);
    assert_same_model("CP 2 vs 1", &one, &two, 2e-5);
}

#[test]
fn tabular_training_at_tp_2_cp_2_dp_2_matches_one_rank() {
    let one = train(&[]);
    let eight = train(&[
        "--nproc-per-node",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--num-threads",
        "8",
    ]);
    assert_same_model("TP 2 x CP 2 x DP 2 vs 1", &one, &eight, 2e-5);
}

#[test]
fn tabular_resume_from_a_checkpoint_continues_exactly() {
    let dir = tmpdir("tabular-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let whole = train(&["--save", s, "--save-interval", "2"]);
    // Resume from iteration 2 (the tracker names 4: point it back at 2).
    std::fs::write(save.join("latest_checkpointed_iteration.txt"), "2\n").unwrap();
    let resumed = train(&["--load", s]);
    assert_eq!(resumed.start_iteration, 2);
    assert_eq!(resumed.losses, whole.losses[2..].to_vec());
    assert_eq!(resumed.params, whole.params);
}

#[test]
fn a_damaged_tabular_checkpoint_is_refused_by_name() {
    let dir = tmpdir("tabular-damage");
    let save = dir.join("ckpt");
    train(&["--train-iters", "1", "--save", save.to_str().unwrap()]);
    let file = save.join("iter_0000001/model_optim.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x55;
    std::fs::write(&file, bytes).unwrap();
    let cfg = validate(&tabular_args(&["--load", save.to_str().unwrap()])).unwrap();
    let err = pretrain_tabular(cfg).unwrap_err().to_string();
    assert!(
        err.contains("model_optim.safetensors") && err.contains("damaged"),
        "{err}"
    );
    // Nothing looks complete that is not: no partial directory is left behind either.
    assert!(!save.join("iter_0000001.partial").exists());
}

#[test]
fn tabular_flags_it_cannot_honour_are_refused_by_name() {
    for (flags, named) in [
        (
            vec!["--pipeline-model-parallel-size", "2"],
            "--pipeline-model-parallel-size",
        ),
        (vec!["--bf16"], "--bf16"),
        (
            vec!["--context-parallel-size", "2"],
            "--context-parallel-size",
        ),
        (vec!["--tabular-cell-budget", "64"], "--tabular-cell-budget"),
        (
            vec!["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
            "--nproc-per-node",
        ),
    ] {
        let err = validate(&tabular_args(&flags)).unwrap_err().to_string();
        assert!(err.contains(named), "{flags:?}: {err}");
    }
}
