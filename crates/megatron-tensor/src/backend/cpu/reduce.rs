use rayon::prelude::*;

const CHUNK: usize = 1 << 16;

/// Σ x² in f64 with a fixed chunking, so the global gradient norm is deterministic.
pub fn global_norm_squared(x: &[f32]) -> f64 {
    let partials: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
        .collect();
    partials.iter().sum()
}

pub fn scale_inplace(x: &mut [f32], s: f32) {
    x.par_chunks_mut(CHUNK).for_each(|c| {
        for v in c {
            *v *= s;
        }
    });
}

/// True when every element is finite.
pub fn all_finite(x: &[f32]) -> bool {
    x.par_chunks(CHUNK).all(|c| c.iter().all(|v| v.is_finite()))
}

/// `a += b` (residual-stream gradient accumulation).
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    a.par_chunks_mut(CHUNK)
        .zip(b.par_chunks(CHUNK))
        .for_each(|(x, y)| {
            for (p, q) in x.iter_mut().zip(y) {
                *p += q;
            }
        });
}
