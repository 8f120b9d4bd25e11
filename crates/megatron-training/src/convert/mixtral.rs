//! `MixtralForCausalLM` <-> megatron-core's MoE decoder: the Llama attention and norms
//! (`llama.rs`), and in every layer a router (`block_sparse_moe.gate`, softmax, top-k
//! renormalized: megatron-core's softmax router without `--moe-router-pre-softmax`) and
//! experts whose `w1`/`w3`/`w2` are the gate, up and down projections (fc1 = `[w1; w3]`).

use super::llama::{fuse_gate_up, MlpMapping};
use super::{take, Tensors};
use megatron_core::transformer::config::{MoEConfig, RouterScore};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) struct MixtralMoe;

fn count(hf: &Value, key: &str) -> Result<usize, String> {
    hf[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| format!("config.json has no {key}"))
}

/// The MoE settings shared by the converted families: dropless, every layer, no auxiliary
/// losses unless the checkpoint asks to train with them.
pub(crate) fn moe_config(
    hf: &Value,
    experts: usize,
    ffn: usize,
    pre_softmax: bool,
) -> Result<MoEConfig, String> {
    let topk = count(hf, "num_experts_per_tok")?;
    let aux = if hf["output_router_logits"].as_bool() == Some(true) {
        hf["router_aux_loss_coef"].as_f64().unwrap_or(0.0) as f32
    } else {
        0.0
    };
    Ok(MoEConfig {
        num_experts: experts,
        ffn_hidden_size: ffn,
        topk,
        score: RouterScore::Softmax,
        pre_softmax,
        topk_scaling_factor: None,
        aux_loss_coeff: aux,
        z_loss_coeff: 0.0,
        layer_freq: 1,
        dispatcher: Default::default(),
        load_balancing: Default::default(),
        expert_bias_update_rate: None,
        capacity_factor: None,
        drop_policy: Default::default(),
        pad_to_capacity: false,
        shared_expert_ffn: None,
        shared_expert_gate: false,
        grouped_gemm: false,
    })
}

impl MlpMapping for MixtralMoe {
    fn configure(&self, hf: &Value, cfg: &mut TransformerConfig) -> Result<(), String> {
        let experts = count(hf, "num_local_experts")?;
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
        let moe = cfg.moe.as_ref().expect("configured");
        let (h, f, e) = (cfg.hidden_size, moe.ffn_hidden_size, moe.num_experts);
        let router = take(t, &format!("{src}.block_sparse_moe.gate.weight"), &[e, h])?;
        m.insert(format!("{dst}.mlp.router.weight"), (vec![e, h], router));
        for x in 0..e {
            let (s, d) = (
                format!("{src}.block_sparse_moe.experts.{x}"),
                format!("{dst}.mlp.experts.local_experts.{x}"),
            );
            let fc1 = fuse_gate_up(
                take(t, &format!("{s}.w1.weight"), &[f, h])?,
                take(t, &format!("{s}.w3.weight"), &[f, h])?,
            );
            m.insert(format!("{d}.linear_fc1.weight"), (vec![2 * f, h], fc1));
            let down = take(t, &format!("{s}.w2.weight"), &[h, f])?;
            m.insert(format!("{d}.linear_fc2.weight"), (vec![h, f], down));
        }
        Ok(())
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        t: &mut Tensors,
        dst: &str,
        src: &str,
    ) -> Result<(), String> {
        let moe = cfg.moe.as_ref().expect("an MoE model");
        let (h, f, e) = (cfg.hidden_size, moe.ffn_hidden_size, moe.num_experts);
        let router = take(m, &format!("{src}.mlp.router.weight"), &[e, h])?;
        t.insert(
            format!("{dst}.block_sparse_moe.gate.weight"),
            (vec![e, h], router),
        );
        for x in 0..e {
            let (d, s) = (
                format!("{dst}.block_sparse_moe.experts.{x}"),
                format!("{src}.mlp.experts.local_experts.{x}"),
            );
            let fc1 = take(m, &format!("{s}.linear_fc1.weight"), &[2 * f, h])?;
            t.insert(
                format!("{d}.w1.weight"),
                (vec![f, h], fc1[..f * h].to_vec()),
            );
            t.insert(
                format!("{d}.w3.weight"),
                (vec![f, h], fc1[f * h..].to_vec()),
            );
            let down = take(m, &format!("{s}.linear_fc2.weight"), &[h, f])?;
            t.insert(format!("{d}.w2.weight"), (vec![h, f], down));
        }
        Ok(())
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
