mod common;
use common::*;
use megatron_tensor::cpu::{
    attention_backward, attention_decode_forward, attention_forward, sliding_window_starts,
    AttentionDims, AttentionMask, DecodeDims,
};
use megatron_tensor::RngKey;

/// Naive attention over the full T x T score matrix, in f64.
fn naive_attention(qkv: &[f32], lens: Option<&[usize]>, d: AttentionDims) -> Vec<f32> {
    naive_attention_docs(qkv, lens, None, d)
}

fn naive_attention_docs(
    qkv: &[f32],
    lens: Option<&[usize]>,
    docs: Option<&[u32]>,
    d: AttentionDims,
) -> Vec<f32> {
    naive_attention_window(qkv, lens, docs, None, d)
}

/// With `window = Some(w)` query `i` sees only keys `j >= i - w`.
fn naive_attention_window(
    qkv: &[f32],
    lens: Option<&[usize]>,
    docs: Option<&[u32]>,
    window: Option<usize>,
    d: AttentionDims,
) -> Vec<f32> {
    let (t, nh, hd) = (d.t, d.heads, d.head_dim);
    let qpg = nh / d.groups;
    let qrs = d.groups * (qpg + 2) * hd;
    // Query head h reads row offset q_at(h); its group's key and value sit after the group's
    // queries.
    let q_at = |h: usize| ((h / qpg) * (qpg + 2) + h % qpg) * hd;
    let k_at = |h: usize| ((h / qpg) * (qpg + 2) + qpg) * hd;
    let mut out = vec![0.0f32; d.b * t * nh * hd];
    for b in 0..d.b {
        let klen = lens.map_or(t, |l| l[b]);
        for h in 0..nh {
            for i in 0..t {
                let q = &qkv[(b * t + i) * qrs + q_at(h)..][..hd];
                let mut s = vec![f64::NEG_INFINITY; t];
                for j in 0..t {
                    if (d.causal && j > i)
                        || j >= klen
                        || docs.is_some_and(|s| (j as u32) < s[b * t + i])
                        || window.is_some_and(|w| j + w < i)
                    {
                        continue;
                    }
                    let k = &qkv[(b * t + j) * qrs + k_at(h)..][..hd];
                    s[j] = q
                        .iter()
                        .zip(k)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt();
                }
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if mx == f64::NEG_INFINITY {
                    continue;
                }
                let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for j in 0..t {
                    let v = &qkv[(b * t + j) * qrs + k_at(h) + hd..][..hd];
                    for c in 0..hd {
                        out[(b * t + i) * nh * hd + h * hd + c] +=
                            (e[j] / sum * v[c] as f64) as f32;
                    }
                }
            }
        }
    }
    out
}

fn dims(
    b: usize,
    t: usize,
    heads: usize,
    head_dim: usize,
    causal: bool,
    dropout: f32,
) -> AttentionDims {
    AttentionDims {
        b,
        t,
        heads,
        groups: heads,
        head_dim,
        causal,
        dropout,
        rng_heads: (0, heads),
        rng_block: None,
    }
}

/// [`dims`] with `groups` key/value heads (grouped-query attention).
fn gqa(d: AttentionDims, groups: usize) -> AttentionDims {
    AttentionDims { groups, ..d }
}

fn qkv_len(d: AttentionDims) -> usize {
    d.b * d.t * (d.heads + 2 * d.groups) * d.head_dim
}

fn mask<'a>(lens: Option<&'a [usize]>, docs: Option<&'a [u32]>) -> AttentionMask<'a> {
    AttentionMask {
        key_lens: lens,
        doc_start: docs,
    }
}

fn run_forward(
    qkv: &[f32],
    lens: Option<&[usize]>,
    d: AttentionDims,
    key: RngKey,
) -> (Vec<f32>, Vec<f32>) {
    run_forward_docs(qkv, lens, None, d, key)
}

fn run_forward_docs(
    qkv: &[f32],
    lens: Option<&[usize]>,
    docs: Option<&[u32]>,
    d: AttentionDims,
    key: RngKey,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0; d.b * d.t * d.heads * d.head_dim];
    let mut lse = vec![0.0; d.b * d.heads * d.t];
    attention_forward(&mut out, &mut lse, qkv, mask(lens, docs), d, key);
    (out, lse)
}

#[test]
fn attention_forward_matches_naive_across_several_blocks() {
    // t = 150 spans three 64-row blocks with a ragged last one.
    for causal in [true, false] {
        let d = dims(2, 150, 3, 16, causal, 0.0);
        let qkv = randn(d.b * d.t * d.heads * 3 * d.head_dim, 1, 1.0);
        let (out, _) = run_forward(&qkv, None, d, RngKey::new(0));
        assert_close(
            &out,
            &naive_attention(&qkv, None, d),
            1e-4,
            1e-4,
            &format!("causal={causal}"),
        );
    }
}

