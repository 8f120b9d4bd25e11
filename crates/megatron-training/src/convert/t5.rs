//! T5 (`T5ForConditionalGeneration`) <-> megatron-rs's T5: separate `q`/`k`/`v` (ours fused
//! per head: self-attention `[q_h, k_h, v_h]`, cross-attention `q` and `[k_h, v_h]`), the
//! relative position bias of each stack's block 0 (ours one table per stack), T5's RMSNorm
//! ("T5LayerNorm"), no biases anywhere. The MLP is the original T5's `DenseReluDense` `wi`/`wo`
//! (ReLU, or GELU) or T5 v1.1 / Flan-T5's gated `wi_0` (gate) / `wi_1` (up) / `wo` (GeGLU from
//! `"gated-gelu"`, SwiGLU from `"gated-silu"`), ours a fused `[gate; up]` fc1. The output
//! layer is the shared embedding, or `lm_head` when `tie_word_embeddings` is false (T5 v1.1 as
//! transformers 4 saved it); the decoder output is rescaled by `d_model^-1/2` unless
//! `scale_decoder_outputs` (transformers 5) or an untied `lm_head` says otherwise.

use super::llama::num;
use super::{decimal, pad_rows, take, HfFamily, Tensors};
use megatron_core::models::t5::T5Stacks;
use megatron_core::transformer::config::{Activation, GeluForm, Normalization};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

pub(crate) const ARCHITECTURE: &str = "T5ForConditionalGeneration";

pub(crate) struct T5 {
    pub stacks: T5Stacks,
}

impl T5 {
    /// The stacks of a config.json.
    pub fn from_config(hf: &Value) -> Result<Self, String> {
        let layers = num(hf, "num_layers")?;
        Ok(T5 {
            stacks: T5Stacks {
                encoder_layers: layers,
                decoder_layers: hf["num_decoder_layers"]
                    .as_u64()
                    .map_or(layers, |v| v as usize),
                relative_buckets: hf["relative_attention_num_buckets"].as_u64().unwrap_or(32)
                    as usize,
                relative_max_distance: hf["relative_attention_max_distance"]
                    .as_u64()
                    .unwrap_or(128) as usize,
                softmax_scale: 1.0,
                scale_decoder_outputs: hf["scale_decoder_outputs"]
                    .as_bool()
                    .unwrap_or(hf["tie_word_embeddings"].as_bool() != Some(false)),
            },
        })
    }
}

/// Per head, `parts` tensors of `rows` rows each (`[heads * rows, cols]`) interleaved into
/// `[heads, parts, rows, cols]`, or back.
fn interleave(parts: &[&[f32]], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let block = rows * cols;
    let mut out = Vec::with_capacity(parts.len() * heads * block);
    for h in 0..heads {
        for p in parts {
            out.extend_from_slice(&p[h * block..(h + 1) * block]);
        }
    }
    out
}

fn deinterleave(x: &[f32], n: usize, heads: usize, rows: usize, cols: usize) -> Vec<Vec<f32>> {
    let block = rows * cols;
    let mut out = vec![Vec::with_capacity(heads * block); n];
    for h in 0..heads {
        for (p, o) in out.iter_mut().enumerate() {
            let s = (h * n + p) * block;
            o.extend_from_slice(&x[s..s + block]);
        }
    }
    out
}

