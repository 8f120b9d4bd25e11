//! `LanguageModelEmbedding`: word embeddings (vocabulary-parallel) + learned position
//! embeddings (only under `--position-embedding-type learned_absolute`; rotary embeddings act
//! inside attention) + token-type embeddings (BERT's segments, when the model has them), then
//! embedding dropout. The sum and the dropout are also separate steps, for a model that
//! normalizes in between (post-LN BERT). Under sequence parallelism the output is this rank's
//! block of token rows (the word lookup is reduce-scattered; positions and dropout are applied
//! to the block with global numbering).

use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::{Tp, VocabParallelEmbedding};
use crate::transformer::config::{PositionEmbeddingType, TransformerConfig};
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::dropout::{dropout_backward, dropout_forward};
use megatron_tensor::cpu::{embedding_lookup_backward, embedding_lookup_forward};
use megatron_tensor::Tensor;

pub struct LanguageModelEmbedding {
    pub word: VocabParallelEmbedding,
    pub word_embeddings: ParamId,
    pub position_embeddings: Option<ParamId>,
    /// `[num_tokentypes, hidden]` (Megatron's `num_tokentypes`), if the model has segments.
    pub tokentype_embeddings: Option<ParamId>,
    hidden: usize,
    dropout: f32,
}

const SITE_EMBEDDING_DROPOUT: u64 = 0;
/// Layer index used for the embedding's random stream (transformer layers use 0..L).
const EMBEDDING_LAYER: usize = usize::MAX >> 1;

impl LanguageModelEmbedding {
    pub fn new(cfg: &TransformerConfig, params: &mut Params, inits: &mut Vec<Init>) -> Self {
        Self::with_tokentypes(cfg, 0, params, inits)
    }

    /// With `num_tokentypes` segment embeddings (none if 0).
    pub fn with_tokentypes(
        cfg: &TransformerConfig,
        num_tokentypes: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let word = VocabParallelEmbedding::new(
            params,
            inits,
            "embedding.word_embeddings.weight",
            cfg.padded_vocab_size,
            h,
            cfg.init_method_std,
        );
        let learned = cfg.position_embedding_type == PositionEmbeddingType::LearnedAbsolute;
        let position_embeddings = learned.then(|| {
            params.add_sharded(
                inits,
                "embedding.position_embeddings.weight".into(),
                &[cfg.max_position_embeddings, h],
                true,
                Init::Normal(cfg.init_method_std),
                Sharding::ReplicatedSequenceParallel,
            )
        });
        let tokentype_embeddings = (num_tokentypes > 0).then(|| {
            params.add_sharded(
                inits,
                "embedding.tokentype_embeddings.weight".into(),
                &[num_tokentypes, h],
                true,
                Init::Normal(cfg.init_method_std),
                Sharding::ReplicatedSequenceParallel,
            )
        });
        LanguageModelEmbedding {
            word_embeddings: word.weight,
            word,
            position_embeddings,
            tokentype_embeddings,
            hidden: h,
            dropout: cfg.hidden_dropout,
        }
    }

    /// The word embedding over `word`, a copy of the first stage's table on the last stage
    /// (multi-token prediction embeds its shifted tokens there); no position embeddings.
    pub fn sharing_word(cfg: &TransformerConfig, word: ParamId, params: &Params) -> Self {
        let h = cfg.hidden_size;
        LanguageModelEmbedding {
            word: VocabParallelEmbedding::over(params, word, cfg.padded_vocab_size, h),
            word_embeddings: word,
            position_embeddings: None,
            tokentype_embeddings: None,
            hidden: h,
            dropout: cfg.hidden_dropout,
        }
    }

    /// The last pipeline stage's copy of a tied model's word embedding (the output layer's
    /// weight): registered under the same name and with the same initialization as the first
    /// stage's (so no start-up synchronization is needed), marked `shared` (its gradient is
    /// summed over the embedding group).
    pub fn last_stage_copy(
        cfg: &TransformerConfig,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> ParamId {
        let id = params.add_sharded(
            inits,
            "embedding.word_embeddings.weight".into(),
            &[cfg.padded_vocab_size, cfg.hidden_size],
            true,
            Init::Normal(cfg.init_method_std),
            Sharding::Split(0),
        );
        params.metas[id.0].shared = true;
        id
    }

    /// Position ids of token rows `[lo, hi)`.
    fn position_ids(positions: Option<&[u32]>, t: usize, lo: usize, hi: usize) -> Vec<u32> {
        (lo..hi)
            .map(|r| positions.map_or((r % t) as u32, |p| p[r]))
            .collect()
    }

    /// `positions` (`[b, t]`) replaces the default `0..t` (Megatron's `--reset-position-ids`).
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        tokens: &[u32],
        positions: Option<&[u32]>,
        t: usize,
        ctx: &StepContext,
    ) -> Result<Tensor, CommError> {
        let sum = self.sum_forward(params, tp, tokens, positions, None, t)?;
        Ok(self.dropout_forward(tp, sum, tokens.len(), t, ctx))
    }

