//! Activation recomputation: every option trains bit-identically to keeping everything (the
//! recomputed forwards draw the same dropout masks), and keeps exactly the bytes the engine's
//! formula says.

mod common;

use common::*;
use megatron_core::models::gpt::{activation_bytes_formula_with, ActivationSplit};

fn split(tp: usize, sp: bool) -> ActivationSplit {
    ActivationSplit::tensor_parallel(tp, sp)
}
use megatron_core::transformer::config::ResidualPrecision;
use megatron_core::transformer::step::{Recompute, RecomputeMethod, SelectiveModules};
use megatron_training::pretrain;

/// `--recompute-*` flags and the policy they mean.
fn options() -> Vec<(&'static [&'static str], Recompute)> {
    let sel = |core_attn, mlp| Recompute::Selective(SelectiveModules { core_attn, mlp });
    let full = |method, num_layers| Recompute::Full { method, num_layers };
    vec![
        (&["--recompute-activations"][..], sel(true, false)),
        (
            &[
                "--recompute-granularity",
                "selective",
                "--recompute-modules",
                "mlp",
            ][..],
            sel(false, true),
        ),
        (
            &[
                "--recompute-granularity",
                "selective",
                "--recompute-modules",
                "core_attn",
                "mlp",
                "layernorm",
            ][..],
            sel(true, true),
        ),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
            ][..],
            full(RecomputeMethod::Uniform, 1),
        ),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "3",
            ][..],
            full(RecomputeMethod::Uniform, 3),
        ),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "5",
            ][..],
            full(RecomputeMethod::Block, 5),
        ),
    ]
}

fn run(
    dir: &std::path::Path,
    name: &str,
    extra: &[&str],
) -> (
    megatron_training::TrainSummary,
    megatron_training::checkpointing::LoadedCheckpoint,
) {
    let dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"];
    train_and_load(dir, name, &[&dropout[..], extra].concat())
}

