//! A small mixture-of-experts model trains, and data and pipeline parallelism train the same
//! model as one rank (experts are replicated over data-parallel ranks; dropless routing).

mod common;

use common::*;
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::pretrain;

const MOE: &[&str] = &[
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
    "--swiglu",
];

fn run(
    dir: &std::path::Path,
    name: &str,
    layout: &[&str],
) -> (
    megatron_training::TrainSummary,
    megatron_training::checkpointing::LoadedCheckpoint,
) {
    let save = dir.join(name);
    let s = save.to_str().unwrap().to_string();
    let v = [PP_MODEL, MOE, &["--train-iters", "5", "--save", &s], layout].concat();
    let summary = pretrain(&args(&v)).unwrap();
    (summary, load_checkpoint(&save, None).unwrap())
}

#[test]
fn moe_data_and_pipeline_parallel_layouts_match_one_rank() {
    let dir = tmpdir("moe-layouts");
    let serial = run(&dir, "serial", &[]);
    for (name, layout) in [
        (
            "dp2 distributed optimizer",
            &["--nproc-per-node", "2", "--use-distributed-optimizer"][..],
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
    ] {
        let r = run(&dir, name, layout);
        assert_same_training(name, &serial, &r, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Expert parallelism (tokens dispatched to the ranks of their experts, parallel folding over
/// tensor- and data-parallel ranks) trains the one-rank model, with both dispatchers.
#[test]
fn moe_expert_parallel_layouts_match_one_rank() {
    let dir = tmpdir("moe-ep-layouts");
    let serial = run(&dir, "serial", &[]);
    let ep = |n: &'static str, e: &'static str, d: &'static str| -> Vec<&'static str> {
        vec![
            "--nproc-per-node",
            n,
            "--expert-model-parallel-size",
            e,
            "--moe-token-dispatcher-type",
            d,
        ]
    };
    let with = |mut v: Vec<&'static str>, more: &[&'static str]| {
        v.extend_from_slice(more);
        v
    };
    let layouts: Vec<(&str, Vec<&str>)> = vec![
        ("ep2 alltoall", ep("2", "2", "alltoall")),
        ("ep2 allgather", ep("2", "2", "allgather")),
        ("ep4 alltoall", ep("4", "4", "alltoall")),
        (
            "ep2 x tp2 (sp, etp1) alltoall",
            with(
                ep("4", "2", "alltoall"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "1",
                ],
            ),
        ),
        (
            "ep2 x tp2 (sp, etp1) allgather",
            with(
                ep("4", "2", "allgather"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "1",
                ],
            ),
        ),
        (
            "ep2 x tp2 (sp, etp2) alltoall",
            with(
                ep("4", "2", "alltoall"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "2",
                ],
            ),
        ),
        (
            "ep2 x tp2 (sp, etp2) allgather",
            with(
                ep("4", "2", "allgather"),
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                    "--expert-tensor-parallel-size",
                    "2",
                ],
            ),
        ),
        (
            "tp2 (sp, etp2, ep1) distributed optimizer",
            vec![
                "--nproc-per-node",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--use-distributed-optimizer",
            ],
        ),
        (
            "etp2 over dp ranks (tp1, ep1)",
            vec![
                "--nproc-per-node",
                "2",
                "--expert-tensor-parallel-size",
                "2",
            ],
        ),
        (
            "ep2 x pp2 alltoall",
            with(
                ep("4", "2", "alltoall"),
                &["--pipeline-model-parallel-size", "2"],
            ),
        ),
        (
            "ep2 x edp2 distributed optimizer",
            with(ep("4", "2", "alltoall"), &["--use-distributed-optimizer"]),
        ),
        (
            "ep2 x edp2 plain optimizer allgather",
            ep("4", "2", "allgather"),
        ),
    ];
    for (name, layout) in &layouts {
        let r = run(&dir, &name.replace(' ', "_"), layout);
        assert_same_training(name, &serial, &r, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_moe_model_learns_on_mock_data_and_bad_flags_are_refused() {
    let v = [
        PP_MODEL,
        MOE,
        &[
            "--train-iters",
            "40",
            "--lr",
            "5e-3",
            "--global-batch-size",
            "4",
            "--num-layers",
            "2",
        ],
    ]
    .concat();
    let s = pretrain(&args(&v)).unwrap();
    let (first, last) = (s.losses[0].1, s.losses.last().unwrap().1);
    assert!(last < first - 1.0, "loss {first} -> {last}");
    for (extra, flag) in [
        (&["--moe-router-topk", "5"][..], "--moe-router-topk"),
        (
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"][..],
            "--tensor-model-parallel-size",
        ),
    ] {
        let v = [PP_MODEL, MOE, &["--train-iters", "2"], extra].concat();
        let e = pretrain(&args(&v)).unwrap_err().to_string();
        assert!(e.contains(flag), "{e}");
    }
}
