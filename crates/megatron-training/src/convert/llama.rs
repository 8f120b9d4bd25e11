//! The Llama family (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`) <->
//! megatron-core's decoder with RMSNorm, SwiGLU, RoPE (rotate-half: Hugging Face's convention,
//! so no row permutation) and grouped-query attention: `q_proj`/`k_proj`/`v_proj` become the
//! fused QKV laid out per query group `[q heads of g, k_g, v_g]`, `gate_proj`/`up_proj` the
//! fused `[gate; up]`. Qwen2 adds q/k/v biases; Qwen3 (`Qwen3ForCausalLM`, and Qwen3-MoE) adds
//! per-head RMSNorms of the queries and keys before RoPE (`q_norm`/`k_norm`: megatron-core's
//! `--qk-layernorm`, `q_layernorm`/`k_layernorm`). gpt-oss (`gpt_oss.rs`) adds biases on every
//! projection and learned attention sinks.

use super::{pad_rows, take, HfFamily, Tensors};
use megatron_core::transformer::config::{
    Activation, Normalization, PositionEmbeddingType, RotaryConfig, SoftmaxType,
};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

/// transformers' `hidden_act` of a gated MLP (`act(gate_proj x) * up_proj x`).
fn hf_gated_act(a: Activation) -> Result<&'static str, String> {
    match a {
        Activation::SwiGLU => Ok("silu"),
        Activation::QuickGeGLU => Ok("quick_gelu"),
        other => Err(format!(
            "the MLP's activation {other:?} has no counterpart in Llama's gated MLP (SwiGLU and Quick-GEGLU have)"
        )),
    }
}

/// gpt-oss's attention sinks under a layer (transformers' `self_attn.sinks`).
const SINKS: &str = "self_attention.core_attention.softmax_offset";

pub(crate) struct Llama {
    pub arch: String,
    /// How each layer's feed-forward block maps: the dense SwiGLU MLP here, or a mixture of
    /// experts (`mixtral.rs`, `qwen2_moe.rs`).
    pub mlp: Box<dyn MlpMapping>,
}

/// One family's feed-forward block on the Llama decoder.
pub(crate) trait MlpMapping {
    /// Adds the block's settings (experts, router) to the model read from config.json.
    fn configure(&self, hf: &Value, cfg: &mut TransformerConfig) -> Result<(), String>;
    /// Layer `l`'s block from Hugging Face tensors `t` (prefix `src`) into `m` (prefix `dst`).
    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        m: &mut Tensors,
        src: &str,
        dst: &str,
    ) -> Result<(), String>;
    /// The reverse.
    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        t: &mut Tensors,
        dst: &str,
        src: &str,
    ) -> Result<(), String>;
    /// The architecture, model type and config.json entries of the block.
    fn hf_config(
        &self,
        cfg: &TransformerConfig,
        qkv_bias: bool,
    ) -> (&'static str, &'static str, Value);
}

/// The dense SwiGLU MLP: `gate_proj`/`up_proj` fused into `[gate; up]`.
pub(crate) struct DenseMlp;

/// The Hugging Face names of a SwiGLU MLP's gate, up and down projections.
pub(crate) const GATE_UP_DOWN: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// A SwiGLU MLP under Hugging Face prefix `s` (projections named `names`: gate, up, down) into
/// megatron-core's fused `[gate; up]` fc1 and fc2 under prefix `d`.
pub(crate) fn mlp_to_megatron(
    t: &mut Tensors,
    m: &mut Tensors,
    (s, d): (&str, &str),
    (h, f): (usize, usize),
    [gate, up, down]: [&str; 3],
) -> Result<(), String> {
    let mut fc1 = take(t, &format!("{s}.{gate}.weight"), &[f, h])?;
    fc1.extend(take(t, &format!("{s}.{up}.weight"), &[f, h])?);
    m.insert(format!("{d}.linear_fc1.weight"), (vec![2 * f, h], fc1));
    let w = take(t, &format!("{s}.{down}.weight"), &[h, f])?;
    m.insert(format!("{d}.linear_fc2.weight"), (vec![h, f], w));
    Ok(())
}