#[test]
fn attention_forward_applies_padding_mask() {
    let d = dims(2, 70, 2, 8, true, 0.0);
    let qkv = randn(d.b * d.t * d.heads * 3 * d.head_dim, 2, 1.0);
    let lens = [70usize, 33];
    let (out, _) = run_forward(&qkv, Some(&lens), d, RngKey::new(0));
    assert_close(
        &out,
        &naive_attention(&qkv, Some(&lens), d),
        1e-4,
        1e-4,
        "padding",
    );
}

fn attention_fd_check(d: AttentionDims, lens: Option<&[usize]>, seed: u64) {
    attention_fd_check_docs(d, lens, None, seed)
}

fn attention_fd_check_docs(
    d: AttentionDims,
    lens: Option<&[usize]>,
    docs: Option<&[u32]>,
    seed: u64,
) {
    let key = RngKey::new(5);
    let mut qkv = randn(qkv_len(d), seed, 1.0);
    let r = randn(d.b * d.t * d.heads * d.head_dim, seed + 1, 1.0);
    let (out, lse) = run_forward_docs(&qkv, lens, docs, d, key);
    let mut dqkv = vec![f32::NAN; qkv.len()];
    attention_backward(&mut dqkv, &r, &out, &lse, &qkv, mask(lens, docs), d, key);
    check_grad(
        &mut qkv,
        &dqkv,
        |x| dot(&run_forward_docs(x, lens, docs, d, key).0, &r),
        1e-2,
        2e-3,
        1e-2,
        200,
        "dqkv",
    );
}

/// Documents of a batch: sequence 0 has documents starting at 0, 30 and 71; sequence 1 at 0 and 5.
fn doc_starts(b: usize, t: usize) -> Vec<u32> {
    let cuts = [vec![0u32, 30, 71], vec![0u32, 5]];
    (0..b * t)
        .map(|k| {
            let (bi, i) = (k / t, (k % t) as u32);
            *cuts[bi % 2].iter().filter(|&&c| c <= i).max().unwrap()
        })
        .collect()
}

#[test]
fn attention_forward_with_document_masks_matches_naive() {
    let d = dims(2, 100, 2, 8, true, 0.0);
    let qkv = randn(d.b * d.t * d.heads * 3 * d.head_dim, 12, 1.0);
    let docs = doc_starts(d.b, d.t);
    let (out, _) = run_forward_docs(&qkv, None, Some(&docs), d, RngKey::new(0));
    assert_close(
        &out,
        &naive_attention_docs(&qkv, None, Some(&docs), d),
        1e-4,
        1e-4,
        "documents",
    );
}

#[test]
fn attention_backward_with_document_masks_matches_finite_difference() {
    let d = dims(2, 80, 2, 8, true, 0.0);
    let docs = doc_starts(d.b, d.t);
    attention_fd_check_docs(d, None, Some(&docs), 13);
    let dd = dims(1, 80, 2, 8, true, 0.2);
    attention_fd_check_docs(dd, None, Some(&docs[..80]), 14);
}

#[test]
fn attention_backward_matches_finite_difference() {
    attention_fd_check(dims(2, 80, 2, 8, true, 0.0), None, 3);
}

#[test]
fn attention_backward_non_causal_with_padding_matches_finite_difference() {
    attention_fd_check(dims(2, 70, 2, 8, false, 0.0), Some(&[70, 40]), 7);
}

#[test]
fn attention_backward_with_dropout_matches_finite_difference() {
    attention_fd_check(dims(1, 66, 2, 8, true, 0.2), None, 9);
}

/// Sliding windows of 0 (the query alone), 20 (inside a 64-row block), 70 and 130 (across
/// blocks), alone and merged with document starts, over four blocks of queries: the tiles the
/// kernel skips hold no visible key.
#[test]
fn sliding_window_attention_matches_naive_across_blocks() {
    let d = dims(2, 200, 2, 8, true, 0.0);
    let qkv = randn(qkv_len(d), 21, 1.0);
    let docs = doc_starts(d.b, d.t);
    for w in [0usize, 20, 70, 130] {
        for with_docs in [false, true] {
            let docs = with_docs.then_some(&docs[..]);
            let mut starts = Vec::new();
            sliding_window_starts(&mut starts, docs, d.b, d.t, w);
            let (out, _) = run_forward_docs(&qkv, None, Some(&starts), d, RngKey::new(0));
            assert_close(
                &out,
                &naive_attention_window(&qkv, None, docs, Some(w), d),
                1e-4,
                1e-4,
                &format!("window {w}, documents {with_docs}"),
            );
        }
    }
}

#[test]
fn sliding_window_attention_backward_matches_finite_difference() {
    // 150 queries in three blocks: with a window of 40 the first key tile is invisible to the
    // last block of queries, so backward skips it.
    let d = dims(1, 150, 2, 8, true, 0.0);
    let mut starts = Vec::new();
    sliding_window_starts(&mut starts, None, d.b, d.t, 40);
    attention_fd_check_docs(d, None, Some(&starts), 23);
    let docs = doc_starts(2, 90);
    sliding_window_starts(&mut starts, Some(&docs), 2, 90, 25);
    attention_fd_check_docs(dims(2, 90, 2, 8, true, 0.2), None, Some(&starts), 24);
}

