//! Attention with an additive position bias and separate query and key/value sequences (T5:
//! relative position bias on self-attention, unscaled scores, and cross-attention from the
//! decoder to the encoder). The `[tq, tk]` probabilities of each (sequence, head) are
//! materialized and kept for backward: unlike the blockwise kernel, the bias gradient needs
//! every score's gradient, and T5's sequences are short (encoder 512, decoder 128 at most in
//! Megatron's and Hugging Face's recipes).
//!
//! Layout: `q` is `[b, tq, heads, head_dim]`, `k` and `v` `[b, tk, heads, head_dim]`, `out`
//! like `q`; `bias` is `[heads, tq, tk]` (shared by the sequences); `probs` `[b, heads, tq, tk]`.

use super::matmul::{matmul_with_threads, MatmulDims};
use crate::rng::RngKey;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct BiasedAttentionDims {
    pub b: usize,
    pub tq: usize,
    pub tk: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Query `i` sees keys `j <= i` only (the decoder's self-attention).
    pub causal: bool,
    /// The scores' factor: `1/sqrt(head_dim)` in Megatron, 1 in T5 (folded into its init).
    pub scale: f32,
    pub dropout: f32,
    /// (first global head, heads in the layer) for the dropout stream, as in
    /// [`super::attention::AttentionDims::rng_heads`].
    pub rng_heads: (usize, usize),
}

impl BiasedAttentionDims {
    fn drop_index(&self, b: usize, h: usize, i: usize, j: usize) -> u64 {
        let (h0, total) = self.rng_heads;
        (((b * total.max(self.heads) + h0 + h) * self.tq + i) * self.tk + j) as u64
    }
    /// Keys query `i` of sequence `b` may see: `0..end`.
    fn visible_end(&self, key_lens: Option<&[usize]>, b: usize, i: usize) -> usize {
        let len = key_lens.map_or(self.tk, |l| l[b].min(self.tk));
        if self.causal {
            len.min(i + 1)
        } else {
            len
        }
    }
}

/// Rows `[t, head_dim]` of head `h` of sequence `b` of a `[b, t, heads, head_dim]` tensor.
fn gather_head(x: &[f32], b: usize, h: usize, t: usize, heads: usize, hd: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(t * hd);
    for r in 0..t {
        let o = ((b * t + r) * heads + h) * hd;
        out.extend_from_slice(&x[o..o + hd]);
    }
    out
}

fn scatter_head(
    x: &mut [f32],
    rows: &[f32],
    b: usize,
    h: usize,
    t: usize,
    heads: usize,
    hd: usize,
) {
    for r in 0..t {
        let o = ((b * t + r) * heads + h) * hd;
        x[o..o + hd].copy_from_slice(&rows[r * hd..(r + 1) * hd]);
    }
}

/// The probabilities after dropout (scaled by `1 / (1 - p)`), from the saved ones; the saved
/// ones themselves without dropout.
fn dropped<'a>(
    p: &'a [f32],
    d: &BiasedAttentionDims,
    key: RngKey,
    b: usize,
    h: usize,
) -> std::borrow::Cow<'a, [f32]> {
    if d.dropout == 0.0 {
        return std::borrow::Cow::Borrowed(p);
    }
    let keep_scale = 1.0 / (1.0 - d.dropout);
    p.iter()
        .enumerate()
        .map(|(e, &x)| {
            let (i, j) = (e / d.tk, e % d.tk);
            if key.keep(d.drop_index(b, h, i, j), d.dropout) {
                x * keep_scale
            } else {
                0.0
            }
        })
        .collect::<Vec<f32>>()
        .into()
}