/// One-to-one tensors (megatron-rs name, Hugging Face name, shape).
fn plain(cfg: &TransformerConfig, st: &T5Stacks) -> Vec<(String, String, Vec<usize>)> {
    let (h, f, heads) = (
        cfg.hidden_size,
        cfg.ffn_hidden_size,
        cfg.num_attention_heads,
    );
    let inner = heads * cfg.head_dim();
    let mut v = vec![
        (
            "encoder.relative_pos_emb.relative_attention_bias.weight".to_string(),
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight".to_string(),
            vec![st.relative_buckets, heads],
        ),
        (
            "decoder.relative_pos_emb.relative_attention_bias.weight".into(),
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight".into(),
            vec![st.relative_buckets, heads],
        ),
        (
            "encoder.final_layernorm.weight".into(),
            "encoder.final_layer_norm.weight".into(),
            vec![h],
        ),
        (
            "decoder.final_layernorm.weight".into(),
            "decoder.final_layer_norm.weight".into(),
            vec![h],
        ),
    ];
    for (stack, n, ff) in [
        ("encoder", st.encoder_layers, 1),
        ("decoder", st.decoder_layers, 2),
    ] {
        for l in 0..n {
            let (m, hf) = (
                format!("{stack}.layers.{l}"),
                format!("{stack}.block.{l}.layer"),
            );
            let mut put = |a: String, b: String, s: Vec<usize>| v.push((a, b, s));
            put(
                format!("{m}.input_layernorm.weight"),
                format!("{hf}.0.layer_norm.weight"),
                vec![h],
            );
            put(
                format!("{m}.self_attention.linear_proj.weight"),
                format!("{hf}.0.SelfAttention.o.weight"),
                vec![h, inner],
            );
            if stack == "decoder" {
                put(
                    format!("{m}.pre_cross_attn_layernorm.weight"),
                    format!("{hf}.1.layer_norm.weight"),
                    vec![h],
                );
                put(
                    format!("{m}.cross_attention.linear_q.weight"),
                    format!("{hf}.1.EncDecAttention.q.weight"),
                    vec![inner, h],
                );
                put(
                    format!("{m}.cross_attention.linear_proj.weight"),
                    format!("{hf}.1.EncDecAttention.o.weight"),
                    vec![h, inner],
                );
            }
            put(
                format!("{m}.pre_mlp_layernorm.weight"),
                format!("{hf}.{ff}.layer_norm.weight"),
                vec![h],
            );
            if !cfg.activation.is_gated() {
                put(
                    format!("{m}.mlp.linear_fc1.weight"),
                    format!("{hf}.{ff}.DenseReluDense.wi.weight"),
                    vec![f, h],
                );
            }
            put(
                format!("{m}.mlp.linear_fc2.weight"),
                format!("{hf}.{ff}.DenseReluDense.wo.weight"),
                vec![h, f],
            );
        }
    }
    v
}

/// The gated MLPs' fc1: (megatron-rs name, Hugging Face's gate and up projections).
fn gated_fc1(cfg: &TransformerConfig, st: &T5Stacks) -> Vec<(String, [String; 2])> {
    if !cfg.activation.is_gated() {
        return Vec::new();
    }
    let mut v = Vec::new();
    for (stack, n, ff) in [
        ("encoder", st.encoder_layers, 1),
        ("decoder", st.decoder_layers, 2),
    ] {
        for l in 0..n {
            let hf = format!("{stack}.block.{l}.layer.{ff}.DenseReluDense");
            v.push((
                format!("{stack}.layers.{l}.mlp.linear_fc1.weight"),
                [format!("{hf}.wi_0.weight"), format!("{hf}.wi_1.weight")],
            ));
        }
    }
    v
}

/// The MLP of a config.json: the activation and its GELU's form.
fn activation(hf: &Value) -> Result<(Activation, GeluForm), String> {
    Ok(match hf["feed_forward_proj"].as_str().unwrap_or("relu") {
        "relu" => (Activation::Relu, GeluForm::Tanh),
        "gelu_new" | "gelu_pytorch_tanh" => (Activation::Gelu, GeluForm::Tanh),
        "gelu" => (Activation::Gelu, GeluForm::Erf),
        // transformers maps "gated-gelu" to gelu_new.
        "gated-gelu" | "gated-gelu_new" | "gated-gelu_pytorch_tanh" => {
            (Activation::GeGLU, GeluForm::Tanh)
        }
        "gated-silu" => (Activation::SwiGLU, GeluForm::Tanh),
        "relu2" => (Activation::SquaredRelu, GeluForm::Tanh),
        "gated-quick_gelu" => (Activation::QuickGeGLU, GeluForm::Tanh),
        other => {
            return Err(format!(
                "feed_forward_proj '{other}' is not built (relu, relu2, gelu, gelu_new, gated-gelu, gated-silu and gated-quick_gelu are)"
            ))
        }
    })
}

