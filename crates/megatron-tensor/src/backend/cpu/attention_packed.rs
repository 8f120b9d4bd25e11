//! The blockwise attention kernel (`attention.rs`) with its matrix products on the packed bf16
//! block kernels (`matmul_packed.rs`: AMX tiles, or the AVX512_BF16 dot product), for `--bf16`
//! where the matmuls run on them: Q·Kᵀ and P·V forward; the recomputed scores, dP, dV, dQ and
//! dK backward. Operands are rounded to bf16 (nearest even) as they are packed — Q, K, V, dO
//! once per (batch, head), the probabilities and score gradients once per tile — and every
//! product accumulates in f32; the softmax, its running max and sum, masks and dropout stay in
//! f32 and are the very row functions the f32 kernel runs, so the two kernels differ only in
//! the rounding of the products' operands (what PyTorch's bf16 flash attention rounds too).
//!
//! Layouts are the GEMM's (`amx_pack.rs`): A tile-contiguous per 32-row block, B in VNNI panels
//! of 32 columns over a whole operand's k, so a tile of keys `j0..j0 + 64` of V or K is a k
//! offset into its panel, never a repack. Whole 32 x 32 blocks of C are computed: the tile
//! buffers here are padded to multiples of 32 rows and columns (padding rows and columns of
//! the packed operands are zero, so the padding of C holds zeros or is never read).
//!
//! Tasks are (batch, head) forward and (batch, query group) backward, as in the f32 kernel;
//! each output element is one task's sum in a fixed order, so results do not depend on the
//! thread count.

use super::amx_pack::{pack_a, pack_b, PackBuffer, PackElem, A_STEP, KB, MB, NB};
use super::attention::{
    finish_row, output_dots, probabilities_row, score_grad_row, softmax_row_online,
    write_key_value_grads, AttentionDims, AttentionMask, RowAt,
};
use super::matmul::MatmulDims;
use super::matmul_packed::{BlockKernel, CBlock};
use super::operand::{with_operand, Operand};
use super::simd::multiversion;
use super::sync_ptr::SyncPtr;
use crate::rng::RngKey;

/// Query rows and keys per score tile (two 32-row blocks by two 32-column panels).
const BQ: usize = 64;
const BK: usize = 64;

/// An operand packed as B: panels of NB columns over all of its k (`kpp` k pairs each).
struct Panels {
    buf: PackBuffer,
    kpp: usize,
}

impl Panels {
    fn new() -> Self {
        Panels {
            buf: PackBuffer::new(),
            kpp: 0,
        }
    }

    /// Packs `op(b)` of shape `d.k x d.n` (`d.trans_b` as in a GEMM), stored rows `ld` apart,
    /// reusing the buffer.
    fn pack<T: PackElem>(&mut self, b: &[T], d: MatmulDims, ld: usize) {
        self.kpp = d.k.div_ceil(2 * KB) * KB;
        let kpp = self.kpp;
        let words = self.buf.zeroed(d.n.div_ceil(NB) * kpp * NB);
        for (p, dst) in words.chunks_mut(kpp * NB).enumerate() {
            pack_b(dst, b, d, ld, p * NB, d.n);
        }
    }

    /// [`Panels::pack`] of a stored operand (a QKV kept in bf16 is packed as it is).
    fn pack_operand(&mut self, b: Operand<'_>, d: MatmulDims, ld: usize) {
        with_operand!(b, |x| self.pack(x, d, ld))
    }

    /// [`Panels::pack_operand`] into a new buffer.
    fn packed(b: Operand<'_>, d: MatmulDims, ld: usize) -> Self {
        let mut p = Panels::new();
        p.pack_operand(b, d, ld);
        p
    }

    /// Panels `first..` from k step `step` (32 values of k) on.
    fn at(&self, first: usize, step: usize) -> PanelsAt<'_> {
        PanelsAt {
            words: &self.buf.words()[first * self.kpp * NB + step * KB * NB..],
            stride: self.kpp * NB,
            steps_left: self.kpp / KB - step,
        }
    }
}

#[derive(Clone, Copy)]
struct PanelsAt<'a> {
    words: &'a [u32],
    /// Words from one panel to the next.
    stride: usize,
    /// K steps each panel has from here.
    steps_left: usize,
}

