mod common;
use common::*;
use megatron_tensor::cpu::moe_router::{
    aux_loss, topk_router_backward, topk_router_forward, z_loss, RouterDims, ScoreFunction,
};

fn dims(score: ScoreFunction, pre_softmax: bool, topk: usize) -> RouterDims {
    RouterDims {
        tokens: 7,
        experts: 6,
        topk,
        score,
        pre_softmax,
        scaling: Some(1.5),
    }
}

fn probs_of(logits: &[f32], d: RouterDims) -> (Vec<u32>, Vec<f32>) {
    let mut idx = vec![0u32; d.tokens * d.topk];
    let mut p = vec![0.0f32; d.tokens * d.topk];
    topk_router_forward(&mut idx, &mut p, logits, None, d);
    (idx, p)
}

#[test]
fn softmax_routing_matches_megatrons_definition() {
    // Pre-softmax: top-k of softmax over all experts; otherwise softmax over the k picked logits.
    let logits = [0.1f32, 2.0, -1.0, 0.5, 1.9, 0.0];
    let d = RouterDims {
        tokens: 1,
        experts: 6,
        topk: 2,
        score: ScoreFunction::Softmax,
        pre_softmax: true,
        scaling: None,
    };
    let (idx, p) = probs_of(&logits, d);
    assert_eq!(idx, [1, 4]);
    let z: f32 = logits.iter().map(|v| v.exp()).sum();
    assert_close(
        &p,
        &[2.0f32.exp() / z, 1.9f32.exp() / z],
        1e-6,
        1e-6,
        "pre-softmax",
    );
    let (idx, p) = probs_of(
        &logits,
        RouterDims {
            pre_softmax: false,
            ..d
        },
    );
    assert_eq!(idx, [1, 4]);
    let z = 2.0f32.exp() + 1.9f32.exp();
    assert_close(
        &p,
        &[2.0f32.exp() / z, 1.9f32.exp() / z],
        1e-6,
        1e-6,
        "post-softmax",
    );
    // Sigmoid: normalized over the picked experts; an expert bias changes the pick only.
    let d = RouterDims {
        score: ScoreFunction::Sigmoid,
        ..d
    };
    let mut idx = [0u32; 2];
    let mut p = [0.0f32; 2];
    topk_router_forward(
        &mut idx,
        &mut p,
        &logits,
        Some(&[0.0, 0.0, 5.0, 0.0, 0.0, 0.0]),
        d,
    );
    assert_eq!(idx, [2, 1]);
    let s = |x: f32| 1.0 / (1.0 + (-x).exp());
    let sum = s(-1.0) + s(2.0);
    assert_close(
        &p,
        &[s(-1.0) / sum, s(2.0) / sum],
        1e-6,
        1e-6,
        "sigmoid with bias",
    );
}

#[test]
fn router_backward_matches_finite_difference_for_every_score_function() {
    for (score, pre, k) in [
        (ScoreFunction::Softmax, true, 2),
        (ScoreFunction::Softmax, false, 2),
        (ScoreFunction::Sigmoid, false, 2),
        (ScoreFunction::Sigmoid, false, 1),
    ] {
        let d = dims(score, pre, k);
        let mut logits = randn(d.tokens * d.experts, 3, 1.0);
        let r = randn(d.tokens * k, 4, 1.0);
        let (idx, _) = probs_of(&logits, d);
        let mut dl = vec![f32::NAN; logits.len()];
        topk_router_backward(&mut dl, &r, &logits, &idx, d);
        // Small steps keep the selection fixed (random logits have no near-ties here).
        check_grad(
            &mut logits,
            &dl,
            |x| {
                let (i2, p) = probs_of(x, d);
                assert_eq!(i2, idx, "the step changed the selection");
                dot(&p, &r)
            },
            1e-3,
            2e-3,
            1e-2,
            42,
            &format!("{score:?} pre {pre} k {k}"),
        );
    }
}

#[test]
fn aux_and_z_losses_match_their_formulas_and_finite_differences() {
    for score in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
        let d = dims(score, false, 2);
        let mut logits = randn(d.tokens * d.experts, 5, 1.0);
        let tokens = [3.0f32, 1.0, 4.0, 2.0, 0.0, 4.0];
        let (t, coeff) = (d.tokens as f32, 0.01f32);
        let loss = aux_loss(None, &logits, &tokens, t, coeff, 1.0, d);
        // coeff * E / (k T^2) * sum_i tokens_i * sum_x score(x, i)
        let mut want = 0.0f64;
        for x in logits.chunks(6) {
            let s: Vec<f64> = match score {
                ScoreFunction::Softmax => {
                    let z: f64 = x.iter().map(|v| (*v as f64).exp()).sum();
                    x.iter().map(|v| (*v as f64).exp() / z).collect()
                }
                ScoreFunction::Sigmoid => {
                    let sg: Vec<f64> = x.iter().map(|v| 1.0 / (1.0 + (-*v as f64).exp())).collect();
                    let z: f64 = sg.iter().sum();
                    sg.iter().map(|v| v / z).collect()
                }
            };
            want += s
                .iter()
                .zip(&tokens)
                .map(|(a, b)| a * *b as f64)
                .sum::<f64>();
        }
        want *= 0.01 * 6.0 / (2.0 * 7.0 * 7.0);
        assert!(
            (loss as f64 - want).abs() < 1e-7,
            "{score:?}: {loss} vs {want}"
        );
        let mut dl = vec![0.0f32; logits.len()];
        aux_loss(Some(&mut dl), &logits, &tokens, t, coeff, 1.0, d);
        check_grad(
            &mut logits,
            &dl,
            |x| aux_loss(None, x, &tokens, t, coeff, 1.0, d) as f64,
            1e-2,
            1e-6,
            1e-2,
            42,
            "aux",
        );
    }
    let mut logits = randn(7 * 6, 6, 2.0);
    let z = z_loss(None, &logits, 1e-3, 1.0, 6);
    let want: f64 = logits
        .chunks(6)
        .map(|x| {
            x.iter()
                .map(|v| (*v as f64).exp())
                .sum::<f64>()
                .ln()
                .powi(2)
        })
        .sum::<f64>()
        / 7.0
        * 1e-3;
    assert!((z as f64 - want).abs() < 1e-7, "{z} vs {want}");
    let mut dl = vec![0.0f32; logits.len()];
    z_loss(Some(&mut dl), &logits, 1e-3, 1.0, 6);
    check_grad(
        &mut logits,
        &dl,
        |x| z_loss(None, x, 1e-3, 1.0, 6) as f64,
        1e-2,
        1e-6,
        1e-2,
        42,
        "z-loss",
    );
}
