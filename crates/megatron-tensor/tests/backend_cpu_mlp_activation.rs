mod common;
use common::*;
use megatron_tensor::cpu::{
    mlp_activation_backward, mlp_activation_forward, GeluApprox, GluLimits, MlpActivation,
};

/// The activation in f64 from its definition (GELU's tanh form or erf via libm).
fn naive(x: &[f32], f: usize, act: MlpActivation) -> Vec<f32> {
    let gelu = |g: f64, a: GeluApprox| match a {
        GeluApprox::Tanh => {
            0.5 * g
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
        }
        GeluApprox::Erf => 0.5 * g * (1.0 + libm::erf(g / std::f64::consts::SQRT_2)),
    };
    match act {
        MlpActivation::Relu => x.iter().map(|v| v.max(0.0)).collect(),
        MlpActivation::SquaredRelu => x.iter().map(|v| v.max(0.0).powi(2)).collect(),
        MlpActivation::Gelu(a) => x.iter().map(|&v| gelu(v as f64, a) as f32).collect(),
        MlpActivation::SwiGLU(_) | MlpActivation::GeGLU(_) | MlpActivation::QuickGeGLU(_) => x
            .chunks(2 * f)
            .flat_map(|r| {
                (0..f).map(move |j| {
                    let g = r[j] as f64;
                    let a = match act {
                        MlpActivation::GeGLU(a) => gelu(g, a),
                        MlpActivation::QuickGeGLU(_) => g / (1.0 + (-1.702 * g).exp()),
                        _ => g / (1.0 + (-g).exp()),
                    };
                    (a * r[f + j] as f64) as f32
                })
            })
            .collect(),
    }
}

const ALL: [MlpActivation; 7] = [
    MlpActivation::Relu,
    MlpActivation::SquaredRelu,
    MlpActivation::QuickGeGLU(GluLimits::NONE),
    MlpActivation::Gelu(GeluApprox::Tanh),
    MlpActivation::SwiGLU(GluLimits::NONE),
    MlpActivation::GeGLU(GeluApprox::Tanh),
    MlpActivation::GeGLU(GeluApprox::Erf),
];

#[test]
fn mlp_activation_forward_matches_definition() {
    let (rows, f) = (33, 40);
    for act in ALL {
        let x = randn(rows * act.fc1_factor() * f, 1, 3.0);
        let mut out = vec![f32::NAN; rows * f];
        mlp_activation_forward(&mut out, &x, f, act);
        assert_close(&out, &naive(&x, f, act), 1e-5, 1e-5, &format!("{act:?}"));
    }
}

#[test]
fn mlp_activation_backward_matches_finite_difference() {
    let (rows, f) = (9, 10);
    for act in ALL {
        let mut x = randn(rows * act.fc1_factor() * f, 2, 2.0);
        if matches!(act, MlpActivation::Relu | MlpActivation::SquaredRelu) {
            // Keep inputs away from the kink, where a finite difference is meaningless.
            x.iter_mut()
                .for_each(|v| *v += if *v >= 0.0 { 0.1 } else { -0.1 });
        }
        let r = randn(rows * f, 3, 1.0);
        let mut dx = vec![f32::NAN; x.len()];
        mlp_activation_backward(&mut dx, &r, &x, f, act);
        check_grad(
            &mut x,
            &dx,
            |x| dot(&naive(x, f, act), &r),
            1e-2,
            1e-3,
            1e-2,
            180,
            &format!("{act:?} dinp"),
        );
    }
}

/// Under `--bf16` the MLP reads its kept bf16 fc1 output and writes the activation in bf16 for
/// fc2: every activation must give the f32 kernel's bits on the widened input, rounded, in
/// every storage combination. 23 rows of width 700 cross the staging blocks' edges.
#[test]
fn mlp_activations_in_bf16_storage_match_the_f32_kernels_bit_for_bit() {
    let (rows, f) = (23, 700);
    for act in [
        MlpActivation::Gelu(GeluApprox::Tanh),
        MlpActivation::Gelu(GeluApprox::Erf),
        MlpActivation::Relu,
        MlpActivation::SquaredRelu,
        MlpActivation::SwiGLU(GluLimits::NONE),
        MlpActivation::GeGLU(GeluApprox::Tanh),
        MlpActivation::QuickGeGLU(GluLimits::NONE),
    ] {
        let w = f * act.fc1_factor();
        let x16 = to_bf16(&randn(rows * w, 41, 2.0));
        let xw = widen(&x16);
        let dy = randn(rows * f, 42, 1.0);
        let mut want = vec![0.0; rows * f];
        mlp_activation_forward(&mut want, &xw, f, act);
        let mut want_dx = vec![0.0; rows * w];
        mlp_activation_backward(&mut want_dx, &dy, &xw, f, act);
        for threads in [1, 3] {
            in_pool(threads, || {
                let mut o16 = vec![half::bf16::ZERO; rows * f];
                mlp_activation_forward(&mut o16[..], &x16[..], f, act);
                assert_same_bf16(&o16, &to_bf16(&want), &format!("{act:?} bf16 -> bf16"));
                mlp_activation_forward(&mut o16[..], &xw, f, act);
                assert_same_bf16(&o16, &to_bf16(&want), &format!("{act:?} f32 -> bf16"));
                let mut o32 = vec![0.0; rows * f];
                mlp_activation_forward(&mut o32, &x16[..], f, act);
                assert_same_bits(&o32, &want, &format!("{act:?} bf16 -> f32"));
                let mut dx = vec![0.0; rows * w];
                mlp_activation_backward(&mut dx, &dy, &x16[..], f, act);
                assert_same_bits(&dx, &want_dx, &format!("{act:?} backward"));
            });
        }
    }
}
