//! The small matrix products inside attention tiles, and the packing that feeds them.
//!
//! A general GEMM call costs more in set-up and packing than a `64 x 64 x 64` tile is worth, and
//! a plain Rust loop keeps its accumulators in memory (a store-to-load chain per step). Instead,
//! each (batch, head) task packs K, V, Q, dO once into contiguous (and where needed transposed)
//! panels, and every tile product runs a register-blocked AVX-512 microkernel (4 rows x 64
//! columns of accumulators) straight from those panels, with a portable loop for other widths.

/// Copies `rows` rows of `width` elements (row stride `stride`) into a contiguous
/// `[rows, width]` panel.
#[inline(always)]
pub(crate) fn pack_rows(dst: &mut Vec<f32>, src: &[f32], stride: usize, rows: usize, width: usize) {
    dst.clear();
    dst.reserve(rows * width);
    for r in 0..rows {
        dst.extend_from_slice(&src[r * stride..r * stride + width]);
    }
}

/// Copies `rows` rows of `width` elements (row stride `stride`), transposed and scaled, into a
/// contiguous `[width, rows]` panel.
#[inline(always)]
pub(crate) fn pack_transposed(
    dst: &mut Vec<f32>,
    src: &[f32],
    stride: usize,
    rows: usize,
    width: usize,
    scale: f32,
) {
    dst.clear();
    dst.resize(rows * width, 0.0);
    for r in 0..rows {
        let row = &src[r * stride..r * stride + width];
        for (p, v) in row.iter().enumerate() {
            dst[p * rows + r] = v * scale;
        }
    }
}

/// `out[m, n] (= or +=) a[m, k] · b[k, n]`; `a` by row and column strides, `b` a packed panel
/// with row stride `ldb` (unit column stride). Meant to be inlined into a `multiversion!` kernel.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_matmul(
    out: &mut [f32],
    out_rs: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    ldb: usize,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(out.len() >= (m - 1) * out_rs + n);
    assert!(k == 0 || a.len() > (m - 1) * a_rs + (k - 1) * a_cs);
    assert!(k == 0 || b.len() >= (k - 1) * ldb + n);
    #[cfg(target_arch = "x86_64")]
    {
        if n == 64 && super::simd::level() == super::simd::Level::V4 {
            // SAFETY: AVX-512 was detected; the asserts above bound every access.
            unsafe { x86::tile64_avx512(out, out_rs, a, a_rs, a_cs, b, ldb, m, k, accumulate) };
            return;
        }
    }
    for i in 0..m {
        let orow = &mut out[i * out_rs..i * out_rs + n];
        if !accumulate {
            orow.fill(0.0);
        }
        for p in 0..k {
            let av = a[i * a_rs + p * a_cs];
            for (o, bv) in orow.iter_mut().zip(&b[p * ldb..p * ldb + n]) {
                *o += av * bv;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile64_avx512(
        out: &mut [f32],
        out_rs: usize,
        a: &[f32],
        a_rs: usize,
        a_cs: usize,
        b: &[f32],
        ldb: usize,
        m: usize,
        k: usize,
        accumulate: bool,
    ) {
        let op = out.as_mut_ptr();
        let ap = a.as_ptr();
        let bp = b.as_ptr();
        let mut i = 0;
        while i < m {
            let rows = (m - i).min(4);
            let mut acc = [[_mm512_setzero_ps(); 4]; 4];
            if accumulate {
                for (r, accr) in acc.iter_mut().enumerate().take(rows) {
                    for (q, v) in accr.iter_mut().enumerate() {
                        *v = _mm512_loadu_ps(op.add((i + r) * out_rs + 16 * q));
                    }
                }
            }
            if rows == 4 {
                for p in 0..k {
                    let row = bp.add(p * ldb);
                    let b0 = _mm512_loadu_ps(row);
                    let b1 = _mm512_loadu_ps(row.add(16));
                    let b2 = _mm512_loadu_ps(row.add(32));
                    let b3 = _mm512_loadu_ps(row.add(48));
                    for (r, accr) in acc.iter_mut().enumerate() {
                        let av = _mm512_set1_ps(*ap.add((i + r) * a_rs + p * a_cs));
                        accr[0] = _mm512_fmadd_ps(av, b0, accr[0]);
                        accr[1] = _mm512_fmadd_ps(av, b1, accr[1]);
                        accr[2] = _mm512_fmadd_ps(av, b2, accr[2]);
                        accr[3] = _mm512_fmadd_ps(av, b3, accr[3]);
                    }
                }
            } else {
                for p in 0..k {
                    let row = bp.add(p * ldb);
                    let b0 = _mm512_loadu_ps(row);
                    let b1 = _mm512_loadu_ps(row.add(16));
                    let b2 = _mm512_loadu_ps(row.add(32));
                    let b3 = _mm512_loadu_ps(row.add(48));
                    for (r, accr) in acc.iter_mut().enumerate().take(rows) {
                        let av = _mm512_set1_ps(*ap.add((i + r) * a_rs + p * a_cs));
                        accr[0] = _mm512_fmadd_ps(av, b0, accr[0]);
                        accr[1] = _mm512_fmadd_ps(av, b1, accr[1]);
                        accr[2] = _mm512_fmadd_ps(av, b2, accr[2]);
                        accr[3] = _mm512_fmadd_ps(av, b3, accr[3]);
                    }
                }
            }
            for (r, accr) in acc.iter().enumerate().take(rows) {
                for (q, v) in accr.iter().enumerate() {
                    _mm512_storeu_ps(op.add((i + r) * out_rs + 16 * q), *v);
                }
            }
            i += rows;
        }
    }
}
