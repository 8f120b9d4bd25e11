mod common;
use common::*;
use megatron_tensor::cpu::moe_router::{
    aux_loss, topk_router_backward, topk_router_forward, z_loss, GroupLimit, RouterDims,
    ScoreFunction,
};

fn dims(score: ScoreFunction, pre_softmax: bool, topk: usize) -> RouterDims {
    RouterDims {
        tokens: 7,
        experts: 6,
        topk,
        score,
        pre_softmax,
        scaling: Some(1.5),
        group_limit: None,
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
        group_limit: None,
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
    let groups = Some(GroupLimit {
        groups: 3,
        topk_groups: 2,
    });
    for (score, pre, k, group_limit) in [
        (ScoreFunction::Softmax, true, 2, None),
        (ScoreFunction::Softmax, false, 2, None),
        (ScoreFunction::Sigmoid, false, 2, None),
        (ScoreFunction::Sigmoid, false, 1, None),
        (ScoreFunction::Softmax, false, 2, groups),
        (ScoreFunction::Sigmoid, false, 2, groups),
    ] {
        let d = RouterDims {
            group_limit,
            ..dims(score, pre, k)
        };
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
            &format!("{score:?} pre {pre} k {k} groups {group_limit:?}"),
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

/// Group-limited routing (megatron-core's `group_limited_topk`), worked by hand: 8 experts in
/// 4 groups of 2, top-2 within the best group. Plain top-2 takes experts 1 and 4 (2.0 and 1.9),
/// which lie in groups 0 and 2; each group scores the sum of its best 2 / 1 members: group 0
/// 2.0 + 0.1, group 1 0.5 + 0.4, group 2 1.9 + 0.0, group 3 1.2 + 1.1 = 2.3, so group 3 wins
/// and the token goes to experts 6 and 7 (on sigmoid scores too; on pre-softmax probabilities
/// the convex exponential makes group 0 the best). With two groups of the four (best one member each:
/// 2.0, 0.5, 1.9, 1.2) groups 0 and 2 win and the plain choice stands; the selection's
/// probabilities are those of the selected scores, whatever the score function.
#[test]
fn group_limited_routing_picks_the_top_k_among_the_best_groups() {
    let logits = [0.1f32, 2.0, 0.5, 0.4, 1.9, 0.0, 1.2, 1.1];
    let d = RouterDims {
        tokens: 1,
        experts: 8,
        topk: 2,
        score: ScoreFunction::Softmax,
        pre_softmax: false,
        scaling: None,
        group_limit: None,
    };
    assert_eq!(probs_of(&logits, d).0, [1, 4]);
    let one = Some(GroupLimit {
        groups: 4,
        topk_groups: 1,
    });
    for (score, pre) in [
        (ScoreFunction::Softmax, false),
        (ScoreFunction::Softmax, true),
        (ScoreFunction::Sigmoid, false),
    ] {
        let d = RouterDims {
            score,
            pre_softmax: pre,
            group_limit: one,
            ..d
        };
        let (idx, p) = probs_of(&logits, d);
        // Pre-softmax groups sum probabilities: e^2 + e^0.1 beats e^1.2 + e^1.1, so group 0.
        let want_idx = if pre { [1, 0] } else { [6, 7] };
        assert_eq!(idx, want_idx, "{score:?} pre-softmax {pre}");
        let want: Vec<f32> = match (score, pre) {
            (ScoreFunction::Softmax, false) => {
                let z = 1.2f32.exp() + 1.1f32.exp();
                vec![1.2f32.exp() / z, 1.1f32.exp() / z]
            }
            (ScoreFunction::Softmax, true) => {
                let z: f32 = logits.iter().map(|v| v.exp()).sum();
                vec![2.0f32.exp() / z, 0.1f32.exp() / z]
            }
            (ScoreFunction::Sigmoid, _) => {
                let s = |x: f32| 1.0 / (1.0 + (-x).exp());
                let sum = s(1.2) + s(1.1);
                vec![s(1.2) / sum, s(1.1) / sum]
            }
        };
        assert_close(
            &p,
            &want,
            1e-6,
            1e-6,
            "probabilities of the selected experts",
        );
    }
    let two = RouterDims {
        group_limit: Some(GroupLimit {
            groups: 4,
            topk_groups: 2,
        }),
        ..d
    };
    assert_eq!(probs_of(&logits, two).0, [1, 4]);
    // An expert bias shifts the group scores too (DeepSeek-V3 selects on scores + bias).
    let biased = RouterDims {
        score: ScoreFunction::Sigmoid,
        group_limit: one,
        ..d
    };
    let mut idx = [0u32; 2];
    let mut p = [0.0f32; 2];
    let bias = [0.0, 0.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0];
    topk_router_forward(&mut idx, &mut p, &logits, Some(&bias), biased);
    assert_eq!(idx, [2, 3], "group 1 wins on its biased scores");
}