/// The fused projections: (megatron-rs name, Hugging Face names per part).
fn fused(st: &T5Stacks) -> Vec<(String, Vec<String>)> {
    let mut v = Vec::new();
    for (stack, n) in [
        ("encoder", st.encoder_layers),
        ("decoder", st.decoder_layers),
    ] {
        for l in 0..n {
            let hf = format!("{stack}.block.{l}.layer");
            v.push((
                format!("{stack}.layers.{l}.self_attention.linear_qkv.weight"),
                ["q", "k", "v"]
                    .iter()
                    .map(|p| format!("{hf}.0.SelfAttention.{p}.weight"))
                    .collect(),
            ));
            if stack == "decoder" {
                v.push((
                    format!("{stack}.layers.{l}.cross_attention.linear_kv.weight"),
                    ["k", "v"]
                        .iter()
                        .map(|p| format!("{hf}.1.EncDecAttention.{p}.weight"))
                        .collect(),
                ));
            }
        }
    }
    v
}

impl HfFamily for T5 {
    fn megatron_config(
        &self,
        hf: &Value,
        divisible_by: usize,
    ) -> Result<TransformerConfig, String> {
        let (activation, gelu) = activation(hf)?;
        let (h, heads) = (num(hf, "d_model")?, num(hf, "num_heads")?);
        let dropout = hf["dropout_rate"].as_f64().unwrap_or(0.1) as f32;
        Ok(TransformerConfig {
            num_layers: self.stacks.encoder_layers,
            hidden_size: h,
            num_attention_heads: heads,
            kv_channels: Some(num(hf, "d_kv")?),
            ffn_hidden_size: num(hf, "d_ff")?,
            seq_length: 512,
            max_position_embeddings: 512,
            padded_vocab_size: TransformerConfig::pad_vocab(num(hf, "vocab_size")?, divisible_by),
            hidden_dropout: dropout,
            attention_dropout: dropout,
            layernorm_epsilon: hf["layer_norm_epsilon"].as_f64().unwrap_or(1e-6) as f32,
            untie_embeddings_and_output_weights: hf["tie_word_embeddings"].as_bool() == Some(false),
            normalization: Normalization::RMSNorm,
            activation,
            gelu,
            add_bias_linear: false,
            add_qkv_bias: false,
            position_embedding_type:
                megatron_core::transformer::config::PositionEmbeddingType::None,
            ..Default::default()
        })
    }

    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        vocab: usize,
    ) -> Result<Tensors, String> {
        let (h, heads, hd) = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim());
        let mut m = Tensors::new();
        let shared = take(t, "shared.weight", &[vocab, h])?;
        m.insert(
            "embedding.word_embeddings.weight".into(),
            (
                vec![cfg.padded_vocab_size, h],
                pad_rows(shared, h, cfg.padded_vocab_size),
            ),
        );
        if cfg.untie_embeddings_and_output_weights {
            let lm_head = take(t, "lm_head.weight", &[vocab, h])?;
            m.insert(
                "output_layer.weight".into(),
                (
                    vec![cfg.padded_vocab_size, h],
                    pad_rows(lm_head, h, cfg.padded_vocab_size),
                ),
            );
        }
        // The tied copies, when a writer saved them.
        for n in [
            "encoder.embed_tokens.weight",
            "decoder.embed_tokens.weight",
            "lm_head.weight",
        ] {
            t.remove(n);
        }
        let f = cfg.ffn_hidden_size;
        for (ours, [gate, up]) in gated_fc1(cfg, &self.stacks) {
            let mut x = take(t, &gate, &[f, h])?;
            x.extend(take(t, &up, &[f, h])?);
            m.insert(ours, (vec![2 * f, h], x));
        }
        for (ours, theirs, shape) in plain(cfg, &self.stacks) {
            let x = take(t, &theirs, &shape)?;
            m.insert(ours, (shape, x));
        }
        for (ours, parts) in fused(&self.stacks) {
            let xs: Vec<Vec<f32>> = parts
                .iter()
                .map(|p| take(t, p, &[heads * hd, h]))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
            let rows = parts.len() * heads * hd;
            m.insert(ours, (vec![rows, h], interleave(&refs, heads, hd, h)));
        }
        Ok(m)
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        vocab: usize,
    ) -> Result<(Value, Tensors), String> {
        let (h, heads, hd) = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim());
        let mut t = Tensors::new();
        let mut shared = take(
            m,
            "embedding.word_embeddings.weight",
            &[cfg.padded_vocab_size, h],
        )?;
        shared.truncate(vocab * h);
        t.insert("shared.weight".into(), (vec![vocab, h], shared));
        let untied = cfg.untie_embeddings_and_output_weights;
        if untied {
            let mut w = take(m, "output_layer.weight", &[cfg.padded_vocab_size, h])?;
            w.truncate(vocab * h);
            t.insert("lm_head.weight".into(), (vec![vocab, h], w));
        }
        let f = cfg.ffn_hidden_size;
        for (ours, [gate, up]) in gated_fc1(cfg, &self.stacks) {
            let mut x = take(m, &ours, &[2 * f, h])?;
            let u = x.split_off(f * h);
            t.insert(gate, (vec![f, h], x));
            t.insert(up, (vec![f, h], u));
        }
        for (ours, theirs, shape) in plain(cfg, &self.stacks) {
            let x = take(m, &ours, &shape)?;
            t.insert(theirs, (shape, x));
        }
        for (ours, parts) in fused(&self.stacks) {
            let rows = parts.len() * heads * hd;
            let x = take(m, &ours, &[rows, h])?;
            for (name, p) in parts
                .iter()
                .zip(deinterleave(&x, parts.len(), heads, hd, h))
            {
                t.insert(name.clone(), (vec![heads * hd, h], p));
            }
        }
        let st = &self.stacks;
        let gelu = match cfg.gelu {
            GeluForm::Tanh => "gelu_new",
            GeluForm::Erf => "gelu",
        };
        let (proj, act) = match cfg.activation {
            Activation::Gelu => (gelu, gelu),
            Activation::Relu => ("relu", "relu"),
            Activation::GeGLU => ("gated-gelu", "gelu_new"),
            Activation::SwiGLU => ("gated-silu", "silu"),
            Activation::SquaredRelu => ("relu2", "relu2"),
            Activation::QuickGeGLU => ("gated-quick_gelu", "quick_gelu"),
        };
        let config = json!({
            "architectures": [ARCHITECTURE],
            "model_type": "t5",
            "d_model": h,
            "d_kv": hd,
            "d_ff": cfg.ffn_hidden_size,
            "num_heads": heads,
            "num_layers": st.encoder_layers,
            "num_decoder_layers": st.decoder_layers,
            "relative_attention_num_buckets": st.relative_buckets,
            "relative_attention_max_distance": st.relative_max_distance,
            "dropout_rate": decimal(cfg.hidden_dropout),
            "layer_norm_epsilon": decimal(cfg.layernorm_epsilon),
            "feed_forward_proj": proj,
            "dense_act_fn": act,
            "is_gated_act": cfg.activation.is_gated(),
            "is_encoder_decoder": true,
            "tie_word_embeddings": !untied,
            "scale_decoder_outputs": st.scale_decoder_outputs,
            "vocab_size": vocab,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "decoder_start_token_id": 0,
            "dtype": "float32",
        });
        Ok((config, t))
    }
}
