//! Causal self-attention, blockwise with an online softmax (FlashAttention-2 on the CPU).
//!
//! The full `T x T` score matrix is never held: each task works on one `(batch, head, query
//! block)` and keeps a `BQ x BK` tile. Forward saves the log-sum-exp per query row; backward
//! recomputes the tiles from it. Attention dropout draws its mask from the counter-based RNG keyed
//! by `(b, h, i, j)`, so backward regenerates it.
//!
//! Layout: `qkv` is `[b, t, groups, heads / groups + 2, head_dim]`: megatron-core's fused QKV,
//! each query group's query heads followed by its key and value head (multi-head attention is
//! `groups = heads`: `[heads, 3, head_dim]`), so a tensor-parallel split is a contiguous slice of
//! groups. Grouped-query attention shares a group's K and V among its query heads here, in the
//! kernel; they are never copied per head. `out` is `[b, t, heads, head_dim]`; `lse` is
//! `[b, heads, t]`.

use super::attention_tile::{pack_rows, pack_transposed, tile_matmul};
use super::operand::Operand;
use super::simd::{exp, multiversion};
use super::sync_ptr::SyncPtr;
use crate::rng::RngKey;
use rayon::prelude::*;

const BQ: usize = 64;
const BK: usize = 64;

#[derive(Clone, Copy, Debug)]
pub struct AttentionDims {
    pub b: usize,
    pub t: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (query groups): `heads` for multi-head attention, 1 for multi-query.
    pub groups: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub dropout: f32,
    /// Numbering of heads for the dropout stream: (first global head, heads in the whole
    /// layer). A tensor-parallel rank holding heads `[h0, h0 + heads)` of `total` passes
    /// `(h0, total)` and draws exactly the masks those heads get at TP = 1.
    pub rng_heads: (usize, usize),
    /// Where this block sits in a longer sequence for the dropout stream (ring attention
    /// computes one block of queries against one block of keys at a time): the masks are
    /// those of positions `q0 + i`, `k0 + j` in a sequence of `t`. `None`: the block is the
    /// whole sequence.
    pub rng_block: Option<RngBlock>,
}

/// See [`AttentionDims::rng_block`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RngBlock {
    pub q0: usize,
    pub k0: usize,
    pub t: usize,
}

impl AttentionDims {
    pub(super) fn q_per_group(&self) -> usize {
        self.heads / self.groups
    }
    pub(super) fn qkv_row(&self) -> usize {
        self.groups * (self.q_per_group() + 2) * self.head_dim
    }
    /// Offsets inside a token's QKV row: query head `h`, and the key and value of group `g`.
    pub(super) fn q_offset(&self, h: usize) -> usize {
        let qpg = self.q_per_group();
        ((h / qpg) * (qpg + 2) + h % qpg) * self.head_dim
    }
    pub(super) fn k_offset(&self, g: usize) -> usize {
        let qpg = self.q_per_group();
        (g * (qpg + 2) + qpg) * self.head_dim
    }
    pub(super) fn v_offset(&self, g: usize) -> usize {
        self.k_offset(g) + self.head_dim
    }
    pub(super) fn out_row(&self) -> usize {
        self.heads * self.head_dim
    }
    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Which keys a query may see beyond the causal rule.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionMask<'a> {
    /// Per sequence: keys at positions `>= key_lens[b]` are padding.
    pub key_lens: Option<&'a [usize]>,
    /// Per query `[b, t]`: the first key it may see (Megatron's `--reset-attention-mask`: a token
    /// attends only within its own document).
    pub doc_start: Option<&'a [u32]>,
}

impl<'a> AttentionMask<'a> {
    pub const NONE: AttentionMask<'static> = AttentionMask {
        key_lens: None,
        doc_start: None,
    };
    pub fn key_lens(l: &'a [usize]) -> Self {
        AttentionMask {
            key_lens: Some(l),
            doc_start: None,
        }
    }
    pub fn documents(doc_start: &'a [u32]) -> Self {
        AttentionMask {
            key_lens: None,
            doc_start: Some(doc_start),
        }
    }
}

