//! Multi-latent attention's (DeepSeek-V2/V3, megatron-core's `MLASelfAttention`) layout copies.
//!
//! MLA's heads have queries and keys of `qk + pe` features (a content part from the up
//! projections and a rotary part: each head's own for the query, one shared by all heads for
//! the key) and values of `v` features. The attention kernels take megatron-core's fused QKV
//! layout with one head width, so MLA's projections are packed into it with one query group per
//! head: per head `q = [q_pe | q_nope]`, `k = [k_pe | k_nope]`, `v = [v | 0]` (`v <= qk + pe`).
//! Putting the rotary features first lets the rotary kernel rotate them as a partial rotary
//! dimension; the same reordering of queries and keys leaves every score unchanged, and the zero
//! value features give zero output features, which [`mla_attn_narrow_forward`] drops.

use rayon::prelude::*;

use super::ROWS_PER_TASK;

/// One MLA attention's widths on `rows` token rows and `heads` (local) heads.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub rows: usize,
    pub heads: usize,
    /// Content features of a query/key head (`--qk-head-dim`).
    pub qk: usize,
    /// Rotary features of a query/key head (`--qk-pos-emb-head-dim`).
    pub pe: usize,
    /// Features of a value head (`--v-head-dim`), at most `qk + pe`.
    pub v: usize,
    /// The key/value latent's width (`--kv-lora-rank`).
    pub kv_lora: usize,
}

impl MlaDims {
    /// The packed head width: a query/key head's features.
    pub fn head_dim(&self) -> usize {
        self.qk + self.pe
    }
    fn packed_row(&self) -> usize {
        self.heads * 3 * self.head_dim()
    }
    fn check(&self) {
        assert!(
            self.v <= self.head_dim(),
            "MLA value heads ({}) wider than query/key heads ({})",
            self.v,
            self.head_dim()
        );
    }
}

/// `kv_comb [rows, kv_lora + pe]` (the key/value down projection) into the latent
/// `c_kv [rows, kv_lora]` and the shared rotary key `k_pe [rows, pe]`.
pub fn mla_kv_split_forward(c_kv: &mut [f32], k_pe: &mut [f32], kv_comb: &[f32], d: MlaDims) {
    let w = d.kv_lora + d.pe;
    assert_eq!(kv_comb.len(), d.rows * w);
    assert_eq!(c_kv.len(), d.rows * d.kv_lora);
    assert_eq!(k_pe.len(), d.rows * d.pe);
    c_kv.par_chunks_mut(d.kv_lora.max(1))
        .zip(k_pe.par_chunks_mut(d.pe.max(1)))
        .zip(kv_comb.par_chunks(w))
        .for_each(|((c, k), x)| {
            c.copy_from_slice(&x[..d.kv_lora]);
            k.copy_from_slice(&x[d.kv_lora..]);
        });
}

/// The gradient of [`mla_kv_split_forward`]: `dkv_comb = [dc_kv | dk_pe]`.
pub fn mla_kv_split_backward(dkv_comb: &mut [f32], dc_kv: &[f32], dk_pe: &[f32], d: MlaDims) {
    let w = d.kv_lora + d.pe;
    assert_eq!(dkv_comb.len(), d.rows * w);
    assert_eq!(dc_kv.len(), d.rows * d.kv_lora);
    assert_eq!(dk_pe.len(), d.rows * d.pe);
    dkv_comb
        .par_chunks_mut(w)
        .zip(dc_kv.par_chunks(d.kv_lora.max(1)))
        .zip(dk_pe.par_chunks(d.pe.max(1)))
        .for_each(|((x, c), k)| {
            x[..d.kv_lora].copy_from_slice(c);
            x[d.kv_lora..].copy_from_slice(k);
        });
}