#[test]
fn every_recomputation_option_trains_bit_identically_with_dropout_on() {
    let dir = tmpdir("recompute-bits");
    for (layout_name, layout) in [
        ("one rank", &[][..]),
        (
            "TP 2 + SP",
            &[
                "--nproc-per-node",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ][..],
        ),
        (
            "PP 2 interleaved",
            &[
                "--nproc-per-node",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
            ][..],
        ),
    ] {
        let base = run(
            &dir,
            &format!("{layout_name}-base").replace(' ', "_"),
            layout,
        );
        for (i, (flags, _)) in options().into_iter().enumerate() {
            let what = format!("{layout_name} {flags:?}");
            let r = run(
                &dir,
                &format!("{layout_name}-{i}").replace(' ', "_"),
                &[layout, flags].concat(),
            );
            assert_eq!(base.0.losses, r.0.losses, "{what}: losses");
            assert_same_training_within(&what, &base, &r, 0.0, 0.0);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Under 16-bit precision backward reads kept 16-bit tensors (QKV, the attention output in
/// `rowsum(dO * O)`, the fc1 output in the activation's derivative): forward must read QKV as
/// it is kept, a recomputed tensor must be rounded as the kept one is, and the residual
/// stream must be kept as it is stored (f32 under `--fp16` and `--fp32-residual-connection`),
/// or recomputation changes the gradients.
#[test]
fn every_recomputation_option_trains_bit_identically_under_16_bit_precision() {
    let dir = tmpdir("recompute-bits-16");
    let cp2 = ["--nproc-per-node", "2", "--context-parallel-size", "2"];
    let a2a = [&cp2[..], &["--cp-comm-type", "a2a"]].concat();
    // A constant scale: the default dynamic one skips the first steps' overflowing updates,
    // which would leave nothing to compare.
    let fp16 = ["--fp16", "--loss-scale", "1024"];
    for (name, flags) in [
        ("bf16 one rank", vec!["--bf16"]),
        (
            "bf16 on the f32 kernel",
            vec!["--bf16", "--bf16-matmul-kernel", "fma"],
        ),
        ("bf16 CP 2 ring", [&["--bf16"][..], &cp2].concat()),
        ("bf16 CP 2 all-to-all", [&["--bf16"][..], &a2a].concat()),
        ("bf16 MLA", [&["--bf16"][..], MLA].concat()),
        (
            "bf16 f32 residual stream",
            vec!["--bf16", "--fp32-residual-connection"],
        ),
        ("fp16 one rank", fp16.to_vec()),
    ] {
        let base = run(&dir, &format!("{name}-base").replace(' ', "_"), &flags);
        for (i, (option, _)) in options().into_iter().enumerate() {
            let what = format!("{name} {option:?}");
            let r = run(
                &dir,
                &format!("{name}-{i}").replace(' ', "_"),
                &[&flags[..], option].concat(),
            );
            assert_eq!(base.0.losses, r.0.losses, "{what}: losses");
            assert_same_training_within(&what, &base, &r, 0.0, 0.0);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn recomputation_keeps_exactly_the_bytes_of_the_formula() {
    // PP_MODEL on one rank: 8 layers, hidden 64, 4 heads, seq 32, micro-batch 1.
    let cfg = megatron_core::TransformerConfig {
        num_layers: 8,
        hidden_size: 64,
        num_attention_heads: 4,
        ffn_hidden_size: 256,
        seq_length: 32,
        max_position_embeddings: 32,
        padded_vocab_size: 256,
        ..Default::default()
    };
    let mut options = options();
    options.push((&[][..], Recompute::None));
    // Under context parallelism a rank keeps its 1/C of the sequence, in either attention
    // layout: the formula at seq / C.
    let layouts: &[(usize, bool, &[&str])] = &[
        (1, false, &[]),
        (2, false, &[]),
        (2, true, &[]),
        (
            1,
            false,
            &["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
        ),
        (
            1,
            false,
            &["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
        ),
        (
            2,
            true,
            &["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
        ),
    ];
    for &(tp, sp, cp_flags) in layouts {
        let cp = if cp_flags.is_empty() { 1 } else { 2 };
        for (flags, recompute) in &options {
            for half in [false, true] {
                let mut v: Vec<&str> = [PP_MODEL, &["--train-iters", "3"][..], flags].concat();
                let ranks = (tp * cp).to_string();
                let tps = tp.to_string();
                v.extend([
                    "--nproc-per-node",
                    &ranks,
                    "--tensor-model-parallel-size",
                    &tps,
                ]);
                v.extend_from_slice(cp_flags);
                if sp {
                    v.push("--sequence-parallel");
                }
                if half {
                    v.push("--bf16");
                }
                let s = pretrain(&args(&v)).unwrap();
                // Under --bf16 the kept last-layer output is the bf16 residual stream.
                let mut cfg = cfg.clone();
                if half {
                    cfg.residual = ResidualPrecision::BF16;
                }
                let want = activation_bytes_formula_with(
                    &cfg,
                    1,
                    32 / cp,
                    split(tp, sp),
                    half,
                    *recompute,
                );
                assert_eq!(
                    s.peak_activation_bytes, want,
                    "TP {tp}, SP {sp}, {cp_flags:?}, bf16 {half}, {flags:?}"
                );
            }
        }
    }
}

#[test]
fn recompute_flags_are_checked_as_megatron_does() {
    for (flags, named) in [
        (
            &[
                "--recompute-granularity",
                "selective",
                "--recompute-method",
                "uniform",
            ][..],
            "--recompute-method",
        ),
        (
            &["--recompute-method", "block"][..],
            "--recompute-granularity",
        ),
        (
            &[
                "--recompute-granularity",
                "selective",
                "--recompute-modules",
                "attn",
            ][..],
            "--recompute-modules attn",
        ),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-num-layers",
                "0",
            ][..],
            "--recompute-num-layers",
        ),
        (
            &["--recompute-activations", "--recompute-granularity", "full"][..],
            "--recompute-activations",
        ),
    ] {
        let v = [&["--train-iters", "3"][..], flags].concat();
        let e = pretrain(&args(&v)).unwrap_err().to_string();
        assert!(e.contains(named), "{flags:?}: {e}");
    }
}

#[test]
fn recomputed_moe_layers_route_alike_and_count_their_tokens_once() {
    let dir = tmpdir("recompute-moe");
    let moe: Vec<&str> = [
        MOE,
        &[
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "0.05",
            "--nproc-per-node",
            "2",
            "--expert-model-parallel-size",
            "2",
        ][..],
    ]
    .concat();
    let base = run(&dir, "base", &moe);
    let full = run(
        &dir,
        "full",
        &[
            &moe[..],
            &[
                "--recompute-granularity",
                "full",
                "--recompute-num-layers",
                "2",
            ],
        ]
        .concat(),
    );
    assert_eq!(base.0.losses, full.0.losses);
    assert_same_training_within("MoE, full recomputation", &base, &full, 0.0, 0.0);
    assert_eq!(base.0.moe, full.0.moe, "routing statistics counted once");
    let _ = std::fs::remove_dir_all(dir);
}
