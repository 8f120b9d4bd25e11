//! The bf16 GEMM against a naive reference on the same bf16-rounded operands (f64 sums): every
//! transpose combination, accumulate, ragged edges (m, n, k not multiples of the blocking);
//! the 16-bit precisions of `matmul` (both bf16 kernels, f16) and the rounding they use.

mod common;

use common::naive_matmul_bf16 as naive;
use half::{bf16, f16};
use megatron_tensor::cpu::cast::{round_to_half, round_to_half_inplace, Half};
use megatron_tensor::cpu::matmul::{
    matmul, set_bf16_kernel, set_matmul_precision, Bf16Kernel, MatmulDims, MatmulPrecision,
};
use megatron_tensor::cpu::matmul_bf16::matmul_bf16_with_threads;

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

/// `matmul` under a 16-bit precision, with the given bf16 kernel, on this thread.
fn matmul_as(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    d: MatmulDims,
    p: MatmulPrecision,
    kernel: Bf16Kernel,
) {
    set_matmul_precision(p);
    set_bf16_kernel(kernel);
    matmul(out, a, b, d);
    set_matmul_precision(MatmulPrecision::F32);
}

#[test]
fn bf16_fma_and_dot_kernels_compute_the_same_products() {
    // Both kernels round the operands to bf16 and accumulate exact products in f32: they agree
    // with the reference (and each other) to f32 summation error, whichever the CPU runs.
    let (m, n, k) = (67, 45, 300);
    let a: Vec<f32> = (0..m * k)
        .map(|i| ((i * 29 % 89) as f32 - 44.0) * 0.0123)
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|i| ((i * 31 % 83) as f32 - 41.0) * 0.0171)
        .collect();
    for tb in [false, true] {
        let mut d = MatmulDims::new(m, n, k);
        d.trans_b = tb;
        let want = naive(&a, &b, d);
        let mut dot = vec![0.0; m * n];
        let mut fma = vec![0.0; m * n];
        matmul_as(&mut dot, &a, &b, d, MatmulPrecision::BF16, Bf16Kernel::Dot);
        matmul_as(&mut fma, &a, &b, d, MatmulPrecision::BF16, Bf16Kernel::Fma);
        for i in 0..m * n {
            let tol = 1e-5 * (k as f64).sqrt() * (1.0 + want[i].abs());
            assert!((dot[i] as f64 - want[i]).abs() <= tol, "dot [{i}]");
            assert!((fma[i] as f64 - want[i]).abs() <= tol, "fma [{i}]");
        }
        // The operands really were rounded: f32 operands give a different result.
        let mut f = vec![0.0; m * n];
        matmul(&mut f, &a, &b, d);
        assert!(f.iter().zip(&fma).any(|(x, y)| x != y));
    }
}

#[test]
fn f16_matmul_rounds_operands_to_half_and_overflows_to_inf() {
    let (m, n, k) = (5, 7, 9);
    let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.377).sin()).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.211).cos()).collect();
    let d = MatmulDims::new(m, n, k);
    let mut out = vec![0.0; m * n];
    matmul_as(&mut out, &a, &b, d, MatmulPrecision::F16, Bf16Kernel::Fma);
    let r = |x: f32| f16::from_f32(x).to_f32() as f64;
    for i in 0..m {
        for j in 0..n {
            let w: f64 = (0..k).map(|kk| r(a[i * k + kk]) * r(b[kk * n + j])).sum();
            let got = out[i * n + j] as f64;
            assert!(
                (got - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "[{i},{j}] {got} vs {w}"
            );
        }
    }
    // 1e5 is beyond f16's range (65504): the operand becomes inf, as an fp16 overflow does.
    let mut big = a.clone();
    big[0] = 1e5;
    matmul_as(&mut out, &big, &b, d, MatmulPrecision::F16, Bf16Kernel::Fma);
    assert!(out[..n].iter().all(|x| !x.is_finite()));
    assert!(out[n..].iter().all(|x| x.is_finite()));
}

#[test]
fn round_to_half_matches_the_half_crate_on_every_kind_of_value() {
    let mut x: Vec<f32> = (0..20000)
        .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761)))
        .collect();
    x.extend([
        0.0,
        -0.0,
        1.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65504.0,
        65520.0,
        1.0 + f32::EPSILON,
        f32::from_bits(0x3f80_8000), // a bf16 tie: rounds to even
        f32::from_bits(0x3f81_8000), // a tie that rounds up
    ]);
    for (half, conv) in [
        (
            Half::BF16,
            &(|v: f32| bf16::from_f32(v).to_f32()) as &dyn Fn(f32) -> f32,
        ),
        (Half::F16, &|v: f32| f16::from_f32(v).to_f32()),
    ] {
        let mut out = vec![0.0; x.len()];
        round_to_half(&mut out, &x, half);
        let mut inplace = x.clone();
        round_to_half_inplace(&mut inplace, half);
        for (i, v) in x.iter().enumerate() {
            let want = conv(*v);
            if want.is_nan() {
                assert!(out[i].is_nan() && inplace[i].is_nan(), "{half:?} {v:e}");
            } else {
                assert_eq!(out[i].to_bits(), want.to_bits(), "{half:?} {v:e}");
                assert_eq!(inplace[i].to_bits(), want.to_bits(), "{half:?} {v:e}");
            }
        }
    }
}

/// A `--bf16` layer hands its linear layers bf16 inputs (a norm's output, the MLP activation)
/// instead of f32 ones the matmul would round itself: forward and both gradients must keep the
/// same bits, on every bf16 kernel (those this CPU lacks fall back, and are checked as such), for
/// a product too short to pack (5 rows) and a packed one (70 rows).
#[test]
fn linear_layer_input_in_bf16_gives_the_bits_of_its_f32_input() {
    use megatron_tensor::cpu::{matmul_backward, matmul_forward, Operand};
    let (i, o) = (96, 80);
    let w = common::randn(o * i, 61, 0.1);
    let bias = common::randn(o, 62, 0.1);
    for n in [5, 70] {
        let x = common::randn(n * i, 63, 1.0);
        let x16 = common::to_bf16(&x);
        let dy = common::randn(n * o, 64, 1.0);
        for kernel in [Bf16Kernel::Fma, Bf16Kernel::Dot, Bf16Kernel::Amx] {
            set_matmul_precision(MatmulPrecision::BF16);
            set_bf16_kernel(kernel);
            let run = |x: Operand<'_>| {
                let mut y = vec![0.0; n * o];
                matmul_forward(&mut y, x, Operand::F32(&w), Some(&bias), n, i, o);
                let (mut dx, mut dw) = (vec![0.0; n * i], vec![0.5; o * i]);
                let mut db = vec![0.0; o];
                matmul_backward(
                    Some(&mut dx),
                    &mut dw,
                    Some(&mut db),
                    &dy,
                    x,
                    Operand::F32(&w),
                    n,
                    i,
                    o,
                );
                (y, dx, dw)
            };
            let (y32, dx32, dw32) = run(Operand::F32(&x));
            let (y16, dx16, dw16) = run(Operand::BF16(&x16));
            set_matmul_precision(MatmulPrecision::F32);
            let what = format!("{kernel:?}, {n} rows");
            common::assert_same_bits(&y16, &y32, &format!("forward, {what}"));
            common::assert_same_bits(&dx16, &dx32, &format!("input gradient, {what}"));
            common::assert_same_bits(&dw16, &dw32, &format!("weight gradient, {what}"));
        }
    }
}
