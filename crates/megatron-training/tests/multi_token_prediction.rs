//! Multi-token prediction (`--mtp-num-layers`) trains the same model in every layout it is
//! built for as on one rank, logs each depth's loss, and is refused by name where it is not
//! built.

mod common;

use common::*;
use megatron_training::pretrain;

const MTP: &[&str] = &["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"];

#[test]
fn mtp_tensor_sequence_and_data_parallel_layouts_match_one_rank() {
    // GPT's learned positions shift with the tokens; dropout masks are numbered per depth.
    let dir = tmpdir("mtp-layouts");
    let flags = [
        MTP,
        &["--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    ]
    .concat();
    let tp2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"];
    let tp2_sp = [&tp2[..], &["--sequence-parallel"]].concat();
    let dp2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let tp2_dp2 = [
        "--nproc-per-node",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--overlap-grad-reduce",
    ];
    let layouts: [(&str, &[&str]); 4] = [
        ("tp2", &tp2),
        ("tp2 + sp", &tp2_sp),
        ("dp2 distributed optimizer", &dp2),
        ("tp2 + sp x dp2 overlapped", &tp2_dp2),
    ];
    let serial = assert_layouts_match_one_rank(&dir, "mtp", &flags, &layouts);
    assert!(serial
        .1
        .tensors
        .contains_key("mtp.layers.1.mtp_model_layer.self_attention.linear_qkv.weight"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_pipeline_layouts_match_one_rank_with_tied_and_untied_output_layers() {
    // The last stage embeds the shifted tokens with its copy of the word embedding (the tied
    // output layer's, or one more when untied); the copies' gradients meet the first stage's.
    let dir = tmpdir("mtp-pp");
    let rope = [
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
    ];
    for (name, tie) in [
        ("tied", &[][..]),
        ("untied", &["--untie-embeddings-and-output-weights"][..]),
    ] {
        let flags = [MTP, &rope[..], tie].concat();
        let serial = train_and_load(&dir, &format!("{name}-serial"), &flags);
        let pp2 = [
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ];
        let pp2v = [&pp2[..], &["--num-layers-per-virtual-pipeline-stage", "2"]].concat();
        let pp2_tp2 = [
            "--nproc-per-node",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ];
        for (layout_name, layout) in [
            ("pp2", &pp2[..]),
            ("pp2 interleaved", &pp2v[..]),
            ("pp2 x tp2 + sp", &pp2_tp2[..]),
        ] {
            let what = format!("mtp {name} {layout_name}");
            let run = train_and_load(
                &dir,
                &what.replace(' ', "_"),
                &[&flags[..], layout].concat(),
            );
            assert_same_training(&what, &serial, &run, 1e-5);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_context_parallel_ring_and_all_to_all_match_one_rank() {
    // The shifts cross the chunks: each rank's rows are cut from the gathered whole sequences;
    // each depth's mean is over the whole sequences' counted labels. GPT's learned positions
    // shift with the tokens; dropout on.
    let dir = tmpdir("mtp-cp");
    let flags = [
        MTP,
        &["--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    ]
    .concat();
    let per_token = [&flags[..], &["--calculate-per-token-loss"]].concat();
    let serial = train_and_load(&dir, "serial", &flags);
    let serial_per_token = train_and_load(&dir, "serial-per-token", &per_token);
    let cp2 = |kind: &'static str| {
        vec![
            "--nproc-per-node",
            "2",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            kind,
        ]
    };
    let a2a_tp2 = [
        &cp2("a2a")[..],
        &[
            "--nproc-per-node",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ]
    .concat();
    let p2p_dp2 = [&cp2("p2p")[..], &["--nproc-per-node", "4"]].concat();
    for (name, base, model, layout) in [
        ("cp2 p2p", &serial, &flags, cp2("p2p")),
        ("cp2 a2a x tp2 + sp", &serial, &flags, a2a_tp2),
        (
            "cp2 p2p x dp2 per-token",
            &serial_per_token,
            &per_token,
            p2p_dp2,
        ),
    ] {
        let run = train_and_load(
            &dir,
            &name.replace(' ', "_"),
            &[&model[..], &layout[..]].concat(),
        );
        assert_same_training(&format!("mtp {name}"), base, &run, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_on_mla_and_experts_matches_one_rank_at_tp2_and_ep2() {
    let dir = tmpdir("mtp-mla-moe");
    let flags = [MTP, MOE, MLA].concat();
    let tp2_sp = [
        "--nproc-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ];
    let ep2 = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"];
    let layouts: [(&str, &[&str]); 2] = [("tp2 + sp", &tp2_sp), ("ep2", &ep2)];
    assert_layouts_match_one_rank(&dir, "mtp mla moe", &flags, &layouts);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_losses_are_logged_per_depth_and_held_activations_match_the_formula() {
    let dir = tmpdir("mtp-log");
    let metrics = dir.join("m.jsonl");
    let m = metrics.to_str().unwrap();
    let tb = dir.join("tb");
    let tb_dir = tb.to_str().unwrap();
    let a = args(
        &[
            MTP,
            &[
                "--train-iters",
                "4",
                "--metrics-file",
                m,
                "--tensorboard-dir",
                tb_dir,
            ],
        ]
        .concat(),
    );
    let cfg = a.validate(62).unwrap();
    let s = pretrain(&a).unwrap();
    let text = std::fs::read_to_string(&metrics).unwrap();
    let first: serde_json::Value = serde_json::from_str(
        text.lines()
            .find(|l| l.contains("\"lm_loss\""))
            .expect("a training record"),
    )
    .unwrap();
    let losses = first["mtp_losses"].as_array().expect("mtp_losses logged");
    assert_eq!(losses.len(), 2);
    // Untrained, each depth predicts about uniformly over the vocabulary.
    let uniform = (cfg.model.padded_vocab_size as f64).ln();
    for l in losses {
        let l = l.as_f64().unwrap();
        assert!((l - uniform).abs() < 0.5, "{l} vs ln V {uniform}");
    }
    // TensorBoard: megatron-core's tags, one value per logged iteration.
    let event = std::fs::read_dir(&tb)
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    let scalars = megatron_training::tensorboard::read_scalars(&event).unwrap();
    for tag in ["mtp_1 loss", "mtp_2 loss"] {
        assert_eq!(scalars.iter().filter(|s| s.tag == tag).count(), 4, "{tag}");
    }
    let f = megatron_core::models::gpt::activation_bytes_formula(
        &cfg.model,
        cfg.args.micro_batch_size,
        cfg.args.seq_length,
        1,
        false,
        false,
    );
    assert_eq!(s.peak_activation_bytes, f);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_is_refused_by_name_with_learned_positions_under_pipelining_and_for_bert() {
    let err = |extra: &[&str]| {
        let v = [MTP, extra, &["--train-iters", "5"]].concat();
        args(&v).validate(62).unwrap_err().to_string()
    };
    let pp = err(&[
        "--nproc-per-node",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ]);
    // GPT's learned positions have no copy on the last stage.
    assert!(
        pp.contains("--mtp-num-layers") && pp.contains("position"),
        "{pp}"
    );
    let zero = err(&["--mtp-num-layers", "0"]);
    assert!(zero.contains("--mtp-num-layers"), "{zero}");
    let bert = bert_args(&[MTP, &["--train-iters", "5"]].concat())
        .validate(30522)
        .unwrap_err()
        .to_string();
    assert!(
        bert.contains("--mtp-num-layers") && bert.contains("output layer"),
        "{bert}"
    );
}

#[test]
fn mtp_expert_routers_update_and_checkpoint_their_bias_like_the_decoders() {
    // DeepSeek-V3's aux-loss-free balancing on every MoE layer, the depths' included.
    let dir = tmpdir("mtp-expert-bias");
    let bias = [
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.01",
    ];
    let flags = [MTP, MOE, &bias[..]].concat();
    let serial = train_and_load(&dir, "serial", &flags);
    let name = "mtp.layers.1.mtp_model_layer.mlp.router.expert_bias";
    let b = serial
        .1
        .tensors
        .get(name)
        .expect("the depth's expert bias is saved");
    assert!(b.iter().any(|&x| x != 0.0), "{b:?}");
    let ep2 = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"];
    let run = train_and_load(&dir, "ep2", &[&flags[..], &ep2[..]].concat());
    assert_same_training("mtp expert bias ep2", &serial, &run, 1e-5);
    assert_eq!(&run.1.tensors[name], b);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_with_per_token_loss_and_recomputation_matches_one_rank() {
    // --calculate-per-token-loss scales each depth's loss by the decoder's token count over
    // its own; recomputation reruns the decoder's layers and keeps the depths'.
    let dir = tmpdir("mtp-per-token");
    let flags = [MTP, &["--calculate-per-token-loss"]].concat();
    let tp2_sp = [
        "--nproc-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ];
    let layouts: [(&str, &[&str]); 4] = [
        ("dp2", &["--nproc-per-node", "2"]),
        ("tp2 + sp", &tp2_sp),
        ("full recompute", &["--recompute-granularity", "full"]),
        ("selective recompute", &["--recompute-activations"]),
    ];
    assert_layouts_match_one_rank(&dir, "mtp per-token", &flags, &layouts);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_with_bf16_and_the_overlapped_parameter_gather_matches_one_rank() {
    let dir = tmpdir("mtp-bf16");
    let gather = [
        "--nproc-per-node",
        "2",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ];
    let serial = train_and_load(&dir, "serial", MTP);
    let run = train_and_load(&dir, "gather", &[MTP, &gather[..]].concat());
    assert_same_training("mtp dp2 overlapped parameter gather", &serial, &run, 1e-5);
    let bf16 = [MTP, &["--bf16"]].concat();
    let serial = train_and_load(&dir, "bf16-serial", &bf16);
    let tp2 = [
        "--nproc-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ];
    let run = train_and_load(&dir, "bf16-tp2", &[&bf16[..], &tp2[..]].concat());
    assert_same_training_within(
        "mtp bf16 tp2 + sp",
        &serial,
        &run,
        BF16_LOSS_TOL,
        BF16_PARAM_TOL,
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mtp_kept_activations_match_the_formula_under_either_residual_stream() {
    // Under --bf16 each depth's layer output is the bf16 residual stream; with
    // --fp32-residual-connection it is f32: the engine formula counts either exactly.
    for stream in [
        &["--bf16"][..],
        &["--bf16", "--fp32-residual-connection"][..],
    ] {
        let a = args(
            &[
                MTP,
                stream,
                &["--train-iters", "2", "--lr-warmup-iters", "0"],
            ]
            .concat(),
        );
        let cfg = a.validate(62).unwrap();
        let s = pretrain(&a).unwrap();
        let f = megatron_core::models::gpt::activation_bytes_formula(
            &cfg.model,
            cfg.args.micro_batch_size,
            cfg.args.seq_length,
            1,
            false,
            true,
        );
        assert_eq!(s.peak_activation_bytes, f, "{stream:?}");
    }
}
