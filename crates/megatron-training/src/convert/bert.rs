//! BERT (`BertModel`, `BertForMaskedLM`, `BertForPreTraining`) <-> megatron-rs's BERT: post-LN
//! layers, token-type embeddings, separate `query`/`key`/`value` (ours fused per head
//! `[q_h, k_h, v_h]`), exact or tanh GELU from `hidden_act`, the MLM head
//! (`cls.predictions.transform` + the output bias; the decoder weight is the tied word
//! embedding and is not saved) and the next-sentence head (pooler + `cls.seq_relationship`).
//! The task models prefix the encoder with `bert.`; `BertModel` does not.

use super::llama::{fuse_qkv, num, split_qkv};
use super::{decimal, pad_rows, take, HfFamily, Tensors};
use megatron_core::models::bert::{BertHeads, BinaryHead, LmHead};
use megatron_core::transformer::config::{GeluForm, LayerNormPlacement};
use megatron_core::TransformerConfig;
use serde_json::{json, Value};

/// The output bias of vocabulary rows added by padding (`exp(-1e4)` is 0 in f32).
const PADDED_VOCAB_BIAS: f32 = -1e4;

/// The architectures this file converts.
pub(crate) const ARCHITECTURES: [&str; 3] = ["BertModel", "BertForMaskedLM", "BertForPreTraining"];

pub(crate) struct Bert {
    /// Which Hugging Face class: what it prefixes.
    pub arch: String,
    pub heads: BertHeads,
}

impl Bert {
    /// The class that holds `heads` (export).
    pub fn for_heads(heads: BertHeads) -> Self {
        let arch = match (heads.lm_head, heads.binary_head) {
            (LmHead::MaskedLm, BinaryHead::SentenceOrder) => "BertForPreTraining",
            (LmHead::MaskedLm, _) => "BertForMaskedLM",
            (LmHead::None, _) => "BertModel",
        };
        Bert {
            arch: arch.into(),
            heads,
        }
    }

    /// A Hugging Face file of class `arch` (one of [`ARCHITECTURES`]) with config `hf`: its
    /// heads follow the class, and for a `BertModel` whether the file has the pooler.
    pub fn from_file(arch: &str, hf: &Value, t: &Tensors) -> Self {
        let encoder_only = arch == "BertModel";
        let has_pooler = t.contains_key(if encoder_only {
            "pooler.dense.weight"
        } else {
            "bert.pooler.dense.weight"
        });
        let (lm_head, binary_head) = match arch {
            "BertForPreTraining" => (LmHead::MaskedLm, BinaryHead::SentenceOrder),
            "BertForMaskedLM" => (LmHead::MaskedLm, BinaryHead::None),
            _ if has_pooler => (LmHead::None, BinaryHead::PoolerOnly),
            _ => (LmHead::None, BinaryHead::None),
        };
        Bert {
            arch: arch.into(),
            heads: BertHeads {
                num_tokentypes: hf["type_vocab_size"].as_u64().unwrap_or(2) as usize,
                binary_head,
                lm_head,
                lm_head_gelu: None,
            },
        }
    }

    fn prefix(&self) -> &'static str {
        if self.arch == "BertModel" {
            ""
        } else {
            "bert."
        }
    }
}

/// Megatron name -> Hugging Face name (within one layer: `encoder.layers.N.` <->
/// `encoder.layer.N.`) of the tensors that map one to one.
const LAYER_TENSORS: [(&str, &str); 5] = [
    ("self_attention.linear_proj", "attention.output.dense"),
    ("post_self_attn_layernorm", "attention.output.LayerNorm"),
    ("mlp.linear_fc1", "intermediate.dense"),
    ("mlp.linear_fc2", "output.dense"),
    ("post_mlp_layernorm", "output.LayerNorm"),
];

