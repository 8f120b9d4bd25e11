//! GPT-2 (`GPT2LMHeadModel`) <-> megatron-core's GPT: Conv1D weights are `[in, out]` (ours
//! `[out, in]`), the fused `c_attn` columns are `[q | k | v]` (ours per head `[q_h, k_h, v_h]`),
//! learned positions, LayerNorm, GELU(tanh), tied output layer.

use super::{pad_rows, take, HfFamily, Tensors};
use megatron_core::transformer::config::{Activation, GeluForm, Normalization};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) struct Gpt2;

pub(crate) fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}

/// Rows `[q (all heads) | k | v]` (each `heads x hd` rows of `cols`) to per-head
/// `[q_h, k_h, v_h]`, or back (`to_heads = false`).
fn qkv_rows(x: &[f32], heads: usize, hd: usize, cols: usize, to_heads: bool) -> Vec<f32> {
    let h = heads * hd;
    let mut out = vec![0.0; x.len()];
    for j in 0..heads {
        for part in 0..3 {
            for r in 0..hd {
                let split = (part * h + j * hd + r) * cols;
                let fused = ((j * 3 + part) * hd + r) * cols;
                let (src, dst) = if to_heads {
                    (split, fused)
                } else {
                    (fused, split)
                };
                out[dst..dst + cols].copy_from_slice(&x[src..src + cols]);
            }
        }
    }
    out
}

fn num(hf: &Value, key: &str) -> Result<usize, String> {
    hf[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| format!("config.json has no {key}"))
}

