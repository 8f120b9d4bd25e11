//! Attention sinks (`--softmax-type`): the blockwise kernel's output moved to the sink's
//! softmax against a naive softmax with one more logit per head, and the gradients (the
//! kernel's backward on the sink's output and log-sum-exp, plus the sink's own) against
//! central differences of that naive attention.

mod common;
use common::*;
use megatron_tensor::cpu::{
    attention_backward, attention_decode_forward, attention_forward, attention_sink_backward,
    attention_sink_forward, AttentionDims, AttentionMask, DecodeDims, SinkDims,
};
use megatron_tensor::RngKey;

fn dims(b: usize, t: usize, heads: usize, groups: usize, hd: usize) -> AttentionDims {
    AttentionDims {
        b,
        t,
        heads,
        groups,
        head_dim: hd,
        causal: true,
        dropout: 0.0,
        rng_heads: (0, heads),
        rng_block: None,
    }
}

fn sink_dims(d: AttentionDims) -> SinkDims {
    SinkDims {
        b: d.b,
        t: d.t,
        heads: d.heads,
        head_dim: d.head_dim,
    }
}

/// Causal attention in f64 whose softmax has the extra logit `sink[h]` in every row's
/// denominator (keys `j >= i - window` only, if windowed): the output and each row's
/// log-sum-exp including the sink.
fn naive_sink_attention(
    qkv: &[f32],
    sink: &[f32],
    window: Option<usize>,
    d: AttentionDims,
) -> (Vec<f64>, Vec<f64>) {
    let (t, nh, hd) = (d.t, d.heads, d.head_dim);
    let qpg = nh / d.groups;
    let qrs = d.groups * (qpg + 2) * hd;
    let q_at = |h: usize| ((h / qpg) * (qpg + 2) + h % qpg) * hd;
    let k_at = |h: usize| ((h / qpg) * (qpg + 2) + qpg) * hd;
    let mut out = vec![0.0f64; d.b * t * nh * hd];
    let mut lse = vec![0.0f64; d.b * nh * t];
    for b in 0..d.b {
        for h in 0..nh {
            for i in 0..t {
                let q = &qkv[(b * t + i) * qrs + q_at(h)..][..hd];
                let keys: Vec<usize> = (0..=i)
                    .filter(|&j| window.is_none_or(|w| j + w >= i))
                    .collect();
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let k = &qkv[(b * t + j) * qrs + k_at(h)..][..hd];
                        q.iter()
                            .zip(k)
                            .map(|(a, c)| *a as f64 * *c as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = s.iter().cloned().fold(sink[h] as f64, f64::max);
                let denom: f64 =
                    s.iter().map(|v| (v - mx).exp()).sum::<f64>() + (sink[h] as f64 - mx).exp();
                lse[(b * nh + h) * t + i] = mx + denom.ln();
                for (&j, sv) in keys.iter().zip(&s) {
                    let v = &qkv[(b * t + j) * qrs + k_at(h) + hd..][..hd];
                    let p = (sv - mx).exp() / denom;
                    for c in 0..hd {
                        out[(b * t + i) * nh * hd + h * hd + c] += p * v[c] as f64;
                    }
                }
            }
        }
    }
    (out, lse)
}

/// The kernels' sink output and log-sum-exp.
fn sink_attention(
    qkv: &[f32],
    sink: &[f32],
    starts: Option<&[u32]>,
    d: AttentionDims,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0f32; d.b * d.t * d.heads * d.head_dim];
    let mut lse = vec![0.0f32; d.b * d.heads * d.t];
    let mask = starts.map_or(AttentionMask::NONE, AttentionMask::documents);
    attention_forward(&mut out, &mut lse, qkv, mask, d, RngKey::new(1));
    attention_sink_forward(&mut out, &mut lse, sink, sink_dims(d));
    (out, lse)
}

fn window_starts(b: usize, t: usize, w: usize) -> Vec<u32> {
    (0..b * t)
        .map(|r| (r % t).saturating_sub(w) as u32)
        .collect()
}

#[test]
fn attention_sink_forward_matches_naive_softmax_with_a_sink_logit() {
    // Multi-head and grouped-query, a sequence longer than one block, with and without a window;
    // sinks from strongly negative (nearly plain attention) to dominant.
    for (groups, window) in [(4, None), (2, None), (1, Some(5))] {
        let d = dims(2, 70, 4, groups, 8);
        let n = d.b * d.t * (d.heads + 2 * d.groups) * d.head_dim;
        let qkv = randn(n, 3, 1.0);
        let sink = [-6.0f32, 0.0, 1.5, 4.0];
        let starts = window.map(|w| window_starts(d.b, d.t, w));
        let (out, lse) = sink_attention(&qkv, &sink, starts.as_deref(), d);
        let (want, want_lse) = naive_sink_attention(&qkv, &sink, window, d);
        let want: Vec<f32> = want.iter().map(|&x| x as f32).collect();
        let want_lse: Vec<f32> = want_lse.iter().map(|&x| x as f32).collect();
        assert_close(&out, &want, 1e-5, 1e-4, "sink attention output");
        assert_close(&lse, &want_lse, 1e-5, 1e-5, "sink log-sum-exp");
    }
}