/// Packs `q [rows, heads, qk + pe]` (megatron-core's per-head `[q_nope | q_pe]`),
/// `kv [rows, heads, qk + v]` (`[k_nope | v]`) and `k_pe [rows, pe]` into the fused layout
/// `qkv [rows, heads, 3, qk + pe]` (module doc), the queries multiplied by `q_scale` (YaRN's
/// `mscale²` on the softmax scale; 1 otherwise).
pub fn mla_qkv_forward(
    qkv: &mut [f32],
    q: &[f32],
    kv: &[f32],
    k_pe: &[f32],
    q_scale: f32,
    d: MlaDims,
) {
    d.check();
    let (hd, qk, pe, v) = (d.head_dim(), d.qk, d.pe, d.v);
    let row = d.packed_row();
    assert_eq!(qkv.len(), d.rows * row);
    assert_eq!(q.len(), d.rows * d.heads * hd);
    assert_eq!(kv.len(), d.rows * d.heads * (qk + v));
    assert_eq!(k_pe.len(), d.rows * pe);
    qkv.par_chunks_mut(ROWS_PER_TASK * row)
        .enumerate()
        .for_each(|(task, chunk)| {
            for (i, out) in chunk.chunks_exact_mut(row).enumerate() {
                let r = task * ROWS_PER_TASK + i;
                let qr = &q[r * d.heads * hd..(r + 1) * d.heads * hd];
                let kvr = &kv[r * d.heads * (qk + v)..(r + 1) * d.heads * (qk + v)];
                let kp = &k_pe[r * pe..(r + 1) * pe];
                for (h, o) in out.chunks_exact_mut(3 * hd).enumerate() {
                    let (qh, kvh) = (
                        &qr[h * hd..(h + 1) * hd],
                        &kvr[h * (qk + v)..(h + 1) * (qk + v)],
                    );
                    let (oq, rest) = o.split_at_mut(hd);
                    let (ok, ov) = rest.split_at_mut(hd);
                    for (o, x) in oq[..pe].iter_mut().zip(&qh[qk..]) {
                        *o = q_scale * x;
                    }
                    for (o, x) in oq[pe..].iter_mut().zip(&qh[..qk]) {
                        *o = q_scale * x;
                    }
                    ok[..pe].copy_from_slice(kp);
                    ok[pe..].copy_from_slice(&kvh[..qk]);
                    ov[..v].copy_from_slice(&kvh[qk..]);
                    ov[v..].fill(0.0);
                }
            }
        });
}

/// The gradient of [`mla_qkv_forward`]: `dq`, `dkv` in the projections' layouts and `dk_pe`
/// summed over the heads that share it (this rank's heads).
pub fn mla_qkv_backward(
    dq: &mut [f32],
    dkv: &mut [f32],
    dk_pe: &mut [f32],
    dqkv: &[f32],
    q_scale: f32,
    d: MlaDims,
) {
    d.check();
    let (hd, qk, pe, v) = (d.head_dim(), d.qk, d.pe, d.v);
    let row = d.packed_row();
    assert_eq!(dqkv.len(), d.rows * row);
    assert_eq!(dq.len(), d.rows * d.heads * hd);
    assert_eq!(dkv.len(), d.rows * d.heads * (qk + v));
    assert_eq!(dk_pe.len(), d.rows * pe);
    dq.par_chunks_mut(d.heads * hd)
        .zip(dkv.par_chunks_mut(d.heads * (qk + v)))
        .zip(dk_pe.par_chunks_mut(pe.max(1)))
        .zip(dqkv.par_chunks(row))
        .for_each(|(((dqr, dkvr), dkp), g)| {
            dkp.fill(0.0);
            for (h, gh) in g.chunks_exact(3 * hd).enumerate() {
                let (gq, gk, gv) = (&gh[..hd], &gh[hd..2 * hd], &gh[2 * hd..]);
                let dqh = &mut dqr[h * hd..(h + 1) * hd];
                for (o, x) in dqh[qk..].iter_mut().zip(&gq[..pe]) {
                    *o = q_scale * x;
                }
                for (o, x) in dqh[..qk].iter_mut().zip(&gq[pe..]) {
                    *o = q_scale * x;
                }
                for (o, x) in dkp.iter_mut().zip(&gk[..pe]) {
                    *o += x;
                }
                let dkvh = &mut dkvr[h * (qk + v)..(h + 1) * (qk + v)];
                dkvh[..qk].copy_from_slice(&gk[pe..]);
                dkvh[qk..].copy_from_slice(&gv[..v]);
            }
        });
}

