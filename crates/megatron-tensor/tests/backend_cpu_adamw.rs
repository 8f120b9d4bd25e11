mod common;
use common::*;
use megatron_tensor::cpu::{adamw_update, AdamWParams};

#[test]
fn adamw_matches_reference_formula_over_several_steps() {
    let n = 50;
    let mut p = randn(n, 1, 1.0);
    let mut m = vec![0.0; n];
    let mut v = vec![0.0; n];
    let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    let mut mr = vec![0.0f64; n];
    let mut vr = vec![0.0f64; n];
    let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.95, 1e-8, 0.1);
    for step in 1..=5u64 {
        let g = randn(n, 10 + step, 1.0);
        adamw_update(
            &mut p,
            &g,
            &mut m,
            &mut v,
            AdamWParams {
                lr,
                beta1: b1,
                beta2: b2,
                eps,
                weight_decay: wd,
                step,
            },
        );
        for i in 0..n {
            let gi = g[i] as f64;
            mr[i] = b1 as f64 * mr[i] + (1.0 - b1 as f64) * gi;
            vr[i] = b2 as f64 * vr[i] + (1.0 - b2 as f64) * gi * gi;
            let mh = mr[i] / (1.0 - (b1 as f64).powi(step as i32));
            let vh = vr[i] / (1.0 - (b2 as f64).powi(step as i32));
            pr[i] -= lr as f64 * (mh / (vh.sqrt() + eps as f64) + wd as f64 * pr[i]);
        }
    }
    let want: Vec<f32> = pr.iter().map(|&x| x as f32).collect();
    assert_close(&p, &want, 1e-5, 1e-5, "adamw");
}

#[test]
fn adamw_without_weight_decay_leaves_zero_gradient_params_alone() {
    let mut p = vec![3.0f32; 8];
    let (mut m, mut v) = (vec![0.0; 8], vec![0.0; 8]);
    adamw_update(
        &mut p,
        &[0.0; 8],
        &mut m,
        &mut v,
        AdamWParams {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
        },
    );
    assert_eq!(p, vec![3.0; 8]);
}
