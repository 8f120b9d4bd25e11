//! bf16 matrix multiply with f32 accumulation on the CPU's bf16 dot-product instruction
//! (`vdpbf16ps`, AVX512_BF16): each instruction multiplies 16 pairs of bf16 and adds both
//! products to 16 f32 accumulators, twice the multiply-adds of an f32 FMA. Inputs are f32
//! slices rounded to bf16 (round to nearest even) while they are packed, which is what autocast
//! does to a matmul's operands; the output stays f32. Without the instruction the f32 GEMM runs.
//!
//! Blocking (GotoBLAS style): `B` is packed once into panels of 32 columns, k in pairs; each
//! thread takes blocks of 64 rows of `A`, packs them (8-row groups, k in pairs) and, for every
//! 256-deep slice of k, runs the 8 x 32 microkernel over all panels (the `B` panel slice stays
//! in L1, the `A` block in L2).

use super::cast::Half;
use super::matmul::{matmul_with_threads, rounded_operand, MatmulDims};
use crate::threads::gemm_threads;
use rayon::prelude::*;

const MR: usize = 8;
const NR: usize = 32;
/// k per cache block (pairs: KC / 2).
const KC: usize = 512;
/// Rows of `A` per thread task.
const MC: usize = 64;

/// True when the bf16 dot-product path is available on this CPU.
pub fn bf16_gemm_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out (=|+=) op(a) · op(b)` with bf16 operands and f32 accumulation; [`MatmulDims`] as
/// [`super::matmul::matmul`].
pub fn matmul_bf16(out: &mut [f32], a: &[f32], b: &[f32], d: MatmulDims) {
    matmul_bf16_with_threads(out, a, b, d, gemm_threads());
}

pub fn matmul_bf16_with_threads(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    d: MatmulDims,
    threads: usize,
) {
    let MatmulDims { m, n, k, .. } = d;
    assert_eq!(out.len(), m * n, "matmul out");
    assert_eq!(a.len(), m * k, "matmul a");
    assert_eq!(b.len(), k * n, "matmul b");
    if !bf16_gemm_available() || m == 0 || n == 0 || k == 0 {
        // Same operand rounding, f32 arithmetic.
        let ar = rounded_operand(a, Half::BF16);
        let br = rounded_operand(b, Half::BF16);
        return matmul_with_threads(out, &ar, &br, d, threads);
    }
    let kp = k.div_ceil(2); // k pairs
                            // Columns are done in blocks of NC so the packed copy of B stays small (a few MiB) even
                            // for the output layer's [vocab, hidden] weight.
    let mut bp: Vec<u32> = Vec::new();
    let mut c_blk = 0;
    while c_blk < n {
        let nc = NC.min(n - c_blk);
        pack_b(&mut bp, b, d, kp, c_blk, nc);
        gemm_block(out, a, &bp, d, kp, c_blk, nc, threads);
        c_blk += nc;
    }
}

/// Columns of `op(b)` per packing block.
const NC: usize = 1024;

/// Packs columns `[c_blk, c_blk + nc)` of `op(b)` into panels of NR columns:
/// `[panel][k pair][NR]` words.
fn pack_b(bp: &mut Vec<u32>, b: &[f32], d: MatmulDims, kp: usize, c_blk: usize, nc: usize) {
    let (n, k) = (d.n, d.k);
    let panels = nc.div_ceil(NR);
    bp.clear();
    bp.resize(panels * kp * NR, 0);
    bp.par_chunks_mut(kp * NR)
        .enumerate()
        .for_each(|(p, panel)| {
            let c0 = c_blk + p * NR;
            let cols = NR.min(c_blk + nc - c0);
            if d.trans_b {
                // b is [n, k]: column j's k values are contiguous, pairs adjacent.
                for c in 0..cols {
                    let col = &b[(c0 + c) * k..(c0 + c + 1) * k];
                    for q in 0..kp {
                        let lo = col[2 * q];
                        let hi = if 2 * q + 1 < k { col[2 * q + 1] } else { 0.0 };
                        panel[q * NR + c] = pair(lo, hi);
                    }
                }
            } else {
                // b is [k, n]: rows 2q and 2q + 1 interleave.
                for q in 0..kp {
                    let r0 = &b[2 * q * n + c0..2 * q * n + c0 + cols];
                    let dst = &mut panel[q * NR..q * NR + cols];
                    if 2 * q + 1 < k {
                        let r1 = &b[(2 * q + 1) * n + c0..(2 * q + 1) * n + c0 + cols];
                        for ((w, lo), hi) in dst.iter_mut().zip(r0).zip(r1) {
                            *w = pair(*lo, *hi);
                        }
                    } else {
                        for (w, lo) in dst.iter_mut().zip(r0) {
                            *w = pair(*lo, 0.0);
                        }
                    }
                }
            }
        });
}

/// `out[:, c_blk..c_blk + nc] (=|+=) op(a) · packed B block`, row blocks of MC in parallel.
#[allow(clippy::too_many_arguments)]
fn gemm_block(
    out: &mut [f32],
    a: &[f32],
    bp: &[u32],
    d: MatmulDims,
    kp: usize,
    c_blk: usize,
    nc: usize,
    threads: usize,
) {
    let MatmulDims { m, n, k, .. } = d;
    let panels = nc.div_ceil(NR);
    let out_ptr = SendPtr(out.as_mut_ptr());
    let blocks = m.div_ceil(MC);
    let work = |blk: usize| {
        let r0 = blk * MC;
        let rows = MC.min(m - r0);
        let groups = rows.div_ceil(MR);
        // Packed A block: [group][k pair][MR] words.
        let mut ap = vec![0u32; groups * kp * MR];
        for g in 0..groups {
            for r in 0..MR.min(rows - g * MR) {
                let i = r0 + g * MR + r;
                if d.trans_a {
                    // a is [k, m]: rows 2q and 2q + 1 of column i.
                    for q in 0..kp {
                        let lo = a[2 * q * m + i];
                        let hi = if 2 * q + 1 < k {
                            a[(2 * q + 1) * m + i]
                        } else {
                            0.0
                        };
                        ap[(g * kp + q) * MR + r] = pair(lo, hi);
                    }
                } else {
                    let row = &a[i * k..(i + 1) * k];
                    for q in 0..kp {
                        let lo = row[2 * q];
                        let hi = if 2 * q + 1 < k { row[2 * q + 1] } else { 0.0 };
                        ap[(g * kp + q) * MR + r] = pair(lo, hi);
                    }
                }
            }
        }
        let kcp = KC / 2;
        let mut tile = [0.0f32; MR * NR];
        let mut q0 = 0;
        while q0 < kp {
            let qn = kcp.min(kp - q0);
            let first = q0 == 0;
            for p in 0..panels {
                let bpanel = &bp[(p * kp + q0) * NR..(p * kp + q0 + qn) * NR];
                let c0 = c_blk + p * NR;
                let cols = NR.min(c_blk + nc - c0);
                for g in 0..groups {
                    let apanel = &ap[(g * kp + q0) * MR..(g * kp + q0 + qn) * MR];
                    let i0 = r0 + g * MR;
                    let nrows = MR.min(m - i0);
                    // SAFETY: the feature was detected by the caller.
                    unsafe { kernel_8x32(&mut tile, apanel, bpanel, qn) };
                    // SAFETY: row blocks are disjoint between tasks; in bounds by construction.
                    let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get(), m * n) };
                    for r in 0..nrows {
                        let row = &mut o[(i0 + r) * n + c0..(i0 + r) * n + c0 + cols];
                        let t = &tile[r * NR..r * NR + cols];
                        if first && !d.accumulate {
                            row.copy_from_slice(t);
                        } else {
                            row.iter_mut().zip(t).for_each(|(x, y)| *x += y);
                        }
                    }
                }
            }
            q0 += qn;
        }
    };
    if threads > 1 && blocks > 1 && m * nc * k >= 1 << 18 {
        (0..blocks)
            .into_par_iter()
            .with_min_len(blocks.div_ceil(threads.max(1)))
            .for_each(work);
    } else {
        (0..blocks).for_each(work);
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint row blocks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// f32 to bf16 bits, round to nearest even (NaN stays NaN: quiet bit set).
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        rounded
    }
}

/// Two f32 rounded to bf16 (nearest even) in one 32-bit word, `lo` in the low half.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    bf16_bits(lo) | (bf16_bits(hi) << 16)
}

/// `tile[8][32] = Σ_q a[q][r] · b[q][c]` over `qn` k-pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel_8x32(tile: &mut [f32; MR * NR], a: &[u32], b: &[u32], qn: usize) {
    use std::arch::x86_64::*;
    debug_assert!(a.len() >= qn * MR && b.len() >= qn * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let ap = a.as_ptr();
    let bp = b.as_ptr();
    for q in 0..qn {
        let b0 = _mm512_loadu_si512(bp.add(q * NR) as *const _);
        let b1 = _mm512_loadu_si512(bp.add(q * NR + 16) as *const _);
        let b0 = std::mem::transmute::<__m512i, __m512bh>(b0);
        let b1 = std::mem::transmute::<__m512i, __m512bh>(b1);
        for (r, accr) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_epi32(*ap.add(q * MR + r) as i32);
            let av = std::mem::transmute::<__m512i, __m512bh>(av);
            accr[0] = _mm512_dpbf16_ps(accr[0], av, b0);
            accr[1] = _mm512_dpbf16_ps(accr[1], av, b1);
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        _mm512_storeu_ps(tile.as_mut_ptr().add(r * NR), accr[0]);
        _mm512_storeu_ps(tile.as_mut_ptr().add(r * NR + 16), accr[1]);
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel_8x32(_: &mut [f32; MR * NR], _: &[u32], _: &[u32], _: usize) {
    unreachable!("bf16_gemm_available() is false off x86_64")
}

/// The bf16 dot-product instruction's throughput on `threads` threads (GFLOP/s counting 2 per
/// multiply-add: 64 per instruction): 16 independent accumulators, registers only. `None`
/// without AVX512_BF16. Whether bf16 pays on a CPU is this against the f32 FMA peak.
pub fn bf16_dot_peak_gflops(threads: usize) -> Option<f64> {
    if !bf16_gemm_available() {
        return None;
    }
    const ITERS: usize = 5_000_000;
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            // SAFETY: the feature was detected above.
            s.spawn(|| std::hint::black_box(unsafe { dot_loop(ITERS) }));
        }
    });
    let secs = start.elapsed().as_secs_f64();
    Some((threads.max(1) * ITERS * 16 * 64) as f64 / secs / 1e9)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_loop(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let a = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3f80_3f80));
    let b = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3c00_3c00));
    let mut acc = [_mm512_setzero_ps(); 16];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, a, std::hint::black_box(b));
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn dot_loop(_: usize) -> f32 {
    0.0
}