/// `out [rows, heads, v]` = the first `v` features of each head of the attention output
/// `attn [rows, heads, qk + pe]` (the rest are the zero value features' outputs).
pub fn mla_attn_narrow_forward(out: &mut [f32], attn: &[f32], d: MlaDims) {
    d.check();
    let (hd, v) = (d.head_dim(), d.v);
    assert_eq!(attn.len(), d.rows * d.heads * hd);
    assert_eq!(out.len(), d.rows * d.heads * v);
    out.par_chunks_mut(d.heads * v)
        .zip(attn.par_chunks(d.heads * hd))
        .for_each(|(o, a)| {
            for (oh, ah) in o.chunks_exact_mut(v).zip(a.chunks_exact(hd)) {
                oh.copy_from_slice(&ah[..v]);
            }
        });
}

/// The gradient of [`mla_attn_narrow_forward`] (zero for the padding features), or its inverse:
/// the narrowed output padded back to the kernel's width.
pub fn mla_attn_narrow_backward(dattn: &mut [f32], dout: &[f32], d: MlaDims) {
    d.check();
    let (hd, v) = (d.head_dim(), d.v);
    assert_eq!(dattn.len(), d.rows * d.heads * hd);
    assert_eq!(dout.len(), d.rows * d.heads * v);
    dattn
        .par_chunks_mut(d.heads * hd)
        .zip(dout.par_chunks(d.heads * v))
        .for_each(|(a, o)| {
            for (ah, oh) in a.chunks_exact_mut(hd).zip(o.chunks_exact(v)) {
                ah[..v].copy_from_slice(oh);
                ah[v..].fill(0.0);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> MlaDims {
        MlaDims {
            rows: 3,
            heads: 2,
            qk: 3,
            pe: 2,
            v: 4,
            kv_lora: 5,
        }
    }

    fn ramp(n: usize, from: f32) -> Vec<f32> {
        (0..n).map(|i| from + i as f32).collect()
    }

    #[test]
    fn mla_qkv_backward_is_the_transpose_of_forward() {
        // <forward(x), g> = <x, backward(g)> for the linear packing (k_pe shared by the heads).
        let d = dims();
        let hd = d.head_dim();
        let q = ramp(d.rows * d.heads * hd, 0.5);
        let kv = ramp(d.rows * d.heads * (d.qk + d.v), -7.0);
        let kp = ramp(d.rows * d.pe, 3.0);
        let g: Vec<f32> = (0..d.rows * d.heads * 3 * hd)
            .map(|i| ((i * 7919) % 13) as f32 - 6.0)
            .collect();
        let mut qkv = vec![f32::NAN; g.len()];
        mla_qkv_forward(&mut qkv, &q, &kv, &kp, 0.5, d);
        let (mut dq, mut dkv, mut dkp) = (
            vec![f32::NAN; q.len()],
            vec![f32::NAN; kv.len()],
            vec![f32::NAN; kp.len()],
        );
        mla_qkv_backward(&mut dq, &mut dkv, &mut dkp, &g, 0.5, d);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let lhs = dot(&qkv, &g);
        let rhs = dot(&q, &dq) + dot(&kv, &dkv) + dot(&kp, &dkp);
        assert!(
            (lhs - rhs).abs() < 1e-3 * lhs.abs().max(1.0),
            "{lhs} vs {rhs}"
        );
        // The value padding is zero and the rotary features lead each query and key head.
        let head0 = &qkv[..3 * hd];
        assert_eq!(&head0[2 * hd + d.v..], &[0.0]);
        assert_eq!(head0[0], 0.5 * q[d.qk]);
        assert_eq!(head0[hd], kp[0]);
    }

    #[test]
    fn mla_attn_narrow_round_trips_and_kv_split_joins() {
        let d = dims();
        let hd = d.head_dim();
        let out = ramp(d.rows * d.heads * d.v, 1.0);
        let mut padded = vec![f32::NAN; d.rows * d.heads * hd];
        mla_attn_narrow_backward(&mut padded, &out, d);
        let mut back = vec![f32::NAN; out.len()];
        mla_attn_narrow_forward(&mut back, &padded, d);
        assert_eq!(back, out);
        assert_eq!(padded[d.v], 0.0);
        let comb = ramp(d.rows * (d.kv_lora + d.pe), 0.0);
        let (mut c, mut k) = (vec![0.0; d.rows * d.kv_lora], vec![0.0; d.rows * d.pe]);
        mla_kv_split_forward(&mut c, &mut k, &comb, d);
        assert_eq!(k[..2], [5.0, 6.0]);
        let mut joined = vec![f32::NAN; comb.len()];
        mla_kv_split_backward(&mut joined, &c, &k, d);
        assert_eq!(joined, comb);
    }
}
