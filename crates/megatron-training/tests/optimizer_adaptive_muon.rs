//! `--optimizer adaptive_muon` (megatron-core's `TensorParallelAdaptiveMuon`, AdaMuon) in
//! training: every layout trains the one-rank model — under tensor parallelism too, where
//! megatron-core's second scale factor (taken from the local shard's shape) would change the
//! update with the TP size and this one, from the whole matrix's, does not — the state is Muon's
//! momentum and AdaMuon's second moment for the 2-D weights, checkpoints move between layouts,
//! and the planner counts the second moment. The update itself is checked against
//! megatron-core's in megatron-core (`tests/optimizer_adaptive_muon.rs`).

mod common;

use common::*;
use megatron_training::checkpointing::TRACKER;
use megatron_training::pretrain;

/// As `optimizer_muon.rs`'s flags (f32 Newton–Schulz products, GQA for the QKV split, SwiGLU)
/// but a rate 30 times lower: AdaMuon's update is about ±1/sqrt(1 - β₂) = 4.5 times the scale
/// factor per element (the first steps are nearly sign updates), some 36 times Muon's on these
/// matrices; at Muon's rate each step moves a weight by several times its size, and rounding
/// differences between layouts grow to percents within five steps (measured at DP 2 as well as
/// TP 2).
const ADAPTIVE: &[&str] = &[
    "--optimizer",
    "adaptive_muon",
    "--muon-fp32-matmul-prec",
    "high",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--lr",
    "1e-4",
    "--weight-decay",
    "0.1",
];

#[test]
fn adaptive_muon_layouts_match_one_rank_and_checkpoint_the_second_moment() {
    let dir = tmpdir("adaptive-muon-layouts");
    let tp2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"];
    let tp2_sp_distributed = [
        &tp2[..],
        &["--sequence-parallel", "--muon-tp-mode", "distributed"],
    ]
    .concat();
    let pp2 = [
        "--nproc-per-node",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ];
    let dp2_layer_wise = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let tp2_dp2_layer_wise = [
        "--nproc-per-node",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    let layouts: [(&str, &[&str]); 5] = [
        ("tp2 duplicated", &tp2),
        ("tp2 + sp distributed", &tp2_sp_distributed),
        ("pp2", &pp2),
        ("dp2 layer-wise", &dp2_layer_wise),
        ("tp2 dp2 layer-wise", &tp2_dp2_layer_wise),
    ];
    let serial = assert_layouts_match_one_rank(&dir, "adaptive_muon", ADAPTIVE, &layouts);
    let t = &serial.1.tensors;
    for (name, muon) in [
        ("decoder.layers.0.self_attention.linear_qkv.weight", true),
        ("decoder.layers.1.mlp.linear_fc2.weight", true),
        ("embedding.word_embeddings.weight", false),
        ("decoder.final_layernorm.weight", false),
    ] {
        let has = |k: &str| t.contains_key(&format!("optimizer.{k}.{name}"));
        assert_eq!(has("momentum_buffer"), muon, "{name}");
        assert_eq!(has("moment2_buffer"), muon, "{name}");
        assert_eq!(has("exp_avg") && has("exp_avg_sq"), !muon, "{name}");
    }
    let second = &t["optimizer.moment2_buffer.decoder.layers.1.mlp.linear_fc2.weight"];
    assert!(second.iter().all(|v| *v >= 0.0) && second.iter().any(|v| *v > 0.0));
    let muon = train_and_load(
        &dir,
        "muon",
        &[&["--optimizer", "muon"], &ADAPTIVE[2..]].concat(),
    );
    assert!(
        (serial.0.losses[4].1 - muon.0.losses[4].1).abs() > 1e-4,
        "AdaMuon is not Muon: {:?} vs {:?}",
        serial.0.losses[4],
        muon.0.losses[4]
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A layer-wise DP 2 checkpoint resumes on one replicated rank, a one-rank run resumes bit for
/// bit, and Muon's checkpoint (no second moment) is refused by name.
#[test]
fn an_adaptive_muon_run_resumes_across_layouts_and_refuses_muons_checkpoint() {
    let dir = tmpdir("adaptive-muon-resume");
    let flags = [ADAPTIVE, &["--train-iters", "6"]].concat();
    let dp2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let full = pretrain(&args(&flags)).unwrap();
    for (name, saver, loader) in [
        ("dp2 to one rank", &dp2[..], &[][..]),
        ("one rank to one rank", &[][..], &[][..]),
    ] {
        let save = dir.join(name.replace(' ', "_"));
        let s = save.to_str().unwrap();
        let at = ["--save", s, "--save-interval", "3"];
        pretrain(&args(&[&flags[..], saver, &at[..]].concat())).unwrap();
        std::fs::write(save.join(TRACKER), "3\n").unwrap();
        let resumed = pretrain(&args(&[&flags[..], loader, &["--load", s]].concat())).unwrap();
        if saver.is_empty() {
            assert_eq!(resumed.losses[..], full.losses[3..], "{name}");
        } else {
            assert_losses_close(name, &full.losses[3..], &resumed.losses, 1e-5);
        }
    }
    let save = dir.join("muon");
    let s = save.to_str().unwrap();
    let muon = [&["--optimizer", "muon"], &ADAPTIVE[2..]].concat();
    pretrain(&args(
        &[&muon[..], &["--train-iters", "3", "--save", s]].concat(),
    ))
    .unwrap();
    let e = pretrain(&args(&[&flags[..], &["--load", s]].concat()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--optimizer muon") && e.contains("--optimizer adaptive_muon"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn adaptive_muon_with_fp16_is_refused_by_name() {
    let e = pretrain(&args(
        &[&ADAPTIVE[..2], &["--train-iters", "3", "--fp16"]].concat(),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("--optimizer adaptive_muon with --fp16"), "{e}");
}

/// The planner: AdaMuon's second moment is 4 more bytes per Muon element than Muon's state,
/// as many elements as the checkpoint's `moment2_buffer`s hold.
#[test]
fn the_layout_planner_counts_the_second_moment() {
    use megatron_training::plan::cluster::Cluster;
    use megatron_training::plan::cost::predict;
    use megatron_training::plan::muon_cost::muon_share;
    let dir = tmpdir("adaptive-muon-plan");
    let (_, ck) = train_and_load(&dir, "run", ADAPTIVE);
    let second: usize = ck
        .tensors
        .iter()
        .filter(|(k, _)| k.starts_with("optimizer.moment2_buffer."))
        .map(|(_, v)| v.len())
        .sum();
    let trained = args(&[PP_MODEL, &["--train-iters", "5"], ADAPTIVE].concat())
        .validate(62)
        .unwrap();
    assert_eq!(muon_share(&trained, 0).params, second as f64);
    let cfg = |optimizer: &str| {
        args(
            &[
                &["--optimizer", optimizer],
                &ADAPTIVE[2..],
                &[
                    "--nproc-per-node",
                    "8",
                    "--train-iters",
                    "5",
                    "--global-batch-size",
                    "16",
                ],
            ]
            .concat(),
        )
        .validate(62)
        .unwrap()
    };
    let (adaptive, muon) = (cfg("adaptive_muon"), cfg("muon"));
    let share = muon_share(&adaptive, 0);
    let h100 = Cluster::dgx_h100(1);
    let state = |c| predict(c, &h100).unwrap().memory.weights_and_optimizer;
    assert_eq!(state(&adaptive) - state(&muon), 4.0 * share.params);
    let _ = std::fs::remove_dir_all(dir);
}
