//! `DeepseekV3ForCausalLM` (DeepSeek-V3 and the models saved in its format) <-> megatron-core's
//! decoder with multi-latent attention and DeepSeek's mixture of experts.
//!
//! Attention: `q_a_proj`/`q_a_layernorm`/`q_b_proj` (or `q_proj` without a query latent),
//! `kv_a_proj_with_mqa`/`kv_a_layernorm`/`kv_b_proj` and `o_proj` are megatron-core's
//! `linear_q_down_proj`/`q_layernorm`/`linear_q_up_proj` (`linear_q_proj`),
//! `linear_kv_down_proj`/`kv_layernorm`/`linear_kv_up_proj` and `linear_proj`, in the same
//! layouts (per head `[content | rotary]` rows; the rotary key last in the key/value latent).
//! transformers' `rope_interleave` (pairs `2i, 2i+1`) is what megatron-core's MLA always does.
//!
//! Feed-forward: the first `first_k_dense_replace` layers hold a SwiGLU MLP of
//! `intermediate_size`; the rest DeepSeek's MoE: a sigmoid router (`mlp.gate`) whose
//! `e_score_correction_bias` steers the top-k choice only (megatron-core's router expert bias),
//! group-limited to `topk_group` of `n_group` groups, the chosen scores renormalized and scaled
//! by `routed_scaling_factor`, plus `n_shared_experts` always-on experts as one shared MLP.

use super::llama::{
    ends_to_hf, ends_to_megatron, mlp_to_hf, mlp_to_megatron, num, rotary_from_hf, rotary_to_hf,
    GATE_UP_DOWN,
};
use super::mixtral::{routed_to_hf, routed_to_megatron};
use super::{take, HfFamily, Tensors};
use megatron_core::transformer::config::{
    Activation, LayerPattern, MLAConfig, MTPConfig, MoEConfig, Normalization,
    PositionEmbeddingType, RouterScore,
};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) const ARCHITECTURE: &str = "DeepseekV3ForCausalLM";
/// DeepSeek-V2 (and V2-Lite): the same attention and layers; a softmax router whose top-k
/// probabilities are not renormalized, no correction bias, no MTP.
pub(crate) const ARCHITECTURE_V2: &str = "DeepseekV2ForCausalLM";

/// Which of the two DeepSeek generations a checkpoint is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Generation {
    V2,
    V3,
}

impl Generation {
    fn architecture(self) -> &'static str {
        match self {
            Generation::V2 => ARCHITECTURE_V2,
            Generation::V3 => ARCHITECTURE,
        }
    }
}

/// transformers builds the latents' RMSNorms with this epsilon whatever `rms_norm_eps` says.
const LATENT_NORM_EPS: f32 = 1e-6;

/// Megatron's default `--mtp-loss-scaling-factor`, for a converted checkpoint's MTP depths.
const MTP_LOSS_SCALING_FACTOR: f32 = 0.1;

/// Megatron's default `--moe-router-bias-update-rate`: the converted router keeps DeepSeek's
/// correction bias as its expert bias, updated at this rate if the model is trained further.
const EXPERT_BIAS_UPDATE_RATE: f32 = 1e-3;

pub(crate) struct DeepseekV3 {
    pub generation: Generation,
    /// The multi-token-prediction depths the checkpoint holds (`model.layers.{N + k}.eh_proj`
    /// present), converted as `--mtp-num-layers`.
    pub mtp_depths: usize,
}

