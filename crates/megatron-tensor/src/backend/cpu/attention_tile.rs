//! The small matrix products inside attention tiles.
//!
//! A general GEMM call costs more in set-up and packing than a `64 x 64 x 64` tile is worth, and
//! a plain Rust loop keeps its accumulators in memory (a store-to-load chain per step). This
//! packs `b` once and runs a register-blocked AVX-512 microkernel (4 rows x 64 columns of
//! accumulators) for 64-wide tiles, with a portable loop for everything else.

/// `out[m, n] (= or +=) beta * a[m, k] · b[k, n]`, operands given by row and column strides into
/// the fused QKV / output buffers. Meant to be inlined into a `multiversion!` kernel.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_matmul(
    pack: &mut Vec<f32>,
    out: &mut [f32],
    out_rs: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    b_rs: usize,
    b_cs: usize,
    m: usize,
    n: usize,
    k: usize,
    beta: f32,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(out.len() >= (m - 1) * out_rs + n);
    assert!(k == 0 || a.len() > (m - 1) * a_rs + (k - 1) * a_cs);
    assert!(k == 0 || b.len() > (k - 1) * b_rs + (n - 1) * b_cs);
    pack.clear();
    pack.resize(k * n, 0.0);
    for p in 0..k {
        let row = &mut pack[p * n..(p + 1) * n];
        if b_cs == 1 {
            for (v, x) in row.iter_mut().zip(&b[p * b_rs..p * b_rs + n]) {
                *v = x * beta;
            }
        } else {
            for (j, v) in row.iter_mut().enumerate() {
                *v = b[p * b_rs + j * b_cs] * beta;
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        if n == 64 && super::simd::level() == super::simd::Level::V4 {
            // SAFETY: AVX-512 was detected; the asserts above bound every access.
            unsafe { x86::tile64_avx512(out, out_rs, a, a_rs, a_cs, pack, m, k, accumulate) };
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
            for (o, bv) in orow.iter_mut().zip(&pack[p * n..(p + 1) * n]) {
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
        pack: &[f32],
        m: usize,
        k: usize,
        accumulate: bool,
    ) {
        let op = out.as_mut_ptr();
        let ap = a.as_ptr();
        let bp = pack.as_ptr();
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
                    let b0 = _mm512_loadu_ps(bp.add(p * 64));
                    let b1 = _mm512_loadu_ps(bp.add(p * 64 + 16));
                    let b2 = _mm512_loadu_ps(bp.add(p * 64 + 32));
                    let b3 = _mm512_loadu_ps(bp.add(p * 64 + 48));
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
                    let b0 = _mm512_loadu_ps(bp.add(p * 64));
                    let b1 = _mm512_loadu_ps(bp.add(p * 64 + 16));
                    let b2 = _mm512_loadu_ps(bp.add(p * 64 + 32));
                    let b3 = _mm512_loadu_ps(bp.add(p * 64 + 48));
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
