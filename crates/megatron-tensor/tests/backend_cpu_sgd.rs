mod common;
use common::*;
use megatron_tensor::cpu::{sgd_update, SgdParams};

/// torch.optim.SGD's single-tensor loop in f64: the buffer starts as a clone of the first
/// (decayed) gradient, then `buf = momentum * buf + d`; plain SGD keeps none.
fn torch_sgd(p: &mut [f64], buf: &mut Option<Vec<f64>>, g: &[f32], lr: f64, mom: f64, wd: f64) {
    let d: Vec<f64> = g
        .iter()
        .zip(p.iter())
        .map(|(&g, &p)| g as f64 + wd * p)
        .collect();
    let step = if mom == 0.0 {
        d
    } else {
        let b = match buf.take() {
            None => d,
            Some(b) => b.iter().zip(&d).map(|(b, d)| mom * b + d).collect(),
        };
        *buf = Some(b.clone());
        b
    };
    for (pv, s) in p.iter_mut().zip(step) {
        *pv -= lr * s;
    }
}

#[test]
fn sgd_matches_torch_over_several_steps_with_and_without_momentum() {
    let n = 40_000; // past one parallel chunk
    for (mom, wd) in [(0.9f32, 0.1f32), (0.0, 0.1), (0.5, 0.0)] {
        let mut p = randn(n, 1, 1.0);
        let mut buf = if mom == 0.0 { Vec::new() } else { vec![0.0; n] };
        let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let mut br = None;
        let lr = 1e-2;
        for step in 1..=5u64 {
            let g = randn(n, 10 + step, 1.0);
            let h = SgdParams {
                lr,
                momentum: mom,
                weight_decay: wd,
            };
            sgd_update(&mut p, &g, &mut buf, h);
            torch_sgd(&mut pr, &mut br, &g, lr as f64, mom as f64, wd as f64);
        }
        let want: Vec<f32> = pr.iter().map(|&x| x as f32).collect();
        assert_close(
            &p,
            &want,
            1e-5,
            1e-5,
            &format!("sgd momentum {mom} wd {wd}"),
        );
        if let Some(b) = br {
            let b: Vec<f32> = b.iter().map(|&x| x as f32).collect();
            assert_close(&buf, &b, 1e-5, 1e-5, "momentum buffer");
        }
    }
}
