#![allow(dead_code)]
//! Naive references and a finite-difference checker shared by the kernel tests.

use megatron_tensor::cpu::matmul::MatmulDims;
use megatron_tensor::RngKey;

pub fn randn(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let k = RngKey::new(seed);
    (0..n).map(|i| k.normal(i as u64) * std).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn assert_close(a: &[f32], b: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = atol + rtol * y.abs();
        assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y} (tol {tol})");
    }
}

/// Naive `[m,k] x [k,n]` in f64.
pub fn naive_matmul(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                s += a[i * k + p] as f64 * b[p * n + j] as f64;
            }
            out[i * n + j] = s as f32;
        }
    }
    out
}

pub fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; a.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = a[i * cols + j];
        }
    }
    t
}

/// Central-difference check of `analytic` (the gradient of scalar `f` w.r.t. `x`) at `count`
/// coordinates spread over `x`. Tolerance: `|fd - an| <= atol + rtol * |an|`.
pub fn check_grad(
    x: &mut [f32],
    analytic: &[f32],
    mut f: impl FnMut(&[f32]) -> f64,
    eps: f32,
    atol: f64,
    rtol: f64,
    count: usize,
    what: &str,
) {
    let n = x.len();
    let step = (n / count.max(1)).max(1);
    let mut i = step / 2;
    let mut checked = 0;
    while i < n && checked < count {
        let orig = x[i];
        x[i] = orig + eps;
        let fp = f(x);
        x[i] = orig - eps;
        let fm = f(x);
        x[i] = orig;
        let fd = (fp - fm) / (2.0 * eps as f64);
        let an = analytic[i] as f64;
        assert!(
            (fd - an).abs() <= atol + rtol * an.abs(),
            "{what}[{i}]: finite difference {fd} vs analytic {an}"
        );
        i += step;
        checked += 1;
    }
    assert!(checked > 0, "{what}: no coordinate checked");
}

/// Σ out * r, the scalar whose gradient w.r.t. out is r.
pub fn dot(out: &[f32], r: &[f32]) -> f64 {
    out.iter().zip(r).map(|(a, b)| *a as f64 * *b as f64).sum()
}

/// `op(a) · op(b)` on operands rounded to bf16, summed in f64 (`MatmulDims` transposes).
pub fn naive_matmul_bf16(a: &[f32], b: &[f32], d: MatmulDims) -> Vec<f64> {
    let r = |x: f32| half::bf16::from_f32(x).to_f32() as f64;
    let (m, n, k) = (d.m, d.n, d.k);
    let mut out = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0;
            for kk in 0..k {
                let av = if d.trans_a {
                    a[kk * m + i]
                } else {
                    a[i * k + kk]
                };
                let bv = if d.trans_b {
                    b[j * k + kk]
                } else {
                    b[kk * n + j]
                };
                s += r(av) * r(bv);
            }
            out[i * n + j] = s;
        }
    }
    out
}

/// `x` rounded to bf16 by the `half` crate (nearest even): the reference for kernels that
/// write bf16.
pub fn to_bf16(x: &[f32]) -> Vec<half::bf16> {
    x.iter().map(|&v| half::bf16::from_f32(v)).collect()
}

/// `x` widened to f32 (exact).
pub fn widen(x: &[half::bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// Asserts two f32 slices hold the same bits.
pub fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: {x} vs {y}");
    }
}

/// Asserts two bf16 slices hold the same bits.
pub fn assert_same_bf16(a: &[half::bf16], b: &[half::bf16], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: {x} vs {y}");
    }
}

/// `f` run inside a rayon pool of `threads` threads (kernels split work over the current pool).
pub fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}
