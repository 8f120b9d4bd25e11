mod common;
use common::*;
use megatron_tensor::cpu::dropout::{dropout_backward, dropout_forward};
use megatron_tensor::cpu::{
    bias_dropout_add_backward, bias_dropout_add_forward, dropout_add_forward,
};
use megatron_tensor::RngKey;

#[test]
fn bias_dropout_add_without_dropout_is_residual_plus_biased_input() {
    let (rows, c) = (7, 5);
    let x = randn(rows * c, 1, 1.0);
    let b = randn(c, 2, 1.0);
    let res = randn(rows * c, 3, 1.0);
    let mut out = vec![0.0; rows * c];
    bias_dropout_add_forward(&mut out, &x, &b, &res, 0.0, RngKey::new(0));
    let want: Vec<f32> = (0..rows * c).map(|i| res[i] + x[i] + b[i % c]).collect();
    assert_close(&out, &want, 1e-6, 0.0, "no dropout");
}

#[test]
fn dropout_drops_the_requested_fraction_and_rescales() {
    let n = 200_000;
    let x = vec![1.0f32; n];
    let mut out = vec![0.0; n];
    dropout_forward(&mut out, &x, 0.3, RngKey::new(7));
    let kept = out.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
    assert!((kept - 0.7).abs() < 0.01, "kept fraction {kept}");
    assert!(out
        .iter()
        .all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6));
    // Same key, same mask: reproducible regardless of threading.
    let mut again = vec![0.0; n];
    dropout_forward(&mut again, &x, 0.3, RngKey::new(7));
    assert_eq!(out, again);
    let mut other = vec![0.0; n];
    dropout_forward(&mut other, &x, 0.3, RngKey::new(8));
    assert_ne!(out, other);
}

#[test]
fn dropout_mask_is_the_same_in_one_and_two_threads() {
    let n = 100_000;
    let x = randn(n, 4, 1.0);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut o = vec![0.0; n];
            dropout_forward(&mut o, &x, 0.5, RngKey::new(3));
            o
        })
    };
    assert_eq!(run(1), run(2));
}

#[test]
fn bias_dropout_add_backward_matches_finite_difference() {
    let (rows, c) = (6, 8);
    let p = 0.25;
    let key = RngKey::new(11);
    let mut x = randn(rows * c, 5, 1.0);
    let mut b = randn(c, 6, 1.0);
    let res = randn(rows * c, 7, 1.0);
    let r = randn(rows * c, 8, 1.0);
    let mut dx = vec![0.0; rows * c];
    let mut db = vec![0.0; c];
    bias_dropout_add_backward(&mut dx, &mut db, &r, p, key);
    let f = |x: &[f32], b: &[f32]| {
        let mut o = vec![0.0; x.len()];
        bias_dropout_add_forward(&mut o, x, b, &res, p, key);
        dot(&o, &r)
    };
    let bc = b.clone();
    check_grad(&mut x, &dx, |x| f(x, &bc), 1e-2, 1e-3, 1e-3, 48, "dx");
    let xc = x.clone();
    check_grad(&mut b, &db, |b| f(&xc, b), 1e-2, 1e-3, 1e-3, 8, "db");
    let mut di = vec![0.0; rows * c];
    dropout_backward(&mut di, &r, p, key);
    assert_close(
        &di,
        &dx,
        0.0,
        0.0,
        "plain dropout backward uses the same mask",
    );
}

/// The bf16 residual stream (`--bf16`): the residual read as stored, the sum taken in f32 and
/// rounded once: the f32 kernel's result on the widened residual, rounded, bit for bit, with
/// the same dropout masks, in 1, 2 and 3 threads. Crosses several row chunks of the kernel.
#[test]
fn bias_dropout_add_on_a_bf16_residual_is_the_f32_sum_rounded_once() {
    let (rows, c) = (700, 48);
    let n = rows * c;
    let x = randn(n, 21, 1.0);
    let b = randn(c, 22, 0.5);
    let res16 = to_bf16(&randn(n, 23, 2.0));
    let res = widen(&res16);
    for p in [0.0, 0.1] {
        let key = RngKey::new(5);
        let mut want = vec![0.0; n];
        bias_dropout_add_forward(&mut want, &x, &b, &res, p, key);
        let want16 = to_bf16(&want);
        let mut nobias = vec![0.0; n];
        dropout_add_forward(&mut nobias, &x, &res, p, key);
        for threads in [1, 2, 3] {
            let (out16, out32, nb16) = in_pool(threads, || {
                let mut out16 = to_bf16(&vec![0.0; n]);
                bias_dropout_add_forward(&mut out16[..], &x, &b, &res16[..], p, key);
                let mut out32 = vec![0.0; n];
                bias_dropout_add_forward(&mut out32, &x, &b, &res16[..], p, key);
                let mut nb16 = to_bf16(&vec![0.0; n]);
                dropout_add_forward(&mut nb16[..], &x, &res16[..], p, key);
                (out16, out32, nb16)
            });
            let what = format!("p {p}, {threads} threads");
            assert_same_bf16(&out16, &want16, &format!("bf16 out, {what}"));
            assert_same_bits(&out32, &want, &format!("f32 out, {what}"));
            assert_same_bf16(&nb16, &to_bf16(&nobias), &format!("no bias, {what}"));
        }
    }
}
