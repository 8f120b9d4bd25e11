//! AdamW over the flat parameter buffer; weight decay only where the parameter's metadata asks.
//! Under 16-bit parameters the buffer is the fp32 main copy and the 16-bit one is re-rounded.

use crate::params::{Grads, Params};
use megatron_tensor::cpu::{adamw_update, AdamWParams};

#[derive(Clone, Debug)]
pub struct Adam {
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// Successful optimizer steps taken (bias correction).
    pub step: u64,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
}

impl Adam {
    pub fn new(params: &Params, beta1: f32, beta2: f32, eps: f32) -> Self {
        Adam {
            exp_avg: vec![0.0; params.numel()],
            exp_avg_sq: vec![0.0; params.numel()],
            step: 0,
            beta1,
            beta2,
            eps,
        }
    }

    pub fn step(&mut self, params: &mut Params, grads: &Grads, lr: f32, weight_decay: f32) {
        self.step += 1;
        // Consecutive parameters with the same decay flag are updated in one call.
        let metas = params.metas.clone();
        let mut i = 0;
        while i < metas.len() {
            let wd = metas[i].weight_decay;
            let start = metas[i].offset;
            let mut end = start + metas[i].numel;
            let mut j = i + 1;
            while j < metas.len() && metas[j].weight_decay == wd && metas[j].offset == end {
                end += metas[j].numel;
                j += 1;
            }
            let h = AdamWParams {
                lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: if wd { weight_decay } else { 0.0 },
                step: self.step,
            };
            adamw_update(
                &mut params.data[start..end],
                &grads.data[start..end],
                &mut self.exp_avg[start..end],
                &mut self.exp_avg_sq[start..end],
                h,
            );
            i = j;
        }
        // Under 16-bit storage `data` holds the fp32 main parameters; the model reads their
        // rounding.
        params.refresh_half(0..params.numel());
    }
}