/// `out = dropout(softmax(scale * q kᵀ + bias, masked)) v`; `probs` receives the softmax
/// (before dropout). `key_lens[b]`: keys at or beyond it are padding. A query that sees no
/// key gets zero probabilities and a zero output.
#[allow(clippy::too_many_arguments)]
pub fn biased_attention_forward(
    out: &mut [f32],
    probs: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    bias: Option<&[f32]>,
    key_lens: Option<&[usize]>,
    d: BiasedAttentionDims,
    key: RngKey,
) {
    let (tq, tk, nh, hd) = (d.tq, d.tk, d.heads, d.head_dim);
    assert_eq!(q.len(), d.b * tq * nh * hd);
    assert_eq!(k.len(), d.b * tk * nh * hd);
    assert_eq!(v.len(), k.len());
    assert_eq!(out.len(), q.len());
    assert_eq!(probs.len(), d.b * nh * tq * tk);
    if let Some(bias) = bias {
        assert_eq!(bias.len(), nh * tq * tk);
    }
    let outs: Vec<Vec<f32>> = probs
        .par_chunks_mut(tq * tk)
        .enumerate()
        .map(|(task, p)| {
            let (b, h) = (task / nh, task % nh);
            let qh = gather_head(q, b, h, tq, nh, hd);
            let kh = gather_head(k, b, h, tk, nh, hd);
            let vh = gather_head(v, b, h, tk, nh, hd);
            matmul_with_threads(p, &qh, &kh, MatmulDims::new(tq, tk, hd).tb(), 1);
            for i in 0..tq {
                let row = &mut p[i * tk..(i + 1) * tk];
                let end = d.visible_end(key_lens, b, i);
                let brow = bias.map(|x| &x[(h * tq + i) * tk..(h * tq + i + 1) * tk]);
                let mut mx = f32::NEG_INFINITY;
                for j in 0..end {
                    row[j] = row[j] * d.scale + brow.map_or(0.0, |x| x[j]);
                    mx = mx.max(row[j]);
                }
                let mut sum = 0.0f32;
                for x in &mut row[..end] {
                    *x = (*x - mx).exp();
                    sum += *x;
                }
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                row[..end].iter_mut().for_each(|x| *x *= inv);
                row[end..].fill(0.0);
            }
            let pd = dropped(p, &d, key, b, h);
            let mut o = vec![0.0f32; tq * hd];
            matmul_with_threads(&mut o, &pd, &vh, MatmulDims::new(tq, hd, tk), 1);
            o
        })
        .collect();
    for (task, o) in outs.iter().enumerate() {
        scatter_head(out, o, task / nh, task % nh, tq, nh, hd);
    }
}

/// Gradients of [`biased_attention_forward`]: writes `dq`, `dk`, `dv` and accumulates the
/// bias gradient (summed over sequences) into `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn biased_attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    probs: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: BiasedAttentionDims,
    key: RngKey,
) {
    let (tq, tk, nh, hd) = (d.tq, d.tk, d.heads, d.head_dim);
    assert_eq!(dout.len(), d.b * tq * nh * hd);
    assert_eq!(probs.len(), d.b * nh * tq * tk);
    // Per (sequence, head): dq, dk, dv rows and the scores' gradient.
    type Grads = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
    let parts: Vec<Grads> = probs
        .par_chunks(tq * tk)
        .enumerate()
        .map(|(task, p)| {
            let (b, h) = (task / nh, task % nh);
            let qh = gather_head(q, b, h, tq, nh, hd);
            let kh = gather_head(k, b, h, tk, nh, hd);
            let vh = gather_head(v, b, h, tk, nh, hd);
            let doh = gather_head(dout, b, h, tq, nh, hd);
            let pd = dropped(p, &d, key, b, h);
            let mut dvh = vec![0.0f32; tk * hd];
            matmul_with_threads(&mut dvh, &pd, &doh, MatmulDims::new(tk, hd, tq).ta(), 1);
            // dP = dropout'(dO vᵀ), then dS = P (dP - rowsum(dP P)).
            let mut ds = vec![0.0f32; tq * tk];
            matmul_with_threads(&mut ds, &doh, &vh, MatmulDims::new(tq, tk, hd).tb(), 1);
            if d.dropout > 0.0 {
                let keep_scale = 1.0 / (1.0 - d.dropout);
                for (e, x) in ds.iter_mut().enumerate() {
                    let (i, j) = (e / tk, e % tk);
                    *x = if key.keep(d.drop_index(b, h, i, j), d.dropout) {
                        *x * keep_scale
                    } else {
                        0.0
                    };
                }
            }
            for i in 0..tq {
                let (prow, srow) = (&p[i * tk..(i + 1) * tk], &mut ds[i * tk..(i + 1) * tk]);
                let dot: f32 = prow.iter().zip(srow.iter()).map(|(a, b)| a * b).sum();
                for (s, &pp) in srow.iter_mut().zip(prow) {
                    *s = pp * (*s - dot);
                }
            }
            let mut dqh = vec![0.0f32; tq * hd];
            matmul_with_threads(&mut dqh, &ds, &kh, MatmulDims::new(tq, hd, tk), 1);
            let mut dkh = vec![0.0f32; tk * hd];
            matmul_with_threads(&mut dkh, &ds, &qh, MatmulDims::new(tk, hd, tq).ta(), 1);
            dqh.iter_mut()
                .chain(dkh.iter_mut())
                .for_each(|x| *x *= d.scale);
            (dqh, dkh, dvh, ds)
        })
        .collect();
    for (task, (dqh, dkh, dvh, _)) in parts.iter().enumerate() {
        let (b, h) = (task / nh, task % nh);
        scatter_head(dq, dqh, b, h, tq, nh, hd);
        scatter_head(dk, dkh, b, h, tk, nh, hd);
        scatter_head(dv, dvh, b, h, tk, nh, hd);
    }
    if let Some(db) = dbias {
        assert_eq!(db.len(), nh * tq * tk);
        for (task, (_, _, _, ds)) in parts.iter().enumerate() {
            let h = task % nh;
            db[h * tq * tk..(h + 1) * tq * tk]
                .iter_mut()
                .zip(ds)
                .for_each(|(a, b)| *a += b);
        }
    }
}