/// Each query's first visible key under a sliding window of `left` keys before it
/// (`--window-size`), merged with the documents' starts (`doc_start`, `[b, t]`) when given:
/// a window is one more lower bound per query, so every kernel that takes
/// [`AttentionMask::doc_start`] (the blockwise one, context parallelism's ring) honours it.
pub fn sliding_window_starts(
    out: &mut Vec<u32>,
    doc_start: Option<&[u32]>,
    b: usize,
    t: usize,
    left: usize,
) {
    if let Some(s) = doc_start {
        assert_eq!(s.len(), b * t);
    }
    out.clear();
    out.extend((0..b * t).map(|r| {
        let from = (r % t).saturating_sub(left) as u32;
        doc_start.map_or(from, |s| s[r].max(from))
    }));
}

/// Per block of `BQ` queries of sequence `b`: the smallest first visible key of its rows, so
/// the kernels skip key tiles no row of the block sees (a sliding window's, a document's
/// earlier tiles). Skipping only drops products with probabilities that are exactly zero.
fn block_min_starts(mask: &AttentionMask, b: usize, t: usize) -> Vec<usize> {
    (0..t.div_ceil(BQ))
        .map(|ib| {
            let rows = ib * BQ..(ib * BQ + BQ).min(t);
            mask.doc_start.map_or(0, |s| {
                s[b * t + rows.start..b * t + rows.end]
                    .iter()
                    .min()
                    .map_or(0, |&x| x as usize)
            })
        })
        .collect()
}

/// Keys `j0 + lo .. j0 + hi` of the tile are visible to query `i`: every mask here cuts a row
/// into one contiguous range (document start, causal end, padding end).
#[inline(always)]
fn visible(
    d: &AttentionDims,
    mask: &AttentionMask,
    b: usize,
    key_len: usize,
    i: usize,
    j0: usize,
    nk: usize,
) -> (usize, usize) {
    let mut end = key_len.min(j0 + nk);
    if d.causal {
        end = end.min(i + 1);
    }
    let start = mask.doc_start.map_or(0, |s| s[b * d.t + i] as usize);
    let hi = end.saturating_sub(j0);
    (start.saturating_sub(j0).min(hi), hi)
}

#[inline(always)]
fn drop_index(d: &AttentionDims, b: usize, h: usize, i: usize, j: usize) -> u64 {
    let (h0, total) = d.rng_heads;
    let (q0, k0, t) = d.rng_block.map_or((0, 0, d.t), |r| (r.q0, r.k0, r.t));
    (((b * total.max(d.heads) + h0 + h) * t + q0 + i) * t + k0 + j) as u64
}

/// Multiplies the visible part of a row of probabilities by the dropout mask / (1 - p).
#[inline(always)]
fn apply_dropout(
    row: &mut [f32],
    d: &AttentionDims,
    key: RngKey,
    b: usize,
    h: usize,
    i: usize,
    j0: usize,
) {
    let keep_scale = 1.0 / (1.0 - d.dropout);
    for (c, v) in row.iter_mut().enumerate() {
        *v = if key.keep(drop_index(d, b, h, i, j0 + c), d.dropout) {
            *v * keep_scale
        } else {
            0.0
        };
    }
}

/// Max over a slice with 16 independent lanes (so it vectorizes).
#[inline(always)]
fn max16(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rem = chunks.remainder();
    for c in chunks {
        for k in 0..16 {
            m[k] = m[k].max(c[k]);
        }
    }
    let mut r = f32::NEG_INFINITY;
    for v in m.iter().chain(rem) {
        r = r.max(*v);
    }
    r
}

/// `x = exp(x - shift)` in place; returns the sum, with 16 independent lanes.
#[inline(always)]
fn exp_shift_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut s = [0.0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for k in 0..16 {
            c[k] = exp(c[k] - shift);
            s[k] += c[k];
        }
    }
    let mut total: f32 = s.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp(*v - shift);
        total += *v;
    }
    total
}

