use super::simd::multiversion;
use rayon::prelude::*;

/// AdamW with decoupled weight decay and bias correction (Megatron's / torch's `AdamW`).
#[derive(Clone, Copy, Debug)]
pub struct AdamWParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub step: u64,
}

const CHUNK: usize = 1 << 14;

pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: AdamWParams,
) {
    assert_eq!(params.len(), grads.len());
    assert_eq!(params.len(), m.len());
    assert_eq!(params.len(), v.len());
    let bc1 = 1.0 - h.beta1.powi(h.step as i32);
    let bc2 = 1.0 - h.beta2.powi(h.step as i32);
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| adamw_chunk(p, g, m, v, h, bc1, bc2));
}

multiversion! {
    fn adamw_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamWParams, bc1: f32, bc2: f32) {
            for i in 0..p.len() {
                let gi = g[i];
                m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
                v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
                let mhat = m[i] / bc1;
                let vhat = v[i] / bc2;
                p[i] -= h.lr * (mhat / (vhat.sqrt() + h.eps) + h.weight_decay * p[i]);
            }
    }
}

/// [`adamw_update`] with the moments stored in bf16 (Megatron's precision-aware optimizer,
/// `--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`): each moment is widened, updated with the
/// same f32 arithmetic as the f32 kernel and rounded back to nearest in one pass, so the result
/// equals the f32 update followed by rounding the moments.
pub fn adamw_update_bf16_moments(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [half::bf16],
    v: &mut [half::bf16],
    h: AdamWParams,
) {
    assert_eq!(params.len(), grads.len());
    assert_eq!(params.len(), m.len());
    assert_eq!(params.len(), v.len());
    let bc1 = 1.0 - h.beta1.powi(h.step as i32);
    let bc2 = 1.0 - h.beta2.powi(h.step as i32);
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| adamw_bf16_chunk(p, g, m, v, h, bc1, bc2));
}

multiversion! {
    fn adamw_bf16_chunk(p: &mut [f32], g: &[f32], m: &mut [half::bf16], v: &mut [half::bf16], h: AdamWParams, bc1: f32, bc2: f32) {
            for i in 0..p.len() {
                let gi = g[i];
                let mi = h.beta1 * m[i].to_f32() + (1.0 - h.beta1) * gi;
                let vi = h.beta2 * v[i].to_f32() + (1.0 - h.beta2) * gi * gi;
                m[i] = half::bf16::from_f32(mi);
                v[i] = half::bf16::from_f32(vi);
                let mhat = mi / bc1;
                let vhat = vi / bc2;
                p[i] -= h.lr * (mhat / (vhat.sqrt() + h.eps) + h.weight_decay * p[i]);
            }
    }
}
