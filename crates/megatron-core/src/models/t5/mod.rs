//! T5: the encoder-decoder's parts that differ from the decoder stack — its attention
//! (self-attention with T5's relative position bias and unscaled scores, cross-attention from
//! the decoder to the encoder's output), the relative bias table, the encoder and decoder
//! layers, the model as pipeline chunks (Megatron's encoder/decoder stage split) and
//! generation with a decoder cache.

pub mod attention;
pub mod decode;
pub mod layer;
pub mod model;
pub mod relative_bias;

pub use attention::{T5Attention, T5AttentionKind, T5AttentionSaved, T5AttentionShape};
pub use decode::T5DecodeCache;
pub use layer::{T5Layer, T5LayerInputs, T5Stack};
pub use model::{T5Batch, T5Config, T5Model, T5Part, T5Stacks};
pub use relative_bias::RelativePositionBias;