/// Where a row of a score tile sits: sequence `b`, head `h`, query `i`, the tile's first key.
#[derive(Clone, Copy)]
pub(super) struct RowAt {
    pub b: usize,
    pub h: usize,
    pub i: usize,
    pub j0: usize,
}

/// One query row of a score tile through the online softmax (shared by the f32 and AMX
/// kernels, so both mask, normalise and drop alike): scores times `scale` (1 where K was
/// pre-scaled), invisible keys zeroed, the visible ones replaced by `exp(s - max)` (with
/// dropout); `m`/`l` are the row's running max and sum. Returns the factor the row's
/// accumulator must be multiplied by, or `None` when no key of the tile is visible.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn softmax_row_online(
    row: &mut [f32],
    scale: f32,
    m: &mut f32,
    l: &mut f32,
    d: &AttentionDims,
    mask: &AttentionMask,
    klen: usize,
    key: RngKey,
    at: RowAt,
) -> Option<f32> {
    let (lo, nv) = visible(d, mask, at.b, klen, at.i, at.j0, row.len());
    row[nv..].fill(0.0);
    row[..lo].fill(0.0);
    if nv == lo {
        return None;
    }
    let visible = &mut row[lo..nv];
    if scale != 1.0 {
        visible.iter_mut().for_each(|x| *x *= scale);
    }
    let mx = m.max(max16(visible));
    let corr = exp(*m - mx);
    let sum = exp_shift_sum(visible, mx);
    if d.dropout > 0.0 {
        apply_dropout(visible, d, key, at.b, at.h, at.i, at.j0 + lo);
    }
    *l = *l * corr + sum;
    *m = mx;
    Some(corr)
}

/// A finished output row: the accumulator over the softmax sum (zero for a row that saw no
/// key); returns the row's log-sum-exp (infinite for such a row).
#[inline(always)]
pub(super) fn finish_row(o: &mut [f32], acc: &[f32], m: f32, l: f32) -> f32 {
    if l > 0.0 {
        let inv = 1.0 / l;
        for (ov, av) in o.iter_mut().zip(acc) {
            *ov = av * inv;
        }
        m + l.ln()
    } else {
        o.fill(0.0);
        f32::INFINITY
    }
}

/// `D_i = rowsum(dO_i * O_i)` for the `t` rows of one head (rows `stride` apart).
#[inline(always)]
pub(super) fn output_dots(o: &[f32], dout: &[f32], stride: usize, t: usize, hd: usize) -> Vec<f32> {
    (0..t)
        .map(|i| {
            let orow = &o[i * stride..i * stride + hd];
            let drow = &dout[i * stride..i * stride + hd];
            orow.iter().zip(drow).map(|(a, b)| a * b).sum()
        })
        .collect()
}

/// Backward: a row of probabilities recomputed from its scores (times `scale`) and the
/// forward's log-sum-exp `shift`, zero outside the visible keys; `pdrow` gets it with dropout.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn probabilities_row(
    prow: &mut [f32],
    pdrow: &mut [f32],
    scale: f32,
    shift: f32,
    d: &AttentionDims,
    mask: &AttentionMask,
    klen: usize,
    key: RngKey,
    at: RowAt,
) {
    let (lo, nv) = visible(d, mask, at.b, klen, at.i, at.j0, prow.len());
    for x in &mut prow[lo..nv] {
        *x = exp(*x * scale - shift);
    }
    prow[nv..].fill(0.0);
    prow[..lo].fill(0.0);
    pdrow.copy_from_slice(prow);
    if d.dropout > 0.0 {
        apply_dropout(&mut pdrow[lo..nv], d, key, at.b, at.h, at.i, at.j0 + lo);
    }
}

