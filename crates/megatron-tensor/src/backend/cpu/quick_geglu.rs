//! Quick-GEGLU (megatron-core's `quick_geglu`, `--quick-geglu`): a gated unit on the fused
//! `[gate | up]` fc1 rows with GELU's sigmoid approximation, `quick_gelu(gate) * up` where
//! `quick_gelu(x) = x * sigmoid(1.702 x)` (Hendrycks & Gimpel's approximation, CLIP's and
//! gpt-oss's MLP). Backward recomputes the sigmoid from the saved fc1 output.

use super::simd::{exp, multiversion};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// The sigmoid's input scale of quick GELU.
const ALPHA: f32 = 1.702;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `out[r, j] = quick_gelu(inp[r, j]) * inp[r, f + j]`; `inp` is `[rows, 2f]`, `out` `[rows, f]`.
pub fn quick_geglu_forward(out: &mut [f32], inp: &[f32], f: usize) {
    assert!(f > 0);
    assert_eq!(inp.len(), 2 * out.len());
    assert_eq!(out.len() % f, 0);
    let rows = (CHUNK / f).max(1);
    out.par_chunks_mut(rows * f)
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|(o, x)| quick_geglu_rows(o, x, f));
}

/// `dinp` (`[rows, 2f]`, overwritten) from `dout` (`[rows, f]`) and the forward input.
pub fn quick_geglu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], f: usize) {
    assert!(f > 0);
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(inp.len(), 2 * dout.len());
    let rows = (CHUNK / f).max(1);
    dinp.par_chunks_mut(rows * 2 * f)
        .zip(dout.par_chunks(rows * f))
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|((di, dy), x)| quick_geglu_backward_rows(di, dy, x, f));
}

multiversion! {
    fn quick_geglu_rows(o: &mut [f32], x: &[f32], f: usize) {
        for (orow, xrow) in o.chunks_exact_mut(f).zip(x.chunks_exact(2 * f)) {
            let (g, u) = xrow.split_at(f);
            for j in 0..f {
                orow[j] = g[j] * sigmoid(ALPHA * g[j]) * u[j];
            }
        }
    }
}

multiversion! {
    fn quick_geglu_backward_rows(di: &mut [f32], dy: &[f32], x: &[f32], f: usize) {
        for ((drow, dyrow), xrow) in di.chunks_exact_mut(2 * f).zip(dy.chunks_exact(f)).zip(x.chunks_exact(2 * f)) {
            let (g, u) = xrow.split_at(f);
            let (dg, du) = drow.split_at_mut(f);
            for j in 0..f {
                let s = sigmoid(ALPHA * g[j]);
                du[j] = dyrow[j] * g[j] * s;
                dg[j] = dyrow[j] * u[j] * s * (1.0 + ALPHA * g[j] * (1.0 - s));
            }
        }
    }
}