/// The inverse of [`mlp_to_megatron`]: megatron-core prefix `s` to Hugging Face prefix `d`.
pub(crate) fn mlp_to_hf(
    m: &mut Tensors,
    t: &mut Tensors,
    (s, d): (&str, &str),
    (h, f): (usize, usize),
    [gate, up, down]: [&str; 3],
) -> Result<(), String> {
    let fc1 = take(m, &format!("{s}.linear_fc1.weight"), &[2 * f, h])?;
    t.insert(
        format!("{d}.{gate}.weight"),
        (vec![f, h], fc1[..f * h].to_vec()),
    );
    t.insert(
        format!("{d}.{up}.weight"),
        (vec![f, h], fc1[f * h..].to_vec()),
    );
    let w = take(m, &format!("{s}.linear_fc2.weight"), &[h, f])?;
    t.insert(format!("{d}.{down}.weight"), (vec![h, f], w));
    Ok(())
}

/// A whole tensor of `shape` moved from name `s` of `from` to name `d` of `to` (a router, a
/// gate: the same layout on both sides).
pub(crate) fn move_tensor(
    from: &mut Tensors,
    to: &mut Tensors,
    (s, d): (&str, &str),
    shape: [usize; 2],
) -> Result<(), String> {
    let w = take(from, s, &shape)?;
    to.insert(d.to_string(), (shape.to_vec(), w));
    Ok(())
}

impl MlpMapping for DenseMlp {
    fn configure(&self, _hf: &Value, _cfg: &mut TransformerConfig) -> Result<(), String> {
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
        let hf = (cfg.hidden_size, cfg.ffn_hidden_size);
        let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
        mlp_to_megatron(t, m, (&s, &d), hf, GATE_UP_DOWN)
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        t: &mut Tensors,
        dst: &str,
        src: &str,
    ) -> Result<(), String> {
        let hf = (cfg.hidden_size, cfg.ffn_hidden_size);
        let (s, d) = (format!("{src}.mlp"), format!("{dst}.mlp"));
        mlp_to_hf(m, t, (&s, &d), hf, GATE_UP_DOWN)
    }

    fn hf_config(
        &self,
        cfg: &TransformerConfig,
        qkv_bias: bool,
    ) -> (&'static str, &'static str, Value) {
        if cfg.qk_layernorm {
            ("Qwen3ForCausalLM", "qwen3", json!({}))
        } else if qkv_bias {
            ("Qwen2ForCausalLM", "qwen2", json!({}))
        } else {
            ("LlamaForCausalLM", "llama", json!({}))
        }
    }
}

pub(crate) fn num(hf: &Value, key: &str) -> Result<usize, String> {
    hf[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| format!("config.json has no {key}"))
}

/// The ends of a Llama-style decoder: the word embedding (rows padded to the padded
/// vocabulary), the output layer when untied (Hugging Face's tied `lm_head` dropped) and the
/// final norm.
pub(crate) fn ends_to_megatron(
    cfg: &TransformerConfig,
    t: &mut Tensors,
    m: &mut Tensors,
    vocab: usize,
) -> Result<(), String> {
    let (h, vp) = (cfg.hidden_size, cfg.padded_vocab_size);
    let emb = take(t, "model.embed_tokens.weight", &[vocab, h])?;
    m.insert(
        "embedding.word_embeddings.weight".into(),
        (vec![vp, h], pad_rows(emb, h, vp)),
    );
    if cfg.untie_embeddings_and_output_weights {
        let out = take(t, "lm_head.weight", &[vocab, h])?;
        m.insert(
            "output_layer.weight".into(),
            (vec![vp, h], pad_rows(out, h, vp)),
        );
    } else {
        t.remove("lm_head.weight");
    }
    let norm = take(t, "model.norm.weight", &[h])?;
    m.insert("decoder.final_layernorm.weight".into(), (vec![h], norm));
    Ok(())
}