/// Whole-tensor pairs (Megatron, Hugging Face without the encoder prefix, shape) of a model.
fn plain_tensors(cfg: &TransformerConfig, heads: &BertHeads) -> Vec<(String, String, Vec<usize>)> {
    let (h, f) = (cfg.hidden_size, cfg.ffn_hidden_size);
    let mut v = vec![
        (
            "embedding.position_embeddings.weight".to_string(),
            "embeddings.position_embeddings.weight".to_string(),
            vec![cfg.max_position_embeddings, h],
        ),
        (
            "embedding.tokentype_embeddings.weight".into(),
            "embeddings.token_type_embeddings.weight".into(),
            vec![heads.num_tokentypes, h],
        ),
    ];
    for w in ["weight", "bias"] {
        v.push((
            format!("embedding.layernorm.{w}"),
            format!("embeddings.LayerNorm.{w}"),
            vec![h],
        ));
    }
    for l in 0..cfg.num_layers {
        for (m, hf) in LAYER_TENSORS {
            let weight = match m {
                "self_attention.linear_proj" => vec![h, h],
                "mlp.linear_fc1" => vec![f, h],
                "mlp.linear_fc2" => vec![h, f],
                _ => vec![h],
            };
            let bias = if m.ends_with("norm") {
                vec![h]
            } else {
                vec![weight[0]]
            };
            v.push((
                format!("encoder.layers.{l}.{m}.weight"),
                format!("encoder.layer.{l}.{hf}.weight"),
                weight,
            ));
            v.push((
                format!("encoder.layers.{l}.{m}.bias"),
                format!("encoder.layer.{l}.{hf}.bias"),
                bias,
            ));
        }
    }
    if heads.binary_head != BinaryHead::None {
        v.push((
            "pooler.dense.weight".into(),
            "pooler.dense.weight".into(),
            vec![h, h],
        ));
        v.push((
            "pooler.dense.bias".into(),
            "pooler.dense.bias".into(),
            vec![h],
        ));
    }
    v
}

/// Head tensors, with full Hugging Face names (outside the encoder prefix).
fn head_tensors(cfg: &TransformerConfig, heads: &BertHeads) -> Vec<(String, String, Vec<usize>)> {
    let h = cfg.hidden_size;
    let mut v = Vec::new();
    if heads.lm_head == LmHead::MaskedLm {
        for (m, hf, shape) in [
            (
                "lm_head.dense.weight",
                "cls.predictions.transform.dense.weight",
                vec![h, h],
            ),
            (
                "lm_head.dense.bias",
                "cls.predictions.transform.dense.bias",
                vec![h],
            ),
            (
                "lm_head.layer_norm.weight",
                "cls.predictions.transform.LayerNorm.weight",
                vec![h],
            ),
            (
                "lm_head.layer_norm.bias",
                "cls.predictions.transform.LayerNorm.bias",
                vec![h],
            ),
        ] {
            v.push((m.to_string(), hf.to_string(), shape));
        }
    }
    if heads.binary_head == BinaryHead::SentenceOrder {
        v.push((
            "binary_head.weight".into(),
            "cls.seq_relationship.weight".into(),
            vec![2, h],
        ));
        v.push((
            "binary_head.bias".into(),
            "cls.seq_relationship.bias".into(),
            vec![2],
        ));
    }
    v
}

