//! Sentence pooling of an encoder's output (sentence-transformers' `Pooling` with
//! `pooling_mode_mean_tokens` and its `Normalize`): the mean over each sequence's real tokens,
//! padding excluded, optionally scaled to unit L2 norm.

/// `out [b, h]` = mean of rows `0..lens[s]` of each sequence `s` of `x [b, t, h]`; L2-normalized
/// per row under `PoolNorm::Unit`.
pub fn mean_pool_forward(out: &mut [f32], x: &[f32], lens: &[usize], t: usize, norm: PoolNorm) {
    let b = lens.len();
    let h = out.len() / b.max(1);
    assert_eq!(out.len(), b * h);
    assert_eq!(x.len(), b * t * h);
    for (s, row) in out.chunks_exact_mut(h).enumerate() {
        let n = lens[s].clamp(1, t);
        let mut acc = vec![0.0f64; h];
        for tok in x[s * t * h..(s * t + n) * h].chunks_exact(h) {
            for (a, v) in acc.iter_mut().zip(tok) {
                *a += *v as f64;
            }
        }
        let scale = match norm {
            PoolNorm::None => 1.0 / n as f64,
            PoolNorm::Unit => {
                // sentence-transformers' Normalize: F.normalize, eps 1e-12.
                let l2 = acc.iter().map(|a| a * a).sum::<f64>().sqrt();
                1.0 / l2.max(1e-12 * n as f64)
            }
        };
        for (o, a) in row.iter_mut().zip(&acc) {
            *o = (a * scale) as f32;
        }
    }
}

/// Whether pooled vectors are scaled to unit length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolNorm {
    None,
    Unit,
}
