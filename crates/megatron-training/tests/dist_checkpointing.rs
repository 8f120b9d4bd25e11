//! Sharded checkpoints: written by every rank, each piece once; loaded under other layouts with
//! the optimizer state; a corrupt or incomplete newest checkpoint is skipped, named.

mod common;

use common::*;
use megatron_training::checkpointing::{find_checkpoint, load_checkpoint, TRACKER};
use megatron_training::{pretrain, TrainSummary};
use std::path::Path;

/// [`PP_MODEL`] (vocab 256 after padding at TP 1, 2 and 4) with one learning-rate schedule
/// however far a run goes, so a resumed run can continue one that stopped early.
const SCHEDULE: &[&str] = &["--lr-decay-iters", "10"];

const TP2_PP2_DP2: &[&str] = &[
    "--nproc-per-node",
    "8",
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--use-distributed-optimizer",
];

fn train(iters: &str, layout: &[&str], more: &[&str]) -> TrainSummary {
    let mut v: Vec<&str> = [PP_MODEL, SCHEDULE].concat();
    v.extend_from_slice(&["--train-iters", iters]);
    v.extend_from_slice(layout);
    v.extend_from_slice(more);
    pretrain(&args(&v)).unwrap()
}

#[test]
fn every_rank_writes_its_own_shard_and_each_piece_once() {
    let dir = tmpdir("dcp-files");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    train("2", TP2_PP2_DP2, &["--save", s]);
    let it = save.join("iter_0000002");
    let mut files: Vec<String> = std::fs::read_dir(&it)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    let shards: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .collect();
    assert_eq!(shards.len(), 8, "{files:?}");
    assert!(files.contains(&"metadata.json".to_string()));
    assert!(!save.join("iter_0000002.partial").exists());
    let r = find_checkpoint(&save, false).unwrap();
    assert_eq!(r.meta.files.len(), 8);
    assert!(r.meta.files.iter().all(|f| f.crc32c.is_some()));
    let layout = r.meta.layout.clone().unwrap();
    assert_eq!(
        (
            layout.tensor_model_parallel,
            layout.pipeline_model_parallel,
            layout.data_parallel
        ),
        (2, 2, 2)
    );
    // Each tensor's pieces tile it exactly (no element twice, none missing): the areas add up
    // and no two pieces overlap.
    for t in &r.meta.tensors {
        let (rows, cols) = megatron_core::params::view2d(&t.shape);
        let area: usize = t.pieces.iter().map(|p| p.shape[0] * p.shape[1]).sum();
        assert_eq!(area, rows * cols, "{}", t.name);
        for (i, a) in t.pieces.iter().enumerate() {
            for b in &t.pieces[i + 1..] {
                let overlap = a.offset[0] < b.offset[0] + b.shape[0]
                    && b.offset[0] < a.offset[0] + a.shape[0]
                    && a.offset[1] < b.offset[1] + b.shape[1]
                    && b.offset[1] < a.offset[1] + a.shape[1];
                assert!(!overlap, "{}: {a:?} and {b:?} overlap", t.name);
            }
        }
    }
    // The distributed optimizer's moments are spread over the DP ranks' files.
    let owners: std::collections::BTreeSet<&str> = r
        .meta
        .tensors
        .iter()
        .filter(|t| t.name.starts_with("optimizer.exp_avg."))
        .flat_map(|t| t.pieces.iter().map(|p| p.file.as_str()))
        .collect();
    assert_eq!(owners.len(), 8, "{owners:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_tp2_pp2_dp2_distributed_checkpoint_resumes_at_other_layouts_with_its_optimizer_state() {
    let dir = tmpdir("dcp-reshard");
    let first = dir.join("first");
    let f = first.to_str().unwrap();
    // The run that never changes layout: 10 steps at TP 2 x PP 2 x DP 2.
    let straight = train("10", TP2_PP2_DP2, &[]);
    train("5", TP2_PP2_DP2, &["--save", f]);
    let layouts: &[(&str, &[&str])] = &[
        ("same layout", TP2_PP2_DP2),
        ("one rank", &[]),
        (
            "TP 1 x PP 4 x DP 2",
            &[
                "--nproc-per-node",
                "8",
                "--pipeline-model-parallel-size",
                "4",
                "--use-distributed-optimizer",
            ],
        ),
        (
            "TP 4 x PP 1 x DP 2",
            &[
                "--nproc-per-node",
                "8",
                "--tensor-model-parallel-size",
                "4",
                "--use-distributed-optimizer",
            ],
        ),
    ];
    for (name, layout) in layouts {
        let resumed = train("10", layout, &["--load", f]);
        assert_eq!(resumed.start_iteration, 5, "{name}");
        assert_eq!(resumed.losses.len(), 5, "{name}");
        assert_losses_close(name, &straight.losses[5..], &resumed.losses, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// An MoE checkpoint names experts by their global number, so it loads at any expert layout
/// (with the routers' expert biases):
/// saved at EP 2 x EDP 2 (distributed optimizer), resumed at one rank, at EP 4, and at EP 2 x
/// TP 2 with experts split over TP (ETP 2), each continuing the uninterrupted run.
#[test]
fn an_moe_checkpoint_resumes_across_expert_parallel_sizes() {
    let dir = tmpdir("dcp-moe-reshard");
    let first = dir.join("first");
    let f = first.to_str().unwrap();
    let moe = [
        MOE,
        &[
            "--moe-token-dispatcher-type",
            "alltoall",
            // The router's expert bias is a buffer the checkpoint carries.
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "0.05",
        ],
    ]
    .concat();
    let ep2_edp2 = [
        "--nproc-per-node",
        "4",
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    let straight = train("10", &ep2_edp2, &moe);
    train("5", &ep2_edp2, &[&moe[..], &["--save", f]].concat());
    let layouts: &[(&str, &[&str])] = &[
        ("one rank", &[]),
        (
            "EP 4",
            &["--nproc-per-node", "4", "--expert-model-parallel-size", "4"],
        ),
        (
            "EP 2 x TP 2 (ETP 2)",
            &[
                "--nproc-per-node",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
        ),
    ];
    for (name, layout) in layouts {
        let resumed = train("10", layout, &[&moe[..], &["--load", f]].concat());
        assert_eq!(resumed.start_iteration, 5, "{name}");
        assert_eq!(resumed.losses.len(), 5, "{name}");
        assert_losses_close(name, &straight.losses[5..], &resumed.losses, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Flips one byte in the middle of `path`.
fn flip_byte(path: &Path) {
    let mut b = std::fs::read(path).unwrap();
    let i = b.len() / 2;
    b[i] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_corrupt_or_incomplete_newest_checkpoint_is_skipped_and_named() {
    let dir = tmpdir("dcp-corrupt");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let dp2 = ["--nproc-per-node", "2"];
    let straight = train("6", &dp2, &["--save", s, "--save-interval", "2"]);
    // Iteration 6: a flipped byte in one shard. Iteration 4: its manifest is gone.
    flip_byte(&save.join("iter_0000006").join("shard_00001.safetensors"));
    std::fs::remove_file(save.join("iter_0000004").join("metadata.json")).unwrap();
    let e = match load_checkpoint(&save, Some(6)) {
        Ok(_) => panic!("a flipped byte went unnoticed"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("shard_00001.safetensors") && e.contains("checksum mismatch"),
        "{e}"
    );
    let r = find_checkpoint(&save, false).unwrap();
    assert_eq!(r.meta.iteration, 2);
    let resumed = train("6", &dp2, &["--load", s]);
    assert_eq!(resumed.start_iteration, 2);
    assert_losses_close(
        "resumed past corrupt ones",
        &straight.losses[2..],
        &resumed.losses,
        1e-5,
    );
    // With every checkpoint broken, the error names each and why.
    flip_byte(&save.join("iter_0000002").join("shard_00000.safetensors"));
    std::fs::write(save.join(TRACKER), "2\n").unwrap();
    let e = pretrain(&args(
        &[PP_MODEL, SCHEDULE, &["--train-iters", "6", "--load", s]].concat(),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no complete checkpoint") && e.contains("iter_0000002"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn exit_interval_and_duration_save_and_stop_and_old_checkpoints_are_retained_as_asked() {
    let dir = tmpdir("dcp-exit");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let dp2 = ["--nproc-per-node", "2"];
    let run = train("10", &dp2, &["--save", s, "--exit-interval", "3"]);
    assert_eq!(run.final_iteration, 3);
    assert_eq!(find_checkpoint(&save, false).unwrap().meta.iteration, 3);
    let run = train(
        "10",
        &dp2,
        &["--load", s, "--save", s, "--exit-duration-in-mins", "0"],
    );
    assert_eq!((run.start_iteration, run.final_iteration), (3, 4));
    assert_eq!(find_checkpoint(&save, false).unwrap().meta.iteration, 4);
    // Keep the newest two: after saves at 6 and 8 only those remain.
    let more = [
        "--load",
        s,
        "--save",
        s,
        "--save-interval",
        "2",
        "--ckpt-keep-last",
        "2",
    ];
    train("8", &dp2, &more);
    let mut left: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("iter_"))
        .collect();
    left.sort();
    assert_eq!(left, ["iter_0000006", "iter_0000008"]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn async_saves_complete_in_the_background_and_resume_like_synchronous_ones() {
    let dir = tmpdir("dcp-async");
    let (sync_dir, async_dir) = (dir.join("sync"), dir.join("async"));
    let dp2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let every2 = ["--save-interval", "2"];
    let a = train(
        "6",
        &dp2,
        &[
            &every2[..],
            &["--save", async_dir.to_str().unwrap(), "--async-save"],
        ]
        .concat(),
    );
    let s = train(
        "6",
        &dp2,
        &[&every2[..], &["--save", sync_dir.to_str().unwrap()]].concat(),
    );
    assert_eq!(a.losses, s.losses, "an async save does not change training");
    // Every save completed (the last one before the run returned), with the same tensors.
    for it in [2, 4, 6] {
        let x = load_checkpoint(&async_dir, Some(it)).unwrap();
        let y = load_checkpoint(&sync_dir, Some(it)).unwrap();
        assert_eq!(x.tensors, y.tensors, "iteration {it}");
    }
    // Resume from the async checkpoint of iteration 4.
    std::fs::write(async_dir.join(TRACKER), "4\n").unwrap();
    let r = train("6", &dp2, &["--load", async_dir.to_str().unwrap()]);
    assert_eq!(r.start_iteration, 4);
    assert_losses_close(
        "resumed from an async save",
        &s.losses[4..],
        &r.losses,
        1e-5,
    );
    let _ = std::fs::remove_dir_all(dir);
}
