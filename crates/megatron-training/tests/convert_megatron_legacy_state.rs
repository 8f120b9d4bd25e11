//! A Megatron-LM run saved in the legacy `--ckpt-format torch` continued here: runs that
//! Megatron-LM's own training code stopped at iteration 3 and saved with `save_checkpoint`
//! (`bench/make_megatron_optim_fixtures.py`, the `legacy_*` runs), converted with their
//! optimizer state by `convert --from torch` and trained on with the run's own flags, must log
//! the losses and gradient norms Megatron-LM logged for iterations 4-6 when it simply went on.

mod common;

use common::megatron_resume::*;
use common::{tmpdir, TP2_PP2};
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::convert::{
    megatron_to_torch_dist, torch_dist_to_megatron, torch_to_megatron, OptimizerExport,
};

#[test]
fn a_legacy_bf16_run_saved_at_tp2_continues_from_its_fp32_main_parameters() {
    // The non-distributed mixed-precision optimizer: torch's Adam state by parameter index on
    // each tensor-parallel rank, the fp32 main copies by group (fp32_from_fp16_params), the
    // step per parameter.
    follows_megatron_lm("legacy_gpt_bf16_tp2", "world1", GPT, &["--bf16"], BF16);
}

#[test]
fn a_legacy_run_with_pipeline_stages_continues_with_the_losses_megatron_lm_logs() {
    // Each stage's own optimizer, the last stage's groups holding the tied output layer's copy
    // of the embedding; continued at TP 2 x PP 2.
    follows_megatron_lm("legacy_gpt_pp2", "world1", GPT, &[], FP32);
    follows_megatron_lm("legacy_gpt_pp2", "tp2pp2", GPT, TP2_PP2, FP32);
}

#[test]
fn a_legacy_mixture_of_experts_run_continues_with_the_losses_megatron_lm_logs() {
    // At expert-parallel size 1 the experts are in the dense groups.
    follows_megatron_lm("legacy_mixtral_adam", "world1", &mixtral(), &[], FP32);
}

#[test]
fn the_legacy_distributed_optimizers_gathered_buffers_continue_the_run() {
    // distrib_optim.pt: each model-parallel rank's buffers gathered over data-parallel ranks,
    // parameters found by their main values: fp32 at TP 2 x DP 2, bf16 at DP 2, and experts at
    // EP 2 (a chained expert optimizer, each expert-parallel rank's file its own experts).
    follows_megatron_lm("legacy_llama_distopt_tp2_dp2", "world1", LLAMA, &[], FP32);
    follows_megatron_lm(
        "legacy_llama_bf16_distopt_dp2",
        "world1",
        LLAMA,
        &["--bf16"],
        BF16,
    );
    follows_megatron_lm(
        "legacy_mixtral_distopt_ep2",
        "world1",
        &mixtral(),
        &[],
        FP32,
    );
}

#[test]
fn a_legacy_run_goes_back_to_megatron_lm_as_torch_dist_with_its_state() {
    // Legacy in, torch_dist out (what Megatron-LM itself reshards), read back: the same
    // weights, moments, main parameters and position.
    let dir = tmpdir("mlm-legacy-to-dist");
    let (first, export, back) = (dir.join("first"), dir.join("export"), dir.join("back"));
    convert(&fixture("legacy_gpt_bf16_tp2"), &first).unwrap();
    megatron_to_torch_dist(
        &first,
        &export,
        OptimizerExport::default(),
        megatron_training::convert::LayerSpec::default(),
    )
    .unwrap();
    torch_dist_to_megatron(&export, &back).unwrap();
    let (a, b) = (all_tensors(&first), all_tensors(&back));
    assert!(a.keys().any(|k| k.starts_with("optimizer.exp_avg.")));
    assert_eq!(a, b);
    let meta = |s: &std::path::Path| load_checkpoint(s, None).unwrap().meta;
    let (ma, mb) = (meta(&first), meta(&back));
    assert_eq!(
        (ma.iteration, ma.optimizer_step, ma.consumed_train_samples),
        (3, 3, 12)
    );
    assert_eq!(
        (ma.iteration, ma.optimizer_step, ma.consumed_train_samples),
        (mb.iteration, mb.optimizer_step, mb.consumed_train_samples)
    );
    assert_eq!(ma.scheduler, mb.scheduler);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_legacy_distributed_optimizer_run_missing_a_ranks_state_file_lands_as_weights_alone() {
    // Without one tensor-parallel rank's distrib_optim.pt the state cannot be put together:
    // the weights are converted, at iteration 0, with no optimizer state (and a warning).
    let dir = tmpdir("mlm-legacy-missing-optim");
    let input = dir.join("input");
    let src = fixture("legacy_llama_distopt_tp2_dp2");
    for rank in ["mp_rank_00", "mp_rank_01"] {
        let to = input.join("iter_0000003").join(rank);
        std::fs::create_dir_all(&to).unwrap();
        let from = src.join("iter_0000003").join(rank);
        std::fs::copy(
            from.join("model_optim_rng.pt"),
            to.join("model_optim_rng.pt"),
        )
        .unwrap();
        if rank == "mp_rank_00" {
            std::fs::copy(from.join("distrib_optim.pt"), to.join("distrib_optim.pt")).unwrap();
        }
    }
    std::fs::write(input.join("latest_checkpointed_iteration.txt"), "3").unwrap();
    let out = dir.join("out");
    torch_to_megatron(&input, &out).unwrap();
    let loaded = load_checkpoint(&out, None).unwrap();
    assert_eq!(loaded.meta.iteration, 0);
    assert!(loaded.tensors.keys().all(|k| !k.starts_with("optimizer.")));
    let _ = std::fs::remove_dir_all(&dir);
}
