//! Ring attention's pieces: a sequence's attention computed block by block (queries of the
//! second half against each half of the keys, merged by log-sum-exp) equals the whole-sequence
//! kernel's, with and without documents that start inside a block.

mod common;

use common::*;
use megatron_tensor::cpu::ring_attention::{
    attention_merge, block_doc_start, fuse_q_kv, kv_rows, RingDims,
};
use megatron_tensor::cpu::{attention_forward, AttentionDims, AttentionMask};
use megatron_tensor::RngKey;

#[test]
fn blockwise_attention_merged_by_log_sum_exp_equals_the_whole_sequence() {
    let (b, t, heads, groups, hd) = (2, 16, 4, 2, 8);
    let c = t / 2;
    let row = (heads + 2 * groups) * hd;
    let qkv = randn(b * t * row, 7, 1.0);
    let d = AttentionDims {
        b,
        t,
        heads,
        groups,
        head_dim: hd,
        causal: true,
        dropout: 0.0,
        rng_heads: (0, heads),
        rng_block: None,
    };
    // Documents: sequence 0 one document; sequence 1 a new one at position 11 (inside the
    // second half), so its later queries see nothing of the first half.
    let mut starts = vec![0u32; b * t];
    for q in 11..t {
        starts[t + q] = 11;
    }
    for docs in [None, Some(&starts[..])] {
        let m = docs.map_or_else(AttentionMask::default, AttentionMask::documents);
        let mut out = vec![0.0f32; b * t * heads * hd];
        let mut lse = vec![0.0f32; b * heads * t];
        attention_forward(&mut out, &mut lse, &qkv, m, d, RngKey::new(0));
        // Rows of half `k` of every sequence.
        let half = |x: &[f32], w: usize, k: usize| -> Vec<f32> {
            (0..b)
                .flat_map(|s| x[(s * t + k * c) * w..(s * t + k * c + c) * w].to_vec())
                .collect()
        };
        let rd = RingDims {
            b,
            rows: c,
            heads,
            groups,
            head_dim: hd,
        };
        let q1 = half(&qkv, row, 1);
        let mut acc: Option<(Vec<f32>, Vec<f32>)> = None;
        for (kv_half, causal) in [(1, true), (0, false)] {
            // Only keys and values travel: compact rows of them.
            let mut kv = vec![0.0f32; b * c * rd.kv_row()];
            kv_rows(&mut kv, &half(&qkv, row, kv_half), rd);
            let mut pair = vec![0.0f32; b * c * row];
            fuse_q_kv(&mut pair, &q1, &kv, rd);
            let block = AttentionDims { t: c, causal, ..d };
            let starts_block = docs.map(|s| {
                let mut o = vec![0u32; b * c];
                block_doc_start(&mut o, s, t, c, kv_half * c, c);
                o
            });
            let bm = starts_block
                .as_deref()
                .map_or_else(AttentionMask::default, AttentionMask::documents);
            let (mut o, mut l) = (
                vec![0.0f32; b * c * heads * hd],
                vec![0.0f32; b * heads * c],
            );
            attention_forward(&mut o, &mut l, &pair, bm, block, RngKey::new(0));
            match &mut acc {
                None => acc = Some((o, l)),
                Some((ao, al)) => attention_merge(ao, al, &o, &l, rd),
            }
        }
        let (o, l) = acc.unwrap();
        let want_o = half(&out, heads * hd, 1);
        for (x, y) in o.iter().zip(&want_o) {
            assert!((x - y).abs() < 1e-5, "{docs:?}: output {x} vs {y}");
        }
        for s in 0..b {
            for h in 0..heads {
                for q in 0..c {
                    let (x, y) = (l[(s * heads + h) * c + q], lse[(s * heads + h) * t + c + q]);
                    assert!((x - y).abs() < 1e-5, "{docs:?}: lse {x} vs {y}");
                }
            }
        }
    }
}
