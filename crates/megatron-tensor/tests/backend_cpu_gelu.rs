mod common;
use common::*;
use megatron_tensor::cpu::{bias_backward, bias_gelu_backward, bias_gelu_forward};

fn naive_gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

#[test]
fn bias_gelu_forward_matches_naive() {
    let (rows, c) = (33, 10);
    let x = randn(rows * c, 1, 2.0);
    let b = randn(c, 2, 1.0);
    let mut out = vec![0.0; rows * c];
    bias_gelu_forward(&mut out, &x, &b);
    let want: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| naive_gelu(v as f64 + b[i % c] as f64) as f32)
        .collect();
    assert_close(&out, &want, 1e-5, 1e-5, "gelu");
}

#[test]
fn bias_gelu_backward_matches_finite_difference() {
    let (rows, c) = (4, 9);
    let mut x = randn(rows * c, 3, 1.5);
    let mut b = randn(c, 4, 1.0);
    let r = randn(rows * c, 5, 1.0);
    let mut dx = vec![0.0; rows * c];
    bias_gelu_backward(&mut dx, &r, &x, &b);
    let mut db = vec![0.0; c];
    bias_backward(&mut db, &dx, rows, c);
    let bc = b.clone();
    let f = |x: &[f32], b: &[f32]| {
        let mut o = vec![0.0; x.len()];
        bias_gelu_forward(&mut o, x, b);
        dot(&o, &r)
    };
    check_grad(&mut x, &dx, |x| f(x, &bc), 1e-2, 1e-3, 1e-2, 36, "dx");
    let xc = x.clone();
    check_grad(&mut b, &db, |b| f(&xc, b), 1e-2, 1e-3, 1e-2, 9, "db");
}

#[test]
fn gelu_without_bias_equals_bias_gelu_with_a_zero_bias() {
    let (rows, c) = (37, 20);
    let x = randn(rows * c, 11, 2.0);
    let dy = randn(rows * c, 12, 1.0);
    let zero = vec![0.0f32; c];
    let (mut a, mut b) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    megatron_tensor::cpu::gelu_forward(&mut a, &x);
    bias_gelu_forward(&mut b, &x, &zero);
    assert_eq!(a, b);
    megatron_tensor::cpu::gelu_backward(&mut a, &dy, &x);
    bias_gelu_backward(&mut b, &dy, &x, &zero);
    assert_eq!(a, b);
}
