mod common;
use common::*;
use megatron_tensor::cpu::{swiglu_backward, swiglu_forward};

/// `silu(gate) * up` on `[gate | up]` rows, in f64.
fn naive_swiglu(x: &[f32], f: usize) -> Vec<f32> {
    x.chunks(2 * f)
        .flat_map(|r| {
            (0..f).map(move |j| {
                let g = r[j] as f64;
                (g / (1.0 + (-g).exp()) * r[f + j] as f64) as f32
            })
        })
        .collect()
}

#[test]
fn swiglu_forward_matches_naive() {
    let (rows, f) = (33, 40);
    let x = randn(rows * 2 * f, 1, 3.0);
    let mut out = vec![0.0; rows * f];
    swiglu_forward(&mut out, &x, f);
    assert_close(&out, &naive_swiglu(&x, f), 1e-5, 1e-5, "swiglu");
}

#[test]
fn swiglu_backward_matches_finite_difference() {
    let (rows, f) = (9, 10);
    let mut x = randn(rows * 2 * f, 2, 2.0);
    let r = randn(rows * f, 3, 1.0);
    let mut dx = vec![f32::NAN; x.len()];
    swiglu_backward(&mut dx, &r, &x, f);
    check_grad(
        &mut x,
        &dx,
        |x| dot(&naive_swiglu(x, f), &r),
        1e-2,
        1e-3,
        1e-2,
        180,
        "dinp",
    );
}