impl Bert {
    /// The reverse of [`Bert::to_megatron_tensors`].
    fn to_hf_tensors(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        vocab: usize,
    ) -> Result<(Value, Tensors), String> {
        let heads = &self.heads;
        let (h, nh) = (cfg.hidden_size, cfg.num_attention_heads);
        let hd = h / nh;
        let p = self.prefix();
        let mut t = Tensors::new();
        let mut wte = take(
            m,
            "embedding.word_embeddings.weight",
            &[cfg.padded_vocab_size, h],
        )?;
        wte.truncate(vocab * h);
        t.insert(
            format!("{p}embeddings.word_embeddings.weight"),
            (vec![vocab, h], wte),
        );
        for (ours, theirs, shape) in plain_tensors(cfg, heads) {
            let x = take(m, &ours, &shape)?;
            t.insert(format!("{p}{theirs}"), (shape, x));
        }
        for l in 0..cfg.num_layers {
            let src = format!("encoder.layers.{l}.self_attention.linear_qkv");
            let w = take(m, &format!("{src}.weight"), &[3 * h, h])?;
            let b = take(m, &format!("{src}.bias"), &[3 * h])?;
            let (qw, kw, vw) = split_qkv(&w, nh, nh, hd, h);
            let (qb, kb, vb) = split_qkv(&b, nh, nh, hd, 1);
            let dst = format!("{p}encoder.layer.{l}.attention.self");
            for (n, x, s) in [
                ("query.weight", qw, vec![h, h]),
                ("key.weight", kw, vec![h, h]),
                ("value.weight", vw, vec![h, h]),
                ("query.bias", qb, vec![h]),
                ("key.bias", kb, vec![h]),
                ("value.bias", vb, vec![h]),
            ] {
                t.insert(format!("{dst}.{n}"), (s, x));
            }
        }
        for (ours, theirs, shape) in head_tensors(cfg, heads) {
            let x = take(m, &ours, &shape)?;
            t.insert(theirs, (shape, x));
        }
        if heads.lm_head == LmHead::MaskedLm {
            let mut b = take(m, "output_layer.bias", &[cfg.padded_vocab_size])?;
            b.truncate(vocab);
            t.insert("cls.predictions.bias".into(), (vec![vocab], b));
        }
        let act = match cfg.gelu {
            GeluForm::Erf => "gelu",
            GeluForm::Tanh => "gelu_new",
        };
        if heads.lm_head == LmHead::MaskedLm && heads.lm_head_gelu.is_some_and(|g| g != cfg.gelu) {
            return Err(format!(
                "the MLM head's GELU ({:?}, Megatron's BertLMHead) differs from the layers' ({:?}, the fused bias-GELU): Hugging Face BERT has one hidden_act for both; a model trained with --no-bias-gelu-fusion has the exact GELU in both and converts",
                heads.lm_head_gelu.unwrap_or(cfg.gelu),
                cfg.gelu
            ));
        }
        let config = json!({
            "architectures": [self.arch],
            "model_type": "bert",
            "hidden_size": h,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": nh,
            "intermediate_size": cfg.ffn_hidden_size,
            "hidden_act": act,
            "hidden_dropout_prob": decimal(cfg.hidden_dropout),
            "attention_probs_dropout_prob": decimal(cfg.attention_dropout),
            "max_position_embeddings": cfg.max_position_embeddings,
            "type_vocab_size": heads.num_tokentypes,
            "initializer_range": decimal(cfg.init_method_std),
            "layer_norm_eps": decimal(cfg.layernorm_epsilon),
            "vocab_size": vocab,
            "pad_token_id": 0,
            "position_embedding_type": "absolute",
            "dtype": "float32",
        });
        Ok((config, t))
    }

