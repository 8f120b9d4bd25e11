//! BERT: the encoder is the config-driven transformer stack with `AttnMaskType::Padding`;
//! what only BERT has lives here — its embeddings' segments, its masked-language-model head,
//! its sentence-order (binary) head and the model chunk that assembles them.

pub mod binary_head;
pub mod lm_head;
pub mod model;

pub use binary_head::BertBinaryHead;
pub use lm_head::{BertLMHead, HeadBackward, MaskedTokens};
pub use model::{BertBatch, BertConfig, BertHeads, BertModel, BinaryHead, LmHead};

use crate::params::{Init, ParamId, Params};

/// A replicated linear layer's weight `[out, inp]` (decayed, normal init) and bias (zeros)
/// under `name`.
fn linear(
    params: &mut Params,
    inits: &mut Vec<Init>,
    name: &str,
    out: usize,
    inp: usize,
    std: f32,
) -> (ParamId, ParamId) {
    (
        params.add(
            inits,
            format!("{name}.weight"),
            &[out, inp],
            true,
            Init::Normal(std),
        ),
        params.add(
            inits,
            format!("{name}.bias"),
            &[out],
            false,
            Init::Const(0.0),
        ),
    )
}
