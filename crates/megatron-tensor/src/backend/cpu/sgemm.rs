//! f32 GEMM on an AVX-512 register-blocked microkernel (BLIS loop order), used instead of the
//! `gemm` crate where the CPU has AVX-512.
//!
//! Why our own: measured against the `gemm` crate, alternating call by call (BENCHMARKS.md), it
//! is level on the forward GEMM, 5-10 % behind on the input gradient and 10-30 % ahead on the
//! weight gradient (`dyᵀ·x`, a transposed A with a long K), and 0-6 % ahead over a whole training
//! step; and each thread owns a contiguous range of C's rows (or columns, whichever duplicates
//! less packing), so one GEMM is one parallel dispatch and every element is summed in the same
//! order whatever the thread count: results are bit-identical across GEMM thread budgets.
//!
//! Layout: a 24 x 16 tile (24 accumulators of one vector each; each A value is the broadcast
//! operand of its FMA, so one fused load per FMA: the 12 x 32 shape with separate broadcasts ran
//! 15-20 % slower here) keeps its 24-row A micro-panel in L1 (24 KiB at kc = 256) and streams one
//! B vector per k step from a packed B block held in L2, prefetched ahead. x86-64 only;
//! elsewhere the `gemm` crate.

use super::sync_ptr::SyncPtr;
use rayon::prelude::*;
use std::cell::RefCell;

/// Rows of C per microkernel call (A values, broadcast inside the FMA).
pub(crate) const MR: usize = 24;
/// Columns of C per microkernel call (one 16-lane vector).
pub(crate) const NR: usize = 16;
/// Depth of one packed block: the A micro-panel (MR x KC) stays in L1.
const KC: usize = 256;
/// Columns of one packed B block (KC x NC = 1 MiB, held in L2).
const NC: usize = 1024;

/// A strided read-only matrix: element (i, j) at `ptr[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}
// SAFETY: read-only views shared by the GEMM's worker threads while the caller's borrow lives.
unsafe impl Send for MatRef {}
unsafe impl Sync for MatRef {}

impl MatRef {
    #[inline(always)]
    unsafe fn at(&self, i: usize, j: usize) -> *const f32 {
        self.ptr.add(i * self.rs + j * self.cs)
    }
}

/// Bytes of packing buffers each thread that runs this kernel keeps for the rest of its life
/// (the A and B panels, each with room to align to a cache line).
pub fn pack_bytes_per_thread() -> usize {
    (MR * KC + 16 + KC * NC + 16) * 4
}

/// Whether this CPU runs the AVX-512 kernel. `MEGATRON_NO_AVX512_GEMM` hides it, so that the
/// portable path (the `gemm` crate, what a CPU without AVX-512 runs) can be trained and
/// measured on any machine.
pub(crate) fn available() -> bool {
    use std::sync::OnceLock;
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::env::var_os("MEGATRON_NO_AVX512_GEMM").is_none() && is_x86_feature_detected!("avx512f")
    })
}

thread_local! {
    static PACK: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `c[m, n] (= or +=) a[m, k] · b[k, n]` with `c` row-major (row stride `ldc`). Callers check
/// [`available`] first and pass `k > 0`.
///
/// # Safety
/// `a` and `b` must describe readable matrices of `m x k` and `k x n` elements, `c` must hold
/// `(m - 1) * ldc + n` elements, and `c` must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    accumulate: bool,
    threads: usize,
) {
    let c = SyncPtr(c);
    let split_rows = split_rows(m, n, threads);
    let (len, unit) = if split_rows { (m, MR) } else { (n, NR) };
    let units = len.div_ceil(unit);
    let parts = threads.min(units).max(1);
    let run = |p: usize| {
        let lo = (units * p / parts) * unit;
        let hi = ((units * (p + 1) / parts) * unit).min(len);
        if split_rows {
            sgemm_serial(
                hi - lo,
                n,
                k,
                c.ptr().add(lo * ldc),
                ldc,
                a.shift(lo, 0),
                b,
                accumulate,
            );
        } else {
            sgemm_serial(
                m,
                hi - lo,
                k,
                c.ptr().add(lo),
                ldc,
                a,
                b.shift(0, lo),
                accumulate,
            );
        }
    };
    if parts == 1 {
        run(0);
    } else {
        (0..parts).into_par_iter().for_each(run);
    }
}

