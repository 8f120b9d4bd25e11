//! The bf16 GEMM against a naive reference on the same bf16-rounded operands (f64 sums): every
//! transpose combination, accumulate, ragged edges (m, n, k not multiples of the blocking).

use half::bf16;
use megatron_tensor::cpu::matmul::MatmulDims;
use megatron_tensor::cpu::matmul_bf16::matmul_bf16_with_threads;

fn naive(a: &[f32], b: &[f32], d: MatmulDims) -> Vec<f64> {
    let r = |x: f32| bf16::from_f32(x).to_f32() as f64;
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

#[test]
fn bf16_matmul_matches_a_reference_on_bf16_operands() {
    for (m, n, k) in [
        (1, 1, 1),
        (7, 33, 5),
        (64, 64, 256),
        (65, 97, 513),
        (130, 40, 300),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                for acc in [false, true] {
                    for threads in [1, 2] {
                        let a: Vec<f32> = (0..m * k)
                            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                            .collect();
                        let b: Vec<f32> = (0..k * n)
                            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.017)
                            .collect();
                        let mut d = MatmulDims::new(m, n, k);
                        d.trans_a = ta;
                        d.trans_b = tb;
                        d.accumulate = acc;
                        let init: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32).collect();
                        let mut out = init.clone();
                        matmul_bf16_with_threads(&mut out, &a, &b, d, threads);
                        let want = naive(&a, &b, d);
                        for i in 0..m * n {
                            let w = want[i] + if acc { init[i] as f64 } else { 0.0 };
                            // f32 accumulation of exact bf16 products.
                            let tol = 1e-5 * (k as f64).sqrt() * (1.0 + w.abs());
                            assert!(
                                (out[i] as f64 - w).abs() <= tol,
                                "m {m} n {n} k {k} ta {ta} tb {tb} acc {acc}: [{i}] {} vs {w}",
                                out[i]
                            );
                        }
                    }
                }
            }
        }
    }
}
