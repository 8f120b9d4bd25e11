//! T5 (issue 21, in progress): the encoder-decoder's parts that differ from the decoder
//! stack. So far its attention (self-attention with T5's relative position bias and unscaled
//! scores, and cross-attention from the decoder to the encoder's output), the relative bias
//! table, the encoder and decoder layers and the whole model on one stage; the pipeline
//! chunk, conversion and training come next.

pub mod attention;
pub mod layer;
pub mod model;
pub mod relative_bias;

pub use attention::{T5Attention, T5AttentionKind, T5AttentionSaved, T5AttentionShape};
pub use layer::{T5Layer, T5LayerInputs, T5Stack};
pub use model::{T5Batch, T5Config, T5Model, T5Stacks};
pub use relative_bias::RelativePositionBias;