/// Whether threads split C by rows (else by columns). The busiest thread's tile count decides
/// first (a 256-row C is 10.7 tiles of 24 rows: 6 + 5 by rows, but 8 + 8 column tiles); on a
/// near tie, the split that duplicates less packing: by rows every thread packs all of B
/// (k x n), by columns all of A (m x k). Either way each element keeps its summation order.
fn split_rows(m: usize, n: usize, threads: usize) -> bool {
    let (tm, tn) = (m.div_ceil(MR), n.div_ceil(NR));
    let busiest_by_rows = tm.div_ceil(threads.min(tm).max(1)) * tn;
    let busiest_by_cols = tn.div_ceil(threads.min(tn).max(1)) * tm;
    if busiest_by_rows * 100 > busiest_by_cols * 103 {
        false
    } else if busiest_by_cols * 100 > busiest_by_rows * 103 {
        true
    } else {
        m >= n
    }
}

impl MatRef {
    unsafe fn shift(self, i: usize, j: usize) -> MatRef {
        MatRef {
            ptr: self.at(i, j),
            ..self
        }
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_serial(
    m: usize,
    n: usize,
    k: usize,
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    PACK.with(|p| {
        let (ap, bp) = &mut *p.borrow_mut();
        let ap = aligned(ap, MR * KC);
        let bp = aligned(bp, KC * NC);
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                pack_b(bp, b, pc, jc, kc, nc);
                let add = accumulate || pc > 0;
                for ir in (0..m).step_by(MR) {
                    let mr = MR.min(m - ir);
                    pack_a(ap, a, ir, pc, mr, kc);
                    for jr in (0..nc).step_by(NR) {
                        let nr = NR.min(nc - jr);
                        x86::kernel_24x16(
                            kc,
                            ap.as_ptr(),
                            bp.as_ptr().add(jr * kc),
                            c.add(ir * ldc + jc + jr),
                            ldc,
                            mr,
                            nr,
                            add,
                        );
                    }
                }
            }
        }
    });
}

/// A 64-byte aligned slice of `len` floats inside `buf`.
fn aligned(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len + 16 {
        buf.resize(len + 16, 0.0);
    }
    let off = buf.as_ptr().align_offset(64);
    &mut buf[off..off + len]
}

/// `ap[kk * MR + i] = a(ir + i, pc + kk)`, rows past `mr` zero.
unsafe fn pack_a(ap: &mut [f32], a: MatRef, ir: usize, pc: usize, mr: usize, kc: usize) {
    if a.rs == 1 {
        x86::pack_contiguous(ap.as_mut_ptr(), MR, a.at(ir, pc), a.cs, mr, kc);
    } else {
        // Rows 0..16 into lanes 0..16 of each packed row, rows 16..MR into the rest.
        let src = a.at(ir, pc);
        x86::pack_transposed_16(ap.as_mut_ptr(), MR, 16, src, a.rs, a.cs, mr.min(16), kc);
        // With no rows there (the last, short micro-panel) nothing is read: pass a pointer that
        // stays inside the matrix.
        let w = mr.saturating_sub(16);
        let src = if w > 0 { a.at(ir + 16, pc) } else { src };
        x86::pack_transposed_16(ap.as_mut_ptr().add(16), MR, MR - 16, src, a.rs, a.cs, w, kc);
    }
}

/// B block `[pc..pc+kc, jc..jc+nc]` as micro-panels of NR columns, each `[kc, NR]` row-major,
/// columns past `nc` zero.
unsafe fn pack_b(bp: &mut [f32], b: MatRef, pc: usize, jc: usize, kc: usize, nc: usize) {
    for jr in (0..nc).step_by(NR) {
        let nr = NR.min(nc - jr);
        let panel = bp.as_mut_ptr().add(jr * kc);
        if b.cs == 1 {
            x86::pack_contiguous(panel, NR, b.at(pc, jc + jr), b.rs, nr, kc);
        } else {
            let src = b.at(pc, jc + jr);
            x86::pack_transposed_16(panel, NR, NR, src, b.cs, b.rs, nr, kc);
        }
    }
}

