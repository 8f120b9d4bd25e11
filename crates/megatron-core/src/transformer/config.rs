use serde::{Deserialize, Serialize};

/// A configuration the model cannot be built from. Each message names the flags at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("{flag} must be positive, got {value}")]
    NotPositive { flag: &'static str, value: i64 },
    #[error("--num-attention-heads ({heads}) must divide --hidden-size ({hidden})")]
    HeadsDoNotDivideHidden { heads: usize, hidden: usize },
    #[error("--seq-length ({seq}) exceeds --max-position-embeddings ({max_pos})")]
    SeqLongerThanPositions { seq: usize, max_pos: usize },
    #[error("{flag} must be in [0, 1), got {value}")]
    BadProbability { flag: &'static str, value: f32 },
}

/// Megatron's `TransformerConfig`, the part a GPT needs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TransformerConfig {
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub ffn_hidden_size: usize,
    pub seq_length: usize,
    pub max_position_embeddings: usize,
    /// Padded vocabulary size (rows of the embedding).
    pub padded_vocab_size: usize,
    pub hidden_dropout: f32,
    pub attention_dropout: f32,
    pub init_method_std: f32,
    pub layernorm_epsilon: f32,
    pub untie_embeddings_and_output_weights: bool,
}

impl TransformerConfig {
    /// Init std of the layers that write into the residual stream (attention and MLP output
    /// projections): `init_method_std / sqrt(2 * num_layers)`.
    pub fn output_layer_init_std(&self) -> f32 {
        self.init_method_std / (2.0 * self.num_layers as f32).sqrt()
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        for (flag, v) in [
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--ffn-hidden-size", self.ffn_hidden_size),
            ("--seq-length", self.seq_length),
            ("--max-position-embeddings", self.max_position_embeddings),
            ("--vocab-size", self.padded_vocab_size),
        ] {
            if v == 0 {
                return Err(ConfigError::NotPositive { flag, value: 0 });
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(ConfigError::HeadsDoNotDivideHidden {
                heads: self.num_attention_heads,
                hidden: self.hidden_size,
            });
        }
        if self.seq_length > self.max_position_embeddings {
            return Err(ConfigError::SeqLongerThanPositions {
                seq: self.seq_length,
                max_pos: self.max_position_embeddings,
            });
        }
        for (flag, p) in [
            ("--hidden-dropout", self.hidden_dropout),
            ("--attention-dropout", self.attention_dropout),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(ConfigError::BadProbability { flag, value: p });
            }
        }
        Ok(())
    }

    /// Vocabulary padded up to a multiple of `divisible_by` (Megatron's `_vocab_size_with_padding`).
    pub fn pad_vocab(vocab: usize, divisible_by: usize) -> usize {
        let d = divisible_by.max(1);
        vocab.div_ceil(d) * d
    }
}