    /// Word + position (+ token-type, `[b, t]`) embeddings of this rank's token rows, before
    /// dropout.
    pub fn sum_forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        tokens: &[u32],
        positions: Option<&[u32]>,
        tokentypes: Option<&[u32]>,
        t: usize,
    ) -> Result<Tensor, CommError> {
        let (lo, hi) = tp.sequence_shard(tokens.len());
        let mut out = self.word.forward(params, tp, tokens)?;
        if let Some(wpe) = self.position_embeddings {
            let pos = Self::position_ids(positions, t, lo, hi);
            embedding_lookup_forward(out.data_mut(), &pos, &params.get(wpe), 0, true);
        }
        if let (Some(tte), Some(types)) = (self.tokentype_embeddings, tokentypes) {
            embedding_lookup_forward(out.data_mut(), &types[lo..hi], &params.get(tte), 0, true);
        }
        Ok(out)
    }

    /// Embedding dropout of this rank's rows of the micro-batch's `n` tokens (masks numbered
    /// by micro-batch element).
    pub fn dropout_forward(
        &self,
        tp: &Tp,
        x: Tensor,
        n: usize,
        t: usize,
        ctx: &StepContext,
    ) -> Tensor {
        self.dropout_forward_at(tp, x, (n, t), ctx, EMBEDDING_LAYER)
    }

    /// [`Self::dropout_forward`] with the masks of dropout site `layer`.
    fn dropout_forward_at(
        &self,
        tp: &Tp,
        x: Tensor,
        (n, t): (usize, usize),
        ctx: &StepContext,
        layer: usize,
    ) -> Tensor {
        let p = ctx.p(self.dropout);
        if p == 0.0 {
            return x;
        }
        let (lo, hi) = tp.sequence_shard(n);
        let mut d = Tensor::for_overwrite(x.shape());
        for (r, key) in self.dropout_runs(tp, lo, hi, t, ctx, layer) {
            dropout_forward(&mut d.data_mut()[r.clone()], &x.data()[r], p, key);
        }
        d
    }

    /// This rank's embedding rows `lo..hi` as runs consecutive in the micro-batch (one, or
    /// one per context-parallel chunk) with the dropout key of each: masks numbered by
    /// micro-batch element, so every layout draws one rank's.
    fn dropout_runs(
        &self,
        tp: &Tp,
        lo: usize,
        hi: usize,
        t: usize,
        ctx: &StepContext,
        layer: usize,
    ) -> Vec<(std::ops::Range<usize>, megatron_tensor::RngKey)> {
        let cp = tp.cp_layout();
        let h = self.hidden;
        let base = ctx.site_for(layer, SITE_EMBEDDING_DROPOUT, t * cp.size * h);
        crate::context_parallel::element_runs(lo, hi, t, cp, h)
            .into_iter()
            .map(|(r, k)| (r, base.offset(k)))
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        grads: &mut Grads,
        tp: &mut Tp,
        tokens: &[u32],
        positions: Option<&[u32]>,
        t: usize,
        dout: Tensor,
        ctx: &StepContext,
    ) -> Result<(), CommError> {
        let dsum = self.dropout_backward(tp, dout, tokens.len(), t, ctx);
        self.sum_backward(grads, tp, tokens, positions, None, t, dsum)
    }

    /// The gradient through [`Self::dropout_forward`].
    pub fn dropout_backward(
        &self,
        tp: &Tp,
        dout: Tensor,
        n: usize,
        t: usize,
        ctx: &StepContext,
    ) -> Tensor {
        self.dropout_backward_at(tp, dout, (n, t), ctx, EMBEDDING_LAYER)
    }

    /// [`Self::dropout_backward`] with the masks of dropout site `layer`.
    fn dropout_backward_at(
        &self,
        tp: &Tp,
        dout: Tensor,
        (n, t): (usize, usize),
        ctx: &StepContext,
        layer: usize,
    ) -> Tensor {
        let p = ctx.p(self.dropout);
        if p == 0.0 {
            return dout;
        }
        let (lo, hi) = tp.sequence_shard(n);
        let mut d = Tensor::for_overwrite(dout.shape());
        for (r, key) in self.dropout_runs(tp, lo, hi, t, ctx, layer) {
            dropout_backward(&mut d.data_mut()[r.clone()], &dout.data()[r], p, key);
        }
        d
    }

    /// The embedding of multi-token-prediction depth `depth`'s shifted tokens (and
    /// positions): the same tables, dropout masks of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_shifted(
        &self,
        params: &Params,
        tp: &mut Tp,
        tokens: &[u32],
        positions: &[u32],
        t: usize,
        ctx: &StepContext,
        depth: usize,
    ) -> Result<Tensor, CommError> {
        let sum = self.sum_forward(params, tp, tokens, Some(positions), None, t)?;
        let site = EMBEDDING_LAYER - 1 - depth;
        Ok(self.dropout_forward_at(tp, sum, (tokens.len(), t), ctx, site))
    }

    /// The gradient of [`Self::forward_shifted`] into the tables.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_shifted(
        &self,
        grads: &mut Grads,
        tp: &mut Tp,
        tokens: &[u32],
        positions: &[u32],
        t: usize,
        dout: Tensor,
        ctx: &StepContext,
        depth: usize,
    ) -> Result<(), CommError> {
        let site = EMBEDDING_LAYER - 1 - depth;
        let dsum = self.dropout_backward_at(tp, dout, (tokens.len(), t), ctx, site);
        self.sum_backward(grads, tp, tokens, Some(positions), None, t, dsum)
    }

    /// The gradients of [`Self::sum_forward`]'s tables.
    #[allow(clippy::too_many_arguments)]
    pub fn sum_backward(
        &self,
        grads: &mut Grads,
        tp: &mut Tp,
        tokens: &[u32],
        positions: Option<&[u32]>,
        tokentypes: Option<&[u32]>,
        t: usize,
        dout: Tensor,
    ) -> Result<(), CommError> {
        let (lo, hi) = tp.sequence_shard(tokens.len());
        if let Some(wpe) = self.position_embeddings {
            let pos = Self::position_ids(positions, t, lo, hi);
            embedding_lookup_backward(grads.get_mut(wpe), dout.data(), &pos, 0);
        }
        if let (Some(tte), Some(types)) = (self.tokentype_embeddings, tokentypes) {
            embedding_lookup_backward(grads.get_mut(tte), dout.data(), &types[lo..hi], 0);
        }
        self.word.backward(grads, tp, tokens, dout)
    }
}
