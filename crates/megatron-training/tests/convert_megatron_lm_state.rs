//! A Megatron-LM run continued here: runs that Megatron-LM's own training code stopped at
//! iteration 3 and saved with `save_checkpoint` (`bench/make_megatron_optim_fixtures.py`:
//! its model, DDP, optimizer, scheduler and schedules on CPU ranks, its GPTDataset over a
//! committed `.bin/.idx`), converted with their optimizer state and trained on by `megatron
//! train --load` with the run's own flags, must log the losses and gradient norms Megatron-LM
//! logged for iterations 4-6 when it simply went on.

mod common;

use common::{parse_train, tmpdir, TP2_PP2};
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::convert::{megatron_to_torch_dist, torch_dist_to_megatron, OptimizerExport};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/megatron_resume")
        .join(name)
}

const GPT: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
];
const LLAMA: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "48",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--norm-epsilon",
    "1e-6",
    "--no-rope-fusion",
];

/// The flags the fixture script gave Megatron-LM (besides the model's and the layout's).
const RUN: &[&str] = &[
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
    "--make-vocab-size-divisible-by",
    "32",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--init-method-std",
    "0.2",
    "--seed",
    "5",
    "--split",
    "100,0,0",
    "--eval-iters",
    "0",
    "--train-iters",
    "6",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--adam-beta2",
    "0.95",
    "--no-progress-bar",
    "--num-threads",
    "1",
];

/// Megatron-LM's `(iteration, lm loss, grad norm)` after the save.
fn megatron_lm_log(name: &str) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(fixture(name).join("losses.json")).unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    rows.iter()
        .map(|r| {
            (
                r["iteration"].as_u64().unwrap(),
                r["lm_loss"].as_f64().unwrap(),
                r["grad_norm"].as_f64().unwrap(),
            )
        })
        .filter(|r| r.0 > 3)
        .collect()
}

/// `megatron train` on the fixtures' dataset (its index cache under `dir`) with [`RUN`]'s
/// flags, `--load load`, the model's flags and `extra`.
fn train(
    dir: &Path,
    load: &Path,
    model: &[&str],
    extra: &[&str],
) -> megatron_training::TrainSummary {
    let data = fixture("data/tokens_text_document");
    let cache = dir.join("cache");
    let mut v = vec![
        "megatron",
        "--load",
        load.to_str().unwrap(),
        "--data-path",
        data.to_str().unwrap(),
        "--data-cache-path",
        cache.to_str().unwrap(),
    ];
    v.extend_from_slice(RUN);
    v.extend_from_slice(model);
    v.extend_from_slice(extra);
    megatron_training::pretrain(&parse_train(&v)).unwrap()
}

/// Converts fixture `name` and trains it to iteration 6 with the model's flags and `extra`
/// (a layout, a precision); the log of iterations 4-6.
fn continued(name: &str, test: &str, model: &[&str], extra: &[&str]) -> Vec<(u64, f64, f64)> {
    let dir = tmpdir(&format!("mlm-resume-{name}-{test}"));
    let save = dir.join("converted");
    torch_dist_to_megatron(&fixture(name), &save).unwrap();
    let s = train(&dir, &save, model, extra);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        s.start_iteration, 3,
        "{name}: the run continues at iteration 3"
    );
    s.losses
        .iter()
        .zip(&s.grad_norms)
        .map(|(&(i, l), &(j, g))| {
            assert_eq!(i, j);
            (i, l, g)
        })
        .collect()
}

/// fp32: losses and gradient norms within 2e-6 (relative) of Megatron-LM's.
const FP32: (f64, f64) = (2e-6, 2e-6);
/// bf16: the products each engine rounds (PyTorch's CPU bf16 GEMMs against ours) move losses
/// by a few 1e-4 and gradient norms by a few 1e-3, as much as Megatron-LM's own runs at TP 1
/// and TP 2 differ (BENCHMARKS.md).
const BF16: (f64, f64) = (1e-3, 1e-2);

/// fp16 (loss scaling at 128): half-precision products round differently too, by less.
const FP16: (f64, f64) = (1e-4, 1e-3);

/// Fixture `name` continued here (the model's flags and `extra`) follows Megatron-LM's log
/// within `tol`.
fn follows_megatron_lm(name: &str, test: &str, model: &[&str], extra: &[&str], tol: (f64, f64)) {
    let want = megatron_lm_log(name);
    let got = continued(name, test, model, extra);
    assert_follows(&format!("{name} ({test})"), &want, &got, tol);
}

