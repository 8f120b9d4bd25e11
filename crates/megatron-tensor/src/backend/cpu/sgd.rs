//! SGD with momentum, as torch's `SGD` (megatron-core's `--optimizer sgd`): L2 weight decay added
//! to the gradient, `buf = momentum * buf + g` (no dampening, not Nesterov; torch starts `buf` at
//! the first gradient, which a zero buffer gives exactly), `p -= lr * buf`.

use super::simd::multiversion;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct SgdParams {
    pub lr: f32,
    /// 0: plain SGD, and no buffer is kept.
    pub momentum: f32,
    pub weight_decay: f32,
}

const CHUNK: usize = 1 << 14;

/// One step on `params` from `grads`; `momentum_buffer` has their length, or is empty when
/// `h.momentum` is 0.
pub fn sgd_update(params: &mut [f32], grads: &[f32], momentum_buffer: &mut [f32], h: SgdParams) {
    assert_eq!(params.len(), grads.len());
    if h.momentum == 0.0 {
        assert!(momentum_buffer.is_empty(), "plain SGD keeps no buffer");
        params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .for_each(|(p, g)| sgd_chunk(p, g, h));
        return;
    }
    assert_eq!(params.len(), momentum_buffer.len());
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(momentum_buffer.par_chunks_mut(CHUNK))
        .for_each(|((p, g), b)| sgd_momentum_chunk(p, g, b, h));
}

multiversion! {
    fn sgd_chunk(p: &mut [f32], g: &[f32], h: SgdParams) {
        for (pv, gv) in p.iter_mut().zip(g) {
            let d = gv + h.weight_decay * *pv;
            *pv -= h.lr * d;
        }
    }
}

multiversion! {
    fn sgd_momentum_chunk(p: &mut [f32], g: &[f32], b: &mut [f32], h: SgdParams) {
        for ((pv, gv), bv) in p.iter_mut().zip(g).zip(b.iter_mut()) {
            let d = gv + h.weight_decay * *pv;
            *bv = h.momentum * *bv + d;
            *pv -= h.lr * *bv;
        }
    }
}