/// Backward: `dP` (with dropout) into `dS = P * (dP - D_i) * scale`, in place.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn score_grad_row(
    dprow: &mut [f32],
    prow: &[f32],
    di: f32,
    scale: f32,
    d: &AttentionDims,
    mask: &AttentionMask,
    klen: usize,
    key: RngKey,
    at: RowAt,
) {
    if d.dropout > 0.0 {
        let (lo, nv) = visible(d, mask, at.b, klen, at.i, at.j0, dprow.len());
        apply_dropout(&mut dprow[lo..nv], d, key, at.b, at.h, at.i, at.j0 + lo);
    }
    for (g, pv) in dprow.iter_mut().zip(prow) {
        *g = pv * (*g - di) * scale;
    }
}

/// Writes a backward task's dK and dV (`[t, head_dim]` each, summed over the group's query
/// heads) into the key and value head of group `g` of the sequence at `base` in `dqkv`.
#[inline(always)]
pub(super) fn write_key_value_grads(
    dq_p: SyncPtr,
    base: usize,
    d: &AttentionDims,
    g: usize,
    dk: &[f32],
    dv: &[f32],
) {
    let (hd, qrs) = (d.head_dim, d.qkv_row());
    for i in 0..d.t {
        let row = base + i * qrs;
        // SAFETY: each backward task owns the key and value head of group g of its sequence.
        unsafe {
            dq_p.write(row + d.k_offset(g), &dk[i * hd..(i + 1) * hd]);
            dq_p.write(row + d.v_offset(g), &dv[i * hd..(i + 1) * hd]);
        }
    }
}