    /// Hugging Face tensors to megatron-rs names and layouts.
    fn to_megatron_tensors(
        &self,
        cfg: &TransformerConfig,
        t: &mut Tensors,
        vocab: usize,
    ) -> Result<Tensors, String> {
        let heads = &self.heads;
        let (h, nh) = (cfg.hidden_size, cfg.num_attention_heads);
        let hd = h / nh;
        let p = self.prefix();
        let mut m = Tensors::new();
        let wte = take(
            t,
            &format!("{p}embeddings.word_embeddings.weight"),
            &[vocab, h],
        )?;
        m.insert(
            "embedding.word_embeddings.weight".into(),
            (
                vec![cfg.padded_vocab_size, h],
                pad_rows(wte, h, cfg.padded_vocab_size),
            ),
        );
        for (ours, theirs, shape) in plain_tensors(cfg, heads) {
            let x = take(t, &format!("{p}{theirs}"), &shape)?;
            m.insert(ours, (shape, x));
        }
        for l in 0..cfg.num_layers {
            let src = format!("{p}encoder.layer.{l}.attention.self");
            let mut get = |n: &str, s: &[usize]| take(t, &format!("{src}.{n}"), s);
            let (qw, kw, vw) = (
                get("query.weight", &[h, h])?,
                get("key.weight", &[h, h])?,
                get("value.weight", &[h, h])?,
            );
            let (qb, kb, vb) = (
                get("query.bias", &[h])?,
                get("key.bias", &[h])?,
                get("value.bias", &[h])?,
            );
            let dst = format!("encoder.layers.{l}.self_attention.linear_qkv");
            m.insert(
                format!("{dst}.weight"),
                (vec![3 * h, h], fuse_qkv(&qw, &kw, &vw, nh, nh, hd, h)),
            );
            m.insert(
                format!("{dst}.bias"),
                (vec![3 * h], fuse_qkv(&qb, &kb, &vb, nh, nh, hd, 1)),
            );
        }
        for (ours, theirs, shape) in head_tensors(cfg, heads) {
            let x = take(t, &theirs, &shape)?;
            m.insert(ours, (shape, x));
        }
        if heads.lm_head == LmHead::MaskedLm {
            // The padded vocabulary entries' bias is far below any logit: with a zero bias
            // their zero logits would take probability mass the original model never gave
            // them, and the converted MLM loss would not be transformers'.
            let mut b = take(t, "cls.predictions.bias", &[vocab])?;
            b.resize(cfg.padded_vocab_size, PADDED_VOCAB_BIAS);
            m.insert("output_layer.bias".into(), (vec![cfg.padded_vocab_size], b));
            // The tied decoder, when a writer saved it: the word embedding and the same bias.
            t.remove("cls.predictions.decoder.weight");
            t.remove("cls.predictions.decoder.bias");
        }
        Ok(m)
    }
}

impl HfFamily for Bert {
    fn megatron_config(
        &self,
        hf: &Value,
        divisible_by: usize,
    ) -> Result<TransformerConfig, String> {
        let gelu = match hf["hidden_act"].as_str().unwrap_or("gelu") {
            "gelu" => GeluForm::Erf,
            "gelu_new" | "gelu_pytorch_tanh" => GeluForm::Tanh,
            other => {
                return Err(format!(
                    "hidden_act '{other}': only gelu, gelu_new and gelu_pytorch_tanh are built"
                ))
            }
        };
        let pos_type = hf["position_embedding_type"].as_str().unwrap_or("absolute");
        if pos_type != "absolute" {
            return Err(format!(
                "position_embedding_type '{pos_type}': only absolute positions are built"
            ));
        }
        let positions = num(hf, "max_position_embeddings")?;
        Ok(TransformerConfig {
            num_layers: num(hf, "num_hidden_layers")?,
            hidden_size: num(hf, "hidden_size")?,
            num_attention_heads: num(hf, "num_attention_heads")?,
            ffn_hidden_size: num(hf, "intermediate_size")?,
            seq_length: positions,
            max_position_embeddings: positions,
            padded_vocab_size: TransformerConfig::pad_vocab(num(hf, "vocab_size")?, divisible_by),
            hidden_dropout: hf["hidden_dropout_prob"].as_f64().unwrap_or(0.1) as f32,
            attention_dropout: hf["attention_probs_dropout_prob"].as_f64().unwrap_or(0.1) as f32,
            init_method_std: hf["initializer_range"].as_f64().unwrap_or(0.02) as f32,
            layernorm_epsilon: hf["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32,
            untie_embeddings_and_output_weights: false,
            attn_mask_type: megatron_core::transformer::config::AttnMaskType::Padding,
            gelu,
            layernorm_placement: LayerNormPlacement::PostLn,
            ..Default::default()
        })
    }

    fn to_megatron(
        &self,
        cfg: &TransformerConfig,
        hf: &mut Tensors,
        vocab: usize,
    ) -> Result<Tensors, String> {
        self.to_megatron_tensors(cfg, hf, vocab)
    }

    fn to_hf(
        &self,
        cfg: &TransformerConfig,
        m: &mut Tensors,
        vocab: usize,
    ) -> Result<(Value, Tensors), String> {
        self.to_hf_tensors(cfg, m, vocab)
    }
}
