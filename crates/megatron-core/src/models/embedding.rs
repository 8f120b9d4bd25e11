//! `LanguageModelEmbedding`: word + learned position embeddings, then embedding dropout.

use crate::params::{Grads, Init, ParamId, Params};
use crate::transformer::config::TransformerConfig;
use crate::transformer::step::StepContext;
use megatron_tensor::cpu::dropout::{dropout_backward, dropout_forward};
use megatron_tensor::cpu::{embedding_backward, embedding_forward};
use megatron_tensor::Tensor;

pub struct LanguageModelEmbedding {
    pub word_embeddings: ParamId,
    pub position_embeddings: ParamId,
    hidden: usize,
    dropout: f32,
}

const SITE_EMBEDDING_DROPOUT: u64 = 0;
/// Layer index used for the embedding's random stream (transformer layers use 0..L).
const EMBEDDING_LAYER: usize = usize::MAX >> 1;

impl LanguageModelEmbedding {
    pub fn new(cfg: &TransformerConfig, params: &mut Params, inits: &mut Vec<Init>) -> Self {
        let h = cfg.hidden_size;
        let word_embeddings = params.add(
            inits,
            "embedding.word_embeddings.weight".into(),
            &[cfg.padded_vocab_size, h],
            true,
            Init::Normal(cfg.init_method_std),
        );
        let position_embeddings = params.add(
            inits,
            "embedding.position_embeddings.weight".into(),
            &[cfg.max_position_embeddings, h],
            true,
            Init::Normal(cfg.init_method_std),
        );
        LanguageModelEmbedding {
            word_embeddings,
            position_embeddings,
            hidden: h,
            dropout: cfg.hidden_dropout,
        }
    }

    /// `positions` (`[b, t]`) replaces the default `0..t` (Megatron's `--reset-position-ids`).
    pub fn forward(
        &self,
        params: &Params,
        tokens: &[u32],
        positions: Option<&[u32]>,
        t: usize,
        ctx: &StepContext,
    ) -> Tensor {
        let n = tokens.len();
        let mut out = Tensor::for_overwrite(&[n, self.hidden]);
        embedding_forward(
            out.data_mut(),
            tokens,
            positions,
            params.get(self.word_embeddings),
            params.get(self.position_embeddings),
            t,
        );
        let p = ctx.p(self.dropout);
        if p > 0.0 {
            let mut d = Tensor::for_overwrite(&[n, self.hidden]);
            dropout_forward(
                d.data_mut(),
                out.data(),
                p,
                ctx.site_for(EMBEDDING_LAYER, SITE_EMBEDDING_DROPOUT, t * self.hidden),
            );
            out = d;
        }
        out
    }

    pub fn backward(
        &self,
        grads: &mut Grads,
        tokens: &[u32],
        positions: Option<&[u32]>,
        t: usize,
        dout: Tensor,
        ctx: &StepContext,
    ) {
        let p = ctx.p(self.dropout);
        let dout = if p > 0.0 {
            let mut d = Tensor::for_overwrite(dout.shape());
            dropout_backward(
                d.data_mut(),
                dout.data(),
                p,
                ctx.site_for(EMBEDDING_LAYER, SITE_EMBEDDING_DROPOUT, t * self.hidden),
            );
            d
        } else {
            dout
        };
        let [dwte, dwpe] = grads.many_mut([self.word_embeddings, self.position_embeddings]);
        embedding_backward(dwte, dwpe, dout.data(), tokens, positions, t);
    }
}
