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

/// Under `--bf16` the norm reads a kept bf16 residual and writes bf16 for the next matmul: the
/// result must be the f32 kernel's on the widened input, rounded, bit for bit (what the matmul
/// would have rounded to itself), for every thread count. 37 rows: two full tasks and a ragged one.
#[test]
fn layernorm_in_bf16_storage_matches_the_f32_kernel_on_widened_rows_bit_for_bit() {
    let (rows, c) = (37, 48);
    let x16 = to_bf16(&randn(rows * c, 21, 3.0));
    let xw = widen(&x16);
    let (w, b) = (randn(c, 22, 1.0), randn(c, 23, 1.0));
    let dy = randn(rows * c, 24, 1.0);
    let d = LayerNormDims {
        rows,
        cols: c,
        eps: 1e-5,
    };
    let mut want = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
    layernorm_forward(&mut want.0, &mut want.1, &mut want.2, &xw, &w, &b, d);
    let mut want_dx = vec![0.0; rows * c];
    let (mut want_dw, mut want_db) = (vec![0.5; c], vec![0.5; c]);
    let (m, r) = (&want.1, &want.2);
    layernorm_backward(
        &mut want_dx,
        &mut want_dw,
        &mut want_db,
        &dy,
        &xw,
        &w,
        m,
        r,
        d,
    );
    for threads in [1, 2, 3] {
        in_pool(threads, || {
            let (mut o16, mut mean, mut rstd) = (
                vec![half::bf16::ZERO; rows * c],
                vec![0.0; rows],
                vec![0.0; rows],
            );
            layernorm_forward(&mut o16[..], &mut mean, &mut rstd, &x16[..], &w, &b, d);
            assert_same_bf16(&o16, &to_bf16(&want.0), "bf16 -> bf16 output");
            assert_same_bits(&mean, &want.1, "mean");
            assert_same_bits(&rstd, &want.2, "rstd");
            let mut o32 = vec![0.0; rows * c];
            layernorm_forward(&mut o32, &mut mean, &mut rstd, &x16[..], &w, &b, d);
            assert_same_bits(&o32, &want.0, "bf16 -> f32 output");
            let mut dx = vec![0.0; rows * c];
            let (mut dw, mut db) = (vec![0.5; c], vec![0.5; c]);
            layernorm_backward(&mut dx, &mut dw, &mut db, &dy, &x16[..], &w, m, r, d);
            assert_same_bits(&dx, &want_dx, "dx");
            assert_same_bits(&dw, &want_dw, "dweight");
            assert_same_bits(&db, &want_db, "dbias");
        });
    }
}
