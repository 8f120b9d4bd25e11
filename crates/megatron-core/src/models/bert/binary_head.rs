//! BERT's sentence-order (binary) head: the pooler, `tanh(W_p h_[CLS] + b_p)` of each
//! sequence's first token, then a linear map to two logits and softmax cross-entropy
//! (megatron-core's `Pooler` and `BertModel.binary_head`, both replicated over tensor
//! parallelism).

use super::linear;
use crate::params::{Grads, Init, ParamId, Params};
use megatron_tensor::cpu::{
    embedding_lookup_backward, embedding_lookup_forward, masked_cross_entropy, matmul_backward,
    matmul_forward, tanh_backward, tanh_forward,
};
use megatron_tensor::Tensor;

pub struct BertBinaryHead {
    pub pooler: (ParamId, ParamId),
    pub head: (ParamId, ParamId),
    hidden: usize,
}

impl BertBinaryHead {
    pub fn new(hidden: usize, init_std: f32, params: &mut Params, inits: &mut Vec<Init>) -> Self {
        BertBinaryHead {
            pooler: linear(params, inits, "pooler.dense", hidden, hidden, init_std),
            head: linear(params, inits, "binary_head", 2, hidden, init_std),
            hidden,
        }
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
        backward: Option<(&mut Grads, &mut Tensor, f32)>,
    ) -> f64 {
        let (b, h) = (labels.len(), self.hidden);
        // The first token of each sequence, gathered as embedding rows of `y`.
        let firsts: Vec<u32> = (0..b).map(|s| (s * t) as u32).collect();
        let mut first = Tensor::for_overwrite(&[b, h]);
        embedding_lookup_forward(first.data_mut(), &firsts, y.data(), 0, false);
        let (pw, pb) = self.pooler;
        let mut pre = Tensor::for_overwrite(&[b, h]);
        let pooler_w = params.get(pw);
        matmul_forward(
            pre.data_mut(),
            first.data(),
            &pooler_w,
            Some(&params.get(pb)),
            b,
            h,
            h,
        );
        let mut pooled = Tensor::for_overwrite(&[b, h]);
        tanh_forward(pooled.data_mut(), pre.data());
        let (hw, hb) = self.head;
        let head_w = params.get(hw);
        let mut logits = Tensor::for_overwrite(&[b, 2]);
        matmul_forward(
            logits.data_mut(),
            pooled.data(),
            &head_w,
            Some(&params.get(hb)),
            b,
            h,
            2,
        );
        let mut losses = vec![0.0f32; b];
        let scale = backward.as_ref().map_or(1.0, |x| x.2) / b as f32;
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
        if let (Some((grads, dy, _)), Some(dlogits)) = (backward, dlogits) {
            let mut dpooled = Tensor::for_overwrite(&[b, h]);
            {
                let [dw, db] = grads.many_mut([hw, hb]);
                matmul_backward(
                    Some(dpooled.data_mut()),
                    dw,
                    Some(db),
                    dlogits.data(),
                    pooled.data(),
                    &head_w,
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
                &pooler_w,
                b,
                h,
                h,
            );
            embedding_lookup_backward(dy.data_mut(), dfirst.data(), &firsts, 0);
        }
        loss
    }
}