#[test]
fn attention_decode_matches_last_row_of_full_attention() {
    decode_matches_last_row(None);
}

#[test]
fn windowed_decode_matches_last_row_of_sliding_window_attention() {
    decode_matches_last_row(Some(6));
}

fn decode_matches_last_row(window: Option<usize>) {
    let d = dims(2, 20, 2, 8, true, 0.0);
    let qkv = randn(d.b * d.t * d.heads * 3 * d.head_dim, 4, 1.0);
    let out = naive_attention_window(&qkv, None, None, window, d);
    let (hd, nh, t) = (d.head_dim, d.heads, d.t);
    let max_t = 32;
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
    let mut o = vec![0.0; d.b * nh * hd];
    let dd = DecodeDims {
        b: d.b,
        heads: nh,
        groups: nh,
        head_dim: hd,
        max_t,
    };
    let first = window.map_or(0, |w| t - 1 - w);
    attention_decode_forward(&mut o, &q, &kc, &vc, dd, first..t, None);
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

#[test]
fn grouped_query_attention_forward_matches_naive() {
    // 6 query heads in 2 groups, and multi-query (1 group), across blocks.
    for groups in [2, 1] {
        for causal in [true, false] {
            let d = gqa(dims(2, 130, 6, 8, causal, 0.0), groups);
            let qkv = randn(qkv_len(d), 21, 1.0);
            let (out, _) = run_forward(&qkv, None, d, RngKey::new(0));
            assert_close(
                &out,
                &naive_attention(&qkv, None, d),
                1e-4,
                1e-4,
                &format!("groups={groups} causal={causal}"),
            );
        }
    }
}

#[test]
fn grouped_query_attention_backward_matches_finite_difference() {
    // The shared key/value gradients sum over the group's query heads.
    attention_fd_check(gqa(dims(2, 70, 4, 8, true, 0.0), 2), None, 22);
    attention_fd_check(gqa(dims(1, 70, 3, 8, true, 0.0), 1), None, 23);
    attention_fd_check(gqa(dims(1, 66, 4, 8, true, 0.2), 2), None, 24);
}

#[test]
fn grouped_query_attention_equals_multi_head_attention_with_repeated_keys_and_values() {
    // GQA is MHA whose heads of a group see copies of one K and V: build that MHA input and
    // compare outputs (the kernel itself never copies).
    let d = gqa(dims(2, 40, 4, 8, true, 0.0), 2);
    let qkv = randn(qkv_len(d), 25, 1.0);
    let hd = d.head_dim;
    let mha = dims(2, 40, 4, 8, true, 0.0);
    let mut expanded = vec![0.0; d.b * d.t * 4 * 3 * hd];
    for r in 0..d.b * d.t {
        let src = &qkv[r * 8 * hd..(r + 1) * 8 * hd];
        for h in 0..4 {
            let g = h / 2;
            let dst = &mut expanded[(r * 4 + h) * 3 * hd..(r * 4 + h + 1) * 3 * hd];
            dst[..hd].copy_from_slice(&src[(g * 4 + h % 2) * hd..][..hd]);
            dst[hd..2 * hd].copy_from_slice(&src[(g * 4 + 2) * hd..][..hd]);
            dst[2 * hd..].copy_from_slice(&src[(g * 4 + 3) * hd..][..hd]);
        }
    }
    let (a, _) = run_forward(&qkv, None, d, RngKey::new(0));
    let (b, _) = run_forward(&expanded, None, mha, RngKey::new(0));
    assert_eq!(a, b);
}

#[test]
fn grouped_query_decode_matches_last_row_of_full_attention() {
    let d = gqa(dims(2, 20, 6, 8, true, 0.0), 3);
    let qkv = randn(qkv_len(d), 26, 1.0);
    let (out, _) = run_forward(&qkv, None, d, RngKey::new(0));
    let (hd, nh, t, max_t) = (d.head_dim, d.heads, d.t, 24);
    let dd = DecodeDims {
        b: d.b,
        heads: nh,
        groups: 3,
        head_dim: hd,
        max_t,
    };
    let mut kc = vec![0.0; d.b * 3 * max_t * hd];
    let mut vc = kc.clone();
    let mut q = vec![0.0; d.b * nh * hd];
    for j in 0..t {
        let rows: Vec<f32> = (0..d.b)
            .flat_map(|b| qkv[(b * t + j) * 12 * hd..(b * t + j + 1) * 12 * hd].to_vec())
            .collect();
        megatron_tensor::cpu::kv_cache_append(&mut kc, &mut vc, &mut q, &rows, dd, j);
    }
    let mut o = vec![0.0; d.b * nh * hd];
    attention_decode_forward(&mut o, &q, &kc, &vc, dd, 0..t, None);
    for b in 0..d.b {
        let want = &out[(b * t + t - 1) * nh * hd..][..nh * hd];
        assert_close(
            &o[b * nh * hd..(b + 1) * nh * hd],
            want,
            1e-5,
            1e-4,
            "gqa decode",
        );
    }
}
