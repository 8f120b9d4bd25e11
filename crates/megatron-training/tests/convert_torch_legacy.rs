//! `megatron convert --from torch` against the outside reference: checkpoints Megatron-LM's own
//! `save_checkpoint` wrote with `--ckpt-format torch` (`bench/make_megatron_legacy_fixtures.py`,
//! one file per model-parallel rank), converted, give the logits megatron-core computes from
//! the same weights.

mod common;

use common::hf_fixtures::{megatron_fixture as fixture, megatron_fixture_gives_reference_logits};
use common::tmpdir;
use megatron_training::convert::torch_to_megatron;

fn logits_match(name: &str) {
    megatron_fixture_gives_reference_logits(name, torch_to_megatron);
}

#[test]
fn a_llama_saved_at_tp2_pp2_with_interleaved_chunks_converts_to_megatron_cores_logits() {
    // Four rank files, each with two model chunks (model0, model1) of one layer: layers put in
    // Megatron's interleaved order, TP shards joined (SwiGLU's [gate_r; up_r] halves, GQA's
    // query groups, the padded vocabulary's rows).
    logits_match("legacy_llama_tp2_pp2_vp2");
}

#[test]
fn experts_saved_at_tp2_ep2_convert_to_megatron_cores_logits() {
    // mp_rank_TT_EEE: each expert-parallel rank's two local experts, split over TP as well.
    logits_match("legacy_mixtral_tp2_ep2");
}

#[test]
fn multi_latent_attention_with_an_mtp_depth_saved_at_tp2_converts_to_megatron_cores_logits() {
    // MLA (latents with their norms, YaRN) and one MTP depth (its layer under
    // mtp.layers.0.mtp_model_layer.*); the local spec's down projections split over the two
    // TP ranks' files, joined by rows.
    logits_match("legacy_mla_mtp_tp2");
}

#[test]
fn a_missing_rank_file_or_the_other_format_is_refused_by_name() {
    let dir = tmpdir("torch-legacy-damaged");
    let copy = dir.join("copy/iter_0000010");
    let src = fixture("legacy_mixtral_tp2_ep2").join("iter_0000010");
    for rank in ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000"] {
        std::fs::create_dir_all(copy.join(rank)).unwrap();
        std::fs::copy(
            src.join(rank).join("model_optim_rng.pt"),
            copy.join(rank).join("model_optim_rng.pt"),
        )
        .unwrap();
    }
    let e = torch_to_megatron(&copy, &dir.join("out"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor rank 1, pipeline rank 0, expert rank 1 is missing"),
        "{e}"
    );
    let e = torch_to_megatron(&fixture("gpt"), &dir.join("out"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--from torch_dist"), "{e}");
    assert!(!dir.join("out").exists());
    let _ = std::fs::remove_dir_all(dir);
}
