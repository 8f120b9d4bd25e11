use megatron_core::{ConfigError, TransformerConfig};

fn ok() -> TransformerConfig {
    TransformerConfig {
        num_layers: 2,
        hidden_size: 16,
        num_attention_heads: 2,
        ffn_hidden_size: 64,
        seq_length: 8,
        max_position_embeddings: 8,
        padded_vocab_size: 128,
        hidden_dropout: 0.1,
        attention_dropout: 0.1,
        init_method_std: 0.02,
        layernorm_epsilon: 1e-5,
        untie_embeddings_and_output_weights: false,
        ..Default::default()
    }
}

#[test]
fn valid_config_passes() {
    assert_eq!(ok().validate(), Ok(()));
}

#[test]
fn heads_not_dividing_hidden_is_refused_naming_both_flags() {
    let mut c = ok();
    c.num_attention_heads = 3;
    let e = c.validate().unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("--num-attention-heads") && msg.contains("--hidden-size"),
        "{msg}"
    );
}

#[test]
fn seq_longer_than_positions_is_refused() {
    let mut c = ok();
    c.seq_length = 16;
    assert_eq!(
        c.validate(),
        Err(ConfigError::SeqLongerThanPositions {
            seq: 16,
            max_pos: 8
        })
    );
}

#[test]
fn zero_sizes_are_refused() {
    let mut c = ok();
    c.num_layers = 0;
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--num-layers"));
    let mut c = ok();
    c.hidden_dropout = 1.0;
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--hidden-dropout"));
}

#[test]
fn vocab_is_padded_to_multiple() {
    assert_eq!(TransformerConfig::pad_vocab(50257, 128), 50304);
    assert_eq!(TransformerConfig::pad_vocab(256, 128), 256);
    assert_eq!(TransformerConfig::pad_vocab(257, 128), 384);
}