mod x86 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    #[inline(always)]
    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    }

    /// `dst[kk * width + i] = src[kk * ld + i]` for `i < w`, zero for `w <= i < width`
    /// (`width <= 32`): an operand whose packed rows are already contiguous.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_contiguous(
        dst: *mut f32,
        width: usize,
        src: *const f32,
        ld: usize,
        w: usize,
        kc: usize,
    ) {
        let (m0, m1) = (mask(w), mask(w.saturating_sub(16)));
        let (s0, s1) = (mask(width), mask(width.saturating_sub(16)));
        for kk in 0..kc {
            let s = src.add(kk * ld);
            let d = dst.add(kk * width);
            _mm512_mask_storeu_ps(d, s0, _mm512_maskz_loadu_ps(m0, s));
            if width > 16 {
                _mm512_mask_storeu_ps(d.add(16), s1, _mm512_maskz_loadu_ps(m1, s.add(16)));
            }
        }
    }

    /// `dst[kk * ld + i] = src[i * rs + kk * cs]` for `i < w`, zero for `w <= i < lanes`
    /// (`lanes <= 16`): rows stored along k, transposed 16 k at a time in registers.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_transposed_16(
        dst: *mut f32,
        ld: usize,
        lanes: usize,
        src: *const f32,
        rs: usize,
        cs: usize,
        w: usize,
        kc: usize,
    ) {
        let store = mask(lanes);
        let mut kk = 0;
        if cs == 1 {
            while kk + 16 <= kc {
                let mut r = [_mm512_setzero_ps(); 16];
                for (i, ri) in r.iter_mut().enumerate().take(w) {
                    *ri = _mm512_loadu_ps(src.add(i * rs + kk));
                }
                let c = transpose16(r);
                for (j, cj) in c.iter().enumerate() {
                    _mm512_mask_storeu_ps(dst.add((kk + j) * ld), store, *cj);
                }
                kk += 16;
            }
        }
        for kk in kk..kc {
            let d = dst.add(kk * ld);
            for i in 0..lanes {
                *d.add(i) = if i < w {
                    *src.add(i * rs + kk * cs)
                } else {
                    0.0
                };
            }
        }
    }

    /// Transpose of a 16 x 16 block held as 16 row vectors.
    #[inline(always)]
    unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        let mut t = [_mm512_setzero_ps(); 16];
        for p in 0..8 {
            t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
            t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
        }
        // u[4q + c], 128-bit lane L: rows 4q..4q+3 of column 4L + c.
        let mut u = [_mm512_setzero_ps(); 16];
        for q in 0..4 {
            let pd = |x: __m512| _mm512_castps_pd(x);
            let (a, b) = (pd(t[4 * q]), pd(t[4 * q + 2]));
            let (c, d) = (pd(t[4 * q + 1]), pd(t[4 * q + 3]));
            u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
            u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
            u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
        }
        let mut out = [_mm512_setzero_ps(); 16];
        for c in 0..4 {
            let v_lo = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
            let v_hi = _mm512_shuffle_f32x4::<0xEE>(u[c], u[4 + c]);
            let w_lo = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
            let w_hi = _mm512_shuffle_f32x4::<0xEE>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_f32x4::<0x88>(v_lo, w_lo);
            out[4 + c] = _mm512_shuffle_f32x4::<0xDD>(v_lo, w_lo);
            out[8 + c] = _mm512_shuffle_f32x4::<0x88>(v_hi, w_hi);
            out[12 + c] = _mm512_shuffle_f32x4::<0xDD>(v_hi, w_hi);
        }
        out
    }

    const PF_B: usize = 16;

    /// `c[0..mr, 0..nr] (= or +=) Σ_kk ap[kk, 0..MR]ᵀ · bp[kk, 0..NR]`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel_24x16(
        kc: usize,
        ap: *const f32,
        bp: *const f32,
        c: *mut f32,
        ldc: usize,
        mr: usize,
        nr: usize,
        add: bool,
    ) {
        // The C tile is read (or written) once at the end: start fetching it now.
        for i in 0..mr {
            _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc) as *const i8);
        }
        let mut acc = [_mm512_setzero_ps(); MR];
        let mut a = ap;
        let mut b = bp;
        for _ in 0..kc {
            // B streams from L2: ask for it PF_B k steps ahead.
            // `wrapping_add`: near the panel's end this address lies past the buffer (a prefetch
            // never faults, but an out-of-bounds `add` is undefined).
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PF_B * NR) as *const i8);
            let bv = _mm512_loadu_ps(b);
            for (i, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(*a.add(i)), bv, *acc);
            }
            a = a.add(MR);
            b = b.add(NR);
        }
        let m = mask(nr);
        for (i, acc) in acc.iter().enumerate().take(mr) {
            let p = c.add(i * ldc);
            let v = if add {
                _mm512_add_ps(*acc, _mm512_maskz_loadu_ps(m, p))
            } else {
                *acc
            };
            _mm512_mask_storeu_ps(p, m, v);
        }
    }
}
