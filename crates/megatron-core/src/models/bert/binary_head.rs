//! BERT's sentence-order (binary) head: the pooler, `tanh(W_p h_[CLS] + b_p)` of each
//! sequence's first token, then a linear map to two logits and softmax cross-entropy
//! (megatron-core's `Pooler` and `BertModel.binary_head`, both replicated over tensor
//! parallelism).

use super::linear;
use super::lm_head::HeadBackward;
use crate::params::{Init, ParamId, Params};
use crate::transformer::config::TransformerConfig;
use megatron_tensor::cpu::{
    embedding_lookup_backward, embedding_lookup_forward, masked_cross_entropy, matmul_backward,
    matmul_forward, tanh_backward, tanh_forward,
};
use megatron_tensor::Tensor;

pub struct BertBinaryHead {
    pub pooler: (ParamId, ParamId),
    /// The two-logit layer; `None` for a pooler kept only for conversion (Hugging Face's
    /// `BertModel`), which computes no loss.
    pub head: Option<(ParamId, ParamId)>,
    hidden: usize,
}

impl BertBinaryHead {
    pub fn new(cfg: &TransformerConfig, params: &mut Params, inits: &mut Vec<Init>) -> Self {
        let mut h = Self::pooler_only(cfg, params, inits);
        let (hidden, std) = (cfg.hidden_size, cfg.init_method_std);
        h.head = Some(linear(params, inits, "binary_head", 2, hidden, std));
        h
    }

    /// The pooler alone.
    pub fn pooler_only(
        cfg: &TransformerConfig,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let (hidden, std) = (cfg.hidden_size, cfg.init_method_std);
        BertBinaryHead {
            pooler: linear(params, inits, "pooler.dense", hidden, hidden, std),
            head: None,
            hidden,
        }
    }

    /// Whether it computes the sentence-order loss.
    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    /// Mean loss over the `b` sequences of `y` (`[b * t, hidden]`, sequence-major) against
    /// `labels` (0: in order, 1: swapped); with `backward`, parameter gradients accumulate into
    /// its `Grads` and `dloss` times the gradient of `y` into its tensor (first tokens only).
    pub fn loss(
        &self,
        params: &Params,
        y: &Tensor,
        t: usize,
        labels: &[u32],
        backward: Option<HeadBackward>,
    ) -> f64 {
        let (b, h) = (labels.len(), self.hidden);
        // The first token of each sequence, gathered as embedding rows of `y`.
        let firsts: Vec<u32> = (0..b).map(|s| (s * t) as u32).collect();
        let mut first = Tensor::for_overwrite(&[b, h]);
        embedding_lookup_forward(first.data_mut(), &firsts, y.data(), 0, false);
        let (pw, pb) = self.pooler;
        let mut pre = Tensor::for_overwrite(&[b, h]);
        let pooler_w = params.operand(pw);
        matmul_forward(
            pre.data_mut(),
            first.data(),
            pooler_w.operand(),
            Some(&params.get(pb)),
            b,
            h,
            h,
        );
        let mut pooled = Tensor::for_overwrite(&[b, h]);
        tanh_forward(pooled.data_mut(), pre.data());
        let (hw, hb) = self
            .head
            .expect("the sentence-order loss needs the binary head");
        let head_w = params.operand(hw);
        let mut logits = Tensor::for_overwrite(&[b, 2]);
        matmul_forward(
            logits.data_mut(),
            pooled.data(),
            head_w.operand(),
            Some(&params.get(hb)),
            b,
            h,
            2,
        );
        let mut losses = vec![0.0f32; b];
        let scale = backward.as_ref().map_or(1.0, |x| x.dloss) / b as f32;
        let mut dlogits = backward.is_some().then(|| Tensor::for_overwrite(&[b, 2]));
        masked_cross_entropy(
            &mut losses,
            dlogits.as_mut().map(|d| d.data_mut()),
            logits.data(),
            labels,
            &vec![2; b],
            &vec![scale; b],
            2,
        );
        let loss = losses.iter().map(|&l| l as f64).sum::<f64>() / b as f64;
        if let (Some(HeadBackward { grads, dy, .. }), Some(dlogits)) = (backward, dlogits) {
            let mut dpooled = Tensor::for_overwrite(&[b, h]);
            {
                let [dw, db] = grads.many_mut([hw, hb]);
                matmul_backward(
                    Some(dpooled.data_mut()),
                    dw,
                    Some(db),
                    dlogits.data(),
                    pooled.data(),
                    head_w.operand(),
                    b,
                    h,
                    2,
                );
            }
            let mut dpre = Tensor::for_overwrite(&[b, h]);
            tanh_backward(dpre.data_mut(), dpooled.data(), pooled.data());
            let mut dfirst = Tensor::for_overwrite(&[b, h]);
            let [dw, db] = grads.many_mut([pw, pb]);
            matmul_backward(
                Some(dfirst.data_mut()),
                dw,
                Some(db),
                dpre.data(),
                first.data(),
                pooler_w.operand(),
                b,
                h,
                h,
            );
            embedding_lookup_backward(dy.data_mut(), dfirst.data(), &firsts, 0);
        }
        loss
    }
}