/// T5's relative position buckets (Hugging Face's `_relative_position_bucket`, Mesh
/// TensorFlow's): exact buckets for small distances, logarithmic ones up to `max_distance`,
/// and with `bidirectional` half the buckets for keys after the query. Computed in f32 as
/// transformers computes it, so the buckets are transformers'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelativePositionDims {
    pub tq: usize,
    pub tk: usize,
    pub heads: usize,
    pub num_buckets: usize,
    pub max_distance: usize,
    pub bidirectional: bool,
}

/// The bucket of `relative_position = key position - query position`.
pub fn relative_position_bucket(relative_position: i64, d: &RelativePositionDims) -> usize {
    let mut buckets = d.num_buckets;
    let mut out = 0usize;
    let rp = if d.bidirectional {
        buckets /= 2;
        if relative_position > 0 {
            out += buckets;
        }
        relative_position.unsigned_abs() as usize
    } else {
        (-relative_position.min(0)) as usize
    };
    let max_exact = buckets / 2;
    if rp < max_exact {
        return out + rp;
    }
    let ratio = (rp as f32 / max_exact as f32).ln()
        / ((d.max_distance as f64 / max_exact as f64).ln() as f32)
        * (buckets - max_exact) as f32;
    out + (max_exact + ratio as usize).min(buckets - 1)
}

/// `out[h, i, j] = table[bucket(j - i), h]` (`table` is `[num_buckets, heads]`).
pub fn relative_position_bias_forward(out: &mut [f32], table: &[f32], d: RelativePositionDims) {
    assert_eq!(out.len(), d.heads * d.tq * d.tk);
    assert_eq!(table.len(), d.num_buckets * d.heads);
    for i in 0..d.tq {
        for j in 0..d.tk {
            let bucket = relative_position_bucket(j as i64 - i as i64, &d);
            for h in 0..d.heads {
                out[(h * d.tq + i) * d.tk + j] = table[bucket * d.heads + h];
            }
        }
    }
}

/// `dtable[bucket(j - i), h] += dout[h, i, j]`.
pub fn relative_position_bias_backward(dtable: &mut [f32], dout: &[f32], d: RelativePositionDims) {
    assert_eq!(dout.len(), d.heads * d.tq * d.tk);
    assert_eq!(dtable.len(), d.num_buckets * d.heads);
    for i in 0..d.tq {
        for j in 0..d.tk {
            let bucket = relative_position_bucket(j as i64 - i as i64, &d);
            for h in 0..d.heads {
                dtable[bucket * d.heads + h] += dout[(h * d.tq + i) * d.tk + j];
            }
        }
    }
}

/// Splits a fused projection `[rows, heads, parts, head_dim]` (megatron-core's per-head
/// `[q_h, k_h, v_h]`, or `[k_h, v_h]`) into `parts` tensors `[rows, heads, head_dim]`.
pub fn unfuse_heads(outs: &mut [&mut [f32]], fused: &[f32], heads: usize, head_dim: usize) {
    let parts = outs.len();
    let row = heads * parts * head_dim;
    assert_eq!(fused.len() % row, 0);
    for (r, chunk) in fused.chunks_exact(row).enumerate() {
        for h in 0..heads {
            for (p, out) in outs.iter_mut().enumerate() {
                let src = &chunk[(h * parts + p) * head_dim..(h * parts + p + 1) * head_dim];
                let o = (r * heads + h) * head_dim;
                out[o..o + head_dim].copy_from_slice(src);
            }
        }
    }
}

/// The inverse of [`unfuse_heads`] (the gradient of the fused projection's output).
pub fn fuse_heads(fused: &mut [f32], parts: &[&[f32]], heads: usize, head_dim: usize) {
    let n = parts.len();
    let row = heads * n * head_dim;
    assert_eq!(fused.len() % row, 0);
    for (r, chunk) in fused.chunks_exact_mut(row).enumerate() {
        for h in 0..heads {
            for (p, part) in parts.iter().enumerate() {
                let o = (r * heads + h) * head_dim;
                chunk[(h * n + p) * head_dim..(h * n + p + 1) * head_dim]
                    .copy_from_slice(&part[o..o + head_dim]);
            }
        }
    }
}
