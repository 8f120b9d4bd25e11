//! T5 (issue 21, in progress): the encoder-decoder's parts that differ from the decoder
//! stack. So far its attention (self-attention with T5's relative position bias and unscaled
//! scores, and cross-attention from the decoder to the encoder's output); the layers, stacks,
//! model chunk, conversion and training come next.

pub mod attention;

pub use attention::{T5Attention, T5AttentionKind, T5AttentionSaved};