/// The inverse of [`ends_to_megatron`] (vocabulary padding dropped).
pub(crate) fn ends_to_hf(
    cfg: &TransformerConfig,
    m: &mut Tensors,
    t: &mut Tensors,
    vocab: usize,
) -> Result<(), String> {
    let (h, vp) = (cfg.hidden_size, cfg.padded_vocab_size);
    let mut emb = take(m, "embedding.word_embeddings.weight", &[vp, h])?;
    emb.truncate(vocab * h);
    t.insert("model.embed_tokens.weight".into(), (vec![vocab, h], emb));
    if cfg.untie_embeddings_and_output_weights {
        let mut out = take(m, "output_layer.weight", &[vp, h])?;
        out.truncate(vocab * h);
        t.insert("lm_head.weight".into(), (vec![vocab, h], out));
    }
    let norm = take(m, "decoder.final_layernorm.weight", &[h])?;
    t.insert("model.norm.weight".into(), (vec![h], norm));
    Ok(())
}

/// The rotary settings of a Hugging Face config.json (`rope_parameters`, or the older
/// `rope_theta` / `rope_scaling`): base, and Llama 3.1, YaRN or linear scaling (`positions`:
/// the model's `max_position_embeddings`). Rotate-half pairing, the whole head.
pub(crate) fn rotary_from_hf(hf: &Value, positions: usize) -> Result<RotaryConfig, String> {
    let rope = if hf["rope_parameters"].is_object() {
        &hf["rope_parameters"]
    } else {
        hf
    };
    let base = rope["rope_theta"].as_f64().unwrap_or(10000.0);
    let mut yarn = None;
    let mut linear = None;
    let scaling = match rope["rope_type"]
        .as_str()
        .or_else(|| hf["rope_scaling"]["rope_type"].as_str())
    {
        None | Some("default") => None,
        Some("llama3") => {
            let r = if rope["factor"].is_number() {
                rope
            } else {
                &hf["rope_scaling"]
            };
            let (lo, hi, orig) = (
                r["low_freq_factor"].as_f64(),
                r["high_freq_factor"].as_f64(),
                r["original_max_position_embeddings"].as_f64(),
            );
            if (lo, hi, orig) != (Some(1.0), Some(4.0), Some(8192.0)) {
                return Err(format!("llama3 rope scaling with low/high/original {lo:?}/{hi:?}/{orig:?}: only Llama 3.1's 1/4/8192 is built"));
            }
            Some(r["factor"].as_f64().unwrap_or(8.0))
        }
        Some("yarn") => {
            let r = if rope["factor"].is_number() {
                rope
            } else {
                &hf["rope_scaling"]
            };
            yarn = Some(super::yarn::yarn_from_hf(r, positions)?);
            None
        }
        Some("linear") => {
            let r = if rope["factor"].is_number() {
                rope
            } else {
                &hf["rope_scaling"]
            };
            let f = r["factor"]
                .as_f64()
                .ok_or("linear rope scaling without a factor")?;
            linear = Some(f);
            None
        }
        Some(other) => return Err(format!("rope_type '{other}' is not built")),
    };
    Ok(RotaryConfig {
        base,
        percent: 1.0,
        interleaved: false,
        scaling_factor: scaling,
        yarn,
        seq_len_interpolation_factor: linear,
    })
}

/// The inverse of [`rotary_from_hf`]: config.json's `rope_parameters`.
pub(crate) fn rotary_to_hf(cfg: &TransformerConfig) -> Value {
    let mut rope = json!({"rope_theta": cfg.rotary.base, "rope_type": "default"});
    if let Some(factor) = cfg.rotary.scaling_factor {
        rope = json!({"rope_theta": cfg.rotary.base, "rope_type": "llama3", "factor": factor,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192});
    }
    if let Some(y) = &cfg.rotary.yarn {
        rope = super::yarn::yarn_to_hf(y, cfg.rotary.base);
    }
    if let Some(f) = cfg.rotary.seq_len_interpolation_factor {
        rope = json!({"rope_theta": cfg.rotary.base, "rope_type": "linear", "factor": f});
    }
    rope
}

