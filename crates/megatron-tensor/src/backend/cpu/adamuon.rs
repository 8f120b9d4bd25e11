//! AdaMuon's second moment (megatron-core's `--optimizer adaptive_muon`, NVIDIA's
//! emerging-optimizers `AdaptiveMuon` with `moment2_method="adamuon"`): an element-wise EMA of
//! the orthogonalized update's squares divides the update, as Adam's `exp_avg_sq` divides its
//! momentum (no bias correction). torch's `lerp` for the EMA, as the reference computes it.

use super::simd::multiversion;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaMuonParams {
    pub beta2: f32,
    pub eps: f32,
}

const CHUNK: usize = 1 << 14;

/// torch's `lerp`: `a + w(b - a)`, computed from the nearer end (`b - (b - a)(1 - w)` for
/// `w >= 0.5`), so the EMAs round as the reference's do.
#[inline]
pub fn torch_lerp(a: f32, b: f32, w: f32) -> f32 {
    if w < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

/// In place on the orthogonalized update `orth`: `moment2 = lerp(moment2, orth², 1 - β₂)`, then
/// `orth /= sqrt(moment2) + eps`.
pub fn adamuon_normalize(orth: &mut [f32], moment2: &mut [f32], h: AdaMuonParams) {
    assert_eq!(orth.len(), moment2.len());
    orth.par_chunks_mut(CHUNK)
        .zip(moment2.par_chunks_mut(CHUNK))
        .for_each(|(o, m)| adamuon_chunk(o, m, h));
}

multiversion! {
    fn adamuon_chunk(o: &mut [f32], m: &mut [f32], h: AdaMuonParams) {
        let w = 1.0 - h.beta2;
        for (ov, mv) in o.iter_mut().zip(m.iter_mut()) {
            *mv = torch_lerp(*mv, *ov * *ov, w);
            *ov /= mv.sqrt() + h.eps;
        }
    }
}
