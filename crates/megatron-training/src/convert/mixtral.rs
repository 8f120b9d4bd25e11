//! `MixtralForCausalLM` <-> megatron-core's MoE decoder: the Llama attention and norms
//! (`llama.rs`), and in every layer a router (`block_sparse_moe.gate`, softmax, top-k
//! renormalized: megatron-core's softmax router without `--moe-router-pre-softmax`) and
//! experts whose `w1`/`w3`/`w2` are the gate, up and down projections (fc1 = `[w1; w3]`).

use super::llama::{mlp_to_hf, mlp_to_megatron, move_tensor, num, MlpMapping};
use super::Tensors;
use megatron_core::transformer::config::MoEConfig;
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) struct MixtralMoe;

/// Mixtral's expert projections: `w1` gate, `w3` up, `w2` down.
const W1_W3_W2: [&str; 3] = ["w1", "w3", "w2"];

/// A Hugging Face MoE block's router (`{s}.gate`) and experts (`{s}.experts.N`, projections
/// `names`) into megatron-core's under `d` (`router`, `experts.local_experts.N`).
pub(crate) fn routed_to_megatron(
    cfg: &TransformerConfig,
    t: &mut Tensors,
    m: &mut Tensors,
    (s, d): (&str, &str),
    names: [&str; 3],
) -> Result<(), String> {
    let moe = cfg.moe.as_ref().expect("configured");
    let (h, e) = (cfg.hidden_size, moe.num_experts);
    let r = (format!("{s}.gate.weight"), format!("{d}.router.weight"));
    move_tensor(t, m, (&r.0, &r.1), [e, h])?;
    for x in 0..e {
        let (a, b) = (
            format!("{s}.experts.{x}"),
            format!("{d}.experts.local_experts.{x}"),
        );
        mlp_to_megatron(t, m, (&a, &b), (h, moe.ffn_hidden_size), names)?;
    }
    Ok(())
}

/// The inverse of [`routed_to_megatron`]: megatron-core prefix `s`, Hugging Face prefix `d`.
pub(crate) fn routed_to_hf(
    cfg: &TransformerConfig,
    m: &mut Tensors,
    t: &mut Tensors,
    (s, d): (&str, &str),
    names: [&str; 3],
) -> Result<(), String> {
    let moe = cfg.moe.as_ref().expect("an MoE model");
    let (h, e) = (cfg.hidden_size, moe.num_experts);
    let r = (format!("{s}.router.weight"), format!("{d}.gate.weight"));
    move_tensor(m, t, (&r.0, &r.1), [e, h])?;
    for x in 0..e {
        let (a, b) = (
            format!("{s}.experts.local_experts.{x}"),
            format!("{d}.experts.{x}"),
        );
        mlp_to_hf(m, t, (&a, &b), (h, moe.ffn_hidden_size), names)?;
    }
    Ok(())
}

/// The MoE settings shared by the converted families: dropless, every layer, no auxiliary
/// losses unless the checkpoint asks to train with them.
pub(crate) fn moe_config(
    hf: &Value,
    experts: usize,
    ffn: usize,
    pre_softmax: bool,
) -> Result<MoEConfig, String> {
    let topk = num(hf, "num_experts_per_tok")?;
    let aux = if hf["output_router_logits"].as_bool() == Some(true) {
        hf["router_aux_loss_coef"].as_f64().unwrap_or(0.0) as f32
    } else {
        0.0
    };
    Ok(MoEConfig {
        pre_softmax,
        aux_loss_coeff: aux,
        ..MoEConfig::new(experts, ffn, topk)
    })
}

impl MlpMapping for MixtralMoe {
    fn configure(&self, hf: &Value, cfg: &mut TransformerConfig) -> Result<(), String> {
        let experts = num(hf, "num_local_experts")?;
        cfg.moe = Some(moe_config(hf, experts, cfg.ffn_hidden_size, false)?);
        Ok(())
    }

    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        m: &mut Tensors,
        src: &str,
        dst: &str,
    ) -> Result<(), String> {
        let hf = format!("{src}.block_sparse_moe");
        routed_to_megatron(cfg, t, m, (&hf, &format!("{dst}.mlp")), W1_W3_W2)
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        t: &mut Tensors,
        dst: &str,
        src: &str,
    ) -> Result<(), String> {
        let hf = format!("{dst}.block_sparse_moe");
        routed_to_hf(cfg, m, t, (&format!("{src}.mlp"), &hf), W1_W3_W2)
    }

    fn hf_config(
        &self,
        cfg: &TransformerConfig,
        _qkv_bias: bool,
    ) -> (&'static str, &'static str, Value) {
        let moe = cfg.moe.as_ref().expect("an MoE model");
        (
            "MixtralForCausalLM",
            "mixtral",
            json!({
                "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.topk,
                "intermediate_size": moe.ffn_hidden_size,
                "output_router_logits": false,
                "router_aux_loss_coef": moe.aux_loss_coeff,
                "sliding_window": null,
            }),
        )
    }
}
