//! BERT's masked-language-model head (megatron-core's `BertLMHead` and the output layer):
//! the masked positions' hidden states through a dense layer, GELU and LayerNorm (replicated
//! over tensor parallelism, as Megatron's `get_linear_layer` dense is), then logits against the
//! word embeddings (tied, as Megatron's BERT always ties them) plus the output layer's bias,
//! both split over the vocabulary like a column-parallel layer, and
//! `vocab_parallel_cross_entropy` over the masked tokens (the full-vocabulary logits never
//! exist). Megatron computes the head on every position and masks the loss; only the masked
//! rows reach the loss, so only they are computed here — the same loss and gradients.

use super::linear;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::mappings::copy_to_tensor_model_parallel_region_backward;
use crate::tensor_parallel::{vocab_parallel_cross_entropy, Tp};
use crate::transformer::config::{GeluForm, TransformerConfig};
use crate::transformer::norm::LayerNorm;
use megatron_comm::CommError;
use megatron_tensor::cpu::{
    embedding_lookup_backward, embedding_lookup_forward, gelu_backward, gelu_forward,
    matmul_backward, matmul_forward, ClassifierBias, ClassifierDims, GeluApprox,
};
use megatron_tensor::Tensor;

pub struct BertLMHead {
    pub dense: (ParamId, ParamId),
    pub norm: LayerNorm,
    /// This rank's slice of the output layer's bias over the vocabulary.
    pub output_bias: ParamId,
    hidden: usize,
    vocab_start: usize,
    vocab_per_partition: usize,
    gelu: GeluApprox,
}

/// The masked tokens of a micro-batch: rows of the model output and their original tokens.
pub struct MaskedTokens<'a> {
    pub rows: &'a [u32],
    pub labels: &'a [u32],
}

/// What the head's backward adds to: parameter gradients, the gradient of the encoder output
/// (`[rows, hidden]`, every row of the micro-batch) and the loss gradient's scale.
pub struct HeadBackward<'a> {
    pub grads: &'a mut Grads,
    pub dy: &'a mut Tensor,
    pub dloss: f32,
}

impl HeadBackward<'_> {
    /// The same gradients, for one more head.
    pub fn reborrow(&mut self) -> HeadBackward<'_> {
        HeadBackward {
            grads: self.grads,
            dy: self.dy,
            dloss: self.dloss,
        }
    }
}

impl BertLMHead {
    /// Registers the head (`lm_head.*`, `output_layer.bias`) for the config's hidden and padded
    /// vocabulary sizes, on `params`' tensor-parallel rank, with its GELU's form.
    pub fn new(
        cfg: &TransformerConfig,
        gelu: GeluForm,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let dense = linear(params, inits, "lm_head.dense", h, h, cfg.init_method_std);
        let norm = LayerNorm::new(
            "lm_head.layer_norm",
            h,
            cfg.layernorm_epsilon,
            Sharding::Replicated,
            params,
            inits,
        );
        let output_bias = params.add_sharded(
            inits,
            "output_layer.bias".into(),
            &[cfg.padded_vocab_size],
            false,
            Init::Const(0.0),
            Sharding::Split(0),
        );
        let (tp_rank, t) = (params.tp.0, params.tp.1.max(1));
        let per = cfg.padded_vocab_size / t;
        BertLMHead {
            dense,
            norm,
            output_bias,
            hidden: h,
            vocab_start: tp_rank * per,
            vocab_per_partition: per,
            gelu: gelu.kernel(),
        }
    }

    /// Mean cross-entropy over the masked tokens of `y` (`[rows, hidden]`, the whole
    /// micro-batch on every tensor-parallel rank), logits against this rank's shard of
    /// `word_embeddings`. With `backward`, parameter gradients (the embedding's included)
    /// accumulate and `dloss` times the gradient of `y` is added to its tensor, the same on
    /// every rank. Collective over `tp`.
    pub fn loss(
        &self,
        params: &Params,
        tp: &mut Tp,
        y: &Tensor,
        word_embeddings: ParamId,
        masked: &MaskedTokens,
        backward: Option<HeadBackward>,
    ) -> Result<f64, CommError> {
        let (n, h) = (masked.rows.len(), self.hidden);
        if n == 0 {
            return Ok(0.0);
        }
        let mut x = Tensor::for_overwrite(&[n, h]);
        embedding_lookup_forward(x.data_mut(), masked.rows, y.data(), 0, false);
        let (dw, db) = self.dense;
        let dense_w = params.operand(dw);
        let mut pre = Tensor::for_overwrite(&[n, h]);
        matmul_forward(
            pre.data_mut(),
            x.data(),
            dense_w.operand(),
            Some(&params.get(db)),
            n,
            h,
            h,
        );
        let mut act = Tensor::for_overwrite(&[n, h]);
        gelu_forward(act.data_mut(), pre.data(), self.gelu);
        let (normed, norm_saved) = self.norm.forward(params, &act);
        let v = self.vocab_per_partition;
        let dims = ClassifierDims {
            n,
            c: h,
            v,
            chunk_rows: crate::models::gpt::classifier_tile_rows(v),
        };
        let mut losses = vec![0.0f32; n];
        let emb = params.operand(word_embeddings);
        let bias = params.get(self.output_bias);
        let Some(HeadBackward { grads, dy, dloss }) = backward else {
            vocab_parallel_cross_entropy(
                tp,
                &mut losses,
                None,
                normed.data(),
                emb.operand(),
                Some(ClassifierBias {
                    bias: &bias,
                    dbias: None,
                }),
                masked.labels,
                &[],
                dims,
                self.vocab_start,
            )?;
            return Ok(mean(&losses));
        };
        let mut dnormed = Tensor::for_overwrite(&[n, h]);
        {
            let [demb, dbias] = grads.many_mut([word_embeddings, self.output_bias]);
            vocab_parallel_cross_entropy(
                tp,
                &mut losses,
                Some((dnormed.data_mut(), demb)),
                normed.data(),
                emb.operand(),
                Some(ClassifierBias {
                    bias: &bias,
                    dbias: Some(dbias),
                }),
                masked.labels,
                &vec![dloss / n as f32; n],
                dims,
                self.vocab_start,
            )?;
        }
        drop((emb, bias));
        // Each rank holds its vocabulary slice's part of the gradient: summed over TP, as the
        // input gradient of a column-parallel layer is.
        let dnormed = copy_to_tensor_model_parallel_region_backward(tp, dnormed)?;
        let dact = self
            .norm
            .backward(params, grads, &norm_saved, &act, &dnormed);
        let mut dpre = Tensor::for_overwrite(&[n, h]);
        gelu_backward(dpre.data_mut(), dact.data(), pre.data(), self.gelu);
        let mut dx = Tensor::for_overwrite(&[n, h]);
        let [ddw, ddb] = grads.many_mut([dw, db]);
        matmul_backward(
            Some(dx.data_mut()),
            ddw,
            Some(ddb),
            dpre.data(),
            x.data(),
            dense_w.operand(),
            n,
            h,
            h,
        );
        embedding_lookup_backward(dy.data_mut(), dx.data(), masked.rows, 0);
        Ok(mean(&losses))
    }
}

fn mean(losses: &[f32]) -> f64 {
    losses.iter().map(|&l| l as f64).sum::<f64>() / losses.len().max(1) as f64
}