/// An operand packed as A: blocks of 32 rows, `steps` k steps each.
struct Blocks {
    buf: PackBuffer,
    steps: usize,
}

impl Blocks {
    fn new() -> Self {
        Blocks {
            buf: PackBuffer::new(),
            steps: 0,
        }
    }

    /// Packs `op(a)` (`d.m x d.k`, `d.trans_a` as in a GEMM), stored rows `ld` apart.
    fn pack<T: PackElem>(&mut self, a: &[T], d: MatmulDims, ld: usize) {
        self.steps = d.k.div_ceil(2 * KB);
        let step_words = self.steps * A_STEP;
        let words = self.buf.zeroed(d.m.div_ceil(MB) * step_words);
        for (blk, dst) in words.chunks_mut(step_words).enumerate() {
            pack_a(dst, a, d, ld, blk * MB, self.steps);
        }
    }

    /// [`Blocks::pack`] of a stored operand.
    fn pack_operand(&mut self, a: Operand<'_>, d: MatmulDims, ld: usize) {
        with_operand!(a, |x| self.pack(x, d, ld))
    }

    /// Row blocks `first..` (32 rows each).
    fn at(&self, first: usize) -> BlocksAt<'_> {
        let step_words = self.steps * A_STEP;
        BlocksAt {
            words: &self.buf.words()[first * step_words..],
            steps: self.steps,
        }
    }
}

#[derive(Clone, Copy)]
struct BlocksAt<'a> {
    words: &'a [u32],
    steps: usize,
}

/// How a product's C starts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CInit {
    Overwrite,
    Accumulate,
}

/// `C (=|+=) A · B` on `row_blocks x panels` whole 32 x 32 blocks of `c` (row stride `ldc`),
/// over A's k steps, on `kernel` (prepared on this thread).
#[allow(clippy::too_many_arguments)]
fn tiles(
    kernel: BlockKernel,
    c: &mut [f32],
    ldc: usize,
    a: BlocksAt,
    row_blocks: usize,
    b: PanelsAt,
    panels: usize,
    into: CInit,
) {
    if row_blocks == 0 || panels == 0 {
        return;
    }
    let steps = a.steps;
    assert!(
        steps >= 1 && steps <= b.steps_left,
        "k steps {steps} of {}",
        b.steps_left
    );
    assert!(
        a.words.len() >= row_blocks * steps * A_STEP,
        "packed A too short"
    );
    assert!(
        b.words.len() >= (panels - 1) * b.stride + steps * KB * NB,
        "packed B too short"
    );
    assert!(panels * NB <= ldc && c.len() >= (row_blocks * MB - 1) * ldc + panels * NB);
    let row_bytes = ldc * 4;
    for rb in 0..row_blocks {
        let a_blk = a.words[rb * steps * A_STEP..].as_ptr();
        for p in 0..panels {
            let ptr = c[rb * MB * ldc + p * NB..].as_mut_ptr();
            let cb = match into {
                CInit::Overwrite => CBlock::Store { ptr, row_bytes },
                CInit::Accumulate => CBlock::Accumulate { ptr, row_bytes },
            };
            // SAFETY: every task prepares its thread for `kernel` first (the only callers); the
            // asserts above bound A's `steps` k steps of this row block, B's `steps * 16` rows of
            // this panel and C's 32 x 32 block at `row_bytes` apart.
            unsafe { kernel.block_32x32(cb, a_blk, b.words[p * b.stride..].as_ptr(), steps, MB) };
        }
    }
}

/// Whole 32-row (or 32-column) blocks covering `n`.
fn blocks(n: usize) -> usize {
    n.div_ceil(32)
}

