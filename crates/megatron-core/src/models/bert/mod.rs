//! BERT (issue 21): the encoder is the config-driven transformer stack with
//! `AttnMaskType::Padding`; what only BERT has lives here — its masked-language-model head and
//! its sentence-order (binary) head. The model chunk, Megatron's `BertDataset` samples and the
//! layouts come next.

pub mod binary_head;
pub mod lm_head;

pub use binary_head::BertBinaryHead;
pub use lm_head::{BertLMHead, MaskedTokens};
