//! `Qwen2MoeForCausalLM` <-> megatron-core's MoE decoder: the Llama attention with q/k/v
//! biases (`llama.rs`); in every layer a softmax router (`mlp.gate`; `norm_topk_prob: false`
//! keeps the softmax over all experts, megatron-core's `--moe-router-pre-softmax`), experts with
//! `gate_proj`/`up_proj`/`down_proj`, and a shared expert scaled by a sigmoid gate
//! (`shared_expert_gate`: megatron-core's `--moe-shared-expert-gate`).

use super::llama::{fuse_gate_up, MlpMapping};
use super::mixtral::moe_config;
use super::{take, Tensors};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) struct Qwen2Moe;

fn count(hf: &Value, key: &str) -> Result<usize, String> {
    hf[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| format!("config.json has no {key}"))
}

/// `gate_proj`/`up_proj`/`down_proj` under `s` into fc1/fc2 under `d`.
fn mlp_in(
    t: &mut Tensors,
    m: &mut Tensors,
    s: &str,
    d: &str,
    h: usize,
    f: usize,
) -> Result<(), String> {
    let fc1 = fuse_gate_up(
        take(t, &format!("{s}.gate_proj.weight"), &[f, h])?,
        take(t, &format!("{s}.up_proj.weight"), &[f, h])?,
    );
    m.insert(format!("{d}.linear_fc1.weight"), (vec![2 * f, h], fc1));
    let down = take(t, &format!("{s}.down_proj.weight"), &[h, f])?;
    m.insert(format!("{d}.linear_fc2.weight"), (vec![h, f], down));
    Ok(())
}

fn mlp_out(
    m: &mut Tensors,
    t: &mut Tensors,
    d: &str,
    s: &str,
    h: usize,
    f: usize,
) -> Result<(), String> {
    let fc1 = take(m, &format!("{s}.linear_fc1.weight"), &[2 * f, h])?;
    t.insert(
        format!("{d}.gate_proj.weight"),
        (vec![f, h], fc1[..f * h].to_vec()),
    );
    t.insert(
        format!("{d}.up_proj.weight"),
        (vec![f, h], fc1[f * h..].to_vec()),
    );
    let down = take(m, &format!("{s}.linear_fc2.weight"), &[h, f])?;
    t.insert(format!("{d}.down_proj.weight"), (vec![h, f], down));
    Ok(())
}

impl MlpMapping for Qwen2Moe {
    fn configure(&self, hf: &Value, cfg: &mut TransformerConfig) -> Result<(), String> {
        if hf["decoder_sparse_step"].as_u64().unwrap_or(1) != 1
            || hf["mlp_only_layers"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
        {
            return Err("Qwen2-MoE with dense layers (decoder_sparse_step > 1 or mlp_only_layers) is not built: every layer must be an MoE layer".into());
        }
        let experts = count(hf, "num_experts")?;
        let ffn = count(hf, "moe_intermediate_size")?;
        let norm = hf["norm_topk_prob"].as_bool().unwrap_or(false);
        let mut moe = moe_config(hf, experts, ffn, !norm)?;
        let shared = hf["shared_expert_intermediate_size"].as_u64().unwrap_or(0) as usize;
        if shared > 0 {
            moe.shared_expert_ffn = Some(shared);
            moe.shared_expert_gate = true;
        }
        cfg.moe = Some(moe);
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
        let router = take(t, &format!("{src}.mlp.gate.weight"), &[e, h])?;
        m.insert(format!("{dst}.mlp.router.weight"), (vec![e, h], router));
        for x in 0..e {
            let s = format!("{src}.mlp.experts.{x}");
            let d = format!("{dst}.mlp.experts.local_experts.{x}");
            mlp_in(t, m, &s, &d, h, f)?;
        }
        if let Some(sf) = moe.shared_expert_ffn {
            let d = format!("{dst}.mlp.shared_experts");
            mlp_in(t, m, &format!("{src}.mlp.shared_expert"), &d, h, sf)?;
            let g = take(t, &format!("{src}.mlp.shared_expert_gate.weight"), &[1, h])?;
            m.insert(format!("{d}.gate_weight"), (vec![1, h], g));
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
        t.insert(format!("{dst}.mlp.gate.weight"), (vec![e, h], router));
        for x in 0..e {
            let s = format!("{src}.mlp.experts.local_experts.{x}");
            mlp_out(m, t, &format!("{dst}.mlp.experts.{x}"), &s, h, f)?;
        }
        if let Some(sf) = moe.shared_expert_ffn {
            let s = format!("{src}.mlp.shared_experts");
            mlp_out(m, t, &format!("{dst}.mlp.shared_expert"), &s, h, sf)?;
            let g = take(m, &format!("{s}.gate_weight"), &[1, h])?;
            t.insert(
                format!("{dst}.mlp.shared_expert_gate.weight"),
                (vec![1, h], g),
            );
        }
        Ok(())
    }

    fn hf_config(
        &self,
        cfg: &TransformerConfig,
        qkv_bias: bool,
    ) -> (&'static str, &'static str, Value) {
        let moe = cfg.moe.as_ref().expect("an MoE model");
        (
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            json!({
                "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.topk,
                "moe_intermediate_size": moe.ffn_hidden_size,
                "shared_expert_intermediate_size": moe.shared_expert_ffn.unwrap_or(0),
                "norm_topk_prob": !moe.pre_softmax,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "qkv_bias": qkv_bias,
                "use_sliding_window": false,
                "output_router_logits": false,
                "router_aux_loss_coef": moe.aux_loss_coeff,
            }),
        )
    }
}
