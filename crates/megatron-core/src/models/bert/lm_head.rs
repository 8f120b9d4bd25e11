//! BERT's masked-language-model head (megatron-core's `BertLMHead` and the output layer):
//! the masked positions' hidden states through a dense layer, GELU and LayerNorm, then logits
//! against the word embeddings (tied, as Megatron's BERT always ties them) plus an output
//! bias, and softmax cross-entropy over the masked tokens. One tensor-parallel rank's whole
//! vocabulary for now: the vocab-parallel classifier comes with the model's TP layout.
//! GELU is the tanh approximation of the backend (exact-erf GELU is needed for Hugging Face
//! BERT checkpoints and comes with their conversion).

use super::linear;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::transformer::norm::LayerNorm;
use megatron_tensor::cpu::{
    embedding_lookup_backward, embedding_lookup_forward, gelu_backward, gelu_forward,
    masked_cross_entropy, matmul_backward, matmul_forward,
};
use megatron_tensor::Tensor;

pub struct BertLMHead {
    pub dense: (ParamId, ParamId),
    pub norm: LayerNorm,
    /// The output layer's bias over the vocabulary.
    pub output_bias: ParamId,
    hidden: usize,
    vocab: usize,
}

/// The masked tokens of a micro-batch: rows of the model output and their original tokens.
pub struct MaskedTokens<'a> {
    pub rows: &'a [u32],
    pub labels: &'a [u32],
}

impl BertLMHead {
    pub fn new(
        hidden: usize,
        vocab: usize,
        init_std: f32,
        eps: f32,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let dense = linear(params, inits, "lm_head.dense", hidden, hidden, init_std);
        let norm = LayerNorm::new(
            "lm_head.layer_norm",
            hidden,
            eps,
            Sharding::Replicated,
            params,
            inits,
        );
        let output_bias = params.add(
            inits,
            "output_layer.bias".into(),
            &[vocab],
            false,
            Init::Const(0.0),
        );
        BertLMHead {
            dense,
            norm,
            output_bias,
            hidden,
            vocab,
        }
    }

    /// Mean cross-entropy over the masked tokens of `y` (`[rows, hidden]`), logits against
    /// `word_embeddings` (`[vocab, hidden]`); with `backward`, parameter gradients (the
    /// embedding's included) accumulate into its `Grads` and `dloss` times the gradient of `y`
    /// into its tensor.
    pub fn loss(
        &self,
        params: &Params,
        y: &Tensor,
        word_embeddings: ParamId,
        masked: &MaskedTokens,
        backward: Option<(&mut Grads, &mut Tensor, f32)>,
    ) -> f64 {
        let (n, h, v) = (masked.rows.len(), self.hidden, self.vocab);
        if n == 0 {
            return 0.0;
        }
        let mut x = Tensor::for_overwrite(&[n, h]);
        embedding_lookup_forward(x.data_mut(), masked.rows, y.data(), 0, false);
        let (dw, db) = self.dense;
        let dense_w = params.get(dw);
        let mut pre = Tensor::for_overwrite(&[n, h]);
        matmul_forward(
            pre.data_mut(),
            x.data(),
            &dense_w,
            Some(&params.get(db)),
            n,
            h,
            h,
        );
        let mut act = Tensor::for_overwrite(&[n, h]);
        gelu_forward(act.data_mut(), pre.data());
        let (normed, norm_saved) = self.norm.forward(params, &act);
        let emb = params.get(word_embeddings);
        let mut logits = Tensor::for_overwrite(&[n, v]);
        matmul_forward(
            logits.data_mut(),
            normed.data(),
            &emb,
            Some(&params.get(self.output_bias)),
            n,
            h,
            v,
        );
        let scale = backward.as_ref().map_or(1.0, |x| x.2) / n as f32;
        let mut losses = vec![0.0f32; n];
        let mut dlogits = backward.is_some().then(|| Tensor::for_overwrite(&[n, v]));
        masked_cross_entropy(
            &mut losses,
            dlogits.as_mut().map(|d| d.data_mut()),
            logits.data(),
            masked.labels,
            &vec![v as u32; n],
            &vec![scale; n],
            v,
        );
        let loss = losses.iter().map(|&l| l as f64).sum::<f64>() / n as f64;
        if let (Some((grads, dy, _)), Some(dlogits)) = (backward, dlogits) {
            let mut dnormed = Tensor::for_overwrite(&[n, h]);
            {
                let [demb, dbias] = grads.many_mut([word_embeddings, self.output_bias]);
                matmul_backward(
                    Some(dnormed.data_mut()),
                    demb,
                    Some(dbias),
                    dlogits.data(),
                    normed.data(),
                    &emb,
                    n,
                    h,
                    v,
                );
            }
            let dact = self
                .norm
                .backward(params, grads, &norm_saved, &act, &dnormed);
            let mut dpre = Tensor::for_overwrite(&[n, h]);
            gelu_backward(dpre.data_mut(), dact.data(), pre.data());
            let mut dx = Tensor::for_overwrite(&[n, h]);
            let [ddw, ddb] = grads.many_mut([dw, db]);
            matmul_backward(
                Some(dx.data_mut()),
                ddw,
                Some(ddb),
                dpre.data(),
                x.data(),
                &dense_w,
                n,
                h,
                h,
            );
            embedding_lookup_backward(dy.data_mut(), dx.data(), masked.rows, 0);
        }
        loss
    }
}