/// Ours follows Megatron-LM's log within `tol` (relative: losses, gradient norms).
fn assert_follows(what: &str, want: &[(u64, f64, f64)], got: &[(u64, f64, f64)], tol: (f64, f64)) {
    assert_eq!(want.len(), got.len(), "{what}: iterations {got:?}");
    for (w, g) in want.iter().zip(got) {
        assert_eq!(w.0, g.0, "{what}");
        let close = |a: f64, b: f64, t: f64| (a - b).abs() <= t * a.abs();
        assert!(
            close(w.1, g.1, tol.0) && close(w.2, g.2, tol.1),
            "{what} iteration {}: Megatron-LM logged loss {} grad norm {}, ours {} and {}",
            w.0,
            w.1,
            w.2,
            g.1,
            g.2
        );
    }
}

#[test]
fn a_megatron_lm_fp32_run_continues_with_the_losses_megatron_lm_logs() {
    // The non-distributed fp32 optimizer: Adam's moments under the weights' own keys, the
    // shared step in the common state; the schedule mid-warm-up-and-decay.
    follows_megatron_lm("gpt_adam", "world1", GPT, &[], FP32);
}

#[test]
fn without_its_optimizer_state_the_run_does_not_continue_megatron_lms_log() {
    // The check above can fail: the same weights with Adam restarted from zero state (as a
    // weights-only conversion would train) leave Megatron-LM's log at once.
    let want = megatron_lm_log("gpt_adam");
    let got = continued("gpt_adam", "no-optim", GPT, &["--no-load-optim"]);
    let (w, g) = (want[1].1, got[1].1);
    assert!(
        (w - g).abs() > 1e-3,
        "iteration 5 without the optimizer state: {g}, Megatron-LM's {w}"
    );
}

#[test]
fn a_distributed_optimizer_run_saved_at_tp2_dp2_continues_at_one_rank_and_at_tp2_pp2() {
    // The distributed optimizer's fully_reshardable form: main parameters, moments and each
    // group's step; a Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, untied output).
    follows_megatron_lm("llama_distopt_tp2_dp2", "world1", LLAMA, &[], FP32);
    follows_megatron_lm("llama_distopt_tp2_dp2", "tp2pp2", LLAMA, TP2_PP2, FP32);
}

#[test]
fn a_run_with_pipeline_stages_continues_with_the_losses_megatron_lm_logs() {
    // Saved from 2 pipeline stages, the tied embedding's last-stage copy among them.
    follows_megatron_lm("gpt_pp2", "world1", GPT, &[], FP32);
}

#[test]
fn a_bf16_run_continues_from_its_fp32_main_parameters_within_bf16_tolerance() {
    // bf16 weights, fp32 main parameters and moments.
    follows_megatron_lm("gpt_bf16_adam", "world1", GPT, &["--bf16"], BF16);
}

#[test]
fn an_fp16_run_continues_with_its_loss_scaler() {
    // fp16 weights, fp32 main parameters, and the dynamic loss scaler's scale and trackers.
    let small = [
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
    ];
    let fp16 = ["--fp16", "--initial-loss-scale", "128"];
    follows_megatron_lm("gpt_fp16_small", "world1", &small, &fp16, FP16);
}

/// Mixtral-style: 4 SwiGLU experts, top 2.
fn mixtral() -> Vec<&'static str> {
    let moe = [
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        "16",
    ];
    LLAMA.iter().chain(&moe).copied().collect()
}

#[test]
fn the_distributed_optimizers_bucket_form_continues_with_the_losses_megatron_lm_logs() {
    // dp_reshardable, the distributed optimizer's default: flat buckets whose chunks are found
    // by their main parameters. bf16 at TP 2 x DP 2 (a bucket per TP rank, of TP shards, the
    // norms the same on both); fp32 experts at EP 2 (a second, chained optimizer, a bucket
    // per expert-parallel rank).
    let name = "llama_bf16_distopt_dp_reshardable_tp2_dp2";
    follows_megatron_lm(name, "world1", LLAMA, &["--bf16"], BF16);
    follows_megatron_lm("mixtral_distopt_ep2", "world1", &mixtral(), &[], FP32);
}

#[test]
fn a_mixture_of_experts_run_continues_with_the_losses_megatron_lm_logs() {
    // The non-distributed optimizer: the experts' moments under their stacked keys
    // (layer, expert leading), the router's too.
    follows_megatron_lm("mixtral_adam", "world1", &mixtral(), &[], FP32);
}

/// Every tensor of a checkpoint by name (weights and optimizer state).
fn all_tensors(save: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    megatron_training::checkpointing::load_checkpoint(save, None)
        .unwrap()
        .tensors
        .into_iter()
        .collect()
}