/// `key_lens[b]` (optional) masks keys at positions `>= key_lens[b]` (padding). `qkv` may be
/// bf16 (kept under `--bf16`): the packed kernels pack it as it is, which rounds nothing
/// more; the f32 kernel reads it widened.
pub fn attention_forward<'q>(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: impl Into<Operand<'q>>,
    mask: AttentionMask,
    d: AttentionDims,
    key: RngKey,
) {
    let qkv = qkv.into();
    let t = d.t;
    assert!(
        d.groups > 0 && d.heads.is_multiple_of(d.groups),
        "{} heads in {} groups",
        d.heads,
        d.groups
    );
    assert_eq!(qkv.len(), d.b * t * d.qkv_row());
    assert_eq!(out.len(), d.b * t * d.out_row());
    assert_eq!(lse.len(), d.b * d.heads * t);
    if let Some(l) = mask.key_lens {
        assert_eq!(l.len(), d.b);
    }
    if let Some(s) = mask.doc_start {
        assert_eq!(s.len(), d.b * d.t);
    }
    let out_p = SyncPtr(out.as_mut_ptr());
    let lse_p = SyncPtr(lse.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = super::matmul::attention_block_kernel() {
        (0..d.b * d.heads).into_par_iter().for_each(|i| {
            super::attention_packed::forward_task(i, out_p, lse_p, qkv, mask, d, key, kernel)
        });
        return;
    }
    let qkv = qkv.widened();
    (0..d.b * d.heads)
        .into_par_iter()
        .for_each(|i| forward_task(i, out_p, lse_p, &qkv, mask, d, key));
}

multiversion! {
    fn forward_task(task: usize, out_p: SyncPtr, lse_p: SyncPtr, qkv: &[f32], mask: AttentionMask, d: AttentionDims, key: RngKey) {
        let (t, hd) = (d.t, d.head_dim);
        let h = task % d.heads;
        let b = task / d.heads;
        let klen = mask.key_lens.map_or(t, |l| l[b].min(t));
        let qrs = d.qkv_row();
        let g = h / d.q_per_group();
        let base = b * t * qrs;
        // K^T (pre-scaled) and V as contiguous panels, packed once per (batch, head).
        let mut kt = Vec::new();
        pack_transposed(&mut kt, &qkv[base + d.k_offset(g)..], qrs, t, hd, d.scale());
        let mut vv = Vec::new();
        pack_rows(&mut vv, &qkv[base + d.v_offset(g)..], qrs, t, hd);
        let base = base + d.q_offset(h);
        let first_keys = block_min_starts(&mask, b, t);
        let mut s = vec![0.0f32; BQ * BK];
        let mut acc = vec![0.0f32; BQ * hd];
        let mut i0 = 0;
        while i0 < t {
            let nq = BQ.min(t - i0);
            let q = &qkv[base + i0 * qrs..];
            let mut m = [f32::NEG_INFINITY; BQ];
            let mut l = [0.0f32; BQ];
            acc.fill(0.0);
            let kend = if d.causal { (i0 + nq).min(klen) } else { klen };
            let first = first_keys[i0 / BQ];
            let mut j0 = first - first % BK;
            while j0 < kend {
                let nk = BK.min(kend - j0);
                tile_matmul(&mut s, BK, q, qrs, 1, &kt[j0..], t, nq, nk, hd, false);
                for r in 0..nq {
                    let at = RowAt { b, h, i: i0 + r, j0 };
                    let row = &mut s[r * BK..r * BK + nk];
                    if let Some(corr) = softmax_row_online(row, 1.0, &mut m[r], &mut l[r], &d, &mask, klen, key, at) {
                        for a in &mut acc[r * hd..(r + 1) * hd] {
                            *a *= corr;
                        }
                    }
                }
                tile_matmul(&mut acc, hd, &s, BK, 1, &vv[j0 * hd..], hd, nq, hd, nk, true);
                j0 += BK;
            }
            for r in 0..nq {
                let i = i0 + r;
                // SAFETY: each task owns head h of batch b.
                let o = unsafe { out_p.slice((b * t + i) * d.out_row() + h * hd, hd) };
                let lrow = unsafe { lse_p.slice((b * d.heads + h) * t + i, 1) };
                lrow[0] = finish_row(o, &acc[r * hd..(r + 1) * hd], m[r], l[r]);
            }
            i0 += BQ;
        }
    }
}

/// Writes the whole of `dqkv`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<'q>(
    dqkv: &mut [f32],
    dout: &[f32],
    out: &[f32],
    lse: &[f32],
    qkv: impl Into<Operand<'q>>,
    mask: AttentionMask,
    d: AttentionDims,
    key: RngKey,
) {
    let qkv = qkv.into();
    assert!(
        d.groups > 0 && d.heads.is_multiple_of(d.groups),
        "{} heads in {} groups",
        d.heads,
        d.groups
    );
    assert_eq!(dqkv.len(), qkv.len());
    assert_eq!(dout.len(), out.len());
    let dq_p = SyncPtr(dqkv.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = super::matmul::attention_block_kernel() {
        (0..d.b * d.groups).into_par_iter().for_each(|i| {
            super::attention_packed::backward_task(
                i, dq_p, dout, out, lse, qkv, mask, d, key, kernel,
            )
        });
        return;
    }
    // One task per (batch, query group): the group's heads all add into its dK and dV.
    let qkv = qkv.widened();
    (0..d.b * d.groups)
        .into_par_iter()
        .for_each(|i| backward_task(i, dq_p, dout, out, lse, &qkv, mask, d, key));
}

multiversion! {
    fn backward_task(task: usize, dq_p: SyncPtr, dout: &[f32], out: &[f32], lse: &[f32], qkv: &[f32], mask: AttentionMask, d: AttentionDims, key: RngKey) {
        let (t, hd) = (d.t, d.head_dim);
        let qrs = d.qkv_row();
        let ors = d.out_row();
        let scale = d.scale();
        let g = task % d.groups;
        let b = task / d.groups;
        let klen = mask.key_lens.map_or(t, |l| l[b].min(t));
        let base = b * t * qrs;
        let k = &qkv[base + d.k_offset(g)..];
        let v = &qkv[base + d.v_offset(g)..];
        // Contiguous panels of the group's K and V, packed once per (batch, group): K^T
        // (pre-scaled) and V^T for the recomputed scores and dP, K for dQ.
        let (mut kt, mut vt, mut kk) = (Vec::new(), Vec::new(), Vec::new());
        pack_transposed(&mut kt, k, qrs, t, hd, scale);
        pack_transposed(&mut vt, v, qrs, t, hd, 1.0);
        pack_rows(&mut kk, k, qrs, t, hd);
        // The group's dK and dV, summed over its query heads.
        let mut dk_all = vec![0.0f32; t * hd];
        let mut dv_all = vec![0.0f32; t * hd];
        let (mut qq, mut dd) = (Vec::new(), Vec::new());
        let mut dq = vec![0.0f32; t * hd];
        let mut dk = vec![0.0f32; BK * hd];
        let mut dv = vec![0.0f32; BK * hd];
        let mut p = vec![0.0f32; BQ * BK];
        let mut pd = vec![0.0f32; BQ * BK];
        let mut dp = vec![0.0f32; BQ * BK];
        let first_keys = block_min_starts(&mask, b, t);
        for h in g * d.q_per_group()..(g + 1) * d.q_per_group() {
            let q = &qkv[base + d.q_offset(h)..];
            let o = &out[b * t * ors + h * hd..];
            let dout_h = &dout[b * t * ors + h * hd..];
            let lse_h = &lse[(b * d.heads + h) * t..(b * d.heads + h + 1) * t];
            // D_i = rowsum(dO_i * O_i)
            let dsum = output_dots(o, dout_h, ors, t, hd);
            // Q for dK and dO for dV, per head.
            pack_rows(&mut qq, q, qrs, t, hd);
            pack_rows(&mut dd, dout_h, ors, t, hd);
            // dQ accumulates over key blocks in a private buffer, then is written once.
            dq.fill(0.0);
            let mut j0 = 0;
            while j0 < t {
                let nk = BK.min(t - j0);
                dk.fill(0.0);
                dv.fill(0.0);
                let istart = if d.causal { j0 } else { 0 };
                let mut i0 = istart - istart % BQ;
                while j0 < klen && i0 < t {
                    let nq = BQ.min(t - i0);
                    if first_keys[i0 / BQ] >= j0 + nk {
                        i0 += BQ;
                        continue;
                    }
                    tile_matmul(&mut p, BK, &q[i0 * qrs..], qrs, 1, &kt[j0..], t, nq, nk, hd, false);
                    for r in 0..nq {
                        let at = RowAt { b, h, i: i0 + r, j0 };
                        let (prow, pdrow) = (&mut p[r * BK..r * BK + nk], &mut pd[r * BK..r * BK + nk]);
                        probabilities_row(prow, pdrow, 1.0, lse_h[at.i], &d, &mask, klen, key, at);
                    }
                    // dV_j += Pd^T dO_i
                    tile_matmul(&mut dv, hd, &pd, 1, BK, &dd[i0 * hd..], hd, nk, hd, nq, true);
                    // dP = dO_i V_j^T
                    tile_matmul(&mut dp, BK, &dout_h[i0 * ors..], ors, 1, &vt[j0..], t, nq, nk, hd, false);
                    for r in 0..nq {
                        let at = RowAt { b, h, i: i0 + r, j0 };
                        let dprow = &mut dp[r * BK..r * BK + nk];
                        score_grad_row(dprow, &p[r * BK..r * BK + nk], dsum[at.i], scale, &d, &mask, klen, key, at);
                    }
                    // dQ_i += dS K_j ; dK_j += dS^T Q_i
                    tile_matmul(&mut dq[i0 * hd..], hd, &dp, BK, 1, &kk[j0 * hd..], hd, nq, hd, nk, true);
                    tile_matmul(&mut dk, hd, &dp, 1, BK, &qq[i0 * hd..], hd, nk, hd, nq, true);
                    i0 += BQ;
                }
                for (a, x) in dk_all[j0 * hd..(j0 + nk) * hd].iter_mut().zip(&dk[..nk * hd]) {
                    *a += x;
                }
                for (a, x) in dv_all[j0 * hd..(j0 + nk) * hd].iter_mut().zip(&dv[..nk * hd]) {
                    *a += x;
                }
                j0 += BK;
            }
            for i in 0..t {
                // SAFETY: each task owns the query heads of group g of batch b in dqkv.
                unsafe { dq_p.write(base + i * qrs + d.q_offset(h), &dq[i * hd..(i + 1) * hd]) };
            }
        }
        write_key_value_grads(dq_p, base, &d, g, &dk_all, &dv_all);
    }
}

/// Shapes of KV-cache decoding: `groups` key/value heads serve `heads` query heads.
#[derive(Clone, Copy, Debug)]
pub struct DecodeDims {
    pub b: usize,
    pub heads: usize,
    pub groups: usize,
    pub head_dim: usize,
    /// Positions the cache holds.
    pub max_t: usize,
}

/// One new query per sequence against a KV cache, for generation.
/// `q` is `[b, heads, head_dim]`, `k_cache`/`v_cache` are `[b, groups, max_t, head_dim]`;
/// the query sees cache positions `keys` (`0..len`, or a sliding window's last ones);
/// `out` is `[b, heads, head_dim]`. Query head `h` reads the cache of group
/// `h / (heads / groups)`. `sink` (one logit per head, `--softmax-type`) joins each head's
/// softmax denominator.
pub fn attention_decode_forward(
    out: &mut [f32],
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    d: DecodeDims,
    keys: std::ops::Range<usize>,
    sink: Option<&[f32]>,
) {
    if let Some(s) = sink {
        assert_eq!(s.len(), d.heads);
    }
    assert!(
        keys.end <= d.max_t && keys.start < keys.end,
        "decode keys {keys:?}"
    );
    let (head_dim, max_t) = (d.head_dim, d.max_t);
    let qpg = d.heads / d.groups;
    let scale = 1.0 / (head_dim as f32).sqrt();
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each(|(bh, o)| {
            debug_assert!(bh < d.b * d.heads);
            let (bi, h) = (bh / d.heads, bh % d.heads);
            let cache = (bi * d.groups + h / qpg) * max_t * head_dim;
            let qv = &q[bh * head_dim..(bh + 1) * head_dim];
            let kc = &k_cache[cache..];
            let vc = &v_cache[cache..];
            let scores: Vec<f32> = keys
                .clone()
                .map(|j| {
                    let kr = &kc[j * head_dim..(j + 1) * head_dim];
                    qv.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale
                })
                .collect();
            let sink = sink.map(|s| s[h]);
            let mx = scores
                .iter()
                .chain(&sink)
                .cloned()
                .fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f32 = e.iter().sum::<f32>() + sink.map_or(0.0, |s| (s - mx).exp());
            o.fill(0.0);
            for (j, w) in keys.clone().zip(&e) {
                let vr = &vc[j * head_dim..(j + 1) * head_dim];
                for (ov, vv) in o.iter_mut().zip(vr) {
                    *ov += w / sum * vv;
                }
            }
        });
}

/// Appends the K and V of one new position per sequence from a fused `qkv` row
/// (`[b, groups, heads / groups + 2, head_dim]`) into caches `[b, groups, max_t, head_dim]` at
/// `pos`, and extracts the queries into `q` (`[b, heads, head_dim]`).
pub fn kv_cache_append(
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    q: &mut [f32],
    qkv: &[f32],
    d: DecodeDims,
    pos: usize,
) {
    assert!(pos < d.max_t);
    let (hd, qpg) = (d.head_dim, d.heads / d.groups);
    for bi in 0..d.b {
        for g in 0..d.groups {
            let src = &qkv[(bi * d.groups + g) * (qpg + 2) * hd..][..(qpg + 2) * hd];
            let dst = ((bi * d.groups + g) * d.max_t + pos) * hd;
            q[(bi * d.heads + g * qpg) * hd..][..qpg * hd].copy_from_slice(&src[..qpg * hd]);
            k_cache[dst..dst + hd].copy_from_slice(&src[qpg * hd..(qpg + 1) * hd]);
            v_cache[dst..dst + hd].copy_from_slice(&src[(qpg + 1) * hd..]);
        }
    }
}