impl DeepseekV3 {
    /// The family for a checkpoint: its MTP depths are those `num_nextn_predict_layers` names
    /// that have their tensors (transformers' own saves drop them).
    pub(crate) fn reading(generation: Generation, hf: &Value, t: &Tensors) -> Self {
        let layers = hf["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
        let named = hf["num_nextn_predict_layers"].as_u64().unwrap_or(0) as usize;
        let mtp_depths = (0..named)
            .take_while(|k| t.contains_key(&format!("model.layers.{}.eh_proj.weight", layers + k)))
            .count();
        DeepseekV3 {
            generation,
            mtp_depths,
        }
    }

    /// The family that exports `cfg`: DeepSeek-V2's softmax router, else V3.
    pub(crate) fn exporting(cfg: &TransformerConfig) -> Self {
        let softmax = cfg
            .moe
            .as_ref()
            .is_some_and(|m| m.score == RouterScore::Softmax);
        DeepseekV3 {
            generation: if softmax {
                Generation::V2
            } else {
                Generation::V3
            },
            mtp_depths: cfg.mtp.map_or(0, |d| d.num_layers),
        }
    }
}

/// Each attention tensor: Hugging Face name, megatron-core name, shape.
fn attention_tensors(cfg: &TransformerConfig) -> Vec<(&'static str, &'static str, Vec<usize>)> {
    let m = cfg.mla.expect("an MLA model");
    let (h, a) = (cfg.hidden_size, cfg.num_attention_heads);
    let (qk, pe, v, kv) = (
        m.qk_head_dim,
        m.qk_pos_emb_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let mut t = match m.q_lora_rank {
        Some(r) => vec![
            ("q_a_proj.weight", "linear_q_down_proj.weight", vec![r, h]),
            ("q_a_layernorm.weight", "q_layernorm.weight", vec![r]),
            (
                "q_b_proj.weight",
                "linear_q_up_proj.weight",
                vec![a * (qk + pe), r],
            ),
        ],
        None => vec![(
            "q_proj.weight",
            "linear_q_proj.weight",
            vec![a * (qk + pe), h],
        )],
    };
    t.extend([
        (
            "kv_a_proj_with_mqa.weight",
            "linear_kv_down_proj.weight",
            vec![kv + pe, h],
        ),
        ("kv_a_layernorm.weight", "kv_layernorm.weight", vec![kv]),
        (
            "kv_b_proj.weight",
            "linear_kv_up_proj.weight",
            vec![a * (qk + v), kv],
        ),
        ("o_proj.weight", "linear_proj.weight", vec![h, a * v]),
    ]);
    t
}

/// The first MoE layer, if the MoE layers are all the layers from it on (DeepSeek's
/// `first_k_dense_replace`): `Ok(None)` for a dense model.
fn first_moe_layer(cfg: &TransformerConfig) -> Result<Option<usize>, String> {
    if cfg.moe.is_none() {
        return Ok(None);
    }
    let k = (0..cfg.num_layers)
        .find(|&l| cfg.is_moe_layer(l))
        .unwrap_or(cfg.num_layers);
    if (k..cfg.num_layers).all(|l| cfg.is_moe_layer(l)) {
        Ok(Some(k))
    } else {
        Err("--moe-layer-freq: DeepseekV3ForCausalLM's dense layers come first (first_k_dense_replace), then only MoE layers".into())
    }
}

/// DeepSeek-V2's router as megatron-core's: softmax over every expert, the top-k taken as
/// they are (`--moe-router-pre-softmax`; transformers' V2 router never renormalizes), groups
/// (`topk_method: group_limited_greedy`) scored by their best expert.
fn v2_router(hf: &Value, moe: &mut MoEConfig) -> Result<(), String> {
    moe.score = RouterScore::Softmax;
    moe.pre_softmax = true;
    moe.expert_bias_update_rate = None;
    moe.router_groups = match hf["topk_method"].as_str().unwrap_or("greedy") {
        "greedy" => None,
        "group_limited_greedy" => {
            let groups = num(hf, "n_group")?;
            let topk_group = num(hf, "topk_group")?;
            // transformers scores a group by its best expert; megatron-core by its best
            // topk / topk_group.
            if moe.topk != topk_group || !moe.num_experts.is_multiple_of(groups) {
                return Err(format!(
                    "group_limited_greedy with num_experts_per_tok {} and topk_group {topk_group}: transformers scores a group by its best expert, megatron-core by its best num_experts_per_tok / topk_group, so only equal values convert",
                    moe.topk
                ));
            }
            Some((groups, topk_group))
        }
        other => return Err(format!("topk_method '{other}' is not built")),
    };
    Ok(())
}

/// DeepSeek's MoE block as megatron-core's settings.
fn moe_from_hf(
    hf: &Value,
    layers: usize,
    generation: Generation,
) -> Result<Option<MoEConfig>, String> {
    let k = hf["first_k_dense_replace"].as_u64().unwrap_or(0) as usize;
    if k >= layers {
        return Ok(None);
    }
    let experts = num(hf, "n_routed_experts")?;
    let ffn = num(hf, "moe_intermediate_size")?;
    let topk = num(hf, "num_experts_per_tok")?;
    let shared = hf["n_shared_experts"].as_u64().unwrap_or(0) as usize;
    let scale = hf["routed_scaling_factor"].as_f64().unwrap_or(1.0) as f32;
    let aux = if hf["output_router_logits"].as_bool() == Some(true) {
        hf["router_aux_loss_coef"].as_f64().unwrap_or(0.0) as f32
    } else {
        0.0
    };
    let mut moe = MoEConfig {
        topk_scaling_factor: (scale != 1.0).then_some(scale),
        aux_loss_coeff: aux,
        layers: if k == 0 {
            LayerPattern::Every(1)
        } else {
            LayerPattern::List((0..layers).map(|l| l >= k).collect())
        },
        shared_expert_ffn: (shared > 0).then_some(shared * ffn),
        ..MoEConfig::new(experts, ffn, topk)
    };
    if generation == Generation::V2 {
        v2_router(hf, &mut moe)?;
        return Ok(Some(moe));
    }
    let norm = hf["norm_topk_prob"].as_bool().unwrap_or(true);
    // megatron-core renormalizes the chosen sigmoid scores whenever it picks more than one.
    if norm != (topk > 1) {
        return Err(format!(
            "norm_topk_prob {norm} with num_experts_per_tok {topk}: megatron-core's sigmoid router renormalizes the chosen scores exactly when it picks more than one"
        ));
    }
    let groups = hf["n_group"].as_u64().unwrap_or(1) as usize;
    let topk_group = hf["topk_group"].as_u64().unwrap_or(1) as usize;
    let router_groups = if groups > 1 {
        // transformers scores a group by its best two experts; megatron-core by its best
        // topk / topk_group.
        if topk_group == 0 || topk / topk_group != 2 || !experts.is_multiple_of(groups) {
            return Err(format!(
                "n_group {groups}, topk_group {topk_group}, num_experts_per_tok {topk}: transformers scores a group by its best 2 experts, megatron-core by its best num_experts_per_tok / topk_group, so only topk / topk_group = 2 converts"
            ));
        }
        Some((groups, topk_group))
    } else {
        None
    };
    Ok(Some(MoEConfig {
        score: RouterScore::Sigmoid,
        expert_bias_update_rate: Some(EXPERT_BIAS_UPDATE_RATE),
        router_groups,
        ..moe
    }))
}

/// Decoder layer `l`'s tensors (or a multi-token-prediction depth's layer, numbered after the
/// decoder's) from Hugging Face prefix `src` to megatron-core prefix `dst`.
fn layer_to_megatron(
    cfg: &TransformerConfig,
    t: &mut Tensors,
    m: &mut Tensors,
    l: usize,
    (src, dst): (&str, &str),
) -> Result<(), String> {
    let h = cfg.hidden_size;
    for (a, b) in [
        ("input_layernorm", "input_layernorm"),
        ("post_attention_layernorm", "pre_mlp_layernorm"),
    ] {
        let w = take(t, &format!("{src}.{a}.weight"), &[h])?;
        m.insert(format!("{dst}.{b}.weight"), (vec![h], w));
    }
    for (a, b, shape) in attention_tensors(cfg) {
        let w = take(t, &format!("{src}.self_attn.{a}"), &shape)?;
        m.insert(format!("{dst}.self_attention.{b}"), (shape, w));
    }
    let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
    match &cfg.moe {
        Some(moe) if cfg.is_moe_layer(l) => {
            routed_to_megatron(cfg, t, m, (&s, &d), GATE_UP_DOWN)?;
            let e = moe.num_experts;
            if moe.score == RouterScore::Sigmoid {
                let b = take(t, &format!("{s}.gate.e_score_correction_bias"), &[e])?;
                m.insert(format!("{d}.router.expert_bias"), (vec![e], b));
            }
            if let Some(sf) = moe.shared_expert_ffn {
                let (a, b) = (format!("{s}.shared_experts"), format!("{d}.shared_experts"));
                mlp_to_megatron(t, m, (&a, &b), (h, sf), GATE_UP_DOWN)?;
            }
        }
        _ => {
            let f = (h, cfg.ffn_hidden_size);
            mlp_to_megatron(t, m, (&s, &d), f, GATE_UP_DOWN)?;
        }
    }
    Ok(())
}

/// The inverse of [`layer_to_megatron`]: megatron-core prefix `src`, Hugging Face prefix `dst`.
fn layer_to_hf(
    cfg: &TransformerConfig,
    m: &mut Tensors,
    t: &mut Tensors,
    l: usize,
    (src, dst): (&str, &str),
) -> Result<(), String> {
    let h = cfg.hidden_size;
    for (a, b) in [
        ("input_layernorm", "input_layernorm"),
        ("post_attention_layernorm", "pre_mlp_layernorm"),
    ] {
        let w = take(m, &format!("{src}.{b}.weight"), &[h])?;
        t.insert(format!("{dst}.{a}.weight"), (vec![h], w));
    }
    for (a, b, shape) in attention_tensors(cfg) {
        let w = take(m, &format!("{src}.self_attention.{b}"), &shape)?;
        t.insert(format!("{dst}.self_attn.{a}"), (shape, w));
    }
    let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
    match &cfg.moe {
        Some(moe) if cfg.is_moe_layer(l) => {
            routed_to_hf(cfg, m, t, (&s, &d), GATE_UP_DOWN)?;
            let e = moe.num_experts;
            if moe.score == RouterScore::Sigmoid {
                // A router without DeepSeek-V3's bias routes as one whose bias is zero.
                let b = match m.remove(&format!("{s}.router.expert_bias")) {
                    Some((_, b)) => b,
                    None => vec![0.0; e],
                };
                t.insert(format!("{d}.gate.e_score_correction_bias"), (vec![e], b));
            }
            let sf = moe.shared_expert_ffn.expect("checked");
            let (a, b) = (format!("{s}.shared_experts"), format!("{d}.shared_experts"));
            mlp_to_hf(m, t, (&a, &b), (h, sf), GATE_UP_DOWN)?;
        }
        _ => {
            let f = (h, cfg.ffn_hidden_size);
            mlp_to_hf(m, t, (&s, &d), f, GATE_UP_DOWN)?;
        }
    }
    Ok(())
}

/// A multi-token-prediction depth's own tensors: Hugging Face suffix, megatron-core suffix
/// (Megatron-Bridge's mapping; DeepSeek's `shared_head.norm` is the depth's final norm).
const MTP_NORMS: [(&str, &str); 3] = [
    ("enorm", "enorm"),
    ("hnorm", "hnorm"),
    ("shared_head.norm", "final_layernorm"),
];

/// DeepSeek's depth `k` (`model.layers.{num_hidden_layers + k}`) into `mtp.layers.{k}`: its
/// norms, `eh_proj` and layer; its copies of the word embedding and output layer
/// (`embed_tokens`, `shared_head.head`) must equal the model's and are dropped.
fn mtp_depth_to_megatron(
    cfg: &TransformerConfig,
    t: &mut Tensors,
    m: &mut Tensors,
    k: usize,
) -> Result<(), String> {
    let h = cfg.hidden_size;
    let (src, dst) = (
        format!("model.layers.{}", cfg.num_layers + k),
        format!("mtp.layers.{k}"),
    );
    for (a, b) in MTP_NORMS {
        let w = take(t, &format!("{src}.{a}.weight"), &[h])?;
        m.insert(format!("{dst}.{b}.weight"), (vec![h], w));
    }
    let w = take(t, &format!("{src}.eh_proj.weight"), &[h, 2 * h])?;
    m.insert(format!("{dst}.eh_proj.weight"), (vec![h, 2 * h], w));
    let own = format!("{dst}.mtp_model_layer");
    layer_to_megatron(cfg, t, m, cfg.num_layers + k, (&src, &own))?;
    let output = if cfg.untie_embeddings_and_output_weights {
        "output_layer.weight"
    } else {
        "embedding.word_embeddings.weight"
    };
    for (copy, of) in [
        ("embed_tokens", "embedding.word_embeddings.weight"),
        ("shared_head.head", output),
    ] {
        let name = format!("{src}.{copy}.weight");
        if let Some((_, v)) = t.remove(&name) {
            let kept = &m.get(of).expect("the ends are mapped first").1;
            if kept[..v.len()] != v[..] {
                return Err(format!(
                    "{name} differs from the model's {of}: a depth with its own embedding or output layer is not built"
                ));
            }
        }
    }
    Ok(())
}

/// The inverse of [`mtp_depth_to_megatron`], writing DeepSeek's copies of the word embedding
/// and output layer as its checkpoints hold them.
fn mtp_depth_to_hf(
    cfg: &TransformerConfig,
    m: &mut Tensors,
    t: &mut Tensors,
    k: usize,
) -> Result<(), String> {
    let h = cfg.hidden_size;
    let (dst, src) = (
        format!("model.layers.{}", cfg.num_layers + k),
        format!("mtp.layers.{k}"),
    );
    for (a, b) in MTP_NORMS {
        let w = take(m, &format!("{src}.{b}.weight"), &[h])?;
        t.insert(format!("{dst}.{a}.weight"), (vec![h], w));
    }
    let w = take(m, &format!("{src}.eh_proj.weight"), &[h, 2 * h])?;
    t.insert(format!("{dst}.eh_proj.weight"), (vec![h, 2 * h], w));
    let own = format!("{src}.mtp_model_layer");
    layer_to_hf(cfg, m, t, cfg.num_layers + k, (&own, &dst))?;
    let output = if cfg.untie_embeddings_and_output_weights {
        "lm_head.weight"
    } else {
        "model.embed_tokens.weight"
    };
    for (copy, of) in [
        ("embed_tokens", "model.embed_tokens.weight"),
        ("shared_head.head", output),
    ] {
        let v = t.get(of).expect("the ends are mapped first").clone();
        t.insert(format!("{dst}.{copy}.weight"), v);
    }
    Ok(())
}

impl HfFamily for DeepseekV3 {
    fn megatron_config(
        &self,
        hf: &Value,
        divisible_by: usize,
    ) -> Result<TransformerConfig, String> {
        if hf["hidden_act"].as_str().unwrap_or("silu") != "silu" {
            return Err(format!(
                "hidden_act {}: DeepseekV3ForCausalLM converts with silu (SwiGLU)",
                hf["hidden_act"]
            ));
        }
        if hf["mlp_bias"].as_bool().unwrap_or(false) {
            return Err("mlp_bias: megatron-core's DeepSeek MLPs have no biases".into());
        }
        if hf["attention_bias"].as_bool().unwrap_or(false) {
            return Err("attention_bias: megatron-core's MLA projections have no biases".into());
        }
        if hf["rope_interleave"].as_bool() == Some(false) {
            return Err("rope_interleave false: megatron-core's MLA rotates interleaved pairs (DeepSeek's layout)".into());
        }
        let eps = hf["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32;
        if eps != LATENT_NORM_EPS {
            return Err(format!(
                "rms_norm_eps {eps}: transformers' latent norms always use 1e-6 and megatron-core's use --norm-epsilon for every norm, so only 1e-6 converts"
            ));
        }
        let layers = num(hf, "num_hidden_layers")?;
        let positions = num(hf, "max_position_embeddings")?;
        let mut rotary = rotary_from_hf(hf, positions)?;
        rotary.interleaved = true;
        // transformers scales the softmax by mscale_all_dim's concentration whenever it is
        // given; megatron-core (and the YaRN reading) only with mscale beside it.
        let rope = if hf["rope_parameters"].is_object() {
            &hf["rope_parameters"]
        } else {
            &hf["rope_scaling"]
        };
        let all_dim = rope["mscale_all_dim"].as_f64().unwrap_or(0.0);
        if rotary.yarn.is_some_and(|y| y.mscale_all_dim != all_dim) {
            return Err(format!(
                "YaRN mscale_all_dim {all_dim} without mscale: transformers scales the softmax by it, megatron-core's YaRN only reads it with mscale"
            ));
        }
        Ok(TransformerConfig {
            num_layers: layers,
            hidden_size: num(hf, "hidden_size")?,
            num_attention_heads: num(hf, "num_attention_heads")?,
            ffn_hidden_size: num(hf, "intermediate_size")?,
            seq_length: positions,
            max_position_embeddings: positions,
            padded_vocab_size: TransformerConfig::pad_vocab(num(hf, "vocab_size")?, divisible_by),
            hidden_dropout: 0.0,
            attention_dropout: hf["attention_dropout"].as_f64().unwrap_or(0.0) as f32,
            init_method_std: hf["initializer_range"].as_f64().unwrap_or(0.02) as f32,
            layernorm_epsilon: eps,
            untie_embeddings_and_output_weights: !hf["tie_word_embeddings"]
                .as_bool()
                .unwrap_or(false),
            normalization: Normalization::RMSNorm,
            activation: Activation::SwiGLU,
            position_embedding_type: PositionEmbeddingType::Rope,
            rotary,
            add_bias_linear: false,
            add_qkv_bias: false,
            qk_layernorm: true,
            moe: moe_from_hf(hf, layers, self.generation)?,
            mtp: (self.mtp_depths > 0).then_some(MTPConfig {
                num_layers: self.mtp_depths,
                loss_scaling_factor: MTP_LOSS_SCALING_FACTOR,
            }),
            mla: Some(MLAConfig {
                q_lora_rank: hf["q_lora_rank"].as_u64().map(|v| v as usize),
                kv_lora_rank: num(hf, "kv_lora_rank")?,
                qk_head_dim: num(hf, "qk_nope_head_dim")?,
                qk_pos_emb_head_dim: num(hf, "qk_rope_head_dim")?,
                v_head_dim: num(hf, "v_head_dim")?,
            }),
            ..Default::default()
        })
    }

    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        vocab: usize,
    ) -> Result<Tensors, String> {
        let mut m = Tensors::new();
        ends_to_megatron(cfg, t, &mut m, vocab)?;
        // DeepSeek-V3's multi-token-prediction layers (`num_nextn_predict_layers`) follow the
        // decoder's as `model.layers.{num_hidden_layers + k}`: those converted as MTP depths are
        // mapped below; any beyond (an incomplete depth) are dropped, as transformers drops
        // them all.
        let kept = cfg.num_layers + cfg.mtp.map_or(0, |d| d.num_layers);
        let mtp: Vec<String> = t
            .keys()
            .filter(|k| {
                k.strip_prefix("model.layers.")
                    .and_then(|r| r.split('.').next()?.parse::<usize>().ok())
                    .is_some_and(|l| l >= kept)
            })
            .cloned()
            .collect();
        for k in mtp {
            t.remove(&k);
        }
        for l in 0..cfg.num_layers {
            let (src, dst) = (format!("model.layers.{l}"), format!("decoder.layers.{l}"));
            layer_to_megatron(cfg, t, &mut m, l, (&src, &dst))?;
        }
        for k in 0..cfg.mtp.map_or(0, |d| d.num_layers) {
            mtp_depth_to_megatron(cfg, t, &mut m, k)?;
        }
        Ok(m)
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        vocab: usize,
    ) -> Result<(Value, Tensors), String> {
        let mla = cfg.mla.ok_or("not a multi-latent attention model")?;
        check_exportable(cfg, self.generation)?;
        let first_moe = first_moe_layer(cfg)?;
        let h = cfg.hidden_size;
        let mut t = Tensors::new();
        ends_to_hf(cfg, m, &mut t, vocab)?;
        for l in 0..cfg.num_layers {
            let (dst, src) = (format!("model.layers.{l}"), format!("decoder.layers.{l}"));
            layer_to_hf(cfg, m, &mut t, l, (&src, &dst))?;
        }
        for k in 0..cfg.mtp.map_or(0, |d| d.num_layers) {
            mtp_depth_to_hf(cfg, m, &mut t, k)?;
        }
        let a = cfg.num_attention_heads;
        let mut config = json!({
            "architectures": [self.generation.architecture()],
            "model_type": match self.generation {
                Generation::V2 => "deepseek_v2",
                Generation::V3 => "deepseek_v3",
            },
            "hidden_act": "silu",
            "hidden_size": h,
            "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": a,
            "num_key_value_heads": a,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_head_dim,
            "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
            "v_head_dim": mla.v_head_dim,
            "rope_interleave": true,
            "attention_bias": false,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.layernorm_epsilon,
            "rope_parameters": rotary_to_hf(cfg),
            "tie_word_embeddings": !cfg.untie_embeddings_and_output_weights,
            "vocab_size": vocab,
            "initializer_range": cfg.init_method_std,
            "first_k_dense_replace": first_moe.unwrap_or(cfg.num_layers),
            "num_nextn_predict_layers": cfg.mtp.map_or(0, |d| d.num_layers),
        });
        if let Some(moe) = &cfg.moe {
            let (groups, topk_group) = moe.router_groups.unwrap_or((1, 1));
            let shared = moe.shared_expert_ffn.expect("checked") / moe.ffn_hidden_size;
            for (k, v) in [
                ("n_routed_experts", json!(moe.num_experts)),
                ("moe_intermediate_size", json!(moe.ffn_hidden_size)),
                ("num_experts_per_tok", json!(moe.topk)),
                ("n_shared_experts", json!(shared)),
                ("n_group", json!(groups)),
                ("topk_group", json!(topk_group)),
                (
                    "norm_topk_prob",
                    json!(moe.topk > 1 && moe.score == RouterScore::Sigmoid),
                ),
                (
                    "routed_scaling_factor",
                    json!(moe.topk_scaling_factor.unwrap_or(1.0)),
                ),
                ("output_router_logits", json!(false)),
                ("router_aux_loss_coef", json!(moe.aux_loss_coeff)),
            ] {
                config[k] = v;
            }
            if self.generation == Generation::V2 {
                let method = if moe.router_groups.is_some() {
                    "group_limited_greedy"
                } else {
                    "greedy"
                };
                config["topk_method"] = json!(method);
            }
        }
        Ok((config, t))
    }
}

/// What DeepseekV3ForCausalLM (or V2) cannot hold, named by flag.
fn check_exportable(cfg: &TransformerConfig, generation: Generation) -> Result<(), String> {
    let refuse = |on: bool, what: &str| if on { Err(what.to_string()) } else { Ok(()) };
    refuse(
        cfg.normalization != Normalization::RMSNorm || cfg.activation != Activation::SwiGLU,
        "DeepseekV3ForCausalLM has RMSNorm and SwiGLU (--normalization RMSNorm --swiglu)",
    )?;
    refuse(
        cfg.add_bias_linear || cfg.add_qkv_bias,
        "DeepseekV3ForCausalLM's projections have no biases (--disable-bias-linear)",
    )?;
    refuse(
        !cfg.qk_layernorm,
        "DeepseekV3ForCausalLM always normalizes its latents (--qk-layernorm)",
    )?;
    refuse(
        cfg.layernorm_epsilon != LATENT_NORM_EPS,
        "transformers' latent norms use epsilon 1e-6: --norm-epsilon must be 1e-6",
    )?;
    refuse(
        cfg.window.is_some(),
        "--window-size: DeepseekV3ForCausalLM has no sliding window",
    )?;
    if let Some(moe) = &cfg.moe {
        if generation == Generation::V2 {
            refuse(
                !moe.pre_softmax || moe.expert_bias_update_rate.is_some(),
                "DeepseekV2ForCausalLM's softmax router keeps the top-k probabilities of all experts as they are (--moe-router-pre-softmax) and has no expert bias",
            )?;
            refuse(
                moe.router_groups.is_some_and(|(_, tg)| tg != moe.topk),
                "--moe-router-group-topk: transformers' DeepSeek-V2 scores a group by its best expert, so --moe-router-group-topk must equal --moe-router-topk",
            )?;
            refuse(
                cfg.mtp.is_some(),
                "--mtp-num-layers: DeepseekV2ForCausalLM has no multi-token prediction",
            )?;
        }
        refuse(
            moe.shared_expert_gate,
            "--moe-shared-expert-gate: DeepSeek's shared experts have no gate",
        )?;
        refuse(
            !moe
                .shared_expert_ffn
                .is_some_and(|s| s > 0 && s.is_multiple_of(moe.ffn_hidden_size)),
            "DeepseekV3ForCausalLM holds n_shared_experts of --moe-ffn-hidden-size: --moe-shared-expert-intermediate-size must be a positive multiple of it",
        )?;
        refuse(
            generation == Generation::V3
                && moe
                    .router_groups
                    .is_some_and(|(g, tg)| g > 1 && moe.topk / tg.max(1) != 2),
            "--moe-router-group-topk: transformers scores a group by its best 2 experts, so --moe-router-topk / --moe-router-group-topk must be 2",
        )?;
        refuse(
            moe.capacity_factor.is_some(),
            "--moe-expert-capacity-factor: DeepseekV3ForCausalLM is dropless",
        )?;
    }
    Ok(())
}
