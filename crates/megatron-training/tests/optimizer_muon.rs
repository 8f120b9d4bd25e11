//! `--optimizer muon` in training: every layout trains the one-rank model (Muon orthogonalizes
//! whole matrices, so tensor parallelism gathers or reduces them), the state is Muon's momentum
//! for the 2-D weights and the scalar optimizer's moments for the rest, a resume continues bit
//! for bit, and bad settings are refused by name. The update itself is checked against
//! megatron-core's `TensorParallelMuon` in megatron-core (`tests/optimizer_muon.rs`).

mod common;

use common::*;
use megatron_training::checkpointing::TRACKER;
use megatron_training::pretrain;

/// Muon with f32 Newton–Schulz products, so that layouts compare at f32 precision (bf16
/// products turn a 1e-7 difference in a gradient into a bf16 rounding of the update);
/// GQA (2 groups of 2 heads) and SwiGLU give the QKV split and the `[gate; up]` weight.
const MUON: &[&str] = &[
    "--optimizer",
    "muon",
    "--muon-fp32-matmul-prec",
    "high",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--lr",
    "3e-3",
    "--weight-decay",
    "0.1",
];

#[test]
fn muon_tensor_sequence_pipeline_and_data_parallel_layouts_match_one_rank() {
    let dir = tmpdir("muon-layouts");
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
    let dp2 = ["--nproc-per-node", "2"];
    let layouts: [(&str, &[&str]); 4] = [
        ("tp2 duplicated", &tp2),
        ("tp2 + sp distributed", &tp2_sp_distributed),
        ("pp2", &pp2),
        ("dp2", &dp2),
    ];
    let serial = assert_layouts_match_one_rank(&dir, "muon", MUON, &layouts);
    let t = &serial.1.tensors;
    // Muon's momentum for the 2-D weights, Adam's moments for the rest.
    for (name, muon) in [
        ("decoder.layers.0.self_attention.linear_qkv.weight", true),
        ("decoder.layers.0.mlp.linear_fc1.weight", true),
        ("decoder.layers.0.mlp.linear_fc2.weight", true),
        ("embedding.word_embeddings.weight", false),
        ("decoder.layers.0.self_attention.linear_qkv.bias", false),
        ("decoder.final_layernorm.weight", false),
    ] {
        let has = |k: &str| t.contains_key(&format!("optimizer.{k}.{name}"));
        assert_eq!(has("momentum_buffer"), muon, "{name}");
        assert_eq!(has("exp_avg") && has("exp_avg_sq"), !muon, "{name}");
    }
    let adam = train_and_load(
        &dir,
        "adam",
        &[&MUON[..2], &["--optimizer", "adam"], &MUON[4..]].concat(),
    );
    assert!(
        (serial.0.losses[4].1 - adam.0.losses[4].1).abs() > 1e-3,
        "Muon is not Adam: {:?} vs {:?}",
        serial.0.losses[4],
        adam.0.losses[4]
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `--use-distributed-optimizer` with Muon is megatron-core's layer-wise distributed optimizer:
/// each DP rank owns whole matrices (and pieces of the scalar parameters), steps them, and
/// all-gathers; one bucket or many, overlapped or not, and under TP (the TP peers own the same
/// matrices), it trains the one-rank model.
#[test]
fn muon_layer_wise_distributed_optimizer_matches_one_rank() {
    let dir = tmpdir("muon-layer-wise");
    let dp2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let dp2_buckets = [
        &dp2[..],
        &[
            "--ddp-bucket-size",
            "3000",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ],
    ]
    .concat();
    let tp2_dp2 = [
        "--nproc-per-node",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    // The last stage's copy of the tied embedding is a bucket of its own, split.
    let pp2_dp2 = [
        "--nproc-per-node",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    let layouts: [(&str, &[&str]); 4] = [
        ("dp2 layer-wise", &dp2),
        ("dp2 layer-wise small overlapped buckets", &dp2_buckets),
        ("tp2 dp2 layer-wise", &tp2_dp2),
        ("pp2 dp2 layer-wise", &pp2_dp2),
    ];
    assert_layouts_match_one_rank(&dir, "muon", MUON, &layouts);
    let _ = std::fs::remove_dir_all(dir);
}

/// Rank 0 of a layer-wise DP 2 run holds about half the optimizer state of a replicated run
/// (its matrices' momenta, its pieces of the scalar moments), and Megatron's deprecated
/// `--optimizer dist_muon` is the same optimizer.
#[test]
fn the_layer_wise_optimizer_holds_about_half_the_state_and_dist_muon_is_its_old_name() {
    let dir = tmpdir("muon-layer-wise-memory");
    let metrics = dir.join("metrics.jsonl");
    let m = metrics.to_str().unwrap();
    let memory = ["--log-memory", "--metrics-file", m];
    let mut state = Vec::new();
    let mut runs = Vec::new();
    for (name, layout) in [
        ("replicated", &["--nproc-per-node", "2"][..]),
        (
            "layer-wise",
            &["--nproc-per-node", "2", "--use-distributed-optimizer"][..],
        ),
    ] {
        runs.push(train_and_load(
            &dir,
            name,
            &[MUON, layout, &memory[..]].concat(),
        ));
        let bytes = last_memory_record(&metrics)["optimizer_state"]
            .as_u64()
            .unwrap();
        state.push(bytes);
        std::fs::remove_file(&metrics).unwrap();
    }
    assert!(
        state[1] * 10 <= state[0] * 6,
        "layer-wise rank 0 holds {} of the replicated {} bytes",
        state[1],
        state[0]
    );
    println!(
        "optimizer state on rank 0: replicated {} B, layer-wise {} B",
        state[0], state[1]
    );
    let mut old = MUON.to_vec();
    old[1] = "dist_muon";
    let alias = train_and_load(
        &dir,
        "dist_muon",
        &[&old[..], &["--nproc-per-node", "2"]].concat(),
    );
    assert_eq!(alias.0.losses, runs[1].0.losses);
    assert_eq!(alias.1.tensors, runs[1].1.tensors);
    let _ = std::fs::remove_dir_all(dir);
}

/// Experts are orthogonalized each on its own (megatron-core's `expert_tp` group under expert
/// tensor parallelism), with Nesterov momentum, another scale mode and a repeated coefficient
/// schedule.
#[test]
fn muon_expert_parallel_and_its_settings_match_one_rank() {
    let dir = tmpdir("muon-moe");
    let flags = [
        MUON,
        &[
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-ffn-hidden-size",
            "32",
            "--muon-nesterov",
            "--muon-scale-mode",
            "unit_rms_norm",
            "--muon-coefficient-type",
            "polar_express",
            "--muon-num-ns-steps",
            "9",
        ],
    ]
    .concat();
    let ep2 = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"];
    let tp2_etp2 = [
        "--nproc-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ];
    // Four ranks: two expert-data-parallel replicas, each owning its half of the experts'
    // matrices under the layer-wise distributed optimizer.
    let ep2_layer_wise = [
        "--nproc-per-node",
        "4",
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    let layouts: [(&str, &[&str]); 3] = [
        ("ep2", &ep2),
        ("tp2 + sp, experts tp2", &tp2_etp2),
        ("ep2 dp4 layer-wise", &ep2_layer_wise),
    ];
    let serial = assert_layouts_match_one_rank(&dir, "muon moe", &flags, &layouts);
    let t = &serial.1.tensors;
    assert!(t.contains_key(
        "optimizer.momentum_buffer.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    ));
    assert!(t.contains_key("optimizer.exp_avg_sq.embedding.word_embeddings.weight"));
    let _ = std::fs::remove_dir_all(dir);
}

/// `--muon-tp-mode blockwise` orthogonalizes each TP shard alone: another optimizer at TP 2
/// (as megatron-core warns), which shows the whole-matrix modes are what make TP 2 equal one rank.
#[test]
fn muon_blockwise_is_another_optimizer_under_tensor_parallelism() {
    let dir = tmpdir("muon-blockwise");
    let flags = [MUON, &["--muon-tp-mode", "blockwise"]].concat();
    let serial = train_and_load(&dir, "serial", &flags);
    let tp2 = train_and_load(
        &dir,
        "tp2",
        &[
            &flags[..],
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
        ]
        .concat(),
    );
    let name = "decoder.layers.0.mlp.linear_fc2.weight";
    let d = serial.1.tensors[name]
        .iter()
        .zip(&tp2.1.tensors[name])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        d > 1e-3,
        "blockwise at TP 2 moved {name} like one rank: {d}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron's defaults (bf16 Newton–Schulz products) under `--bf16`: TP 2 trains the one-rank
/// model within the bf16 tolerance of the other layouts' tests.
#[test]
fn muon_with_bf16_products_and_parameters_matches_one_rank_at_tp2_and_layer_wise_dp2() {
    let dir = tmpdir("muon-bf16");
    let flags = ["--optimizer", "muon", "--bf16"];
    let serial = train_and_load(&dir, "serial", &flags);
    let tp2 = train_and_load(
        &dir,
        "tp2",
        &[
            &flags[..],
            &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
        ]
        .concat(),
    );
    assert_same_training_within(
        "muon bf16 tp2",
        &serial,
        &tp2,
        BF16_LOSS_TOL,
        BF16_PARAM_TOL,
    );
    // The layer-wise distributed optimizer keeps fp32 mains of what it owns only.
    let dp2 = train_and_load(
        &dir,
        "dp2",
        &[
            &flags[..],
            &["--nproc-per-node", "2", "--use-distributed-optimizer"],
        ]
        .concat(),
    );
    assert_same_training_within(
        "muon bf16 dp2 layer-wise",
        &serial,
        &dp2,
        BF16_LOSS_TOL,
        BF16_PARAM_TOL,
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// With Lion for the scalar parameters (its one moment checkpointed beside Muon's momentum).
#[test]
fn a_muon_run_resumes_bit_for_bit_and_refuses_another_optimizers_checkpoint() {
    let dir = tmpdir("muon-resume");
    let save = dir.join("run");
    let s = save.to_str().unwrap();
    let flags = [
        MUON,
        &["--train-iters", "5", "--muon-scalar-optimizer", "lion"],
    ]
    .concat();
    let full = pretrain(&args(
        &[&flags[..], &["--save", s, "--save-interval", "3"]].concat(),
    ))
    .unwrap();
    std::fs::write(save.join(TRACKER), "3\n").unwrap();
    let resumed = pretrain(&args(&[&flags[..], &["--load", s]].concat())).unwrap();
    assert_eq!(resumed.losses[..], full.losses[3..]);
    let ck = megatron_training::checkpointing::load_checkpoint(&save, None).unwrap();
    let t = &ck.tensors;
    assert!(t.contains_key("optimizer.exp_avg.embedding.word_embeddings.weight"));
    assert!(!t.contains_key("optimizer.exp_avg_sq.embedding.word_embeddings.weight"));
    assert!(t.contains_key("optimizer.momentum_buffer.decoder.layers.1.mlp.linear_fc2.weight"));
    let e = pretrain(&args(
        &[&MUON[2..], &["--train-iters", "6", "--load", s]].concat(),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--optimizer muon") && e.contains("--optimizer adam"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The checkpoint holds each parameter's state whatever the layout: a layer-wise run at DP 2
/// resumes on one replicated rank, and a one-rank run resumes layer-wise at DP 2, each
/// continuing the uninterrupted run.
#[test]
fn a_layer_wise_checkpoint_resumes_on_one_rank_and_the_other_way() {
    let dir = tmpdir("muon-layer-wise-resume");
    let flags = [MUON, &["--train-iters", "6"]].concat();
    let dp2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let full = pretrain(&args(&flags)).unwrap();
    for (name, saver, loader) in [
        ("dp2 to one rank", &dp2[..], &[][..]),
        ("one rank to dp2", &[][..], &dp2[..]),
    ] {
        let save = dir.join(name.replace(' ', "_"));
        let s = save.to_str().unwrap();
        let at = ["--save", s, "--save-interval", "3"];
        pretrain(&args(&[&flags[..], saver, &at[..]].concat())).unwrap();
        std::fs::write(save.join(TRACKER), "3\n").unwrap();
        let resumed = pretrain(&args(&[&flags[..], loader, &["--load", s]].concat())).unwrap();
        assert_losses_close(name, &full.losses[3..], &resumed.losses, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_muon_settings_are_refused_by_name() {
    for (extra, want) in [
        (&["--fp16"][..], "--optimizer muon with --fp16"),
        (
            &["--muon-coefficient-type", "cubic"][..],
            "--muon-coefficient-type cubic",
        ),
        (&["--muon-num-ns-steps", "0"][..], "--muon-num-ns-steps"),
        (
            &["--muon-momentum", "1"][..],
            "--muon-momentum must be in [0, 1)",
        ),
        (
            &["--muon-extra-scale-factor", "0"][..],
            "--muon-extra-scale-factor must be positive",
        ),
    ] {
        let e = pretrain(&args(
            &[&["--train-iters", "3", "--optimizer", "muon"][..], extra].concat(),
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains(want), "{extra:?}: {e}");
    }
}

/// The planner's Muon: as many momenta as the model has Muon matrices (counted in the
/// checkpoint a run writes, experts and the position embedding included), 4 bytes each instead
/// of Adam's 8; Newton-Schulz divided by DP under the layer-wise optimizer, repeated on every
/// TP rank under `duplicated` and split under `distributed`.
#[test]
fn the_layout_planner_counts_muons_momenta_and_newton_schulz() {
    use megatron_training::plan::cluster::Cluster;
    use megatron_training::plan::cost::predict;
    use megatron_training::plan::muon_cost::muon_share;
    let dir = tmpdir("muon-plan");
    let moe = [
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        "32",
    ];
    for (name, extra) in [("dense", &[][..]), ("moe", &moe[..])] {
        let flags = [MUON, extra].concat();
        let (_, ck) = train_and_load(&dir, name, &flags);
        let momenta: usize = ck
            .tensors
            .iter()
            .filter(|(k, _)| k.starts_with("optimizer.momentum_buffer."))
            .map(|(_, v)| v.len())
            .sum();
        let cfg = args(&[PP_MODEL, &["--train-iters", "5"], &flags[..]].concat())
            .validate(62)
            .unwrap();
        assert_eq!(muon_share(&cfg, 0).params, momenta as f64, "{name}");
    }
    // Megatron's accounting on H100s: the same model under Adam holds 4 more bytes per Muon
    // element (fp32 weights: 8 + 8 for Adam, 8 + 4 for Muon).
    let h100 = Cluster::dgx_h100(1);
    let cfg = |extra: &[&str]| {
        args(
            &[
                MUON,
                &[
                    "--nproc-per-node",
                    "8",
                    "--train-iters",
                    "5",
                    "--global-batch-size",
                    "16",
                ],
                extra,
            ]
            .concat(),
        )
        .validate(62)
        .unwrap()
    };
    let muon = cfg(&[]);
    let adam = cfg(&["--optimizer", "adam"]);
    let share = muon_share(&muon, 0);
    let state = |c| predict(c, &h100).unwrap().memory.weights_and_optimizer;
    assert_eq!(state(&adam) - state(&muon), 4.0 * share.params);
    let layer_wise = cfg(&["--use-distributed-optimizer"]);
    let lw = muon_share(&layer_wise, 0);
    assert!((lw.ns_flops * 8.0 / share.ns_flops - 1.0).abs() < 1e-12);
    let time = |c| predict(c, &h100).unwrap().time.optimizer;
    assert!(time(&layer_wise) < time(&muon) && time(&adam) < time(&muon));
    let tp2 = |mode: &str| {
        muon_share(
            &cfg(&["--tensor-model-parallel-size", "2", "--muon-tp-mode", mode]),
            0,
        )
    };
    assert_eq!(tp2("duplicated").ns_flops, share.ns_flops);
    assert!(tp2("duplicated").tp_gather_bytes > 0.0);
    assert!(tp2("distributed").ns_flops < share.ns_flops);
    assert!(tp2("blockwise").ns_flops < tp2("distributed").ns_flops);
    let _ = std::fs::remove_dir_all(dir);
}
