//! gpt-oss's pieces on the config-driven decoder: attention sinks (`--softmax-type`), the
//! clamped Quick-GEGLU with its linear offset, experts and router with biases, alternating
//! sliding-window layers. Whole-model gradients against central differences, and decoding
//! through the KV cache against the full-sequence forward.

mod common;

use common::*;
use megatron_core::transformer::config::{
    Activation, GluConfig, LayerPattern, MoEConfig, Normalization, PositionEmbeddingType,
    RotaryConfig, SlidingWindow, SoftmaxType,
};
use megatron_core::{GPTModel, TransformerConfig};

fn tiny_gpt_oss() -> TransformerConfig {
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
        untie_embeddings_and_output_weights: true,
        normalization: Normalization::RMSNorm,
        activation: Activation::QuickGeGLU,
        glu: GluConfig {
            linear_offset: 1.0,
            clamp_value: Some(0.6),
        },
        softmax_type: SoftmaxType::Learnable,
        position_embedding_type: PositionEmbeddingType::Rope,
        rotary: RotaryConfig {
            base: 100.0,
            ..Default::default()
        },
        // Windowed, then full attention (gpt-oss's alternation).
        window: Some(SlidingWindow {
            left: 2,
            skip: Some(LayerPattern::Every(2)),
        }),
        add_bias_linear: true,
        add_qkv_bias: true,
        moe: Some(MoEConfig {
            biases: true,
            ..MoEConfig::new(4, 12, 4)
        }),
        ..Default::default()
    }
}

#[test]
fn gpt_oss_style_model_gradient_matches_finite_difference() {
    // Every expert selected (top-4 of 4) keeps the loss smooth in the router; the clamp at 0.6
    // cuts some of fc1's outputs, so the differences take steps of 1e-3 (a step of 1e-2 moves
    // enough of fc1's outputs across the clamp to bend the difference quotient).
    gradient_check_with_step(tiny_gpt_oss(), 1e-3);
}

#[test]
fn off_by_one_softmax_and_dense_clamped_mlp_gradient_matches_finite_difference() {
    gradient_check_with_step(
        TransformerConfig {
            softmax_type: SoftmaxType::OffByOne,
            moe: None,
            ..tiny_gpt_oss()
        },
        3e-3,
    );
}

#[test]
fn gpt_oss_style_model_registers_sinks_and_biases_under_megatron_names() {
    let (_, params) = GPTModel::new(tiny_gpt_oss(), 1);
    for name in [
        "decoder.layers.0.self_attention.core_attention.softmax_offset",
        "decoder.layers.1.mlp.router.bias",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.bias",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.bias",
    ] {
        let m = params
            .metas
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("{name} is not registered"));
        assert!(!m.weight_decay, "{name}: 1-D tensors do not decay");
    }
    let (_, plain) = GPTModel::new(
        TransformerConfig {
            softmax_type: SoftmaxType::Vanilla,
            ..tiny_gpt_oss()
        },
        1,
    );
    assert!(plain
        .metas
        .iter()
        .all(|m| !m.name.contains("softmax_offset")));
}

#[test]
fn gpt_oss_style_decoding_reproduces_full_sequence_loss() {
    assert_decoding_reproduces_full_sequence_loss(tiny_gpt_oss());
    assert_decoding_reproduces_full_sequence_loss(TransformerConfig {
        softmax_type: SoftmaxType::OffByOne,
        ..tiny_gpt_oss()
    });
}
