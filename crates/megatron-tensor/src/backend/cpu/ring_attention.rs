//! Pieces of ring attention (context parallelism, `--cp-comm-type p2p`): a rank's queries meet
//! one block of keys and values at a time, each block through the ordinary attention kernel;
//! these kernels take the keys and values that travel around the ring out of the fused rows,
//! assemble a block's fused QKV rows from local queries and travelling keys/values, merge
//! partial outputs by their log-sum-exp (the online softmax across blocks), and split a
//! block's QKV gradient back.

use rayon::prelude::*;

/// Shapes of one block: `rows` query rows per sequence, `b` sequences, the attention layout.
#[derive(Clone, Copy, Debug)]
pub struct RingDims {
    pub b: usize,
    pub rows: usize,
    pub heads: usize,
    pub groups: usize,
    pub head_dim: usize,
}

impl RingDims {
    fn qpg(&self) -> usize {
        self.heads / self.groups
    }
    /// Elements of one fused QKV row: per group its query heads, its key, its value.
    pub fn qkv_row(&self) -> usize {
        (self.heads + 2 * self.groups) * self.head_dim
    }
    fn group_width(&self) -> usize {
        (self.qpg() + 2) * self.head_dim
    }

    /// Elements of one row of keys and values only: per group its key, its value.
    pub fn kv_row(&self) -> usize {
        2 * self.groups * self.head_dim
    }
}

/// The keys and values of fused QKV rows (`qkv`, rows of [`RingDims::qkv_row`]) as compact
/// rows of [`RingDims::kv_row`]: what travels around the ring.
pub fn kv_rows(kv: &mut [f32], qkv: &[f32], d: RingDims) {
    let (row, gw, qw, hd) = (
        d.qkv_row(),
        d.group_width(),
        d.qpg() * d.head_dim,
        d.head_dim,
    );
    kv.par_chunks_mut(d.kv_row())
        .zip(qkv.par_chunks(row))
        .for_each(|(o, r)| {
            for g in 0..d.groups {
                o[g * 2 * hd..(g + 1) * 2 * hd].copy_from_slice(&r[g * gw + qw..(g + 1) * gw]);
            }
        });
}

/// `pair[i]` = the query parts of `q[i]` (fused rows) and the keys and values of `kv[i]`
/// (compact rows): one block's fused QKV.
pub fn fuse_q_kv(pair: &mut [f32], q: &[f32], kv: &[f32], d: RingDims) {
    let (row, gw, qw, hd) = (
        d.qkv_row(),
        d.group_width(),
        d.qpg() * d.head_dim,
        d.head_dim,
    );
    pair.par_chunks_mut(row)
        .zip(q.par_chunks(row).zip(kv.par_chunks(d.kv_row())))
        .for_each(|(o, (qr, kr))| {
            for g in 0..d.groups {
                let at = g * gw;
                o[at..at + qw].copy_from_slice(&qr[at..at + qw]);
                o[at + qw..at + gw].copy_from_slice(&kr[g * 2 * hd..(g + 1) * 2 * hd]);
            }
        });
}

/// The inverse of [`fuse_q_kv`] for gradients: `dq[i]` (fused rows) += the query parts of
/// `pair[i]`, `dkv[i]` (compact rows) += its key/value parts.
pub fn split_q_kv_add(dq: &mut [f32], dkv: &mut [f32], pair: &[f32], d: RingDims) {
    let (row, gw, qw, hd) = (
        d.qkv_row(),
        d.group_width(),
        d.qpg() * d.head_dim,
        d.head_dim,
    );
    dq.par_chunks_mut(row)
        .zip(dkv.par_chunks_mut(d.kv_row()).zip(pair.par_chunks(row)))
        .for_each(|(q, (kv, p))| {
            for g in 0..d.groups {
                let at = g * gw;
                for (a, b) in q[at..at + qw].iter_mut().zip(&p[at..at + qw]) {
                    *a += b;
                }
                for (a, b) in kv[g * 2 * hd..(g + 1) * 2 * hd]
                    .iter_mut()
                    .zip(&p[at + qw..at + gw])
                {
                    *a += b;
                }
            }
        });
}

/// `dqkv[i]` (fused rows) key/value parts += `dkv[i]` (compact rows).
pub fn add_kv_rows(dqkv: &mut [f32], dkv: &[f32], d: RingDims) {
    let (row, gw, qw, hd) = (
        d.qkv_row(),
        d.group_width(),
        d.qpg() * d.head_dim,
        d.head_dim,
    );
    dqkv.par_chunks_mut(row)
        .zip(dkv.par_chunks(d.kv_row()))
        .for_each(|(o, r)| {
            for g in 0..d.groups {
                for (a, b) in o[g * gw + qw..(g + 1) * gw]
                    .iter_mut()
                    .zip(&r[g * 2 * hd..(g + 1) * 2 * hd])
                {
                    *a += b;
                }
            }
        });
}

/// Where each query row's document starts in a block of keys (`doc_start` holds the whole
/// micro-batch's starts, `[b, t]`; the block's queries start at `q0`, its keys at `k0`, `rows`
/// each): the kernel's per-row first visible key, `rows` when the document starts after the
/// block.
pub fn block_doc_start(
    out: &mut [u32],
    doc_start: &[u32],
    t: usize,
    q0: usize,
    k0: usize,
    rows: usize,
) {
    for (i, o) in out.iter_mut().enumerate() {
        let (s, q) = (i / rows, i % rows);
        let start = doc_start[s * t + q0 + q] as usize;
        *o = start.saturating_sub(k0).min(rows) as u32;
    }
}

/// Merges a block's attention output and log-sum-exp into the running ones: with
/// `l = log(e^lse_acc + e^lse_new)`, `out = e^(lse_acc - l) out_acc + e^(lse_new - l) out_new`.
/// `out` rows are `[b * rows, heads * head_dim]`, `lse` is `[b, heads, rows]`.
pub fn attention_merge(
    out_acc: &mut [f32],
    lse_acc: &mut [f32],
    out_new: &[f32],
    lse_new: &[f32],
    d: RingDims,
) {
    let (hd, h, rows) = (d.head_dim, d.heads, d.rows);
    let width = h * hd;
    out_acc
        .par_chunks_mut(width)
        .zip(out_new.par_chunks(width))
        .enumerate()
        .for_each(|(row, (o, n))| {
            let (s, q) = (row / rows, row % rows);
            for head in 0..h {
                let li = (s * h + head) * rows + q;
                let (a, b) = (lse_acc[li], lse_new[li]);
                // The kernel marks a row that saw no key (a document started later) with an
                // infinite log-sum-exp and a zero output: it adds nothing.
                let (wa, wb) = match (a.is_finite(), b.is_finite()) {
                    (_, false) => (1.0, 0.0),
                    (false, true) => (0.0, 1.0),
                    (true, true) => {
                        let m = a.max(b);
                        let l = m + ((a - m).exp() + (b - m).exp()).ln();
                        ((a - l).exp(), (b - l).exp())
                    }
                };
                for (x, y) in o[head * hd..(head + 1) * hd]
                    .iter_mut()
                    .zip(&n[head * hd..(head + 1) * hd])
                {
                    *x = wa * *x + wb * y;
                }
            }
        });
    for (a, b) in lse_acc.iter_mut().zip(lse_new) {
        if !b.is_finite() {
            continue;
        }
        if !a.is_finite() {
            *a = *b;
            continue;
        }
        let m = a.max(*b);
        *a = m + ((*a - m).exp() + (b - m).exp()).ln();
    }
}
