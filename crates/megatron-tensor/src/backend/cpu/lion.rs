//! Lion (Chen et al. 2023), as megatron-core's `--optimizer lion` runs it (NVIDIA's
//! emerging-optimizers `Lion`, decoupled weight decay): `p -= lr * wd * p`, then
//! `p -= lr * sign(beta1 * m + (1 - beta1) * g)` and `m += (1 - beta2) * (g - m)` (torch's
//! `lerp`). One moment, `exp_avg`; `sign(0) = 0` as torch's.

use super::simd::multiversion;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct LionParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub weight_decay: f32,
}

const CHUNK: usize = 1 << 14;

/// One step on `params` from `grads` with `exp_avg` their momentum.
pub fn lion_update(params: &mut [f32], grads: &[f32], exp_avg: &mut [f32], h: LionParams) {
    assert_eq!(params.len(), grads.len());
    assert_eq!(params.len(), exp_avg.len());
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(exp_avg.par_chunks_mut(CHUNK))
        .for_each(|((p, g), m)| lion_chunk(p, g, m, h));
}

multiversion! {
    fn lion_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], h: LionParams) {
        let decay = -h.weight_decay * h.lr;
        for ((pv, gv), mv) in p.iter_mut().zip(g).zip(m.iter_mut()) {
            let c = h.beta1 * *mv + (1.0 - h.beta1) * gv;
            let sign = if c == 0.0 { 0.0 } else { c.signum() };
            *pv += decay * *pv;
            *mv += (1.0 - h.beta2) * (gv - *mv);
            *pv += -h.lr * sign;
        }
    }
}