/// `q [heads*hd, cols]`, `k`, `v [groups*hd, cols]` into the fused per-group rows.
pub(crate) fn fuse_qkv(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    heads: usize,
    groups: usize,
    hd: usize,
    cols: usize,
) -> Vec<f32> {
    let qpg = heads / groups;
    let mut out = Vec::with_capacity(q.len() + k.len() + v.len());
    for g in 0..groups {
        out.extend_from_slice(&q[g * qpg * hd * cols..(g + 1) * qpg * hd * cols]);
        out.extend_from_slice(&k[g * hd * cols..(g + 1) * hd * cols]);
        out.extend_from_slice(&v[g * hd * cols..(g + 1) * hd * cols]);
    }
    out
}

/// The inverse of [`fuse_qkv`].
pub(crate) fn split_qkv(
    x: &[f32],
    heads: usize,
    groups: usize,
    hd: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let qpg = heads / groups;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    let per = (qpg + 2) * hd * cols;
    for g in 0..groups {
        let b = &x[g * per..(g + 1) * per];
        q.extend_from_slice(&b[..qpg * hd * cols]);
        k.extend_from_slice(&b[qpg * hd * cols..(qpg + 1) * hd * cols]);
        v.extend_from_slice(&b[(qpg + 1) * hd * cols..]);
    }
    (q, k, v)
}

impl Llama {
    /// q/k/v biases: Qwen2 (`attention_bias` absent) and Qwen2-MoE (`qkv_bias`).
    fn qwen(&self, hf: &Value) -> bool {
        self.arch == "Qwen2ForCausalLM" || hf["qkv_bias"].as_bool() == Some(true)
    }
}

