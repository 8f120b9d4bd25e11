//! gpt-oss's gated unit (`--activation-func-clamp-value`, `--glu-linear-offset`) through the
//! MLP activation entry point: against megatron-core's `glu` written out in f64, and its
//! gradient against central differences away from the clamp's corners.

mod common;
use common::*;
use megatron_tensor::cpu::{
    mlp_activation_backward, mlp_activation_forward, GluLimits, MlpActivation,
};

/// megatron-core's `glu`: gate clamped above, linear half clamped both ways, then
/// `act(gate) * (linear + offset)`; `alpha` is the sigmoid's scale (1 for SiLU, 1.702 quick GELU).
fn naive(x: &[f32], f: usize, alpha: f64, l: GluLimits) -> Vec<f64> {
    let c = l.clamp.map(|c| c as f64);
    x.chunks_exact(2 * f)
        .flat_map(|row| {
            (0..f).map(move |j| {
                let (mut g, mut u) = (row[j] as f64, row[f + j] as f64);
                if let Some(c) = c {
                    g = g.min(c);
                    u = u.clamp(-c, c);
                }
                g / (1.0 + (-alpha * g).exp()) * (u + l.linear_offset as f64)
            })
        })
        .collect()
}

/// A gated unit by its gate's sigmoid slope (1 for SiLU, 1.702 for Quick-GELU).
type GatedUnit = (f64, fn(GluLimits) -> MlpActivation);

const CASES: &[GatedUnit] = &[
    (1.0, MlpActivation::SwiGLU),
    (1.702, MlpActivation::QuickGeGLU),
];

fn limits() -> [GluLimits; 3] {
    [
        GluLimits {
            linear_offset: 1.0,
            clamp: Some(0.9),
        },
        GluLimits {
            linear_offset: 0.0,
            clamp: Some(0.5),
        },
        GluLimits {
            linear_offset: -0.25,
            clamp: None,
        },
    ]
}

#[test]
fn clamped_and_offset_gated_units_match_megatron_glu() {
    let (rows, f) = (37, 24);
    let x = randn(rows * 2 * f, 4, 1.0);
    for &(alpha, act) in CASES {
        for l in limits() {
            let mut out = vec![0.0f32; rows * f];
            mlp_activation_forward(&mut out[..], &x[..], f, act(l));
            let want: Vec<f32> = naive(&x, f, alpha, l).iter().map(|&v| v as f32).collect();
            assert_close(&out, &want, 1e-6, 1e-5, &format!("{:?}", act(l)));
        }
    }
    // The clamp did act: some inputs lie beyond 0.5 either way.
    assert!(x.iter().any(|v| *v > 0.9) && x.iter().any(|v| *v < -0.9));
}

#[test]
fn clamped_and_offset_gated_units_backward_matches_finite_difference() {
    let (rows, f) = (9, 8);
    let mut x = randn(rows * 2 * f, 6, 1.0);
    let r = randn(rows * f, 7, 1.0);
    for &(alpha, act) in CASES {
        for l in limits() {
            let mut dx = vec![0.0f32; x.len()];
            mlp_activation_backward(&mut dx, &r, &x[..], f, act(l));
            let eps = 1e-3f32;
            let mut clamped = 0;
            for i in 0..x.len() {
                let v = x[i];
                // Away from the clamp's corners, where the derivative jumps.
                if let Some(c) = l.clamp {
                    if (v.abs() - c).abs() < 4.0 * eps {
                        continue;
                    }
                    clamped += usize::from(v > c || (i % (2 * f) >= f && v < -c));
                }
                x[i] = v + eps;
                let fp = dot_f64(&naive(&x, f, alpha, l), &r);
                x[i] = v - eps;
                let fm = dot_f64(&naive(&x, f, alpha, l), &r);
                x[i] = v;
                let fd = (fp - fm) / (2.0 * eps as f64);
                assert!(
                    (fd - dx[i] as f64).abs() < 1e-3 + 1e-3 * fd.abs(),
                    "{:?}: dx[{i}] analytic {} vs {fd}",
                    act(l),
                    dx[i]
                );
            }
            assert!(l.clamp.is_none() || clamped > 0, "no element was clamped");
        }
    }
}

#[test]
fn gated_units_without_limits_keep_their_plain_kernels_bits() {
    let (rows, f) = (5, 16);
    let x = randn(rows * 2 * f, 9, 1.0);
    for &(_, act) in CASES {
        let mut plain = vec![0.0f32; rows * f];
        mlp_activation_forward(&mut plain[..], &x[..], f, act(GluLimits::NONE));
        let mut general = vec![0.0f32; rows * f];
        megatron_tensor::cpu::limited_glu_forward(
            &mut general,
            &x,
            f,
            match act(GluLimits::NONE) {
                MlpActivation::SwiGLU(_) => megatron_tensor::cpu::GateFunction::Silu,
                _ => megatron_tensor::cpu::GateFunction::QuickGelu,
            },
            GluLimits::NONE,
        );
        assert_close(&plain, &general, 1e-7, 1e-6, "plain vs general path");
    }
}

fn dot_f64(a: &[f64], r: &[f32]) -> f64 {
    a.iter().zip(r).map(|(x, y)| x * *y as f64).sum()
}
