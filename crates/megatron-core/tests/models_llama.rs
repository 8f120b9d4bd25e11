//! The Llama family on the one config-driven decoder: RMSNorm, SwiGLU, RoPE, grouped-query
//! attention, no biases, untied output layer.

mod common;

use common::*;
use megatron_core::transformer::config::{
    Activation, LayerPattern, Normalization, PositionEmbeddingType, RotaryConfig, SlidingWindow,
};
use megatron_core::{GPTModel, TransformerConfig};

fn tiny_llama() -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 4,
        num_query_groups: Some(2),
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
        ..Default::default()
    }
}

#[test]
fn llama_whole_model_gradient_matches_finite_difference() {
    gradient_check(tiny_llama());
}

#[test]
fn qwen_style_model_with_qkv_bias_partial_interleaved_rope_and_mqa_gradient_matches() {
    // Multi-query (1 group), a QKV bias without other biases, half the head rotated in the
    // interleaved convention, tied embeddings.
    let cfg = TransformerConfig {
        num_query_groups: Some(1),
        add_qkv_bias: true,
        untie_embeddings_and_output_weights: false,
        rotary: RotaryConfig {
            base: 100.0,
            percent: 0.5,
            interleaved: true,
            scaling_factor: None,
            yarn: None,
            seq_len_interpolation_factor: None,
        },
        ..tiny_llama()
    };
    gradient_check(cfg);
}

#[test]
fn qk_layernorm_gradient_matches_finite_difference_with_rmsnorm_and_layernorm() {
    // Qwen3-style: each head's queries and keys RMS-normalized before RoPE; and the LayerNorm
    // kind (weight and bias per norm).
    gradient_check(TransformerConfig {
        qk_layernorm: true,
        ..tiny_llama()
    });
    gradient_check(TransformerConfig {
        qk_layernorm: true,
        normalization: Normalization::LayerNorm,
        ..tiny_llama()
    });
}

#[test]
fn qk_layernorm_decoding_reproduces_full_sequence_loss() {
    assert_decoding_reproduces_full_sequence_loss(TransformerConfig {
        qk_layernorm: true,
        ..tiny_llama()
    });
}

#[test]
fn llama_kv_cache_decoding_reproduces_full_sequence_loss() {
    // RoPE positions continue in the cache; the cache holds one K and V per query group.
    assert_decoding_reproduces_full_sequence_loss(tiny_llama());
    assert_decoding_reproduces_full_sequence_loss(TransformerConfig {
        num_query_groups: Some(1),
        rotary: RotaryConfig {
            scaling_factor: Some(8.0),
            ..Default::default()
        },
        ..tiny_llama()
    });
    // YaRN: interpolated frequencies and cos/sin scaled by its concentration factor.
    assert_decoding_reproduces_full_sequence_loss(TransformerConfig {
        rotary: RotaryConfig {
            yarn: Some(megatron_core::transformer::config::YarnConfig {
                factor: 4.0,
                original_max_position_embeddings: 8,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
                mscale_all_dim: 0.0,
                correction_range_round_to_int: true,
            }),
            ..Default::default()
        },
        ..tiny_llama()
    });
}

#[test]
fn llama_parameters_have_megatron_names_and_shapes_without_biases_or_positions() {
    let (_, params) = GPTModel::new(tiny_llama(), 1);
    let shape = |n: &str| {
        params.metas[params.find(n).unwrap_or_else(|| panic!("{n}")).0]
            .shape
            .clone()
    };
    // 4 query heads + 2 keys + 2 values of 4 features.
    assert_eq!(
        shape("decoder.layers.0.self_attention.linear_qkv.weight"),
        [32, 16]
    );
    assert_eq!(
        shape("decoder.layers.0.self_attention.linear_proj.weight"),
        [16, 16]
    );
    // Fused [gate; up].
    assert_eq!(shape("decoder.layers.1.mlp.linear_fc1.weight"), [48, 16]);
    assert_eq!(shape("decoder.layers.1.mlp.linear_fc2.weight"), [16, 24]);
    assert_eq!(shape("decoder.layers.1.input_layernorm.weight"), [16]);
    assert_eq!(shape("decoder.final_layernorm.weight"), [16]);
    assert_eq!(shape("output_layer.weight"), [64, 16]);
    for m in &params.metas {
        assert!(
            !m.name.ends_with(".bias"),
            "{} under --disable-bias-linear",
            m.name
        );
        assert!(!m.name.contains("position_embeddings"), "{}", m.name);
    }
}

