mod common;
use common::*;
use megatron_tensor::cpu::{bias_backward, bias_gelu_backward, bias_gelu_forward, GeluApprox};

fn naive_gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

#[test]
fn bias_gelu_forward_matches_naive() {
    let (rows, c) = (33, 10);
    let x = randn(rows * c, 1, 2.0);
    let b = randn(c, 2, 1.0);
    let mut out = vec![0.0; rows * c];
    bias_gelu_forward(&mut out, &x, &b, GeluApprox::Tanh);
    let want: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| naive_gelu(v as f64 + b[i % c] as f64) as f32)
        .collect();
    assert_close(&out, &want, 1e-5, 1e-5, "gelu");
}

#[test]
fn exact_gelu_matches_the_normal_cdf_at_known_points() {
    // x * Phi(x), with Phi from tables of the standard normal distribution.
    let x = [1.0f32, -0.5, 2.0, 0.0, -3.0];
    let phi = [
        0.841_344_746_068_542_9f64,
        0.308_537_538_725_986_9,
        0.977_249_868_051_820_8,
        0.5,
        0.001_349_898_031_630_094_6,
    ];
    let mut out = [0.0f32; 5];
    megatron_tensor::cpu::gelu_forward(&mut out, &x, GeluApprox::Erf);
    for i in 0..5 {
        let want = x[i] as f64 * phi[i];
        assert!(
            (out[i] as f64 - want).abs() < 1e-6,
            "gelu({}) = {} vs {want}",
            x[i],
            out[i]
        );
    }
    // The tanh form differs measurably (why converted BERT checkpoints need the exact one).
    let mut tanh = [0.0f32; 5];
    megatron_tensor::cpu::gelu_forward(&mut tanh, &x, GeluApprox::Tanh);
    assert!((tanh[4] - out[4]).abs() > 1e-4, "{} vs {}", tanh[4], out[4]);
}

#[test]
fn bias_gelu_backward_matches_finite_difference() {
    for a in [GeluApprox::Tanh, GeluApprox::Erf] {
        bias_gelu_backward_matches_finite_difference_for(a);
    }
}

fn bias_gelu_backward_matches_finite_difference_for(a: GeluApprox) {
    let (rows, c) = (4, 9);
    let mut x = randn(rows * c, 3, 1.5);
    let mut b = randn(c, 4, 1.0);
    let r = randn(rows * c, 5, 1.0);
    let mut dx = vec![0.0; rows * c];
    bias_gelu_backward(&mut dx, &r, &x, &b, a);
    let mut db = vec![0.0; c];
    bias_backward(&mut db, &dx, rows, c);
    let bc = b.clone();
    let f = |x: &[f32], b: &[f32]| {
        let mut o = vec![0.0; x.len()];
        bias_gelu_forward(&mut o, x, b, a);
        dot(&o, &r)
    };
    check_grad(&mut x, &dx, |x| f(x, &bc), 1e-2, 1e-3, 1e-2, 36, "dx");
    let xc = x.clone();
    check_grad(&mut b, &db, |b| f(&xc, b), 1e-2, 1e-3, 1e-2, 9, "db");
}

#[test]
fn gelu_without_bias_equals_bias_gelu_with_a_zero_bias() {
    for a in [GeluApprox::Tanh, GeluApprox::Erf] {
        gelu_without_bias_equals_bias_gelu_with_a_zero_bias_for(a);
    }
}

fn gelu_without_bias_equals_bias_gelu_with_a_zero_bias_for(a: GeluApprox) {
    let (rows, c) = (37, 20);
    let x = randn(rows * c, 11, 2.0);
    let dy = randn(rows * c, 12, 1.0);
    let zero = vec![0.0f32; c];
    let (mut p, mut q) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    megatron_tensor::cpu::gelu_forward(&mut p, &x, a);
    bias_gelu_forward(&mut q, &x, &zero, a);
    assert_eq!(p, q);
    megatron_tensor::cpu::gelu_backward(&mut p, &dy, &x, a);
    bias_gelu_backward(&mut q, &dy, &x, &zero, a);
    assert_eq!(p, q);
}

/// The fused bias + GELU of GPT's MLP with bf16 storage: the f32 kernel's bits on the widened
/// input (rounded where the output is bf16), the bias added per column across block edges.
#[test]
fn bias_gelu_in_bf16_storage_matches_the_f32_kernel_bit_for_bit() {
    use megatron_tensor::cpu::gelu::bias_gelu_recompute;
    let (rows, c) = (29, 600);
    let x16 = to_bf16(&randn(rows * c, 51, 2.0));
    let xw = widen(&x16);
    let bias = randn(c, 52, 0.5);
    let dy = randn(rows * c, 53, 1.0);
    for a in [GeluApprox::Tanh, GeluApprox::Erf] {
        let mut want = vec![0.0; rows * c];
        bias_gelu_forward(&mut want, &xw, &bias, a);
        let mut want_dx = vec![0.0; rows * c];
        bias_gelu_backward(&mut want_dx, &dy, &xw, &bias, a);
        let mut o16 = vec![half::bf16::ZERO; rows * c];
        bias_gelu_recompute(&mut o16[..], &x16[..], &bias, a);
        assert_same_bf16(&o16, &to_bf16(&want), "bf16 -> bf16");
        let mut o32 = vec![0.0; rows * c];
        bias_gelu_recompute(&mut o32, &x16[..], &bias, a);
        assert_same_bits(&o32, &want, "bf16 -> f32");
        let mut dx = vec![0.0; rows * c];
        bias_gelu_backward(&mut dx, &dy, &x16[..], &bias, a);
        assert_same_bits(&dx, &want_dx, "backward");
    }
}