multiversion! {
    pub(super) fn forward_task(task: usize, out_p: SyncPtr, lse_p: SyncPtr, qkv: Operand<'_>, mask: AttentionMask, d: AttentionDims, key: RngKey, kernel: BlockKernel) {
        assert!(kernel.available());
        // SAFETY: available, asserted above.
        unsafe { kernel.prepare_thread() };
        let (t, hd) = (d.t, d.head_dim);
        let h = task % d.heads;
        let b = task / d.heads;
        let klen = mask.key_lens.map_or(t, |l| l[b].min(t));
        let qrs = d.qkv_row();
        let g = h / d.q_per_group();
        let base = b * t * qrs;
        let hp = blocks(hd) * 32;
        // K as the B of S = Q Kᵀ (op(b) = Kᵀ, hd x t), V as the B of O = P V (t x hd), Q as A.
        let from = |off: usize| qkv.slice(base + off..qkv.len());
        let kt = Panels::packed(from(d.k_offset(g)), MatmulDims::new(0, t, hd).tb(), qrs);
        let vv = Panels::packed(from(d.v_offset(g)), MatmulDims::new(0, hd, t), qrs);
        let mut qa = Blocks::new();
        qa.pack_operand(from(d.q_offset(h)), MatmulDims::new(t, 0, hd), qrs);
        let mut pa = Blocks::new();
        let mut s = vec![0.0f32; BQ * BK];
        let mut acc = vec![0.0f32; BQ * hp];
        let scale = d.scale();
        let mut i0 = 0;
        while i0 < t {
            let nq = BQ.min(t - i0);
            let mut m = [f32::NEG_INFINITY; BQ];
            let mut l = [0.0f32; BQ];
            acc.fill(0.0);
            let kend = if d.causal { (i0 + nq).min(klen) } else { klen };
            let mut j0 = 0;
            while j0 < kend {
                let nk = BK.min(kend - j0);
                tiles(kernel, &mut s, BK, qa.at(i0 / 32), blocks(nq), kt.at(j0 / 32, 0), blocks(nk), CInit::Overwrite);
                for r in 0..nq {
                    let at = RowAt { b, h, i: i0 + r, j0 };
                    let row = &mut s[r * BK..r * BK + nk];
                    if let Some(corr) = softmax_row_online(row, scale, &mut m[r], &mut l[r], &d, &mask, klen, key, at) {
                        for a in &mut acc[r * hp..r * hp + hd] {
                            *a *= corr;
                        }
                    }
                }
                pa.pack(&s, MatmulDims::new(nq, 0, nk), BK);
                tiles(kernel, &mut acc, hp, pa.at(0), blocks(nq), vv.at(0, j0 / 32), blocks(hd), CInit::Accumulate);
                j0 += BK;
            }
            for r in 0..nq {
                let i = i0 + r;
                // SAFETY: each task owns head h of batch b.
                let o = unsafe { out_p.slice((b * t + i) * d.out_row() + h * hd, hd) };
                let lrow = unsafe { lse_p.slice((b * d.heads + h) * t + i, 1) };
                lrow[0] = finish_row(o, &acc[r * hp..r * hp + hd], m[r], l[r]);
            }
            i0 += BQ;
        }
    }
}

