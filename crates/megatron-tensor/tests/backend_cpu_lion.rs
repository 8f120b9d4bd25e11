mod common;
use common::*;
use megatron_tensor::cpu::{lion_update, LionParams};

/// emerging-optimizers' `Lion.step` in f64: decoupled decay `p -= lr * wd * p`, the sign of
/// `beta1 * m + (1 - beta1) * g` (torch's sign: 0 at 0), `m` lerped toward `g` by `1 - beta2`.
fn reference(p: &mut [f64], m: &mut [f64], g: &[f32], lr: f64, b1: f64, b2: f64, wd: f64) {
    for ((pv, mv), &gv) in p.iter_mut().zip(m.iter_mut()).zip(g) {
        let g = gv as f64;
        let c = b1 * *mv + (1.0 - b1) * g;
        let sign = if c > 0.0 {
            1.0
        } else if c < 0.0 {
            -1.0
        } else {
            0.0
        };
        *pv -= lr * wd * *pv;
        *mv += (1.0 - b2) * (g - *mv);
        *pv -= lr * sign;
    }
}

#[test]
fn lion_matches_its_definition_over_several_steps() {
    let n = 40_000; // past one parallel chunk
    let mut p = randn(n, 1, 1.0);
    // Zero gradients on a stretch: the first step's sign is 0 there (decay only).
    let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    let mut m = vec![0.0f32; n];
    let mut m64 = vec![0.0f64; n];
    let h = LionParams {
        lr: 1e-3,
        beta1: 0.95,
        beta2: 0.98,
        weight_decay: 0.1,
    };
    for step in 0..4u64 {
        let mut g = randn(n, 10 + step, 1.0);
        if step == 0 {
            g[100..200].fill(0.0);
        }
        lion_update(&mut p, &g, &mut m, h);
        reference(&mut p64, &mut m64, &g, 1e-3, 0.95, 0.98, 0.1);
        let want: Vec<f32> = p64.iter().map(|&x| x as f32).collect();
        assert_close(&p, &want, 1e-6, 1e-6, &format!("step {step}: parameters"));
        let want: Vec<f32> = m64.iter().map(|&x| x as f32).collect();
        assert_close(&m, &want, 1e-6, 1e-6, &format!("step {step}: exp_avg"));
    }
    // Every step moves a parameter by lr (its sign) plus the decay: the update's size does
    // not follow the gradient's.
    let mut q = vec![1.0f32; 3];
    let mut mq = vec![0.0f32; 3];
    lion_update(&mut q, &[1e-6, -5.0, 0.0], &mut mq, h);
    let decayed = 1.0 - 1e-3 * 0.1;
    assert_close(
        &q,
        &[decayed - 1e-3, decayed + 1e-3, decayed],
        1e-7,
        0.0,
        "sign, not size",
    );
}
