//! A tiny Llama-style model (4 layers, hidden 64, 8 heads in 2 query groups, SwiGLU, RoPE,
//! RMSNorm, untied, no biases) trains the same model in every layout as on one rank.

mod common;

use common::*;
use megatron_training::checkpointing::{load_checkpoint, LoadedCheckpoint};
use megatron_training::{pretrain, TrainSummary};

const LLAMA_MODEL: &[&str] = &[
    "--num-layers",
    "4",
    "--vocab-size",
    "250",
    "--make-vocab-size-divisible-by",
    "64",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "10000",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--seq-length",
    "32",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "1",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
];

fn llama_run(
    dir: &std::path::Path,
    name: &str,
    layout: &[&str],
) -> (TrainSummary, LoadedCheckpoint) {
    let save = dir.join(name);
    let s = save.to_str().unwrap().to_string();
    let mut extra = vec!["--train-iters", "5", "--save", &s];
    extra.extend_from_slice(LLAMA_MODEL);
    extra.extend_from_slice(layout);
    let summary = pretrain(&args(&extra)).unwrap();
    (summary, load_checkpoint(&save, None).unwrap())
}

const TP2: &[&str] = &["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"];

#[test]
fn llama_tensor_sequence_and_pipeline_parallel_layouts_match_one_rank() {
    let dir = tmpdir("llama-tp-pp");
    let serial = llama_run(&dir, "serial", &[]);
    let tp2_sp = [TP2, &["--sequence-parallel"]].concat();
    let pp2 = [
        "--nproc-per-node",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ];
    let pp2v = [&pp2[..], &["--num-layers-per-virtual-pipeline-stage", "1"]].concat();
    for (name, layout) in [
        ("tp2 (one query group per rank)", TP2),
        ("tp2 + sp", &tp2_sp[..]),
        ("pp2 1f1b", &pp2[..]),
        ("pp2 interleaved", &pp2v[..]),
    ] {
        let run = llama_run(&dir, name, layout);
        assert_same_training(name, &serial, &run, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn qk_layernorm_at_tp2_with_and_without_sequence_parallelism_matches_one_rank() {
    // The query/key norm weights are replicated but each rank normalizes only its heads: their
    // gradients are all-reduced over TP even without sequence parallelism.
    let dir = tmpdir("llama-qk");
    let qk = ["--qk-layernorm"];
    let serial = llama_run(&dir, "serial", &qk);
    for (name, sp) in [("tp2", &[][..]), ("tp2 + sp", &["--sequence-parallel"][..])] {
        let layout = [&qk[..], TP2, sp].concat();
        let run = llama_run(&dir, name, &layout);
        assert_same_training(&format!("qk-layernorm {name}"), &serial, &run, 1e-5);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn llama_saved_activations_are_what_the_formula_says() {
    // RMSNorm keeps one statistic per row, SwiGLU a 2f-wide fc1 output, GQA a narrower QKV,
    // --qk-layernorm the norms' inputs: measured bytes equal the engine's formula.
    let base = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--train-iters",
        "2",
    ];
    for extra in [
        &[][..],
        &["--qk-layernorm"][..],
        &["--qk-layernorm", "--bf16"][..],
    ] {
        let a = args(&[&base[..], extra].concat());
        let cfg = a.validate(62).unwrap();
        let s = pretrain(&a).unwrap();
        let f = megatron_core::models::gpt::activation_bytes_formula(
            &cfg.model,
            2,
            16,
            1,
            false,
            extra.contains(&"--bf16"),
        );
        assert_eq!(s.peak_activation_bytes, f, "{extra:?}");
    }
}

#[test]
fn llama_with_four_query_groups_at_tp4_matches_one_rank() {
    let dir = tmpdir("llama-tp4");
    let groups4 = ["--num-query-groups", "4"];
    let serial = llama_run(&dir, "serial", &groups4);
    let tp4 = [
        &groups4[..],
        &[
            "--nproc-per-node",
            "4",
            "--tensor-model-parallel-size",
            "4",
            "--sequence-parallel",
        ],
    ]
    .concat();
    let run = llama_run(&dir, "tp4", &tp4);
    assert_same_training_but_outliers("tp4 + sp, 4 groups", &serial, &run, 5e-5);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn llama_data_parallel_distributed_optimizer_and_3d_layout_match_one_rank() {
    let dir = tmpdir("llama-3d");
    let serial = llama_run(&dir, "serial", &[]);
    let dp2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"];
    let three_d = [
        "--nproc-per-node",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "5000",
    ];
    for (name, layout) in [
        ("dp2 distributed optimizer", &dp2[..]),
        ("tp2 x pp2 x dp2", &three_d[..]),
    ] {
        let run = llama_run(&dir, name, layout);
        assert_same_training(name, &serial, &run, 1e-5);
        assert_same_norms(name, &serial.0, &run.0);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn llama_bf16_3d_layout_matches_one_bf16_rank() {
    let dir = tmpdir("llama-bf16");
    let bf16 = ["--bf16", "--bf16-matmul-kernel", "fma"];
    let serial = llama_run(&dir, "serial", &bf16);
    let three_d = [
        &bf16[..],
        &[
            "--nproc-per-node",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
        ],
    ]
    .concat();
    let run = llama_run(&dir, "3d", &three_d);
    assert_same_training_within(
        "bf16 tp2 x pp2 x dp2",
        &serial,
        &run,
        BF16_LOSS_TOL,
        BF16_PARAM_TOL,
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_llama_checkpoint_saved_at_tp2_pp2_resumes_on_one_rank_and_at_dp2() {
    // The fused QKV (per query group) and the fused [gate; up] fc1 are gathered to whole
    // tensors on save and sliced again on load, whatever the layout.
    let dir = tmpdir("llama-resume");
    let serial = llama_run(&dir, "serial", &[]).0;
    let first = dir.join("first");
    let f = first.to_str().unwrap().to_string();
    let run = |more: &[&str]| {
        let mut v: Vec<&str> = LLAMA_MODEL.to_vec();
        v.extend_from_slice(more);
        pretrain(&args(&v)).unwrap()
    };
    run(&[
        "--train-iters",
        "3",
        "--save",
        &f,
        "--nproc-per-node",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ]);
    for layout in [&[][..], &["--nproc-per-node", "2"][..]] {
        let mut v = vec![
            "--train-iters",
            "5",
            "--override-opt_param-scheduler",
            "--load",
            &f,
        ];
        v.extend_from_slice(layout);
        let resumed = run(&v);
        assert_eq!(resumed.losses.len(), 2, "{layout:?}");
        assert_losses_close(
            &format!("resumed {layout:?}"),
            &serial.losses[3..],
            &resumed.losses,
            1e-5,
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn llama_loss_falls_on_mock_data() {
    let mut v: Vec<&str> = LLAMA_MODEL.to_vec();
    v.extend_from_slice(&[
        "--train-iters",
        "40",
        "--lr",
        "5e-3",
        "--global-batch-size",
        "4",
    ]);
    let s = pretrain(&args(&v)).unwrap();
    let first = s.losses[0].1;
    let last = s.losses.last().unwrap().1;
    assert!(last < first - 1.0, "loss {first} -> {last}");
}

fn refused(extra: &[&str]) -> String {
    let mut v: Vec<&str> = LLAMA_MODEL.to_vec();
    v.extend_from_slice(&["--train-iters", "3"]);
    v.extend_from_slice(extra);
    pretrain(&args(&v)).unwrap_err().to_string()
}

#[test]
fn bad_llama_flag_combinations_are_refused_naming_the_flags() {
    let e = refused(&["--num-query-groups", "3"]);
    assert!(
        e.contains("--num-query-groups (3)") && e.contains("--num-attention-heads (8)"),
        "{e}"
    );
    // Two groups cannot be split over four ranks; multi-query (one group) neither.
    for groups in ["2", "1"] {
        let e = refused(&[
            "--num-query-groups",
            groups,
            "--nproc-per-node",
            "4",
            "--tensor-model-parallel-size",
            "4",
        ]);
        assert!(
            e.contains("--num-query-groups") && e.contains("--tensor-model-parallel-size (4)"),
            "{e}"
        );
    }
    for p in ["1.5", "0"] {
        let e = refused(&["--rotary-percent", p]);
        assert!(e.contains("--rotary-percent"), "{e}");
    }
    // 8 features per head at 10 %: no pair to rotate.
    let e = refused(&["--rotary-percent", "0.1"]);
    assert!(
        e.contains("--rotary-percent") && e.contains("--kv-channels"),
        "{e}"
    );
}

/// Megatron's `--position-embedding-type yarn` (`--rotary-scaling-factor`,
/// `--yarn-original-max-position-embeddings`): another model than plain RoPE, the same model
/// at TP 2 with SP, PP 2 and CP 2 as on one rank (every rank builds the same table); its flags
/// are checked by name. Its numbers are checked against transformers in `convert.rs`.
#[test]
fn yarn_rope_layouts_match_one_rank_and_its_flags_are_checked() {
    let dir = tmpdir("llama-yarn");
    let yarn = [
        "--position-embedding-type",
        "yarn",
        "--rotary-scaling-factor",
        "4",
        "--yarn-original-max-position-embeddings",
        "8",
    ];
    let serial = llama_run(&dir, "serial", &yarn);
    let plain = llama_run(&dir, "rope", &[]);
    assert_ne!(serial.0.losses, plain.0.losses, "YaRN changes the model");
    for (name, layout) in [
        ("tp2-sp", [TP2, &["--sequence-parallel"]].concat()),
        (
            "pp2",
            vec![
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ],
        ),
        (
            "cp2",
            vec!["--nproc-per-node", "2", "--context-parallel-size", "2"],
        ),
    ] {
        let r = llama_run(&dir, name, &[&yarn[..], &layout].concat());
        assert_same_training(name, &serial, &r, 1e-5);
    }
    for (extra, want) in [
        (
            &["--use-rope-scaling"][..],
            "--use-rope-scaling (Llama 3.1's) and --position-embedding-type yarn",
        ),
        (
            &["--rotary-scaling-factor", "0"][..],
            "--rotary-scaling-factor must be positive",
        ),
        (
            &["--yarn-original-max-position-embeddings", "0"][..],
            "--yarn-original-max-position-embeddings must be positive",
        ),
    ] {
        let e = refused(&[&yarn[..], extra].concat());
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `--rotary-seq-len-interpolation-factor` (linear position interpolation): factor 1 is plain
/// RoPE bit for bit, factor 4 another model, the same at CP 2 (p2p) as on one rank; it excludes
/// the other context extensions by name.
#[test]
fn linear_rope_interpolation_matches_one_rank_and_excludes_other_extensions() {
    let dir = tmpdir("llama-linear-rope");
    let plain = llama_run(&dir, "plain", &[]);
    let one = llama_run(&dir, "one", &["--rotary-seq-len-interpolation-factor", "1"]);
    assert_eq!(plain.0.losses, one.0.losses, "factor 1 is no interpolation");
    let four = ["--rotary-seq-len-interpolation-factor", "4"];
    let serial = llama_run(&dir, "serial", &four);
    assert_ne!(serial.0.losses, plain.0.losses);
    let cp = llama_run(
        &dir,
        "cp2",
        &[
            &four[..],
            &["--nproc-per-node", "2", "--context-parallel-size", "2"],
        ]
        .concat(),
    );
    assert_same_training("cp2", &serial, &cp, 1e-5);
    for (extra, want) in [
        (
            &["--use-rope-scaling"][..],
            "--rotary-seq-len-interpolation-factor and --use-rope-scaling",
        ),
        (
            &["--position-embedding-type", "yarn"][..],
            "--rotary-seq-len-interpolation-factor and --position-embedding-type yarn",
        ),
    ] {
        let e = refused(&[&four[..], extra].concat());
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let e = refused(&["--rotary-seq-len-interpolation-factor", "0"]);
    assert!(e.contains("must be positive"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}