#[test]
fn qk_layernorm_weights_are_per_head_dimension_with_megatron_names() {
    let cfg = TransformerConfig {
        qk_layernorm: true,
        ..tiny_llama()
    };
    let (_, params) = GPTModel::new(cfg, 1);
    for n in ["q_layernorm", "k_layernorm"] {
        let id = params
            .find(&format!("decoder.layers.1.self_attention.{n}.weight"))
            .unwrap_or_else(|| panic!("{n}"));
        let m = &params.metas[id.0];
        assert_eq!(m.shape, [4]);
        assert!(m.tp_partial_grad && m.tp_replicated, "{n}");
    }
}

#[test]
fn swiglu_default_ffn_size_is_megatrons() {
    // int(4h * 2/3 / 64) * 64: h 4096 -> 10880 (Megatron's Llama-2-7B-style default), h 576 -> 1536.
    assert_eq!(
        TransformerConfig::default_ffn_hidden_size(4096, Activation::SwiGLU),
        10880
    );
    assert_eq!(
        TransformerConfig::default_ffn_hidden_size(576, Activation::SwiGLU),
        1536
    );
    assert_eq!(
        TransformerConfig::default_ffn_hidden_size(576, Activation::Gelu),
        2304
    );
}

/// Mistral-style sliding windows of 2 earlier keys over 8 tokens, on both layers or (with
/// `Every(2)`, megatron-core's 1-based count) on the first only.
fn windowed(skip: Option<LayerPattern>) -> TransformerConfig {
    TransformerConfig {
        window: Some(SlidingWindow { left: 2, skip }),
        ..tiny_llama()
    }
}

#[test]
fn sliding_window_gradient_matches_finite_difference() {
    gradient_check(windowed(None));
    gradient_check(windowed(Some(LayerPattern::Every(2))));
}

#[test]
fn sliding_window_decoding_reproduces_full_sequence_loss() {
    // The cache keeps every position; a windowed layer's query reads only its window of it.
    assert_decoding_reproduces_full_sequence_loss(windowed(None));
    assert_decoding_reproduces_full_sequence_loss(windowed(Some(LayerPattern::List(vec![
        false, true,
    ]))));
}

#[test]
fn window_attn_skip_freq_picks_the_full_attention_layers() {
    let cfg = |skip| TransformerConfig {
        num_layers: 6,
        ..windowed(skip)
    };
    let windows = |c: &TransformerConfig| (0..6).map(|l| c.attention_window(l)).collect::<Vec<_>>();
    // Every 3rd layer (layer numbers 3 and 6, counting from 1) keeps full attention.
    let w = Some(2);
    assert_eq!(windows(&cfg(None)), vec![w; 6]);
    assert_eq!(
        windows(&cfg(Some(LayerPattern::Every(3)))),
        vec![w, w, None, w, w, None]
    );
    let list = LayerPattern::List(vec![true, false, false, true, true, false]);
    assert_eq!(windows(&cfg(Some(list))), vec![w, None, None, w, w, None]);
    // A pattern of the wrong length is refused by name.
    let short = cfg(Some(LayerPattern::List(vec![true; 4])));
    let e = short.validate().unwrap_err().to_string();
    assert!(
        e.contains("--window-attn-skip-freq") && e.contains("6 layers"),
        "{e}"
    );
}

#[test]
fn a_window_changes_the_loss_and_one_covering_the_sequence_does_not() {
    let (model, params) = GPTModel::new(tiny_llama(), 3);
    let (b, t) = (2, 8);
    let (tokens, labels, mask) = data(b, t);
    let batch = megatron_core::Batch {
        tokens: &tokens,
        labels: &labels,
        loss_mask: &mask,
        b,
        t,
        position_ids: None,
        doc_start: None,
    };
    let full = model.forward_loss_serial(&params, &batch);
    let loss_with = |left: usize| {
        let cfg = TransformerConfig {
            window: Some(SlidingWindow { left, skip: None }),
            ..tiny_llama()
        };
        let (m, p) = GPTModel::new(cfg, 3);
        assert_eq!(p.data, params.data, "the window adds no parameters");
        m.forward_loss_serial(&p, &batch)
    };
    assert_eq!(loss_with(7), full, "7 earlier keys cover 8 tokens");
    assert!(
        (loss_with(2) - full).abs() > 1e-4,
        "a window of 2 is another model"
    );
}