#[test]
fn an_export_carries_the_run_so_megatron_lms_form_reads_back_bit_for_bit() {
    // Megatron-LM's run, converted, exported (bench/megatron_resume_export_check.py has
    // Megatron-LM itself load such exports and go on with our losses), converted again: the
    // weights, moments, main parameters, step, schedule and position are the same.
    // An MoE run's state in both shapes: the experts in the one optimizer (EP 1) and in a
    // chained second one (EP 2).
    let ep = |n| OptimizerExport::IfSaved {
        expert_model_parallel_size: n,
    };
    for (name, optim) in [
        ("gpt_adam", ep(1)),
        ("llama_distopt_tp2_dp2", ep(1)),
        ("gpt_bf16_adam", ep(1)),
        ("gpt_fp16_small", ep(1)),
        ("mixtral_distopt_ep2", ep(1)),
        ("mixtral_distopt_ep2", ep(2)),
    ] {
        let dir = tmpdir(&format!("mlm-resume-export-{name}"));
        let (first, export, back) = (dir.join("first"), dir.join("export"), dir.join("back"));
        torch_dist_to_megatron(&fixture(name), &first).unwrap();
        let written = megatron_to_torch_dist(&first, &export, optim).unwrap();
        // Megatron-LM loads optimizer state from an iteration's directory, not a release.
        assert!(written.ends_with("iter_0000003"), "{}", written.display());
        let tracker = export.join("latest_checkpointed_iteration.txt");
        assert_eq!(std::fs::read_to_string(tracker).unwrap(), "3");
        torch_dist_to_megatron(&export, &back).unwrap();
        let (a, b) = (all_tensors(&first), all_tensors(&back));
        assert!(
            a.keys().any(|k| k.starts_with("optimizer.exp_avg_sq.")),
            "{name}"
        );
        assert_eq!(a, b, "{name}");
        let meta = |s: &Path| load_checkpoint(s, None).unwrap().meta;
        let (ma, mb) = (meta(&first), meta(&back));
        assert_eq!(
            (
                ma.iteration,
                ma.consumed_train_samples,
                ma.optimizer_step,
                ma.seed
            ),
            (
                mb.iteration,
                mb.consumed_train_samples,
                mb.optimizer_step,
                mb.seed
            ),
            "{name}"
        );
        assert_eq!(ma.scheduler, mb.scheduler, "{name}");
        assert_eq!(ma.grad_scaler, mb.grad_scaler, "{name}");
        assert_eq!(
            (ma.adam_beta1, ma.adam_beta2, ma.adam_eps, ma.weight_decay),
            (mb.adam_beta1, mb.adam_beta2, mb.adam_eps, mb.weight_decay),
            "{name}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn an_export_without_the_optimizer_is_a_release_checkpoint_of_the_weights() {
    let dir = tmpdir("mlm-resume-export-weights");
    let (first, export, back) = (dir.join("first"), dir.join("export"), dir.join("back"));
    torch_dist_to_megatron(&fixture("gpt_adam"), &first).unwrap();
    let written = megatron_to_torch_dist(&first, &export, OptimizerExport::WeightsOnly).unwrap();
    assert!(written.ends_with("release"), "{}", written.display());
    torch_dist_to_megatron(&export, &back).unwrap();
    let b = all_tensors(&back);
    assert!(
        b.keys().all(|k| !k.starts_with("optimizer.")),
        "{:?}",
        b.keys()
    );
    assert_eq!(load_checkpoint(&back, None).unwrap().meta.iteration, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_run_trained_here_goes_on_the_same_after_a_round_trip_through_megatron_lms_form() {
    // Ours, saved at iteration 3, exported and converted back, goes on to iteration 6 with
    // the losses it has going on from its own checkpoint.
    let dir = tmpdir("mlm-resume-ours");
    let (save, export, back) = (dir.join("save"), dir.join("export"), dir.join("back"));
    let run = |load: &Path, extra: &[&str]| train(&dir, load, LLAMA, extra);
    let s = save.to_str().unwrap();
    run(
        &save,
        &["--save", s, "--save-interval", "3", "--exit-interval", "3"],
    );
    megatron_to_torch_dist(&save, &export, OptimizerExport::default()).unwrap();
    torch_dist_to_megatron(&export, &back).unwrap();
    let want = run(&save, &[]);
    let got = run(&back, &[]);
    assert_eq!(want.start_iteration, 3);
    assert_eq!(want.losses, got.losses);
    assert_eq!(want.grad_norms, got.grad_norms);
    let _ = std::fs::remove_dir_all(&dir);
}
