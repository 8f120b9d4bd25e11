mod common;
use common::*;
use megatron_tensor::cpu::{rmsnorm_backward, rmsnorm_forward, RMSNormDims};

fn naive_rmsnorm(x: &[f32], w: &[f32], c: usize, eps: f64) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (o, r) in out.chunks_mut(c).zip(x.chunks(c)) {
        let ms: f64 = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
        for j in 0..c {
            o[j] = (r[j] as f64 / (ms + eps).sqrt() * w[j] as f64) as f32;
        }
    }
    out
}

fn dims(rows: usize, cols: usize) -> RMSNormDims {
    RMSNormDims {
        rows,
        cols,
        eps: 1e-5,
    }
}

#[test]
fn rmsnorm_forward_matches_naive() {
    let (rows, c) = (45, 24);
    let x = randn(rows * c, 1, 2.0);
    let w = randn(c, 2, 1.0);
    let (mut out, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
    rmsnorm_forward(&mut out, &mut rstd, &x, &w, dims(rows, c));
    assert_close(&out, &naive_rmsnorm(&x, &w, c, 1e-5), 1e-5, 1e-4, "rmsnorm");
}

#[test]
fn rmsnorm_backward_matches_finite_difference() {
    let (rows, c) = (37, 12);
    let mut x = randn(rows * c, 4, 1.0);
    let mut w = randn(c, 5, 1.0);
    let r = randn(rows * c, 7, 1.0);
    let (mut out, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
    rmsnorm_forward(&mut out, &mut rstd, &x, &w, dims(rows, c));
    let (mut dx, mut dw) = (vec![f32::NAN; rows * c], vec![0.5; c]);
    rmsnorm_backward(&mut dx, &mut dw, &r, &x, &w, &rstd, dims(rows, c));
    // The weight gradient accumulates onto what was there (0.5).
    let dw: Vec<f32> = dw.iter().map(|v| v - 0.5).collect();
    let f = |x: &[f32], w: &[f32]| dot(&naive_rmsnorm(x, w, c, 1e-5), &r);
    let wc = w.clone();
    check_grad(&mut x, &dx, |x| f(x, &wc), 1e-2, 2e-3, 1e-2, 60, "dx");
    let xc = x.clone();
    check_grad(&mut w, &dw, |w| f(&xc, w), 1e-2, 2e-3, 1e-2, 12, "dw");
}
