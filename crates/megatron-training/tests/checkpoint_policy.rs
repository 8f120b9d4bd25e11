//! Megatron's checkpoint flags around --save and --load: a --load directory with nothing in it
//! (the first launch of a job whose --load is its --save) starts from random initialization,
//! or stops under --exit-on-missing-checkpoint; --ckpt-step loads that iteration;
//! --pretrained-checkpoint starts a new run where --load is empty; --save-retain-interval and
//! non-persistent checkpoints keep what Megatron keeps, and a newer non-persistent checkpoint
//! resumes exactly.

mod common;

use common::*;
use megatron_training::checkpointing::TRACKER;
use megatron_training::{pretrain, TrainSummary};
use std::path::Path;

/// One learning-rate schedule however far a run goes, so resumed runs continue it.
const SCHEDULE: &[&str] = &["--lr-decay-iters", "12", "--eval-iters", "0"];

fn train(iters: &str, more: &[&str]) -> TrainSummary {
    try_train(iters, more).unwrap()
}

fn try_train(iters: &str, more: &[&str]) -> Result<TrainSummary, String> {
    let v = [SCHEDULE, &["--train-iters", iters], more].concat();
    pretrain(&args(&v)).map_err(|e| e.to_string())
}

/// The `iter_*` directories under `dir`, sorted.
fn iteration_dirs(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("iter_"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_load_directory_with_nothing_in_it_starts_from_random_or_stops_when_asked() {
    let dir = tmpdir("policy-missing");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let fresh = train("4", &[]);
    // Megatron's launch scripts pass one directory to --save and --load from the first launch.
    let first = train("4", &["--save", c, "--load", c, "--save-interval", "2"]);
    assert_eq!(first.start_iteration, 0);
    assert_losses_close("first launch", &fresh.losses, &first.losses, 0.0);
    // The second launch resumes from it.
    let second = train("6", &["--save", c, "--load", c, "--save-interval", "2"]);
    assert_eq!(second.start_iteration, 4);
    // An empty directory, and one where only an interrupted first save was left, hold nothing.
    let empty = dir.join("empty");
    std::fs::create_dir_all(empty.join("iter_0000002.partial")).unwrap();
    let e = empty.to_str().unwrap();
    assert_eq!(train("2", &["--load", e]).start_iteration, 0);
    let err = try_train("2", &["--load", e, "--exit-on-missing-checkpoint"]).unwrap_err();
    assert!(
        err.contains("--exit-on-missing-checkpoint") && err.contains(e) && err.contains("partial"),
        "{err}"
    );
    // Where a checkpoint was published (a tracker) but none is complete, nothing starts over.
    std::fs::write(empty.join(TRACKER), "2\n").unwrap();
    let err = try_train("2", &["--load", e]).unwrap_err();
    assert!(err.contains("no complete checkpoint"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ckpt_step_resumes_from_that_iteration_and_names_a_missing_one() {
    let dir = tmpdir("policy-step");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let straight = train("6", &["--save", c, "--save-interval", "2"]);
    let rolled_back = train("6", &["--load", c, "--ckpt-step", "4"]);
    assert_eq!(rolled_back.start_iteration, 4);
    assert_losses_close(
        "resumed at --ckpt-step 4",
        &straight.losses[4..],
        &rolled_back.losses,
        0.0,
    );
    let err = try_train("6", &["--load", c, "--ckpt-step", "3"]).unwrap_err();
    assert!(
        err.contains("--ckpt-step 3") && err.contains("iter_0000003") && err.contains("2, 4, 6"),
        "{err}"
    );
    std::fs::remove_file(ckpt.join("iter_0000004").join("metadata.json")).unwrap();
    let err = try_train("6", &["--load", c, "--ckpt-step", "4"]).unwrap_err();
    assert!(
        err.contains("--ckpt-step 4") && err.contains("manifest"),
        "{err}"
    );
    let err = try_train("6", &["--ckpt-step", "4"]).unwrap_err();
    assert!(err.contains("--ckpt-step needs --load"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_pretrained_checkpoint_starts_a_new_run_only_where_load_holds_nothing() {
    let dir = tmpdir("policy-pretrained");
    let (pre, run) = (dir.join("pretrained"), dir.join("run"));
    let (p, r) = (pre.to_str().unwrap(), run.to_str().unwrap());
    train("3", &["--save", p]);
    let finetuned = train("3", &["--load", p, "--finetune"]);
    let from_pretrained = train(
        "3",
        &[
            "--load",
            r,
            "--save",
            r,
            "--save-interval",
            "2",
            "--pretrained-checkpoint",
            p,
            "--exit-interval",
            "2",
        ],
    );
    assert_eq!(from_pretrained.start_iteration, 0);
    assert_losses_close(
        "--pretrained-checkpoint against --finetune",
        &finetuned.losses[..2],
        &from_pretrained.losses,
        0.0,
    );
    // Once the run saved, --load is what it resumes from.
    let resumed = train("3", &["--load", r, "--pretrained-checkpoint", p]);
    assert_eq!(resumed.start_iteration, 2);
    assert_losses_close(
        "resumed from --load",
        &finetuned.losses[2..],
        &resumed.losses,
        0.0,
    );
    let nowhere = dir.join("nowhere");
    let err = try_train("3", &["--pretrained-checkpoint", nowhere.to_str().unwrap()]).unwrap_err();
    assert!(
        err.contains("--pretrained-checkpoint") && err.contains("nowhere"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn save_retain_interval_deletes_the_previous_checkpoint_unless_a_multiple() {
    let dir = tmpdir("policy-retain");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let every2 = ["--save", c, "--save-interval", "2"];
    train(
        "10",
        &[&every2[..], &["--save-retain-interval", "4"]].concat(),
    );
    // 2 went when 4 was saved, 6 when 8 was; the newest always stays.
    assert_eq!(
        iteration_dirs(&ckpt),
        ["iter_0000004", "iter_0000008", "iter_0000010"]
    );
    let err = try_train(
        "4",
        &[&every2[..], &["--save-retain-interval", "3"]].concat(),
    )
    .unwrap_err();
    assert!(
        err.contains("--save-retain-interval (3)") && err.contains("--save-interval (2)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn non_persistent_checkpoints_keep_their_newest_and_resume_exactly_when_newer() {
    let dir = tmpdir("policy-non-persistent");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let flags = [
        "--save",
        c,
        "--save-interval",
        "4",
        "--non-persistent-save-interval",
        "1",
    ];
    let straight = train("6", &flags);
    let np = ckpt.join("non_persistent");
    // Iterations 1, 2, 3 and 5 were non-persistent (4 and the last, 6, persistent); only the
    // newest stays.
    assert_eq!(iteration_dirs(&np), ["iter_0000005"]);
    assert_eq!(iteration_dirs(&ckpt), ["iter_0000004", "iter_0000006"]);
    // A job that died during iteration 6: the newest persistent is 4, the non-persistent 5.
    std::fs::remove_dir_all(ckpt.join("iter_0000006")).unwrap();
    std::fs::write(ckpt.join(TRACKER), "4\n").unwrap();
    let resumed = train("6", &["--load", c, "--non-persistent-ckpt-type", "global"]);
    assert_eq!(resumed.start_iteration, 5);
    assert_losses_close(
        "resumed from the non-persistent checkpoint",
        &straight.losses[5..],
        &resumed.losses,
        0.0,
    );
    // Without the flag, --load takes the persistent one, as Megatron's does.
    assert_eq!(train("6", &["--load", c]).start_iteration, 4);
    // A custom directory, saved and loaded.
    let custom = dir.join("np-custom");
    let u = custom.to_str().unwrap();
    let other = dir.join("ckpt2");
    let o = other.to_str().unwrap();
    let custom_flags = [
        "--save",
        o,
        "--save-interval",
        "4",
        "--non-persistent-save-interval",
        "1",
        "--non-persistent-global-ckpt-dir",
        u,
        "--exit-interval",
        "3",
    ];
    train("6", &custom_flags);
    assert_eq!(iteration_dirs(&custom), ["iter_0000002"]);
    // The exit at iteration 3 saved persistently.
    assert_eq!(iteration_dirs(&other), ["iter_0000003"]);
    let err = try_train("2", &["--save", c, "--non-persistent-ckpt-type", "local"]).unwrap_err();
    assert!(err.contains("--non-persistent-ckpt-type local"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
