//! Attention with an additive bias and separate query / key-value sequences (T5): forward
//! against a naive f64 reference (self-attention with a relative bias, causal; cross-attention
//! with padded keys; scale 1 and 1/sqrt(d)), backward against central differences (dropout
//! on too: the masks are counter-based), and the relative position buckets against
//! transformers' `T5Attention._relative_position_bucket`.

mod common;
use common::*;
use megatron_tensor::cpu::attention_bias::{
    biased_attention_backward, biased_attention_forward, relative_position_bias_backward,
    relative_position_bias_forward, relative_position_bucket, BiasedAttentionDims,
    RelativePositionDims,
};
use megatron_tensor::RngKey;

fn dims(tq: usize, tk: usize, causal: bool, scale: f32, dropout: f32) -> BiasedAttentionDims {
    BiasedAttentionDims {
        b: 2,
        tq,
        tk,
        heads: 3,
        head_dim: 4,
        causal,
        scale,
        dropout,
        rng_heads: (0, 3),
    }
}

fn naive(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    bias: Option<&[f32]>,
    key_lens: Option<&[usize]>,
    d: BiasedAttentionDims,
) -> Vec<f32> {
    let (tq, tk, nh, hd) = (d.tq, d.tk, d.heads, d.head_dim);
    let mut out = vec![0.0f32; d.b * tq * nh * hd];
    for b in 0..d.b {
        for h in 0..nh {
            for i in 0..tq {
                let len = key_lens.map_or(tk, |l| l[b]);
                let end = if d.causal { len.min(i + 1) } else { len };
                let s: Vec<f64> = (0..end)
                    .map(|j| {
                        let dotp: f64 = (0..hd)
                            .map(|c| {
                                q[((b * tq + i) * nh + h) * hd + c] as f64
                                    * k[((b * tk + j) * nh + h) * hd + c] as f64
                            })
                            .sum();
                        dotp * d.scale as f64
                            + bias.map_or(0.0, |x| x[(h * tq + i) * tk + j] as f64)
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                for c in 0..hd {
                    out[((b * tq + i) * nh + h) * hd + c] = (0..end)
                        .map(|j| (s[j] - mx).exp() / z * v[((b * tk + j) * nh + h) * hd + c] as f64)
                        .sum::<f64>()
                        as f32;
                }
            }
        }
    }
    out
}

fn run(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    bias: Option<&[f32]>,
    lens: Option<&[usize]>,
    d: BiasedAttentionDims,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0; q.len()];
    let mut probs = vec![0.0; d.b * d.heads * d.tq * d.tk];
    biased_attention_forward(&mut out, &mut probs, q, k, v, bias, lens, d, RngKey::new(9));
    (out, probs)
}

#[test]
fn biased_attention_forward_matches_naive_for_self_and_cross_attention() {
    for (d, lens, with_bias) in [
        (dims(7, 7, true, 1.0, 0.0), None, true),
        (dims(7, 7, false, 1.0, 0.0), Some(vec![7, 4]), true),
        (dims(5, 9, false, 0.5, 0.0), Some(vec![9, 3]), false),
    ] {
        let (nq, nk) = (d.b * d.tq * 3 * 4, d.b * d.tk * 3 * 4);
        let (q, k, v) = (randn(nq, 1, 1.0), randn(nk, 2, 1.0), randn(nk, 3, 1.0));
        let bias = with_bias.then(|| randn(3 * d.tq * d.tk, 4, 1.0));
        let (out, _) = run(&q, &k, &v, bias.as_deref(), lens.as_deref(), d);
        let want = naive(&q, &k, &v, bias.as_deref(), lens.as_deref(), d);
        assert_close(&out, &want, 1e-5, 1e-5, "attention");
    }
}

#[test]
fn biased_attention_backward_matches_finite_difference() {
    for (d, lens) in [
        (dims(6, 6, true, 1.0, 0.0), None),
        (dims(4, 7, false, 0.5, 0.0), Some(vec![7, 5])),
        (dims(6, 6, false, 1.0, 0.3), Some(vec![6, 4])),
    ] {
        let (nq, nk) = (d.b * d.tq * 3 * 4, d.b * d.tk * 3 * 4);
        let (mut q, mut k, mut v) = (randn(nq, 5, 1.0), randn(nk, 6, 1.0), randn(nk, 7, 1.0));
        let mut bias = randn(3 * d.tq * d.tk, 8, 1.0);
        let r = randn(nq, 9, 1.0);
        let lens = lens.as_deref();
        let (_, probs) = run(&q, &k, &v, Some(&bias), lens, d);
        let (mut dq, mut dk, mut dv) = (vec![0.0; nq], vec![0.0; nk], vec![0.0; nk]);
        let mut dbias = vec![0.0; bias.len()];
        biased_attention_backward(
            &mut dq,
            &mut dk,
            &mut dv,
            Some(&mut dbias),
            &r,
            &probs,
            &q,
            &k,
            &v,
            d,
            RngKey::new(9),
        );
        let loss =
            |q: &[f32], k: &[f32], v: &[f32], b: &[f32]| dot(&run(q, k, v, Some(b), lens, d).0, &r);
        let (kc, vc, bc) = (k.clone(), v.clone(), bias.clone());
        check_grad(
            &mut q,
            &dq,
            |x| loss(x, &kc, &vc, &bc),
            1e-2,
            2e-3,
            2e-2,
            24,
            "dq",
        );
        let qc = q.clone();
        check_grad(
            &mut k,
            &dk,
            |x| loss(&qc, x, &vc, &bc),
            1e-2,
            2e-3,
            2e-2,
            24,
            "dk",
        );
        let kc = k.clone();
        check_grad(
            &mut v,
            &dv,
            |x| loss(&qc, &kc, x, &bc),
            1e-2,
            2e-3,
            2e-2,
            24,
            "dv",
        );
        let vc = v.clone();
        check_grad(
            &mut bias,
            &dbias,
            |x| loss(&qc, &kc, &vc, x),
            1e-2,
            2e-3,
            2e-2,
            24,
            "dbias",
        );
        // Padded keys get no gradient.
        if let Some(l) = lens {
            for j in l[1]..d.tk {
                let row = &dk[((d.tk + j) * 3) * 4..((d.tk + j + 1) * 3) * 4];
                assert!(row.iter().all(|x| *x == 0.0), "padded key {j}");
            }
        }
    }
}

#[test]
fn relative_position_buckets_are_transformers() {
    let j: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/t5_relative_buckets.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let rps: Vec<i64> = j["relative_positions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect();
    for (name, (bidirectional, num_buckets, max_distance)) in [
        ("bi_32_128", (true, 32, 128)),
        ("uni_32_128", (false, 32, 128)),
        ("bi_16_20", (true, 16, 20)),
        ("uni_16_20", (false, 16, 20)),
    ] {
        let d = RelativePositionDims {
            tq: 1,
            tk: 1,
            heads: 1,
            num_buckets,
            max_distance,
            bidirectional,
        };
        let want = j["buckets"][name].as_array().unwrap();
        for (rp, w) in rps.iter().zip(want) {
            assert_eq!(
                relative_position_bucket(*rp, &d) as u64,
                w.as_u64().unwrap(),
                "{name}: relative position {rp}"
            );
        }
    }
}

#[test]
fn relative_position_bias_backward_sums_into_buckets() {
    let d = RelativePositionDims {
        tq: 5,
        tk: 9,
        heads: 2,
        num_buckets: 8,
        max_distance: 6,
        bidirectional: true,
    };
    let mut table = randn(16, 1, 1.0);
    let r = randn(2 * 5 * 9, 2, 1.0);
    let mut dtable = vec![0.0; 16];
    relative_position_bias_backward(&mut dtable, &r, d);
    check_grad(
        &mut table,
        &dtable,
        |t| {
            let mut out = vec![0.0; 2 * 5 * 9];
            relative_position_bias_forward(&mut out, t, d);
            dot(&out, &r)
        },
        1e-2,
        1e-4,
        1e-3,
        16,
        "dtable",
    );
}