impl HfFamily for Llama {
    fn megatron_config(
        &self,
        hf: &Value,
        divisible_by: usize,
    ) -> Result<TransformerConfig, String> {
        let activation = match hf["hidden_act"].as_str().unwrap_or("silu") {
            "silu" => Activation::SwiGLU,
            "quick_gelu" => Activation::QuickGeGLU,
            other => {
                return Err(format!(
                "hidden_act '{other}': only silu (SwiGLU) and quick_gelu (Quick-GEGLU) are built"
            ))
            }
        };
        let h = num(hf, "hidden_size")?;
        let heads = num(hf, "num_attention_heads")?;
        let groups = hf["num_key_value_heads"]
            .as_u64()
            .map_or(heads, |v| v as usize);
        let hd = hf["head_dim"].as_u64().map_or(h / heads, |v| v as usize);
        let positions = num(hf, "max_position_embeddings")?;
        let rotary = rotary_from_hf(hf, positions)?;
        let qwen = self.qwen(hf);
        let gpt_oss = self.arch == super::gpt_oss::ARCHITECTURE;
        if hf["attention_bias"].as_bool().unwrap_or(false) && !qwen && !gpt_oss {
            return Err("attention_bias on q/k/v/o without MLP biases is not built".into());
        }
        if hf["mlp_bias"].as_bool().unwrap_or(false) {
            return Err("mlp_bias is not built".into());
        }
        let mut cfg = TransformerConfig {
            num_layers: num(hf, "num_hidden_layers")?,
            hidden_size: h,
            num_attention_heads: heads,
            num_query_groups: Some(groups),
            kv_channels: Some(hd),
            ffn_hidden_size: num(hf, "intermediate_size")?,
            seq_length: positions,
            max_position_embeddings: positions,
            padded_vocab_size: TransformerConfig::pad_vocab(num(hf, "vocab_size")?, divisible_by),
            hidden_dropout: 0.0,
            attention_dropout: hf["attention_dropout"].as_f64().unwrap_or(0.0) as f32,
            init_method_std: hf["initializer_range"].as_f64().unwrap_or(0.02) as f32,
            layernorm_epsilon: hf["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            untie_embeddings_and_output_weights: !hf["tie_word_embeddings"]
                .as_bool()
                .unwrap_or(false),
            normalization: Normalization::RMSNorm,
            activation,
            position_embedding_type: PositionEmbeddingType::Rope,
            rotary,
            add_bias_linear: false,
            add_qkv_bias: qwen,
            qk_layernorm: self.arch.starts_with("Qwen3"),
            window: super::sliding_window::window_from_hf(hf, num(hf, "num_hidden_layers")?)?,
            ..Default::default()
        };
        self.mlp.configure(hf, &mut cfg)?;
        Ok(cfg)
    }

    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        vocab: usize,
    ) -> Result<Tensors, String> {
        let (h, heads, groups, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.query_groups(),
            cfg.head_dim(),
        );
        let mut m = Tensors::new();
        ends_to_megatron(cfg, t, &mut m, vocab)?;
        for l in 0..cfg.num_layers {
            let (src, dst) = (format!("model.layers.{l}"), format!("decoder.layers.{l}"));
            let mut put = |name: String, shape: Vec<usize>, v: Vec<f32>| {
                m.insert(name, (shape, v));
            };
            put(
                format!("{dst}.input_layernorm.weight"),
                vec![h],
                take(t, &format!("{src}.input_layernorm.weight"), &[h])?,
            );
            put(
                format!("{dst}.pre_mlp_layernorm.weight"),
                vec![h],
                take(t, &format!("{src}.post_attention_layernorm.weight"), &[h])?,
            );
            let q = take(
                t,
                &format!("{src}.self_attn.q_proj.weight"),
                &[heads * hd, h],
            )?;
            let k = take(
                t,
                &format!("{src}.self_attn.k_proj.weight"),
                &[groups * hd, h],
            )?;
            let v = take(
                t,
                &format!("{src}.self_attn.v_proj.weight"),
                &[groups * hd, h],
            )?;
            put(
                format!("{dst}.self_attention.linear_qkv.weight"),
                vec![cfg.qkv_size(), h],
                fuse_qkv(&q, &k, &v, heads, groups, hd, h),
            );
            if cfg.qk_layernorm {
                for (hf, mc) in [("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")] {
                    put(
                        format!("{dst}.self_attention.{mc}.weight"),
                        vec![hd],
                        take(t, &format!("{src}.self_attn.{hf}.weight"), &[hd])?,
                    );
                }
            }
            if cfg.add_qkv_bias {
                let q = take(t, &format!("{src}.self_attn.q_proj.bias"), &[heads * hd])?;
                let k = take(t, &format!("{src}.self_attn.k_proj.bias"), &[groups * hd])?;
                let v = take(t, &format!("{src}.self_attn.v_proj.bias"), &[groups * hd])?;
                put(
                    format!("{dst}.self_attention.linear_qkv.bias"),
                    vec![cfg.qkv_size()],
                    fuse_qkv(&q, &k, &v, heads, groups, hd, 1),
                );
            }
            put(
                format!("{dst}.self_attention.linear_proj.weight"),
                vec![h, heads * hd],
                take(
                    t,
                    &format!("{src}.self_attn.o_proj.weight"),
                    &[h, heads * hd],
                )?,
            );
            if cfg.add_bias_linear {
                put(
                    format!("{dst}.self_attention.linear_proj.bias"),
                    vec![h],
                    take(t, &format!("{src}.self_attn.o_proj.bias"), &[h])?,
                );
            }
            if cfg.softmax_type == SoftmaxType::Learnable {
                put(
                    format!("{dst}.{SINKS}"),
                    vec![heads],
                    take(t, &format!("{src}.self_attn.sinks"), &[heads])?,
                );
            }
            // An MoE model's dense layers (`--moe-layer-freq`; Qwen2-MoE's `mlp_only_layers`)
            // hold the plain Llama MLP, `intermediate_size` wide.
            let mlp: &dyn MlpMapping = if cfg.moe.is_none() || cfg.is_moe_layer(l) {
                self.mlp.as_ref()
            } else {
                &DenseMlp
            };
            mlp.to_megatron(cfg, t, &mut m, &src, &dst)?;
        }
        Ok(m)
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        vocab: usize,
    ) -> Result<(Value, Tensors), String> {
        let (h, f, heads, groups, hd) = (
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            cfg.num_attention_heads,
            cfg.query_groups(),
            cfg.head_dim(),
        );
        let hidden_act = hf_gated_act(cfg.activation)?;
        let mut t = Tensors::new();
        ends_to_hf(cfg, m, &mut t, vocab)?;
        for l in 0..cfg.num_layers {
            let (dst, src) = (format!("model.layers.{l}"), format!("decoder.layers.{l}"));
            let mut put = |name: String, shape: Vec<usize>, v: Vec<f32>| {
                t.insert(name, (shape, v));
            };
            put(
                format!("{dst}.input_layernorm.weight"),
                vec![h],
                take(m, &format!("{src}.input_layernorm.weight"), &[h])?,
            );
            put(
                format!("{dst}.post_attention_layernorm.weight"),
                vec![h],
                take(m, &format!("{src}.pre_mlp_layernorm.weight"), &[h])?,
            );
            let w = take(
                m,
                &format!("{src}.self_attention.linear_qkv.weight"),
                &[cfg.qkv_size(), h],
            )?;
            let (q, k, v) = split_qkv(&w, heads, groups, hd, h);
            put(
                format!("{dst}.self_attn.q_proj.weight"),
                vec![heads * hd, h],
                q,
            );
            put(
                format!("{dst}.self_attn.k_proj.weight"),
                vec![groups * hd, h],
                k,
            );
            put(
                format!("{dst}.self_attn.v_proj.weight"),
                vec![groups * hd, h],
                v,
            );
            if cfg.qk_layernorm {
                for (hf, mc) in [("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")] {
                    put(
                        format!("{dst}.self_attn.{hf}.weight"),
                        vec![hd],
                        take(m, &format!("{src}.self_attention.{mc}.weight"), &[hd])?,
                    );
                }
            }
            if cfg.add_qkv_bias {
                let b = take(
                    m,
                    &format!("{src}.self_attention.linear_qkv.bias"),
                    &[cfg.qkv_size()],
                )?;
                let (q, k, v) = split_qkv(&b, heads, groups, hd, 1);
                put(format!("{dst}.self_attn.q_proj.bias"), vec![heads * hd], q);
                put(format!("{dst}.self_attn.k_proj.bias"), vec![groups * hd], k);
                put(format!("{dst}.self_attn.v_proj.bias"), vec![groups * hd], v);
            }
            put(
                format!("{dst}.self_attn.o_proj.weight"),
                vec![h, heads * hd],
                take(
                    m,
                    &format!("{src}.self_attention.linear_proj.weight"),
                    &[h, heads * hd],
                )?,
            );
            if cfg.add_bias_linear {
                put(
                    format!("{dst}.self_attn.o_proj.bias"),
                    vec![h],
                    take(m, &format!("{src}.self_attention.linear_proj.bias"), &[h])?,
                );
            }
            if cfg.softmax_type == SoftmaxType::Learnable {
                put(
                    format!("{dst}.self_attn.sinks"),
                    vec![heads],
                    take(m, &format!("{src}.{SINKS}"), &[heads])?,
                );
            }
            let mlp: &dyn MlpMapping = if cfg.moe.is_none() || cfg.is_moe_layer(l) {
                self.mlp.as_ref()
            } else {
                &DenseMlp
            };
            mlp.to_hf(cfg, m, &mut t, &dst, &src)?;
        }
        let (arch, model_type, extra) = self.mlp.hf_config(cfg, cfg.add_qkv_bias);
        let rope = rotary_to_hf(cfg);
        let config = json!({
            "architectures": [arch],
            "model_type": model_type,
            "hidden_act": hidden_act,
            "hidden_size": h,
            "intermediate_size": f,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": groups,
            "head_dim": hd,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.layernorm_epsilon,
            "rope_theta": cfg.rotary.base,
            "rope_parameters": rope,
            "tie_word_embeddings": !cfg.untie_embeddings_and_output_weights,
            "attention_bias": cfg.add_bias_linear,
            "mlp_bias": false,
            "vocab_size": vocab,
            "initializer_range": cfg.init_method_std,
        });
        let mut config = config;
        if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                c.insert(k.clone(), v.clone());
            }
        }
        if cfg.add_qkv_bias && !cfg.add_bias_linear {
            config["qkv_bias"] = json!(true);
        }
        super::sliding_window::window_to_hf(cfg, &mut config)?;
        Ok((config, t))
    }
}
