//! Context parallelism: each sequence split into 2C chunks over C ranks (rank r holds chunks r
//! and 2C-1-r); attention by ring (`--cp-comm-type p2p`: keys and values around the ring,
//! partial outputs merged by log-sum-exp) or all-to-all (`a2a`: whole sequences of a share of
//! the heads). Both train the one-rank model in every combination with the other layouts.

mod common;

use common::*;
use megatron_training::pretrain;

fn run(
    dir: &std::path::Path,
    name: &str,
    extra: &[&str],
) -> (
    megatron_training::TrainSummary,
    megatron_training::checkpointing::LoadedCheckpoint,
) {
    train_and_load(dir, name, extra)
}

fn cp_layouts_match_one_rank(kind: &'static str, dropout: &[&str]) {
    let dir = tmpdir(&format!("cp-{kind}"));
    let comm: &'static [&'static str] = if kind == "p2p" {
        &["--cp-comm-type", "p2p"]
    } else {
        &["--cp-comm-type", "a2a"]
    };
    for (model, flags) in [("gpt", dropout), ("llama", &[LLAMA, dropout].concat()[..])] {
        let serial = run(&dir, &format!("{model}-serial"), flags);
        let cp = |n: &'static str, c: &'static str, more: &[&'static str]| -> Vec<&'static str> {
            let mut v = vec!["--nproc-per-node", n, "--context-parallel-size", c];
            v.extend_from_slice(comm);
            v.extend_from_slice(more);
            v
        };
        let mut layouts: Vec<(&str, Vec<&str>)> = vec![
            ("cp2", cp("2", "2", &[])),
            (
                "cp2 x tp2 + sp",
                cp(
                    "4",
                    "2",
                    &["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                ),
            ),
            (
                "cp2 x pp2",
                cp("4", "2", &["--pipeline-model-parallel-size", "2"]),
            ),
            (
                "cp2 x dp2 distributed optimizer",
                cp("4", "2", &["--use-distributed-optimizer"]),
            ),
        ];
        if model == "gpt" {
            layouts.push(("cp4", cp("4", "4", &[])));
            layouts.push((
                "cp2 selective recompute",
                cp("2", "2", &["--recompute-activations"]),
            ));
            layouts.push((
                "cp2 full recompute",
                cp("2", "2", &["--recompute-granularity", "full"]),
            ));
        }
        for (name, layout) in &layouts {
            let what = format!("{kind} {model} {name}");
            let r = run(&dir, &what.replace(' ', "_"), &[flags, layout].concat());
            assert_same_training(&what, &serial, &r, 1e-5);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ring_attention_layouts_match_one_rank() {
    // Dropout on everywhere: each block draws the attention masks of its place in the whole
    // sequence.
    cp_layouts_match_one_rank(
        "p2p",
        &["--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    );
}

#[test]
fn all_to_all_attention_layouts_match_one_rank() {
    // Dropout on everywhere: the masks are numbered by position in the micro-batch, so every
    // chunk draws what one rank draws.
    cp_layouts_match_one_rank(
        "a2a",
        &["--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    );
}

#[test]
fn context_parallel_flags_are_checked() {
    for (flags, named) in [
        (
            &[
                "--nproc-per-node",
                "2",
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "a2a",
                "--seq-length",
                "30",
            ][..],
            "--seq-length",
        ),
        (
            &[
                "--nproc-per-node",
                "4",
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
                "--num-attention-heads",
                "2",
            ][..],
            "--context-parallel-size 4",
        ),
    ] {
        let v = [PP_MODEL, &["--train-iters", "3"][..], flags].concat();
        let e = pretrain(&args(&v)).unwrap_err().to_string();
        assert!(e.contains(named), "{flags:?}: {e}");
    }
}

/// Experts under context parallelism: the load-balancing losses are taken over the whole
/// sequence (counts summed over the context-parallel ranks, megatron-core's `tp_cp_group`),
/// expert gradients reduced over expert data parallelism, which spans the CP ranks.
#[test]
fn moe_under_context_parallelism_matches_one_rank() {
    let dir = tmpdir("cp-moe");
    let seq_aux: &[&str] = &["--moe-router-load-balancing-type", "seq_aux_loss"];
    for (name, balance) in [("aux_loss", &[][..]), ("seq_aux_loss", seq_aux)] {
        let base = [MOE, balance].concat();
        let serial = run(&dir, &format!("{name}-serial"), &base);
        for (layout, flags) in [
            (
                "cp2 ring",
                &["--nproc-per-node", "2", "--context-parallel-size", "2"][..],
            ),
            (
                "cp2 a2a x ep2",
                &[
                    "--nproc-per-node",
                    "4",
                    "--context-parallel-size",
                    "2",
                    "--cp-comm-type",
                    "a2a",
                    "--expert-model-parallel-size",
                    "2",
                    "--moe-token-dispatcher-type",
                    "alltoall",
                ][..],
            ),
        ] {
            let what = format!("{name} {layout}");
            let r = run(&dir, &what.replace(' ', "_"), &[&base[..], flags].concat());
            assert_same_training(&what, &serial, &r, 1e-5);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
