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
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    d: LayerNormDims,
) {
    let c = d.cols;
    assert_eq!(inp.len(), d.rows * c);
    assert_eq!(out.len(), d.rows * c);
    assert_eq!(mean.len(), d.rows);
    assert_eq!(rstd.len(), d.rows);
    out.par_chunks_mut(ROWS_PER_TASK * c)
        .zip(inp.par_chunks(ROWS_PER_TASK * c))
        .zip(mean.par_chunks_mut(ROWS_PER_TASK))
        .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
        .for_each(|(((o, x), m), r)| layernorm_rows(o, m, r, x, weight, bias, d.eps));
}

/// Writes `dinp`; accumulates into `dweight` and `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    d: LayerNormDims,
) {
    let c = d.cols;
    assert_eq!(dinp.len(), d.rows * c);
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dinp
        .par_chunks_mut(ROWS_PER_TASK * c)
        .zip(dout.par_chunks(ROWS_PER_TASK * c))
        .zip(inp.par_chunks(ROWS_PER_TASK * c))
        .zip(mean.par_chunks(ROWS_PER_TASK))
        .zip(rstd.par_chunks(ROWS_PER_TASK))
        .map(|((((di, dy), x), m), r)| {
            let mut dw = vec![0.0f32; c];
            let mut db = vec![0.0f32; c];
            layernorm_backward_rows(di, &mut dw, &mut db, dy, x, weight, m, r);
            (dw, db)
        })
        .collect();
    for (dw, db) in partials {
        for j in 0..c {
            dweight[j] += dw[j];
            dbias[j] += db[j];
        }
    }
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
