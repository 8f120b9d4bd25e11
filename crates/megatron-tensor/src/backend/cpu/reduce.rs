use rayon::prelude::*;

const CHUNK: usize = 1 << 16;

/// Σ x² in f64 with a fixed chunking, so the global gradient norm is deterministic.
pub fn global_norm_squared(x: &[f32]) -> f64 {
    let partials: Vec<f64> = x.par_chunks(CHUNK).map(sum_of_squares).collect();
    partials.iter().sum()
}

/// Σ v² in f64 over 16 independent lanes: one f64 running sum is a chain of dependent adds
/// (~4 cycles per element); 16 lanes vectorize and keep the pass memory-bound. The lane
/// assignment is fixed, so the result is deterministic.
fn sum_of_squares(c: &[f32]) -> f64 {
    const LANES: usize = 16;
    let mut acc = [0.0f64; LANES];
    let mut chunks = c.chunks_exact(LANES);
    for ch in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a += (v as f64) * (v as f64);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += (v as f64) * (v as f64);
    }
    acc.iter().sum()
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

/// The index of the first NaN or infinity, if any (`--check-for-nan-in-loss-and-grad` scans
/// every step's gradients with it). A chunk is tested without early exit, so it vectorizes and
/// the common all-finite pass stays memory-bound.
pub fn first_non_finite(x: &[f32]) -> Option<usize> {
    let chunk = x
        .par_chunks(CHUNK)
        .position_first(|c| c.iter().fold(false, |bad, v| bad | !v.is_finite()))?;
    let c = &x[chunk * CHUNK..];
    c.iter()
        .position(|v| !v.is_finite())
        .map(|i| chunk * CHUNK + i)
}

/// The index of the first maximum (`torch.argmax`'s tie rule): greedy decoding.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
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
