use super::operand::{with_operand, with_operands, with_scratch, Element, Operand, OperandMut};
use super::simd::multiversion;
use super::ROWS_PER_TASK;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct LayerNormDims {
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

/// `out = (inp - mean) * rstd * weight + bias` per row; saves `mean` and `rstd` for backward.
/// The input and output in either storage type (see [`Operand`]): bf16 rows are widened and
/// narrowed a task at a time, in cache.
pub fn layernorm_forward<'o, 'i>(
    out: impl Into<OperandMut<'o>>,
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: impl Into<Operand<'i>>,
    weight: &[f32],
    bias: &[f32],
    d: LayerNormDims,
) {
    let (out, inp) = (out.into(), inp.into());
    let c = d.cols;
    assert_eq!(inp.len(), d.rows * c);
    assert_eq!(out.len(), d.rows * c);
    assert_eq!(mean.len(), d.rows);
    assert_eq!(rstd.len(), d.rows);
    with_operands!(inp, out, |x, o| layernorm_forward_as(
        o, mean, rstd, x, weight, bias, d
    ))
}

fn layernorm_forward_as<X: Element, O: Element>(
    out: &mut [O],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[X],
    weight: &[f32],
    bias: &[f32],
    d: LayerNormDims,
) {
    let c = d.cols;
    out.par_chunks_mut(ROWS_PER_TASK * c)
        .zip(inp.par_chunks(ROWS_PER_TASK * c))
        .zip(mean.par_chunks_mut(ROWS_PER_TASK))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .for_each(|(((o, x), m), r)| {
            with_scratch(|sx, so| {
                let x = X::as_f32(x, sx);
                O::write_f32(o, so, |o| layernorm_rows(o, m, r, x, weight, bias, d.eps));
            })
        });
}

/// Writes `dinp`; accumulates into `dweight` and `dbias`. The input in either storage type.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<'i>(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: impl Into<Operand<'i>>,
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    d: LayerNormDims,
) {
    assert_eq!(dinp.len(), d.rows * d.cols);
    let partials = with_operand!(inp.into(), |x| layernorm_backward_partials(
        dinp, dout, x, weight, mean, rstd, d
    ));
    let c = d.cols;
    for (dw, db) in partials {
        for j in 0..c {
            dweight[j] += dw[j];
            dbias[j] += db[j];
        }
    }
}

/// Each task's weight and bias gradients, in task order (summed in that order whatever the
/// thread count).
fn layernorm_backward_partials<X: Element>(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[X],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    d: LayerNormDims,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let c = d.cols;
    dinp.par_chunks_mut(ROWS_PER_TASK * c)
        .zip(dout.par_chunks(ROWS_PER_TASK * c))
        .zip(inp.par_chunks(ROWS_PER_TASK * c))
        .zip(mean.par_chunks(ROWS_PER_TASK))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .map(|((((di, dy), x), m), r)| {
            with_scratch(|sx, _| {
                let x = X::as_f32(x, sx);
                let mut dw = vec![0.0f32; c];
                let mut db = vec![0.0f32; c];
                layernorm_backward_rows(di, &mut dw, &mut db, dy, x, weight, m, r);
                (dw, db)
            })
        })
        .collect()
}

multiversion! {
    fn layernorm_rows(o: &mut [f32], m: &mut [f32], r: &mut [f32], x: &[f32], weight: &[f32], bias: &[f32], eps: f32) {
        let c = weight.len();
        let d = LayerNormDims { rows: m.len(), cols: c, eps };
            for (i, (orow, xrow)) in o.chunks_exact_mut(c).zip(x.chunks_exact(c)).enumerate() {
            let mu = xrow.iter().sum::<f32>() / c as f32;
            let var = xrow.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / c as f32;
            let rs = 1.0 / (var + d.eps).sqrt();
            for j in 0..c {
                orow[j] = (xrow[j] - mu) * rs * weight[j] + bias[j];
            }
            m[i] = mu;
            r[i] = rs;
        }
    }
}

multiversion! {
    fn layernorm_backward_rows(di: &mut [f32], dw: &mut [f32], db: &mut [f32], dy: &[f32], x: &[f32], weight: &[f32], m: &[f32], r: &[f32]) {
        let c = weight.len();
            for (i, ((dirow, dyrow), xrow)) in di
            .chunks_exact_mut(c)
            .zip(dy.chunks_exact(c))
            .zip(x.chunks_exact(c))
            .enumerate()
        {
            let (mu, rs) = (m[i], r[i]);
            let mut dnorm_mean = 0.0f32;
            let mut dnorm_norm_mean = 0.0f32;
            for j in 0..c {
                let norm = (xrow[j] - mu) * rs;
                let dnorm = weight[j] * dyrow[j];
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * norm;
                dw[j] += norm * dyrow[j];
                db[j] += dyrow[j];
            }
            dnorm_mean /= c as f32;
            dnorm_norm_mean /= c as f32;
            for j in 0..c {
                let norm = (xrow[j] - mu) * rs;
                let dnorm = weight[j] * dyrow[j];
                dirow[j] = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rs;
            }
        }
    }
}
