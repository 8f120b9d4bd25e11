mod common;
use common::*;
use megatron_tensor::cpu::layernorm::LayerNormDims;
use megatron_tensor::cpu::{layernorm_backward, layernorm_forward};

fn naive_layernorm(x: &[f32], w: &[f32], b: &[f32], c: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (o, r) in out.chunks_mut(c).zip(x.chunks(c)) {
        let mu: f64 = r.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var: f64 = r.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
        for j in 0..c {
            o[j] = ((r[j] as f64 - mu) / (var + 1e-5).sqrt() * w[j] as f64 + b[j] as f64) as f32;
        }
    }
    out
}

#[test]
fn layernorm_forward_matches_naive() {
    let (rows, c) = (40, 24);
    let x = randn(rows * c, 1, 2.0);
    let w = randn(c, 2, 1.0);
    let b = randn(c, 3, 1.0);
    let d = LayerNormDims {
        rows,
        cols: c,
        eps: 1e-5,
    };
    let (mut out, mut mean, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
    layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b, d);
    assert_close(&out, &naive_layernorm(&x, &w, &b, c), 1e-4, 1e-4, "ln");
}

#[test]
fn layernorm_backward_matches_finite_difference() {
    let (rows, c) = (5, 12);
    let mut x = randn(rows * c, 4, 1.0);
    let mut w = randn(c, 5, 1.0);
    let mut bias = randn(c, 6, 1.0);
    let r = randn(rows * c, 7, 1.0);
    let d = LayerNormDims {
        rows,
        cols: c,
        eps: 1e-5,
    };
    let (mut out, mut mean, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
    layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &bias, d);
    let (mut dx, mut dw, mut db) = (vec![0.0; rows * c], vec![0.0; c], vec![0.0; c]);
    layernorm_backward(&mut dx, &mut dw, &mut db, &r, &x, &w, &mean, &rstd, d);
    let f = |x: &[f32], w: &[f32], b: &[f32]| dot(&naive_layernorm(x, w, b, c), &r);
    let (wc, bc) = (w.clone(), bias.clone());
    check_grad(&mut x, &dx, |x| f(x, &wc, &bc), 1e-2, 2e-3, 1e-2, 40, "dx");
    let (xc, bc) = (x.clone(), bias.clone());
    check_grad(&mut w, &dw, |w| f(&xc, w, &bc), 1e-2, 2e-3, 1e-2, 12, "dw");
    let (xc, wc) = (x.clone(), w.clone());
    check_grad(
        &mut bias,
        &db,
        |b| f(&xc, &wc, b),
        1e-2,
        2e-3,
        1e-2,
        12,
        "db",
    );
}
