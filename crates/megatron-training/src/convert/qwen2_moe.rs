//! `Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM` (the same block without the shared expert,
//! with Qwen3's query/key norms) <-> megatron-core's MoE decoder: the Llama attention with q/k/v
//! biases (`llama.rs`); in each MoE layer a softmax router (`mlp.gate`; `norm_topk_prob: false`
//! keeps the softmax over all experts, megatron-core's `--moe-router-pre-softmax`), experts with
//! `gate_proj`/`up_proj`/`down_proj`, and a shared expert scaled by a sigmoid gate
//! (`shared_expert_gate`: megatron-core's `--moe-shared-expert-gate`). Layers left dense by
//! `decoder_sparse_step` or `mlp_only_layers` are `--moe-layer-freq`'s 0 entries: the plain
//! MLP, `intermediate_size` wide.

use super::llama::{mlp_to_hf, mlp_to_megatron, move_tensor, num, MlpMapping, GATE_UP_DOWN};
use super::mixtral::{moe_config, routed_to_hf, routed_to_megatron};
use super::Tensors;
use megatron_core::transformer::config::LayerPattern;
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) struct Qwen2Moe;

impl MlpMapping for Qwen2Moe {
    fn configure(&self, hf: &Value, cfg: &mut TransformerConfig) -> Result<(), String> {
        let layers = sparse_layers(hf, cfg.num_layers)?;
        // Hub configs say num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts.
        let experts = num(hf, "num_experts").or_else(|_| num(hf, "num_local_experts"))?;
        let ffn = num(hf, "moe_intermediate_size")?;
        let norm = hf["norm_topk_prob"].as_bool().unwrap_or(false);
        let mut moe = moe_config(hf, experts, ffn, !norm)?;
        let shared = hf["shared_expert_intermediate_size"].as_u64().unwrap_or(0) as usize;
        if shared > 0 {
            moe.shared_expert_ffn = Some(shared);
            moe.shared_expert_gate = true;
        }
        moe.layers = layers;
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
        let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
        routed_to_megatron(cfg, t, m, (&s, &d), GATE_UP_DOWN)?;
        let moe = cfg.moe.as_ref().expect("configured");
        if let Some(sf) = moe.shared_expert_ffn {
            let h = cfg.hidden_size;
            let (a, b) = (format!("{s}.shared_expert"), format!("{d}.shared_experts"));
            mlp_to_megatron(t, m, (&a, &b), (h, sf), GATE_UP_DOWN)?;
            let g = (
                format!("{s}.shared_expert_gate.weight"),
                format!("{b}.gate_weight"),
            );
            move_tensor(t, m, (&g.0, &g.1), [1, h])?;
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
        let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
        routed_to_hf(cfg, m, t, (&s, &d), GATE_UP_DOWN)?;
        let moe = cfg.moe.as_ref().expect("an MoE model");
        if let Some(sf) = moe.shared_expert_ffn {
            let h = cfg.hidden_size;
            let (a, b) = (format!("{s}.shared_experts"), format!("{d}.shared_expert"));
            mlp_to_hf(m, t, (&a, &b), (h, sf), GATE_UP_DOWN)?;
            let g = (
                format!("{a}.gate_weight"),
                format!("{d}.shared_expert_gate.weight"),
            );
            move_tensor(m, t, (&g.0, &g.1), [1, h])?;
        }
        Ok(())
    }

    fn hf_config(
        &self,
        cfg: &TransformerConfig,
        qkv_bias: bool,
    ) -> (&'static str, &'static str, Value) {
        let moe = cfg.moe.as_ref().expect("an MoE model");
        let mlp_only: Vec<usize> = (0..cfg.num_layers)
            .filter(|&l| !cfg.is_moe_layer(l))
            .collect();
        if cfg.qk_layernorm {
            // Qwen3-MoE: query/key norms, no shared expert, no QKV biases (checked by the caller).
            return (
                "Qwen3MoeForCausalLM",
                "qwen3_moe",
                json!({
                    "num_experts": moe.num_experts,
                    "num_experts_per_tok": moe.topk,
                    "moe_intermediate_size": moe.ffn_hidden_size,
                    "norm_topk_prob": !moe.pre_softmax,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": mlp_only,
                    "use_sliding_window": false,
                    "output_router_logits": false,
                    "router_aux_loss_coef": moe.aux_loss_coeff,
                }),
            );
        }
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
                "mlp_only_layers": mlp_only,
                "qkv_bias": qkv_bias,
                "use_sliding_window": false,
                "output_router_logits": false,
                "router_aux_loss_coef": moe.aux_loss_coeff,
            }),
        )
    }
}

/// Transformers' rule for a Qwen2-MoE layer `l`: sparse unless listed in `mlp_only_layers`,
/// and only when `(l + 1) % decoder_sparse_step == 0`.
fn sparse_layers(hf: &Value, layers: usize) -> Result<LayerPattern, String> {
    let step = hf["decoder_sparse_step"].as_u64().unwrap_or(1) as usize;
    if step == 0 {
        return Err("decoder_sparse_step must be positive, got 0".into());
    }
    let mut dense = Vec::new();
    for v in hf["mlp_only_layers"].as_array().into_iter().flatten() {
        match v.as_u64().map(|l| l as usize) {
            Some(l) if l < layers => dense.push(l),
            _ => {
                return Err(format!(
                    "mlp_only_layers: {v} is not a layer number below num_hidden_layers ({layers})"
                ))
            }
        }
    }
    let sparse: Vec<bool> = (0..layers)
        .map(|l| !dense.contains(&l) && (l + 1).is_multiple_of(step))
        .collect();
    Ok(if sparse.iter().all(|&s| s) {
        LayerPattern::Every(1)
    } else {
        LayerPattern::List(sparse)
    })
}
