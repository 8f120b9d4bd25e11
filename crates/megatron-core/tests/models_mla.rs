//! Multi-latent attention (DeepSeek-V2/V3, megatron-core's `MLASelfAttention`) on the
//! config-driven decoder: gradients, decoding, names and shapes.

mod common;

use common::*;
use megatron_core::transformer::config::{
    Activation, MLAConfig, Normalization, PositionEmbeddingType, RotaryConfig, YarnConfig,
};
use megatron_core::{GPTModel, TransformerConfig};

fn mla(q_lora_rank: Option<usize>, v_head_dim: usize) -> MLAConfig {
    MLAConfig {
        q_lora_rank,
        kv_lora_rank: 6,
        qk_head_dim: 4,
        qk_pos_emb_head_dim: 2,
        v_head_dim,
    }
}

/// DeepSeek-V3's shape of things at toy size: RMSNorm, SwiGLU, no biases, untied, the latents'
/// norms (`--qk-layernorm`), values narrower than queries and keys.
fn tiny_mla() -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 4,
        ffn_hidden_size: 24,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.2,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: true,
        normalization: Normalization::RMSNorm,
        activation: Activation::SwiGLU,
        position_embedding_type: PositionEmbeddingType::Rope,
        rotary: RotaryConfig {
            base: 100.0,
            ..Default::default()
        },
        add_bias_linear: false,
        add_qkv_bias: false,
        qk_layernorm: true,
        mla: Some(mla(Some(8), 3)),
        ..Default::default()
    }
}

fn yarn() -> RotaryConfig {
    RotaryConfig {
        base: 100.0,
        yarn: Some(YarnConfig {
            factor: 4.0,
            original_max_position_embeddings: 4,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
            correction_range_round_to_int: true,
        }),
        ..Default::default()
    }
}

#[test]
fn mla_whole_model_gradient_matches_finite_difference() {
    gradient_check(tiny_mla());
}

#[test]
fn mla_without_query_latent_or_norms_and_with_full_width_values_gradient_matches() {
    // linear_q_proj straight from the hidden state, no latent norms, v = qk + pe (no padding),
    // LayerNorm, tied embeddings.
    gradient_check(TransformerConfig {
        mla: Some(mla(None, 6)),
        qk_layernorm: false,
        normalization: Normalization::LayerNorm,
        untie_embeddings_and_output_weights: false,
        ..tiny_mla()
    });
}

#[test]
fn mla_with_yarn_scales_the_softmax_and_its_gradient_matches() {
    let cfg = TransformerConfig {
        rotary: yarn(),
        ..tiny_mla()
    };
    // mscale(4, 1) = 0.1 ln 4 + 1; the softmax scale gains its square.
    let m = 0.1 * 4f64.ln() + 1.0;
    assert!((cfg.mla_query_scale() as f64 - m * m).abs() < 1e-6);
    gradient_check(cfg);
}

#[test]
fn mla_decoding_reproduces_full_sequence_loss() {
    assert_decoding_reproduces_full_sequence_loss(tiny_mla());
    assert_decoding_reproduces_full_sequence_loss(TransformerConfig {
        mla: Some(mla(None, 6)),
        rotary: yarn(),
        ..tiny_mla()
    });
}

#[test]
fn mla_parameters_have_megatron_names_and_shapes() {
    let (_, params) = GPTModel::new(tiny_mla(), 1);
    let meta = |n: &str| {
        let name = format!("decoder.layers.1.self_attention.{n}");
        params.metas[params.find(&name).unwrap_or_else(|| panic!("{name}")).0].clone()
    };
    // 4 heads: queries of 4 + 2 features, keys 4 (+ the shared 2), values 3.
    for (n, shape) in [
        ("linear_q_down_proj.weight", vec![8, 16]),
        ("q_layernorm.weight", vec![8]),
        ("linear_q_up_proj.weight", vec![24, 8]),
        ("linear_kv_down_proj.weight", vec![8, 16]),
        ("kv_layernorm.weight", vec![6]),
        ("linear_kv_up_proj.weight", vec![28, 6]),
        ("linear_proj.weight", vec![16, 12]),
    ] {
        assert_eq!(meta(n).shape, shape, "{n}");
    }
    // Duplicated down projections: partial gradients under sequence parallelism only.
    let down = meta("linear_kv_down_proj.weight");
    assert!(down.tp_replicated && down.sequence_parallel_grad && !down.tp_partial_grad);
    assert_eq!(meta("linear_kv_up_proj.weight").tp_split_dim, Some(0));
    assert!(params
        .find("decoder.layers.0.self_attention.linear_qkv.weight")
        .is_none());
    let (_, plain) = GPTModel::new(
        TransformerConfig {
            mla: Some(mla(None, 6)),
            qk_layernorm: false,
            ..tiny_mla()
        },
        1,
    );
    for n in ["linear_q_proj.weight", "linear_kv_down_proj.weight"] {
        assert!(
            plain
                .find(&format!("decoder.layers.0.self_attention.{n}"))
                .is_some(),
            "{n}"
        );
    }
    for n in ["q_layernorm", "kv_layernorm", "linear_q_down_proj"] {
        assert!(
            plain
                .find(&format!("decoder.layers.0.self_attention.{n}.weight"))
                .is_none(),
            "{n}"
        );
    }
}

#[test]
fn mla_refuses_values_wider_than_keys_groups_and_missing_rope() {
    let bad = |cfg: TransformerConfig| cfg.validate().unwrap_err().to_string();
    assert!(bad(TransformerConfig {
        mla: Some(mla(None, 7)),
        ..tiny_mla()
    })
    .contains("--v-head-dim (7)"));
    assert!(bad(TransformerConfig {
        position_embedding_type: PositionEmbeddingType::LearnedAbsolute,
        ..tiny_mla()
    })
    .contains("--position-embedding-type rope"));
    assert!(bad(TransformerConfig {
        num_query_groups: Some(2),
        ..tiny_mla()
    })
    .contains("--group-query-attention"));
    tiny_mla().validate().unwrap();
}
