//! `--squared-relu` and `--quick-geglu` (megatron-core's `squared_relu` and `quick_geglu`):
//! each trains the same model at TP 2 + SP and PP 2 as on one rank, and each is a model of its
//! own (not GELU under another name). Their kernels are checked against their definitions in
//! the tensor crate, their conversions against transformers' in `convert.rs`.

mod common;

use common::*;
use megatron_training::checkpointing::{load_checkpoint, LoadedCheckpoint};
use megatron_training::{pretrain, TrainSummary};

fn run(dir: &std::path::Path, name: &str, flags: &[&str]) -> (TrainSummary, LoadedCheckpoint) {
    let save = dir.join(name.replace(' ', "-"));
    let s = save.to_str().unwrap().to_string();
    // Vocabulary padding to 64 at one rank and at TP 2 (Megatron pads to a multiple of
    // divisible-by x TP: another padding would be another model).
    let mut extra = vec![
        "--train-iters",
        "5",
        "--save",
        &s,
        "--ffn-hidden-size",
        "48",
        "--make-vocab-size-divisible-by",
        "32",
    ];
    extra.extend_from_slice(flags);
    let summary = pretrain(&args(&extra)).unwrap();
    (summary, load_checkpoint(&save, None).unwrap())
}

#[test]
fn squared_relu_and_quick_geglu_match_one_rank_at_tp2_sp_and_pp2() {
    let dir = tmpdir("mlp-activations");
    let gelu = run(&dir, "gelu", &[]);
    for act in ["--squared-relu", "--quick-geglu"] {
        let serial = run(&dir, &format!("{act} serial"), &[act]);
        let last = |s: &TrainSummary| s.losses.last().unwrap().1;
        assert!(
            (last(&serial.0) - last(&gelu.0)).abs() > 1e-4,
            "{act} trains GELU's model"
        );
        let fc1 = "decoder.layers.0.mlp.linear_fc1.weight";
        let gated = act == "--quick-geglu";
        assert_eq!(
            serial.1.tensors[fc1].len(),
            if gated { 2 * 48 * 32 } else { 48 * 32 },
            "{act}: fc1 is [gate; up] exactly when gated"
        );
        for (name, layout) in [
            (
                "tp2 sp",
                &[
                    "--nproc-per-node",
                    "2",
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                ][..],
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
            let flags = [&[act][..], layout].concat();
            let other = run(&dir, &format!("{act} {name}"), &flags);
            assert_same_training(&format!("{act} {name}"), &serial, &other, 1e-5);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// megatron-core's unfused GELU is torch's exact `F.gelu`, its fused bias-GELU the tanh
/// approximation: `--no-bias-gelu-fusion` trains the exact one (exported as transformers'
/// `gelu`), close to but not the default's losses. (The two agree to ~1e-7 near 0, where a
/// 0.02-std initialisation keeps fc1's outputs: a wide one shows the difference.)
#[test]
fn no_bias_gelu_fusion_trains_the_exact_erf_gelu() {
    let dir = tmpdir("erf-gelu");
    let wide = ["--init-method-std", "0.5"];
    let tanh = run(&dir, "tanh", &wide);
    let erf = run(
        &dir,
        "erf",
        &[&wide[..], &["--no-bias-gelu-fusion"]].concat(),
    );
    let (a, b) = (
        tanh.0.losses.last().unwrap().1,
        erf.0.losses.last().unwrap().1,
    );
    assert!(a != b && (a - b).abs() < 1e-2 * a, "{a} vs {b}");
    megatron_training::convert::megatron_to_hf(&dir.join("erf"), &dir.join("hf")).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("hf/config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["activation_function"], "gelu");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn two_mlp_activations_are_refused_by_name() {
    let e = pretrain(&args(&["--train-iters", "3", "--swiglu", "--squared-relu"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--swiglu") && e.contains("--squared-relu"),
        "{e}"
    );
}