multiversion! {
    pub(super) fn backward_task(task: usize, dq_p: SyncPtr, dout: &[f32], out: &[f32], lse: &[f32], qkv: Operand<'_>, mask: AttentionMask, d: AttentionDims, key: RngKey, kernel: BlockKernel) {
        assert!(kernel.available());
        // SAFETY: available, asserted above.
        unsafe { kernel.prepare_thread() };
        let (t, hd) = (d.t, d.head_dim);
        let qrs = d.qkv_row();
        let ors = d.out_row();
        let scale = d.scale();
        let g = task % d.groups;
        let b = task / d.groups;
        let klen = mask.key_lens.map_or(t, |l| l[b].min(t));
        let base = b * t * qrs;
        let hp = blocks(hd) * 32;
        let tp = blocks(t) * 32;
        let from = |off: usize| qkv.slice(base + off..qkv.len());
        let (k, v) = (from(d.k_offset(g)), from(d.v_offset(g)));
        // The group's K as the B of the scores (Kᵀ) and of dQ (K), V as the B of dP (Vᵀ).
        let kt = Panels::packed(k, MatmulDims::new(0, t, hd).tb(), qrs);
        let kk = Panels::packed(k, MatmulDims::new(0, hd, t), qrs);
        let vt = Panels::packed(v, MatmulDims::new(0, t, hd).tb(), qrs);
        let mut dk_all = vec![0.0f32; t * hd];
        let mut dv_all = vec![0.0f32; t * hd];
        let (mut qa, mut da, mut tile_a) = (Blocks::new(), Blocks::new(), Blocks::new());
        let (mut qb, mut db) = (Panels::new(), Panels::new());
        let mut dq = vec![0.0f32; tp * hp];
        let mut dk = vec![0.0f32; BK * hp];
        let mut dv = vec![0.0f32; BK * hp];
        let mut p = vec![0.0f32; BQ * BK];
        let mut pd = vec![0.0f32; BQ * BK];
        let mut dp = vec![0.0f32; BQ * BK];
        for h in g * d.q_per_group()..(g + 1) * d.q_per_group() {
            let q = from(d.q_offset(h));
            let o = &out[b * t * ors + h * hd..];
            let dout_h = &dout[b * t * ors + h * hd..];
            let lse_h = &lse[(b * d.heads + h) * t..(b * d.heads + h + 1) * t];
            let dsum = output_dots(o, dout_h, ors, t, hd);
            // Q as the A of the scores and the B of dK; dO as the A of dP and the B of dV.
            qa.pack_operand(q, MatmulDims::new(t, 0, hd), qrs);
            qb.pack_operand(q, MatmulDims::new(0, hd, t), qrs);
            da.pack(dout_h, MatmulDims::new(t, 0, hd), ors);
            db.pack(dout_h, MatmulDims::new(0, hd, t), ors);
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
                    tiles(kernel, &mut p, BK, qa.at(i0 / 32), blocks(nq), kt.at(j0 / 32, 0), blocks(nk), CInit::Overwrite);
                    for r in 0..nq {
                        let at = RowAt { b, h, i: i0 + r, j0 };
                        let (prow, pdrow) = (&mut p[r * BK..r * BK + nk], &mut pd[r * BK..r * BK + nk]);
                        probabilities_row(prow, pdrow, scale, lse_h[at.i], &d, &mask, klen, key, at);
                    }
                    // dV_j += Pdᵀ dO_i
                    tile_a.pack(&pd, MatmulDims::new(nk, 0, nq).ta(), BK);
                    tiles(kernel, &mut dv, hp, tile_a.at(0), blocks(nk), db.at(0, i0 / 32), blocks(hd), CInit::Accumulate);
                    // dP = dO_i Vⱼᵀ
                    tiles(kernel, &mut dp, BK, da.at(i0 / 32), blocks(nq), vt.at(j0 / 32, 0), blocks(nk), CInit::Overwrite);
                    for r in 0..nq {
                        let at = RowAt { b, h, i: i0 + r, j0 };
                        let dprow = &mut dp[r * BK..r * BK + nk];
                        score_grad_row(dprow, &p[r * BK..r * BK + nk], dsum[at.i], scale, &d, &mask, klen, key, at);
                    }
                    // dQ_i += dS K_j ; dK_j += dSᵀ Q_i
                    tile_a.pack(&dp, MatmulDims::new(nq, 0, nk), BK);
                    tiles(kernel, &mut dq[i0 * hp..], hp, tile_a.at(0), blocks(nq), kk.at(0, j0 / 32), blocks(hd), CInit::Accumulate);
                    tile_a.pack(&dp, MatmulDims::new(nk, 0, nq).ta(), BK);
                    tiles(kernel, &mut dk, hp, tile_a.at(0), blocks(nk), qb.at(0, i0 / 32), blocks(hd), CInit::Accumulate);
                    i0 += BQ;
                }
                for r in 0..nk {
                    let (dst, src) = ((j0 + r) * hd, r * hp);
                    for (a, x) in dk_all[dst..dst + hd].iter_mut().zip(&dk[src..src + hd]) {
                        *a += x;
                    }
                    for (a, x) in dv_all[dst..dst + hd].iter_mut().zip(&dv[src..src + hd]) {
                        *a += x;
                    }
                }
                j0 += BK;
            }
            for i in 0..t {
                // SAFETY: each task owns the query heads of group g of batch b in dqkv.
                unsafe { dq_p.write(base + i * qrs + d.q_offset(h), &dq[i * hp..i * hp + hd]) };
            }
        }
        write_key_value_grads(dq_p, base, &d, g, &dk_all, &dv_all);
    }
}
