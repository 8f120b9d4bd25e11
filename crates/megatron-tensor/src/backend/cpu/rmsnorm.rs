//! RMSNorm (Zhang & Sennrich 2019), Llama's normalization: `out = inp * rstd * weight` with
//! `rstd = 1 / sqrt(mean(inp²) + eps)` per row; no mean subtraction, no bias. Only `rstd` is
//! saved for backward.

use super::operand::{with_operand, with_operands, with_scratch, Element, Operand, OperandMut};
use super::simd::multiversion;
use super::ROWS_PER_TASK;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct RMSNormDims {
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

/// `out = inp * rstd * weight` per row; saves `rstd`. The input and output in either storage
/// type (see [`Operand`]).
pub fn rmsnorm_forward<'o, 'i>(
    out: impl Into<OperandMut<'o>>,
    rstd: &mut [f32],
    inp: impl Into<Operand<'i>>,
    weight: &[f32],
    d: RMSNormDims,
) {
    let (out, inp) = (out.into(), inp.into());
    let c = d.cols;
    assert_eq!(inp.len(), d.rows * c);
    assert_eq!(out.len(), d.rows * c);
    assert_eq!(rstd.len(), d.rows);
    assert_eq!(weight.len(), c);
    with_operands!(inp, out, |x, o| rmsnorm_forward_as(o, rstd, x, weight, d))
}

fn rmsnorm_forward_as<X: Element, O: Element>(
    out: &mut [O],
    rstd: &mut [f32],
    inp: &[X],
    weight: &[f32],
    d: RMSNormDims,
) {
    let c = d.cols;
    out.par_chunks_mut(ROWS_PER_TASK * c)
        .zip(inp.par_chunks(ROWS_PER_TASK * c))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .for_each(|((o, x), r)| {
            with_scratch(|sx, so| {
                let x = X::as_f32(x, sx);
                O::write_f32(o, so, |o| rmsnorm_rows(o, r, x, weight, d.eps));
            })
        });
}

/// Writes `dinp`; accumulates into `dweight`. Per-task partial weight gradients are summed in
/// task order, so the result does not depend on the thread count. The input in either storage
/// type.
pub fn rmsnorm_backward<'i>(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: impl Into<Operand<'i>>,
    weight: &[f32],
    rstd: &[f32],
    d: RMSNormDims,
) {
    let inp = inp.into();
    let c = d.cols;
    assert_eq!(dinp.len(), d.rows * c);
    assert_eq!(dout.len(), d.rows * c);
    assert_eq!(inp.len(), d.rows * c);
    assert_eq!(rstd.len(), d.rows);
    assert_eq!(dweight.len(), c);
    let partials = with_operand!(inp, |x| rmsnorm_backward_partials(
        dinp, dout, x, weight, rstd, d
    ));
    for dw in partials {
        for (a, b) in dweight.iter_mut().zip(&dw) {
            *a += b;
        }
    }
}

fn rmsnorm_backward_partials<X: Element>(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[X],
    weight: &[f32],
    rstd: &[f32],
    d: RMSNormDims,
) -> Vec<Vec<f32>> {
    let c = d.cols;
    dinp.par_chunks_mut(ROWS_PER_TASK * c)
        .zip(dout.par_chunks(ROWS_PER_TASK * c))
        .zip(inp.par_chunks(ROWS_PER_TASK * c))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .map(|(((di, dy), x), r)| {
            with_scratch(|sx, _| {
                let x = X::as_f32(x, sx);
                let mut dw = vec![0.0f32; c];
                rmsnorm_backward_rows(di, &mut dw, dy, x, weight, r);
                dw
            })
        })
        .collect()
}

multiversion! {
    fn rmsnorm_rows(o: &mut [f32], r: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
        let c = weight.len();
        for (i, (orow, xrow)) in o.chunks_exact_mut(c).zip(x.chunks_exact(c)).enumerate() {
            let ms = xrow.iter().map(|v| v * v).sum::<f32>() / c as f32;
            let rs = 1.0 / (ms + eps).sqrt();
            for j in 0..c {
                orow[j] = xrow[j] * rs * weight[j];
            }
            r[i] = rs;
        }
    }
}

multiversion! {
    fn rmsnorm_backward_rows(di: &mut [f32], dw: &mut [f32], dy: &[f32], x: &[f32], weight: &[f32], r: &[f32]) {
        let c = weight.len();
        for (i, ((dirow, dyrow), xrow)) in di
            .chunks_exact_mut(c)
            .zip(dy.chunks_exact(c))
            .zip(x.chunks_exact(c))
            .enumerate()
        {
            let rs = r[i];
            // d(out_j)/d(x_k) = rs w_j (δ_jk - x_j x_k rs² / c)
            let mut dot = 0.0f32;
            for j in 0..c {
                let g = weight[j] * dyrow[j];
                dot += g * xrow[j];
                dw[j] += xrow[j] * rs * dyrow[j];
            }
            let k = dot * rs * rs / c as f32;
            for j in 0..c {
                dirow[j] = (weight[j] * dyrow[j] - xrow[j] * k) * rs;
            }
        }
    }
}
