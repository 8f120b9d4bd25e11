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

/// As LayerNorm's: bf16 input and output are the f32 kernel's on widened rows, rounded, bit for
/// bit, for every thread count.
#[test]
fn rmsnorm_in_bf16_storage_matches_the_f32_kernel_on_widened_rows_bit_for_bit() {
    let (rows, c) = (37, 40);
    let x16 = to_bf16(&randn(rows * c, 31, 3.0));
    let xw = widen(&x16);
    let w = randn(c, 32, 1.0);
    let dy = randn(rows * c, 33, 1.0);
    let d = RMSNormDims {
        rows,
        cols: c,
        eps: 1e-6,
    };
    let (mut want, mut want_r) = (vec![0.0; rows * c], vec![0.0; rows]);
    rmsnorm_forward(&mut want, &mut want_r, &xw, &w, d);
    let (mut want_dx, mut want_dw) = (vec![0.0; rows * c], vec![0.25; c]);
    rmsnorm_backward(&mut want_dx, &mut want_dw, &dy, &xw, &w, &want_r, d);
    for threads in [1, 2, 3] {
        in_pool(threads, || {
            let (mut o16, mut r) = (vec![half::bf16::ZERO; rows * c], vec![0.0; rows]);
            rmsnorm_forward(&mut o16[..], &mut r, &x16[..], &w, d);
            assert_same_bf16(&o16, &to_bf16(&want), "bf16 -> bf16 output");
            assert_same_bits(&r, &want_r, "rstd");
            let (mut dx, mut dw) = (vec![0.0; rows * c], vec![0.25; c]);
            rmsnorm_backward(&mut dx, &mut dw, &dy, &x16[..], &w, &want_r, d);
            assert_same_bits(&dx, &want_dx, "dx");
            assert_same_bits(&dw, &want_dw, "dweight");
        });
    }
}
