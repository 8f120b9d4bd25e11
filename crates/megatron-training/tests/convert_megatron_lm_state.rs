//! A Megatron-LM run continued here: runs that Megatron-LM's own training code stopped at
//! iteration 3 and saved with `save_checkpoint` (`bench/make_megatron_optim_fixtures.py`:
//! its model, DDP, optimizer, scheduler and schedules on CPU ranks, its GPTDataset over a
//! committed `.bin/.idx`), converted with their optimizer state and trained on by `megatron
//! train --load` with the run's own flags, must log the losses and gradient norms Megatron-LM
//! logged for iterations 4-6 when it simply went on.

mod common;

use common::megatron_resume::*;
use common::{tmpdir, TP2_PP2};
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::convert::{megatron_to_torch_dist, torch_dist_to_megatron, OptimizerExport};
use std::path::Path;

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

#[test]
fn an_export_carries_the_run_so_megatron_lms_form_reads_back_bit_for_bit() {
    // Megatron-LM's run, converted, exported (bench/megatron_resume_export_check.py has
    // Megatron-LM itself load such exports and go on with our losses), converted again: the
    // weights, moments, main parameters, step, schedule and position are the same.
    // An MoE run's state in both shapes: the experts in the one optimizer (EP 1) and in a
    // chained second one (EP 2). The distributed optimizer's form, and the non-distributed
    // one's (bench/megatron_upgrade_check.py: Megatron-LM's non-distributed optimizer goes on
    // from it at another layout).
    use megatron_training::convert::OptimizerForm::{Distributed, NonDistributed};
    let ep = |n, form| OptimizerExport::IfSaved {
        expert_model_parallel_size: n,
        form,
    };
    for (name, optim) in [
        ("gpt_adam", ep(1, Distributed)),
        ("llama_distopt_tp2_dp2", ep(1, Distributed)),
        ("gpt_bf16_adam", ep(1, Distributed)),
        ("gpt_fp16_small", ep(1, Distributed)),
        ("mixtral_distopt_ep2", ep(1, Distributed)),
        ("mixtral_distopt_ep2", ep(2, Distributed)),
        ("mla_distopt_dp2", ep(1, Distributed)),
        ("llama_mtp", ep(1, Distributed)),
        ("deepseek_mla_moe_mtp", ep(2, Distributed)),
        ("gpt_adam", ep(1, NonDistributed)),
        ("gpt_bf16_adam", ep(1, NonDistributed)),
        ("gpt_fp16_small", ep(1, NonDistributed)),
        ("mixtral_adam", ep(1, NonDistributed)),
        ("mixtral_adam", ep(2, NonDistributed)),
        ("gpt_oss_adam", ep(1, NonDistributed)),
        ("gpt_oss_adam", ep(2, NonDistributed)),
        ("gpt_oss_distopt_ep2", ep(2, Distributed)),
    ] {
        let dir = tmpdir(&format!("mlm-resume-export-{name}"));
        let (first, export, back) = (dir.join("first"), dir.join("export"), dir.join("back"));
        torch_dist_to_megatron(&fixture(name), &first).unwrap();
        let written = megatron_to_torch_dist(
            &first,
            &export,
            optim,
            megatron_training::convert::LayerSpec::default(),
        )
        .unwrap();
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
        assert_eq!(ma.model, mb.model, "{name}");
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
    let written = megatron_to_torch_dist(
        &first,
        &export,
        OptimizerExport::WeightsOnly,
        megatron_training::convert::LayerSpec::default(),
    )
    .unwrap();
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
    megatron_to_torch_dist(
        &save,
        &export,
        OptimizerExport::default(),
        megatron_training::convert::LayerSpec::default(),
    )
    .unwrap();
    torch_dist_to_megatron(&export, &back).unwrap();
    let want = run(&save, &[]);
    let got = run(&back, &[]);
    assert_eq!(want.start_iteration, 3);
    assert_eq!(want.losses, got.losses);
    assert_eq!(want.grad_norms, got.grad_norms);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_megatron_core_0_12_distributed_optimizer_run_continues_from_its_flattened_shards() {
    // megatron-core 0.9-0.12 saved the distributed optimizer's state as
    // fully_sharded_model_space by default (--ckpt-fully-parallel-save): each TP shard
    // flattened under a grid-shaped key, cut along the flat axis between DP ranks. Saved by
    // Megatron-LM core_v0.12.0's own training code (bench/make_megatron_v012_optim_fixtures.py).
    follows_megatron_lm("v012_llama_distopt_tp2_dp2", "world1", LLAMA, &[], FP32);
    follows_megatron_lm("v012_gpt_distopt_pp2_dp2", "world1", GPT, &[], FP32);
    follows_megatron_lm("v012_gpt_distopt_pp2_dp2", "tp2pp2", GPT, TP2_PP2, FP32);
    follows_megatron_lm(
        "v012_gpt_bf16_distopt_dp2",
        "world1",
        GPT,
        &["--bf16"],
        BF16,
    );
}

#[test]
fn the_distributed_optimizers_gathered_form_continues_with_the_losses_megatron_lm_logs() {
    // dp_zero_gather_scatter (megatron-core 0.7-0.12 with parallel save off): each TP/PP
    // domain's buffers gathered to DP rank 0 in one object, parameters found by value. fp32 at
    // TP 2 x DP 2 (norms the same on both TP ranks), bf16 at PP 2 x DP 2 and TP 2 x DP 2, experts at EP 2 in a
    // chained optimizer.
    follows_megatron_lm("dpzero_llama_tp2_dp2", "world1", LLAMA, &[], FP32);
    follows_megatron_lm("dpzero_gpt_bf16_pp2_dp2", "world1", GPT, &["--bf16"], BF16);
    // bf16 norms rounding alike, the same on both TP ranks.
    let name = "dpzero_llama_bf16_tp2_dp2";
    follows_megatron_lm(name, "world1", LLAMA, &["--bf16"], BF16);
    follows_megatron_lm("dpzero_mixtral_ep2", "world1", &mixtral(), &[], FP32);
}

/// The fixtures' multi-latent attention (after [`GPT`]'s sizes): latents with their norms,
/// YaRN.
const MLA: &[&str] = &[
    "--multi-latent-attention",
    "--q-lora-rank",
    "16",
    "--kv-lora-rank",
    "12",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "4",
    "--v-head-dim",
    "6",
    "--qk-layernorm",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--ffn-hidden-size",
    "48",
    "--position-embedding-type",
    "yarn",
    "--rotary-scaling-factor",
    "4",
    "--mscale",
    "0.7",
    "--mscale-all-dim",
    "0.5",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
];

#[test]
fn a_multi_latent_attention_run_continues_with_the_losses_megatron_lm_logs() {
    // Saved at DP 2 with the distributed optimizer (its bucket form: each parameter found by
    // value); continued at one rank and at TP 2 x PP 2.
    let mla = [GPT, MLA].concat();
    follows_megatron_lm("mla_distopt_dp2", "world1", &mla, &[], FP32);
    follows_megatron_lm("mla_distopt_dp2", "tp2pp2", &mla, TP2_PP2, FP32);
    // Megatron-LM's own spelling (the fixture script's): RoPE positions, and MLA's rotary
    // embedding YaRN by --rope-type, or by megatron-core's default without it.
    let rope = ["--position-embedding-type", "rope"];
    follows_megatron_lm(
        "mla_distopt_dp2",
        "rope-type",
        &mla,
        &[&rope[..], &["--rope-type", "yarn"]].concat(),
        FP32,
    );
    follows_megatron_lm("mla_distopt_dp2", "rope-default", &mla, &rope, FP32);
    // --rope-type rope is another model (no YaRN scaling): the checkpoint refuses it by name.
    let dir = tmpdir("mla-rope-plain");
    let save = dir.join("converted");
    convert(&fixture("mla_distopt_dp2"), &save).unwrap();
    let load = ["--load", save.to_str().unwrap()];
    let plain = [&rope[..], &["--rope-type", "rope"]].concat();
    let v = fixture_run(&dir, &[&load[..], &mla, &plain].concat());
    let e = megatron_training::pretrain(&common::parse_train(&v))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rotary.yarn"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn mla_down_projections_split_by_the_local_spec_bring_the_state_their_names_hold() {
    // At TP 2 megatron-core's local spec holds the down projections in row blocks, one per TP
    // rank: the bucket form, found by value as of that split, gives every tensor the run's
    // by-name form (--dist-ckpt-optim-fully-reshardable) holds, bit for bit.
    let dir = tmpdir("mla-local-split");
    let (buckets, names) = (dir.join("buckets"), dir.join("names"));
    convert(&fixture("mla_distopt_tp2_dp2"), &buckets).unwrap();
    let by_name = fixture("mla_distopt_tp2_dp2_fully_reshardable");
    convert(&by_name, &names).unwrap();
    let (a, b) = (all_tensors(&buckets), all_tensors(&names));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(a.len(), b.len());
    assert!(
        a.keys()
            .any(|k| k.contains("linear_kv_down_proj") && k.contains("exp_avg_sq")),
        "{:?}",
        a.keys().collect::<Vec<_>>()
    );
    for (k, v) in &a {
        assert!(b.get(k) == Some(v), "{k} differs between the two forms");
    }
}

#[test]
fn a_multi_token_prediction_run_continues_with_the_losses_megatron_lm_logs() {
    // One MTP depth (factor 0.3) on a Llama-style model: the depth's layer is read from
    // mtp.layers.0.transformer_layer.*, and its gradient is part of every logged grad norm.
    let mtp = [
        LLAMA,
        &["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"],
    ]
    .concat();
    follows_megatron_lm("llama_mtp", "world1", &mtp, &[], FP32);
    follows_megatron_lm("llama_mtp", "tp2pp2", &mtp, TP2_PP2, FP32);
}

#[test]
fn a_deepseek_v3_shaped_run_continues_with_the_losses_megatron_lm_logs() {
    // MLA, a dense first layer then MoE (a shared expert, a sigmoid router whose expert bias
    // Megatron-LM updates each step, top-k scaling 2.5), one MTP depth that is an MoE layer:
    // continued at one rank, at expert-parallel 2 and at TP 2 x PP 2.
    let deepseek = [
        "--moe-layer-freq",
        "[0,1]",
        "--moe-shared-expert-intermediate-size",
        "32",
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-topk-scaling-factor",
        "2.5",
        "--mtp-num-layers",
        "1",
    ];
    let model = [GPT, MLA, MOE, &deepseek[..]].concat();
    let name = "deepseek_mla_moe_mtp";
    follows_megatron_lm(name, "world1", &model, &[], FP32);
    let ep2 = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"];
    follows_megatron_lm(name, "ep2", &model, &ep2, FP32);
    follows_megatron_lm(
        name,
        "tp2pp2",
        &model,
        &[TP2_PP2, &["--sequence-parallel"]].concat(),
        FP32,
    );
}