impl HfFamily for Gpt2 {
    fn megatron_config(
        &self,
        hf: &Value,
        divisible_by: usize,
    ) -> Result<TransformerConfig, String> {
        let (activation, gelu) = match hf["activation_function"].as_str().unwrap_or("gelu_new") {
            "gelu_new" | "gelu_pytorch_tanh" => (Activation::Gelu, GeluForm::Tanh),
            "gelu" => (Activation::Gelu, GeluForm::Erf),
            "relu2" => (Activation::SquaredRelu, GeluForm::Tanh),
            other => {
                return Err(format!(
                    "activation_function '{other}': only gelu_new (GELU, tanh), gelu (erf) and relu2 (squared ReLU) are built"
                ))
            }
        };
        let h = num(hf, "n_embd")?;
        let positions = num(hf, "n_positions")?;
        Ok(TransformerConfig {
            num_layers: num(hf, "n_layer")?,
            hidden_size: h,
            num_attention_heads: num(hf, "n_head")?,
            ffn_hidden_size: hf["n_inner"].as_u64().map_or(4 * h, |v| v as usize),
            seq_length: positions,
            max_position_embeddings: positions,
            padded_vocab_size: TransformerConfig::pad_vocab(num(hf, "vocab_size")?, divisible_by),
            hidden_dropout: hf["resid_pdrop"].as_f64().unwrap_or(0.1) as f32,
            attention_dropout: hf["attn_pdrop"].as_f64().unwrap_or(0.1) as f32,
            init_method_std: hf["initializer_range"].as_f64().unwrap_or(0.02) as f32,
            layernorm_epsilon: hf["layer_norm_epsilon"].as_f64().unwrap_or(1e-5) as f32,
            untie_embeddings_and_output_weights: false,
            activation,
            gelu,
            ..Default::default()
        })
    }

    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        vocab: usize,
    ) -> Result<Tensors, String> {
        let (h, f, heads) = (
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            cfg.num_attention_heads,
        );
        let hd = h / heads;
        let mut m = Tensors::new();
        let wte = take(t, "transformer.wte.weight", &[vocab, h])?;
        m.insert(
            "embedding.word_embeddings.weight".into(),
            (
                vec![cfg.padded_vocab_size, h],
                pad_rows(wte, h, cfg.padded_vocab_size),
            ),
        );
        let p = cfg.max_position_embeddings;
        m.insert(
            "embedding.position_embeddings.weight".into(),
            (vec![p, h], take(t, "transformer.wpe.weight", &[p, h])?),
        );
        // A tied copy of the word embedding, when a writer saved it.
        t.remove("lm_head.weight");
        for l in 0..cfg.num_layers {
            let (src, dst) = (format!("transformer.h.{l}"), format!("decoder.layers.{l}"));
            let mut put = |name: String, shape: Vec<usize>, v: Vec<f32>| {
                m.insert(name, (shape, v));
            };
            for (a, b) in [("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")] {
                for w in ["weight", "bias"] {
                    put(
                        format!("{dst}.{b}.{w}"),
                        vec![h],
                        take(t, &format!("{src}.{a}.{w}"), &[h])?,
                    );
                }
            }
            let w = transpose(
                &take(t, &format!("{src}.attn.c_attn.weight"), &[h, 3 * h])?,
                h,
                3 * h,
            );
            put(
                format!("{dst}.self_attention.linear_qkv.weight"),
                vec![3 * h, h],
                qkv_rows(&w, heads, hd, h, true),
            );
            let b = take(t, &format!("{src}.attn.c_attn.bias"), &[3 * h])?;
            put(
                format!("{dst}.self_attention.linear_qkv.bias"),
                vec![3 * h],
                qkv_rows(&b, heads, hd, 1, true),
            );
            let w = transpose(
                &take(t, &format!("{src}.attn.c_proj.weight"), &[h, h])?,
                h,
                h,
            );
            put(
                format!("{dst}.self_attention.linear_proj.weight"),
                vec![h, h],
                w,
            );
            put(
                format!("{dst}.self_attention.linear_proj.bias"),
                vec![h],
                take(t, &format!("{src}.attn.c_proj.bias"), &[h])?,
            );
            let w = transpose(&take(t, &format!("{src}.mlp.c_fc.weight"), &[h, f])?, h, f);
            put(format!("{dst}.mlp.linear_fc1.weight"), vec![f, h], w);
            put(
                format!("{dst}.mlp.linear_fc1.bias"),
                vec![f],
                take(t, &format!("{src}.mlp.c_fc.bias"), &[f])?,
            );
            let w = transpose(
                &take(t, &format!("{src}.mlp.c_proj.weight"), &[f, h])?,
                f,
                h,
            );
            put(format!("{dst}.mlp.linear_fc2.weight"), vec![h, f], w);
            put(
                format!("{dst}.mlp.linear_fc2.bias"),
                vec![h],
                take(t, &format!("{src}.mlp.c_proj.bias"), &[h])?,
            );
        }
        for w in ["weight", "bias"] {
            m.insert(
                format!("decoder.final_layernorm.{w}"),
                (vec![h], take(t, &format!("transformer.ln_f.{w}"), &[h])?),
            );
        }
        Ok(m)
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        vocab: usize,
    ) -> Result<(Value, Tensors), String> {
        let (h, f, heads) = (
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            cfg.num_attention_heads,
        );
        refuse_what_gpt2_cannot_hold(cfg)?;
        let hd = h / heads;
        let activation_function = match cfg.activation {
            Activation::Gelu => match cfg.gelu {
                GeluForm::Tanh => "gelu_new",
                GeluForm::Erf => "gelu",
            },
            Activation::SquaredRelu => "relu2",
            other => {
                return Err(format!(
                    "the MLP's activation {other:?} has no counterpart in GPT-2 (GELU and squared ReLU have)"
                ))
            }
        };
        let mut t = Tensors::new();
        let mut wte = take(
            m,
            "embedding.word_embeddings.weight",
            &[cfg.padded_vocab_size, h],
        )?;
        wte.truncate(vocab * h);
        t.insert("transformer.wte.weight".into(), (vec![vocab, h], wte));
        let p = cfg.max_position_embeddings;
        t.insert(
            "transformer.wpe.weight".into(),
            (
                vec![p, h],
                take(m, "embedding.position_embeddings.weight", &[p, h])?,
            ),
        );
        for l in 0..cfg.num_layers {
            let (dst, src) = (format!("transformer.h.{l}"), format!("decoder.layers.{l}"));
            let mut put = |name: String, shape: Vec<usize>, v: Vec<f32>| {
                t.insert(name, (shape, v));
            };
            for (a, b) in [("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")] {
                for w in ["weight", "bias"] {
                    put(
                        format!("{dst}.{a}.{w}"),
                        vec![h],
                        take(m, &format!("{src}.{b}.{w}"), &[h])?,
                    );
                }
            }
            let w = qkv_rows(
                &take(
                    m,
                    &format!("{src}.self_attention.linear_qkv.weight"),
                    &[3 * h, h],
                )?,
                heads,
                hd,
                h,
                false,
            );
            put(
                format!("{dst}.attn.c_attn.weight"),
                vec![h, 3 * h],
                transpose(&w, 3 * h, h),
            );
            let b = qkv_rows(
                &take(
                    m,
                    &format!("{src}.self_attention.linear_qkv.bias"),
                    &[3 * h],
                )?,
                heads,
                hd,
                1,
                false,
            );
            put(format!("{dst}.attn.c_attn.bias"), vec![3 * h], b);
            let w = take(
                m,
                &format!("{src}.self_attention.linear_proj.weight"),
                &[h, h],
            )?;
            put(
                format!("{dst}.attn.c_proj.weight"),
                vec![h, h],
                transpose(&w, h, h),
            );
            put(
                format!("{dst}.attn.c_proj.bias"),
                vec![h],
                take(m, &format!("{src}.self_attention.linear_proj.bias"), &[h])?,
            );
            let w = take(m, &format!("{src}.mlp.linear_fc1.weight"), &[f, h])?;
            put(
                format!("{dst}.mlp.c_fc.weight"),
                vec![h, f],
                transpose(&w, f, h),
            );
            put(
                format!("{dst}.mlp.c_fc.bias"),
                vec![f],
                take(m, &format!("{src}.mlp.linear_fc1.bias"), &[f])?,
            );
            let w = take(m, &format!("{src}.mlp.linear_fc2.weight"), &[h, f])?;
            put(
                format!("{dst}.mlp.c_proj.weight"),
                vec![f, h],
                transpose(&w, h, f),
            );
            put(
                format!("{dst}.mlp.c_proj.bias"),
                vec![h],
                take(m, &format!("{src}.mlp.linear_fc2.bias"), &[h])?,
            );
        }
        for w in ["weight", "bias"] {
            t.insert(
                format!("transformer.ln_f.{w}"),
                (
                    vec![h],
                    take(m, &format!("decoder.final_layernorm.{w}"), &[h])?,
                ),
            );
        }
        let config = json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": activation_function,
            "n_layer": cfg.num_layers,
            "n_embd": h,
            "n_head": heads,
            "n_inner": f,
            "n_positions": p,
            "vocab_size": vocab,
            "layer_norm_epsilon": cfg.layernorm_epsilon,
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "initializer_range": cfg.init_method_std,
            "tie_word_embeddings": true,
            "bos_token_id": 0,
            "eos_token_id": 0,
        });
        Ok((config, t))
    }
}

/// A model with learned positions exports as GPT-2, whose blocks are fixed: the parts it cannot
/// hold are named by their flag here, rather than as a missing or misshapen tensor later.
fn refuse_what_gpt2_cannot_hold(cfg: &TransformerConfig) -> Result<(), String> {
    let heads = cfg.num_attention_heads;
    let why = if cfg.normalization != Normalization::LayerNorm {
        "--normalization RMSNorm: GPT-2's norms are LayerNorms"
    } else if cfg.query_groups() != heads {
        "--group-query-attention: GPT-2 has one key and value head per query head"
    } else if !cfg.add_bias_linear {
        "--disable-bias-linear: GPT-2 has biases on every linear layer"
    } else if cfg.qk_layernorm {
        "--qk-layernorm: GPT-2 has no query/key norms"
    } else if cfg.head_dim() * heads != cfg.hidden_size {
        "--kv-channels: GPT-2's heads are hidden / heads wide"
    } else if cfg.moe.is_some() {
        "--num-experts: GPT-2 has no experts"
    } else {
        return Ok(());
    };
    Err(format!(
        "{why} (a model with learned positions exports as GPT2LMHeadModel; RoPE models as Llama, Mistral or Qwen)"
    ))
}
