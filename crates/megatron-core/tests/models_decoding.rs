//! Decoding through the KV cache against the full-sequence forward, over combinations of a
//! decoder's parts (norm, MLP activation, positions and their rotary variants, query groups,
//! head width, query/key norms, sliding window, biases, tied output), not only each part alone:
//! every combination the flags allow is a model a user can generate from.

mod common;

use common::assert_decoding_reproduces_full_sequence_loss;
use megatron_core::transformer::config::{
    Activation, Normalization, PositionEmbeddingType, RotaryConfig, SlidingWindow, YarnConfig,
};
use megatron_core::TransformerConfig;

/// SplitMix64: well-mixed bits from a counter, so the parts vary independently.
fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Combination `i` of the parts, each part's value drawn from its own bits of `mix(i)`.
fn combination(i: usize) -> (String, TransformerConfig) {
    let h = mix(i as u64);
    let pick = |part: usize, n: usize| ((h >> (7 * part)) % n as u64) as usize;
    let rope = |rotary| (PositionEmbeddingType::Rope, rotary);
    let base = RotaryConfig {
        base: 100.0,
        ..Default::default()
    };
    let positions = [
        ("learned", (PositionEmbeddingType::LearnedAbsolute, base)),
        ("rope", rope(base)),
        (
            "rope interleaved",
            rope(RotaryConfig {
                interleaved: true,
                ..base
            }),
        ),
        (
            "rope 50 %",
            rope(RotaryConfig {
                percent: 0.5,
                ..base
            }),
        ),
        (
            "yarn",
            (
                PositionEmbeddingType::Rope,
                RotaryConfig {
                    yarn: Some(YarnConfig {
                        factor: 4.0,
                        original_max_position_embeddings: 4,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        mscale: 1.0,
                        mscale_all_dim: 0.0,
                        correction_range_round_to_int: true,
                    }),
                    ..base
                },
            ),
        ),
    ];
    let (pos_name, (position_embedding_type, rotary)) = positions[pick(4, 5)];
    let groups = [None, Some(2), Some(1)][pick(0, 3)];
    let kv_channels = [None, Some(6)][pick(1, 2)];
    let normalization = [Normalization::LayerNorm, Normalization::RMSNorm][pick(2, 2)];
    let activation = [
        Activation::Gelu,
        Activation::SwiGLU,
        Activation::SquaredRelu,
        Activation::QuickGeGLU,
    ][pick(3, 4)];
    let qk_layernorm = pick(5, 2) == 1;
    let window = (pick(6, 2) == 1).then_some(SlidingWindow {
        left: 2,
        skip: None,
    });
    let biases = pick(7, 2) == 0;
    let untied = pick(8, 2) == 0;
    let name = format!(
        "{pos_name}, groups {groups:?}, kv_channels {kv_channels:?}, {normalization:?}, \
         {activation:?}, qk_layernorm {qk_layernorm}, window {}, biases {biases}, untied {}",
        window.is_some(),
        untied
    );
    let cfg = TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 4,
        num_query_groups: groups,
        kv_channels,
        ffn_hidden_size: 24,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 64,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.2,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: untied,
        normalization,
        activation,
        position_embedding_type,
        rotary,
        qk_layernorm,
        window,
        add_bias_linear: biases,
        add_qkv_bias: biases,
        ..Default::default()
    };
    (name, cfg)
}

#[test]
fn decoding_reproduces_the_full_sequence_loss_for_combinations_of_parts() {
    let mut checked = 0;
    for i in 0..64 {
        let (name, cfg) = combination(i);
        if let Err(e) = cfg.validate() {
            eprintln!("skipped (not a valid model): {name}: {e}");
            continue;
        }
        eprintln!("checking {name}");
        assert_decoding_reproduces_full_sequence_loss(cfg);
        checked += 1;
    }
    assert!(checked >= 48, "only {checked} valid combinations");
}
