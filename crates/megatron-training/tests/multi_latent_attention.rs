//! Multi-latent attention (`--multi-latent-attention`) trains the same model in every layout as
//! on one rank: its down projections are duplicated (partial gradients under sequence
//! parallelism), its up projections split over the heads, the shared rotary key's gradient
//! summed over the ranks' heads.

mod common;

use common::*;
use megatron_training::pretrain;

#[test]
fn mla_tensor_sequence_pipeline_and_data_parallel_layouts_match_one_rank() {
    let dir = tmpdir("mla-layouts");
    let tp2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"];
    let tp2_sp = [&tp2[..], &["--sequence-parallel"]].concat();
    let tp4_sp = [
        "--nproc-per-node",
        "4",
        "--tensor-model-parallel-size",
        "4",
        "--sequence-parallel",
    ];
    let pp2 = [
        "--nproc-per-node",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ];
    let dp2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let layouts: [(&str, &[&str]); 5] = [
        ("tp2", &tp2),
        ("tp2 + sp", &tp2_sp),
        ("tp4 + sp (one head per rank)", &tp4_sp),
        ("pp2", &pp2),
        ("dp2 distributed optimizer", &dp2),
    ];
    let serial = assert_layouts_match_one_rank(&dir, "mla", MLA, &layouts);
    assert!(serial
        .1
        .tensors
        .contains_key("decoder.layers.0.self_attention.linear_kv_down_proj.weight"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mla_recomputation_and_bf16_layouts_match_one_rank() {
    // Selective recomputation reruns the attention kernel on the kept QKV (the output
    // projection then reads the narrowed rerun); full recomputation reruns MLA's projections.
    let dir = tmpdir("mla-recompute-bf16");
    let serial = train_and_load(&dir, "serial", MLA);
    let tp2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"];
    for (name, extra) in [
        ("selective", &["--recompute-activations"][..]),
        ("full", &["--recompute-granularity", "full"][..]),
    ] {
        let run = train_and_load(&dir, name, &[MLA, &tp2[..], extra].concat());
        assert_same_training(&format!("mla tp2 {name} recompute"), &serial, &run, 1e-5);
    }
    let bf16 = [MLA, &["--bf16"]].concat();
    let serial = train_and_load(&dir, "bf16-serial", &bf16);
    let tp2_sp = [&bf16[..], &tp2[..], &["--sequence-parallel"]].concat();
    let run = train_and_load(&dir, "bf16-tp2-sp", &tp2_sp);
    assert_same_training_within(
        "mla bf16 tp2 + sp",
        &serial,
        &run,
        BF16_LOSS_TOL,
        BF16_PARAM_TOL,
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mla_context_parallel_ring_and_all_to_all_match_one_rank() {
    // Without a query latent (linear_q_proj) and with dropout on: the masks are numbered by
    // global position and head, so every split draws the same ones.
    let dir = tmpdir("mla-cp");
    let flags = [
        &MLA[..1],
        &MLA[3..],
        &["--attention-dropout", "0.1", "--hidden-dropout", "0.1"],
    ]
    .concat();
    let p2p = [
        "--nproc-per-node",
        "2",
        "--context-parallel-size",
        "2",
        "--cp-comm-type",
        "p2p",
    ];
    let a2a_tp2 = [
        "--nproc-per-node",
        "4",
        "--context-parallel-size",
        "2",
        "--cp-comm-type",
        "a2a",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ];
    let layouts: [(&str, &[&str]); 2] = [("cp2 p2p", &p2p), ("cp2 a2a x tp2 + sp", &a2a_tp2)];
    assert_layouts_match_one_rank(&dir, "mla", &flags, &layouts);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mla_saved_activations_are_what_the_formula_says() {
    // The kernel's QKV (values padded to the query width), the narrowed attention output and
    // the two latents: measured bytes equal the engine's formula, in f32 and bf16.
    let base = [
        MLA,
        &[
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--train-iters",
            "2",
        ],
    ]
    .concat();
    for extra in [&[][..], &["--bf16"][..]] {
        let a = args(&[&base[..], extra].concat());
        let cfg = a.validate(62).unwrap();
        let s = pretrain(&a).unwrap();
        let f = megatron_core::models::gpt::activation_bytes_formula(
            &cfg.model,
            2,
            16,
            1,
            false,
            !extra.is_empty(),
        );
        assert_eq!(s.peak_activation_bytes, f, "{extra:?}");
    }
}

#[test]
fn mla_flags_are_refused_where_they_do_not_apply() {
    let err = |extra: &[&str]| {
        let v = [extra, &["--train-iters", "5"]].concat();
        args(&v).validate(62).unwrap_err().to_string()
    };
    assert!(err(&["--q-lora-rank", "8"]).contains("needs --multi-latent-attention"));
    assert!(err(&["--multi-latent-attention"]).contains("--position-embedding-type rope"));
    let gqa = [MLA, &["--group-query-attention", "--num-query-groups", "2"]].concat();
    assert!(err(&gqa).contains("mutually exclusive"));
    let kv = [MLA, &["--kv-channels", "8"]].concat();
    assert!(err(&kv).contains("--kv-channels"));
    let wide = [MLA, &["--v-head-dim", "32"]].concat();
    assert!(err(&wide).contains("--v-head-dim (32)"));
}

#[test]
fn the_layout_planner_counts_mla_with_its_own_widths() {
    // It plans MLA (it refused it by name before it modelled it), and not as the fused-QKV
    // attention of the same hidden size and heads: its latents and head widths make another
    // parameter count (tests/plan.rs checks it against the engine's).
    use megatron_training::plan::cluster::Cluster;
    use megatron_training::plan::layout::Pins;
    let a = args(&[MLA, &["--train-iters", "5"]].concat());
    let p = megatron_training::plan::plan(&a, &Cluster::dgx_h100(1), &Pins::default())
        .expect("plans MLA");
    assert!(!p.fits.is_empty());
    let mla = megatron_training::plan::cost::parameters_per_rank(&a.validate(62).unwrap()).0;
    let fused = args(&["--train-iters", "5", "--position-embedding-type", "rope"])
        .validate(62)
        .unwrap();
    let fused = megatron_training::plan::cost::parameters_per_rank(&fused).0;
    assert_ne!(mla, fused);
}

/// megatron-core's MLA takes YaRN unless `--rope-type rope`: at factor 1 that rotates as RoPE
/// does, so a run saved with `--position-embedding-type yarn` at factor 1 goes on under `rope`
/// (and the other way), bit for bit; at another factor `rope` with the YaRN flags is YaRN.
#[test]
fn mla_yarn_at_factor_one_is_rope_and_either_spelling_resumes_the_other() {
    let dir = tmpdir("mla-yarn-one");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let run = |extra: &[&str]| {
        pretrain(&args(
            &[MLA, &["--train-iters", "4", "--eval-iters", "0"], extra].concat(),
        ))
        .unwrap()
    };
    let yarn1 = ["--position-embedding-type", "yarn"];
    let straight = run(&yarn1);
    let rope = run(&[]);
    assert_eq!(
        straight.losses, rope.losses,
        "YaRN at factor 1 against RoPE"
    );
    let mut first = vec!["--save", s, "--save-interval", "2", "--exit-interval", "2"];
    first.extend(yarn1);
    run(&first);
    let resumed = run(&["--load", s]);
    assert_eq!(resumed.losses, straight.losses[2..]);
    // Factor 4 with `rope` and no --rope-type: YaRN, as under `yarn`; --rope-type rope: RoPE.
    let f4 = ["--rotary-scaling-factor", "4"];
    let default = run(&f4);
    let explicit = run(&[&f4[..], &yarn1].concat());
    assert_eq!(default.losses, explicit.losses);
    let plain = run(&[&f4[..], &["--rope-type", "rope"]].concat());
    assert_eq!(plain.losses, rope.losses);
    assert_ne!(plain.losses, default.losses);
    let _ = std::fs::remove_dir_all(dir);
}
