//! `megatron convert` of DeepSeek-V3 (`DeepseekV3ForCausalLM`: multi-latent attention, DeepSeek's
//! MoE) against transformers' logits (`bench/make_hf_deepseek_fixtures.py`), and back byte for
//! byte; the converted model trains in every layout like one rank.

mod common;

use common::hf_fixtures::*;
use common::tmpdir;
use megatron_training::checkpointing::load_checkpoint;
use megatron_training::convert::hf_to_megatron;

#[test]
fn deepseek_v3_with_query_latent_and_moe_converts_to_transformers_logits_and_back() {
    check("deepseek_v3");
    let (cfg, back) = converted_and_exported("deepseek_v3");
    let moe = cfg.moe.as_ref().expect("DeepSeek's MoE read");
    assert_eq!(moe.router_groups, Some((2, 1)));
    assert_eq!(moe.topk_scaling_factor, Some(2.5));
    assert_eq!(moe.shared_expert_ffn, Some(16));
    assert!(!cfg.is_moe_layer(0) && cfg.is_moe_layer(1));
    assert_eq!(cfg.mla.unwrap().q_lora_rank, Some(16));
    for (k, v) in [
        ("first_k_dense_replace", 1),
        ("n_group", 2),
        ("topk_group", 1),
        ("n_shared_experts", 1),
        ("n_routed_experts", 4),
    ] {
        assert_eq!(back[k], v, "{k}");
    }
    assert_eq!(back["routed_scaling_factor"], 2.5);
}

#[test]
fn deepseek_v3_without_query_latent_and_with_yarn_converts_to_transformers_logits_and_back() {
    // DeepSeek-V2-Lite's q_proj; YaRN's mscale_all_dim on the softmax scale.
    check("deepseek_v3_yarn");
    let (cfg, back) = converted_and_exported("deepseek_v3_yarn");
    assert_eq!(cfg.mla.unwrap().q_lora_rank, None);
    assert!(cfg.moe.is_none());
    assert_eq!(cfg.rotary.yarn.unwrap().mscale_all_dim, 1.0);
    assert_eq!(back["rope_parameters"]["rope_type"], "yarn");
    assert_eq!(back["first_k_dense_replace"], 2);
}

#[test]
fn a_converted_deepseek_v3_trains_at_tensor_expert_and_pipeline_layouts_like_one_rank() {
    let dir = tmpdir("convert-deepseek-train");
    let save = dir.join("m");
    hf_to_megatron(&fixture("deepseek_v3"), &save, 128).unwrap();
    let s = save.to_str().unwrap();
    let serial = train_converted(s, &[]);
    for layout in [
        &[
            "--nproc-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ][..],
        &["--nproc-per-node", "2", "--expert-model-parallel-size", "2"][..],
        &[
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ][..],
    ] {
        let run = train_converted(s, layout);
        for (a, b) in serial.losses.iter().zip(&run.losses) {
            assert!(
                (a.1 - b.1).abs() <= 1e-5 * a.1.abs(),
                "{layout:?}: {a:?} vs {b:?}"
            );
        }
    }
    let ck = load_checkpoint(&save, None).unwrap();
    assert!(ck.meta.model.mla.is_some());
    let text = megatron_training::checkpoint_tool::inspect(&save).unwrap();
    assert!(
        text.contains("multi-latent attention: queries latent 16, keys/values latent 12, query/key heads 8 + 4 rotary, value heads 6"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn deepseek_v3_mtp_layer_converts_as_an_mtp_depth_and_back_byte_for_byte() {
    // DeepSeek's release format: the MTP module as layer num_hidden_layers (Megatron-Bridge's
    // names), its embed_tokens / shared_head.head copies of the model's. transformers drops it:
    // the logits are still its, and the depth trains with the model.
    check("deepseek_v3_mtp");
    let (cfg, back) = converted_and_exported("deepseek_v3_mtp");
    assert_eq!(cfg.mtp.map(|m| m.num_layers), Some(1));
    assert_eq!(back["num_nextn_predict_layers"], 1);
    let dir = tmpdir("convert-deepseek-mtp-train");
    let save = dir.join("m");
    hf_to_megatron(&fixture("deepseek_v3_mtp"), &save, 128).unwrap();
    let ck = load_checkpoint(&save, None).unwrap();
    for n in [
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.final_layernorm.weight",
        "mtp.layers.0.mtp_model_layer.self_attention.linear_kv_down_proj.weight",
        "mtp.layers.0.mtp_model_layer.mlp.router.expert_bias",
    ] {
        assert!(ck.tensors.contains_key(n), "{n}");
    }
    let text = megatron_training::checkpoint_tool::inspect(&save).unwrap();
    assert!(
        text.contains("multi-token prediction: 1 depth(s), loss weight 0.1"),
        "{text}"
    );
    let s = save.to_str().unwrap();
    let serial = train_converted(s, &[]);
    let tp2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"];
    let run = train_converted(s, &tp2);
    for (a, b) in serial.losses.iter().zip(&run.losses) {
        assert!((a.1 - b.1).abs() <= 1e-5 * a.1.abs(), "{a:?} vs {b:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn deepseek_v3_mtp_layers_beyond_num_nextn_predict_layers_are_dropped_as_transformers_drops_them() {
    let dir = tmpdir("convert-deepseek-mtp-drop");
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for f in ["model.safetensors", "reference.safetensors"] {
        std::fs::copy(fixture("deepseek_v3_mtp").join(f), hf.join(f)).unwrap();
    }
    let text = std::fs::read_to_string(fixture("deepseek_v3_mtp").join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config["num_nextn_predict_layers"] = 0.into();
    std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
    let save = dir.join("m");
    hf_to_megatron(&hf, &save, 128).unwrap();
    let ck = load_checkpoint(&save, None).unwrap();
    assert!(ck.meta.model.mtp.is_none());
    assert!(!ck.tensors.keys().any(|k| k.starts_with("mtp.")));
    let diff = max_logit_difference(&save, &hf.join("reference.safetensors"), "logits");
    assert!(diff <= 1e-4, "{diff}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn deepseek_v2_with_its_softmax_group_limited_router_converts_to_transformers_logits_and_back() {
    // V2-Lite's form: q_proj, a softmax router whose top-k are not renormalized
    // (--moe-router-pre-softmax), scaled. Its groups (2 of 4, each scored by its best expert)
    // convert only with --moe-router-group-topk equal to --moe-router-topk, where the limit
    // picks what plain top-k picks on both sides; DeepSeek-V2's 3-of-8 for top-6 is refused.
    check("deepseek_v2");
    let (cfg, back) = converted_and_exported("deepseek_v2");
    let moe = cfg.moe.as_ref().expect("experts");
    assert!(moe.pre_softmax && moe.expert_bias_update_rate.is_none());
    assert_eq!(moe.router_groups, Some((4, 2)));
    assert_eq!(moe.topk_scaling_factor, Some(1.5));
    assert_eq!(back["architectures"][0], "DeepseekV2ForCausalLM");
    assert_eq!(back["topk_method"], "group_limited_greedy");
    let dir = tmpdir("convert-deepseek-v2-groups");
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::copy(
        fixture("deepseek_v2").join("model.safetensors"),
        hf.join("model.safetensors"),
    )
    .unwrap();
    let text = std::fs::read_to_string(fixture("deepseek_v2").join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config["topk_group"] = 1.into();
    std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
    let err = hf_to_megatron(&hf, &dir.join("m"), 128)
        .unwrap_err()
        .to_string();
    assert!(err.contains("group_limited_greedy"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
