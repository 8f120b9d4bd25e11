//! gpt-oss on the engine: megatron-core's attention sinks (`--softmax-type learnable`), the
//! clamped Quick-GEGLU with its linear offset, biases on the router and the experts, windowed
//! and full layers in turn, YaRN. A Megatron-LM run of that model continued here follows
//! Megatron-LM's own log; the parallel layouts train the one-rank model.

mod common;

use common::megatron_resume::*;
use common::*;

#[test]
fn a_megatron_lm_gpt_oss_run_continues_with_the_losses_megatron_lm_logs() {
    follows_megatron_lm("gpt_oss_adam", "world1", GPT_OSS, &[], FP32);
}

/// Saved by Megatron-LM at EP 2 with the distributed optimizer (the experts' biases and the
/// sinks among its buckets), continued at one rank, at EP 2, and at TP 2 + SP x EP 2 with the
/// sinks split over the heads.
#[test]
fn a_megatron_lm_gpt_oss_run_at_ep2_continues_at_other_layouts() {
    let name = "gpt_oss_distopt_ep2";
    follows_megatron_lm(name, "world1", GPT_OSS, &[], FP32);
    let ep2 = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"];
    follows_megatron_lm(name, "ep2", GPT_OSS, &ep2, FP32);
    let tp2_ep2 = [
        "--nproc-per-node",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "1",
    ];
    follows_megatron_lm(name, "tp2sp-ep2", GPT_OSS, &tp2_ep2, FP32);
}

/// Every layout trains the one-rank gpt-oss model: the sinks split with the heads over tensor
/// parallelism (each rank's heads their own logits) and whole on every context-parallel rank,
/// the experts' fc2 bias split over the expert-tensor-parallel ranks, the router's bias
/// replicated with its weight.
#[test]
fn gpt_oss_layouts_match_one_rank() {
    let dir = tmpdir("gpt-oss-layouts");
    let n = |k: &'static str| ["--nproc-per-node", k];
    let tp2_sp = [
        &n("2")[..],
        &["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ]
    .concat();
    let pp2 = [&n("2")[..], &["--pipeline-model-parallel-size", "2"]].concat();
    let cp2 = |t: &'static str| {
        [
            &n("2")[..],
            &["--context-parallel-size", "2", "--cp-comm-type", t],
        ]
        .concat()
    };
    let (cp2_p2p, cp2_a2a) = (cp2("p2p"), cp2("a2a"));
    let ep2_etp2 = [
        &n("4")[..],
        &[
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "2",
            "--expert-tensor-parallel-size",
            "2",
        ],
    ]
    .concat();
    let ep2_etp1_allgather = [
        &n("4")[..],
        &[
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "2",
            "--expert-tensor-parallel-size",
            "1",
            "--moe-token-dispatcher-type",
            "allgather",
        ],
    ]
    .concat();
    let dp2 = [&n("2")[..], &["--use-distributed-optimizer"]].concat();
    let layouts: [(&str, &[&str]); 7] = [
        ("tp2 + sp", &tp2_sp),
        ("pp2", &pp2),
        ("cp2 p2p", &cp2_p2p),
        ("cp2 a2a", &cp2_a2a),
        ("ep2 x tp2 (sp, etp2)", &ep2_etp2),
        ("ep2 x tp2 (sp, etp1) allgather", &ep2_etp1_allgather),
        ("dp2 distributed optimizer", &dp2),
    ];
    let serial = assert_layouts_match_one_rank(&dir, "gpt-oss", GPT_OSS, &layouts);
    for name in [
        "decoder.layers.0.self_attention.core_attention.softmax_offset",
        "decoder.layers.1.mlp.router.bias",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.bias",
    ] {
        assert!(serial.1.tensors.contains_key(name), "{name} not saved");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The gpt-oss flags are refused by name where megatron-core does not apply them, or where
/// this engine does not build them.
#[test]
fn gpt_oss_flags_are_checked_by_name() {
    let fails = |extra: &[&str], want: &str| {
        let mut flags = vec!["--train-iters", "2"];
        flags.extend_from_slice(extra);
        let e = megatron_training::pretrain(&args(&flags))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{extra:?}: {e}");
    };
    fails(
        &["--glu-linear-offset", "1.0", "--swiglu"],
        "--glu-linear-offset is built for --quick-geglu",
    );
    fails(
        &["--activation-func-clamp-value", "7", "--swiglu"],
        "--activation-func-clamp-value with --swiglu needs --num-experts",
    );
    fails(
        &["--activation-func-clamp-value", "7"],
        "--activation-func-clamp-value acts on a gated unit",
    );
    fails(
        &["--glu-linear-offset", "1.0", "--squared-relu"],
        "--glu-linear-offset acts on a gated unit",
    );
    fails(
        &["--quick-geglu", "--activation-func-clamp-value", "0"],
        "--activation-func-clamp-value must be finite and greater than zero",
    );
    fails(
        &["--quick-geglu", "--glu-linear-offset", "nan"],
        "--glu-linear-offset must be a finite number",
    );
    let e = megatron_training::pretrain(&bert_args(&[
        "--train-iters",
        "2",
        "--softmax-type",
        "learnable",
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("--model bert: --softmax-type"), "{e}");
    // The clamp is live: a clamped run trains a different model from the unclamped one.
    let dir = tmpdir("gpt-oss-clamp");
    let quick = ["--quick-geglu", "--glu-linear-offset", "1.0"];
    let plain = train_and_load(&dir, "plain", &quick);
    let clamped = train_and_load(
        &dir,
        "clamped",
        &[&quick[..], &["--activation-func-clamp-value", "0.05"]].concat(),
    );
    assert_ne!(plain.0.losses, clamped.0.losses);
    let _ = std::fs::remove_dir_all(dir);
}

/// Recomputation reruns the sinks with the attention and the clamped unit with the MLP: every
/// option trains the model bit for bit; under `--bf16` TP 2 + SP trains the one-rank bf16
/// model within the bf16 tolerance.
#[test]
fn gpt_oss_recomputation_and_bf16_match() {
    let dir = tmpdir("gpt-oss-recompute-bf16");
    let plain = train_and_load(&dir, "plain", GPT_OSS);
    for (name, extra) in [
        ("selective", &["--recompute-activations"][..]),
        (
            "selective mlp",
            &[
                "--recompute-granularity",
                "selective",
                "--recompute-modules",
                "core_attn",
                "mlp",
            ][..],
        ),
        ("full", &["--recompute-granularity", "full"][..]),
    ] {
        let run = train_and_load(&dir, &name.replace(' ', "_"), &[GPT_OSS, extra].concat());
        assert_eq!(plain.0.losses, run.0.losses, "{name}");
        assert_eq!(plain.1.tensors, run.1.tensors, "{name}");
    }
    let bf16 = [GPT_OSS, &["--bf16"]].concat();
    let serial = train_and_load(&dir, "bf16-serial", &bf16);
    let tp2_sp = [
        &bf16[..],
        &[
            "--nproc-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ]
    .concat();
    let run = train_and_load(&dir, "bf16-tp2-sp", &tp2_sp);
    assert_same_training_within(
        "gpt-oss bf16 tp2 + sp",
        &serial,
        &run,
        BF16_LOSS_TOL,
        BF16_PARAM_TOL,
    );
    let _ = std::fs::remove_dir_all(dir);
}