#[test]
fn attention_sink_of_minus_infinity_leaves_plain_attention_unchanged() {
    let d = dims(1, 9, 2, 2, 4);
    let qkv = randn(d.b * d.t * 6 * d.head_dim, 5, 1.0);
    let mut plain = vec![0.0f32; d.b * d.t * d.heads * d.head_dim];
    let mut lse = vec![0.0f32; d.b * d.heads * d.t];
    attention_forward(
        &mut plain,
        &mut lse,
        &qkv[..],
        AttentionMask::NONE,
        d,
        RngKey::new(1),
    );
    let (out, lse2) = sink_attention(&qkv, &[f32::NEG_INFINITY; 2], None, d);
    assert_eq!(out, plain);
    assert_eq!(lse2, lse);
}

#[test]
fn attention_sink_backward_matches_finite_difference() {
    for groups in [3, 1] {
        let d = dims(2, 11, 3, groups, 4);
        let n = d.b * d.t * (d.heads + 2 * d.groups) * d.head_dim;
        let mut qkv = randn(n, 7, 0.8);
        let mut sink = vec![0.3f32, -0.7, 1.1];
        let r = randn(d.b * d.t * d.heads * d.head_dim, 8, 1.0);
        let objective = |qkv: &[f32], sink: &[f32]| -> f64 {
            let (o, _) = naive_sink_attention(qkv, sink, None, d);
            o.iter().zip(&r).map(|(a, b)| a * *b as f64).sum()
        };
        let (out, lse) = sink_attention(&qkv, &sink, None, d);
        let mut dqkv = vec![0.0f32; n];
        attention_backward(
            &mut dqkv,
            &r,
            &out,
            &lse,
            &qkv[..],
            AttentionMask::NONE,
            d,
            RngKey::new(1),
        );
        let mut dsink = vec![0.0f32; d.heads];
        attention_sink_backward(&mut dsink, &r, &out, &lse, &sink, sink_dims(d));
        let eps = 1e-3f32;
        for i in (0..n).step_by(7) {
            let x = qkv[i];
            qkv[i] = x + eps;
            let fp = objective(&qkv, &sink);
            qkv[i] = x - eps;
            let fm = objective(&qkv, &sink);
            qkv[i] = x;
            let fd = (fp - fm) / (2.0 * eps as f64);
            assert!(
                (fd - dqkv[i] as f64).abs() < 2e-3 + 1e-2 * fd.abs(),
                "groups {groups}: dqkv[{i}] analytic {} vs {fd}",
                dqkv[i]
            );
        }
        for h in 0..d.heads {
            let x = sink[h];
            sink[h] = x + eps;
            let fp = objective(&qkv, &sink);
            sink[h] = x - eps;
            let fm = objective(&qkv, &sink);
            sink[h] = x;
            let fd = (fp - fm) / (2.0 * eps as f64);
            assert!(
                fd.abs() > 1e-3 && (fd - dsink[h] as f64).abs() < 1e-3 + 1e-2 * fd.abs(),
                "groups {groups}: dsink[{h}] analytic {} vs {fd}",
                dsink[h]
            );
        }
    }
}

#[test]
fn attention_sink_decode_matches_the_full_forward_last_row() {
    let d = dims(2, 13, 2, 2, 4);
    let (t, nh, hd) = (d.t, d.heads, d.head_dim);
    let qkv = randn(d.b * t * nh * 3 * hd, 11, 1.0);
    let sink = [0.5f32, -1.0];
    let (out, _) = sink_attention(&qkv, &sink, None, d);
    let max_t = 16;
    let mut kc = vec![0.0; d.b * nh * max_t * hd];
    let mut vc = kc.clone();
    let mut q = vec![0.0; d.b * nh * hd];
    for b in 0..d.b {
        for h in 0..nh {
            for j in 0..t {
                let row = &qkv[((b * t + j) * nh + h) * 3 * hd..][..3 * hd];
                let dst = ((b * nh + h) * max_t + j) * hd;
                kc[dst..dst + hd].copy_from_slice(&row[hd..2 * hd]);
                vc[dst..dst + hd].copy_from_slice(&row[2 * hd..]);
                if j == t - 1 {
                    q[(b * nh + h) * hd..][..hd].copy_from_slice(&row[..hd]);
                }
            }
        }
    }
    let dd = DecodeDims {
        b: d.b,
        heads: nh,
        groups: nh,
        head_dim: hd,
        max_t,
    };
    let mut o = vec![0.0; d.b * nh * hd];
    attention_decode_forward(&mut o, &q, &kc, &vc, dd, 0..t, Some(&sink));
    for b in 0..d.b {
        let want = &out[(b * t + t - 1) * nh * hd..][..nh * hd];
        assert_close(
            &o[b * nh * hd..(b + 1) * nh * hd],
            want,
            1e-5,
            1e-4,
            "decode",
        );
    }
}
