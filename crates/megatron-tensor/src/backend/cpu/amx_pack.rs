//! Operands of the packed bf16 GEMM (`matmul_packed.rs`: AMX tiles and the dot-product kernel)
//! rounded to bf16 (nearest even) and packed into the tile layouts: A tile-contiguous (`[k step][2 tiles][16 rows][16 words]` per 32-row
//! block), B in VNNI panels (`[k pair][32 words]` per 32 columns), a word being the bf16 values
//! of k = 2q (low half) and 2q + 1 (high half). Zero beyond the matrix, so every tile is whole.
//!
//! Packing converts every operand value once per call, which at AMX speed is a large share of
//! a GEMM: AVX-512 converts 16 or 32 values per instruction (`vcvtne2ps2bf16`, round to
//! nearest even, NaN kept) and transposes 16 x 16 word blocks in registers where the operand
//! runs the other way. Both packed kernels require AVX512_BF16 and AVX-512BW
//! (`bf16_gemm_available()`, which `amx_available()` also checks): every AMX CPU has them.

use super::matmul::MatmulDims;
use half::bf16;

/// An element type the packers read: f32 (rounded to bf16 while packing) or bf16 (activations
/// and weights already kept in bf16, read at half the bytes and without a widening copy; the
/// packed words are the same bits either way, since rounding a bf16 value is exact).
pub(crate) trait PackElem: Copy + Send + Sync + 'static {
    /// Up to 16 values from `p` as f32 (zero past `len`).
    ///
    /// # Safety
    /// AVX-512F/BW; `p..p + min(len, 16)` readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self, len: usize) -> std::arch::x86_64::__m512;
}

impl PackElem for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32, len: usize) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_maskz_loadu_ps(avx512::lanes(len), p) }
    }
}

impl PackElem for bf16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16, len: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; a masked load reads only the first `len` halves, and a
        // bf16 widens to f32 by a 16-bit shift.
        unsafe {
            let w = _mm512_maskz_loadu_epi16(avx512::lanes(len) as __mmask32, p as *const i16);
            let x = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(w));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x))
        }
    }
}

/// Rows of C per kernel call (two A tiles).
pub(crate) const MB: usize = 32;
/// Columns of C per kernel call and per packed B panel (two B tiles).
pub(crate) const NB: usize = 32;
/// k pairs per tile (32 bf16 values of k).
pub(crate) const KB: usize = 16;
/// Words per packed A k step: two tiles of 16 rows x 16 words.
pub(crate) const A_STEP: usize = 2 * 16 * KB;

/// One tile row (64 bytes). Packed buffers are made of these so every tile row starts a cache
/// line: unaligned rows made tile loads touch two lines each and halved the kernel's speed.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TileRow([u32; 16]);

/// A reusable, 64-byte-aligned buffer of packed words.
pub(crate) struct PackBuffer(Vec<TileRow>);

impl PackBuffer {
    pub(crate) const fn new() -> Self {
        PackBuffer(Vec::new())
    }

    /// The packed words.
    pub(crate) fn words(&self) -> &[u32] {
        // SAFETY: as in `zeroed`: the storage is `16 * len` initialised `u32`.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u32, self.0.len() * 16) }
    }

    /// `words` zeroed words (a multiple of 16), starting on a cache line. The buffer grows to
    /// exactly the largest request (not the Vec's doubling), so what a thread keeps is the
    /// largest packed operand it has seen, which the memory prediction computes
    /// ([`super::matmul_packed::packed_gemm_bytes`]).
    pub(crate) fn zeroed(&mut self, words: usize) -> &mut [u32] {
        debug_assert_eq!(words % 16, 0);
        self.0.clear();
        self.0.reserve_exact(words / 16);
        self.0.resize(words / 16, TileRow([0; 16]));
        // SAFETY: `TileRow` is exactly 16 `u32` (repr(C), no padding), so the Vec's storage is
        // `words` initialised `u32`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut u32, words) }
    }
}

/// Index of (row `r` of the block, k pair `q`) in a packed A block.
#[inline(always)]
fn a_index(r: usize, q: usize) -> usize {
    ((q / KB) * 2 + r / 16) * 256 + (r % 16) * KB + q % KB
}

/// Packs rows `[r0, r0 + 32)` of `op(a)` into `dst` (`steps` k steps; dst arrives zeroed).
/// `lda` is the distance between stored rows of `a` (`k`, or `m` with `trans_a`, for a dense
/// matrix; more for a view into a wider one, such as one head of a fused QKV row).
pub(crate) fn pack_a<T: PackElem>(
    dst: &mut [u32],
    a: &[T],
    d: MatmulDims,
    lda: usize,
    r0: usize,
    steps: usize,
) {
    debug_assert_eq!(dst.len(), steps * A_STEP);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F/BW/BF16 are checked by `BlockKernel::available()` (both kernels), the
    // only way here (`PackedB::new` checks the dot-product kernel's); `dst` holds
    // `steps` k steps of a 32-row block and rows `r0..` of `op(a)` exist (the caller's blocks).
    unsafe {
        pack_a_avx512(dst, a, d, lda, r0, steps)
    }
}

/// Packs columns `[c0, min(c0 + 32, c_end))` of `op(b)` into one panel `[k pair][32 words]`
/// (dst arrives zeroed). `ldb` is the distance between stored rows of `b` (as `lda` of
/// [`pack_a`]).
pub(crate) fn pack_b<T: PackElem>(
    dst: &mut [u32],
    b: &[T],
    d: MatmulDims,
    ldb: usize,
    c0: usize,
    c_end: usize,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as for `pack_a`; `dst` is one whole panel of columns `c0..c_end` of `op(b)`.
    unsafe {
        pack_b_avx512(dst, b, d, ldb, c0, c_end)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Mask of the first `len` (at most 16) lanes.
    #[inline(always)]
    pub(super) fn lanes(len: usize) -> __mmask16 {
        if len >= 16 {
            0xFFFF
        } else {
            ((1u32 << len) - 1) as __mmask16
        }
    }

    /// 32 consecutive f32 (k order) as 16 words of bf16 pairs, in k order.
    ///
    /// # Safety
    /// AVX-512F and AVX512_BF16.
    #[inline(always)]
    pub(super) unsafe fn pairs_of_run(lo16: __m512, hi16: __m512) -> __m512i {
        // dst bf16 lanes 0..16 from the second operand, 16..32 from the first.
        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi16, lo16))
    }

    /// Transposes a 16 x 16 block of 32-bit words held as 16 vectors (rows) into columns.
    ///
    /// # Safety
    /// AVX-512F.
    #[inline(always)]
    pub(super) unsafe fn transpose16(r: &[__m512i; 16]) -> [__m512i; 16] {
        // After the two unpack stages, u[4g + c] holds, in 128-bit lane L, column 4L + c of
        // rows 4g..4g + 4; two lane shuffles gather lane L of the four groups.
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
            u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
            u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
            u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let x = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]);
            let y = _mm512_shuffle_i32x4::<0xdd>(u[c], u[4 + c]);
            let x2 = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
            let y2 = _mm512_shuffle_i32x4::<0xdd>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_i32x4::<0x88>(x, x2);
            out[8 + c] = _mm512_shuffle_i32x4::<0xdd>(x, x2);
            out[4 + c] = _mm512_shuffle_i32x4::<0x88>(y, y2);
            out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(y, y2);
        }
        out
    }

    /// 16 words, word j = (bf16 of `even[j]`, bf16 of `odd[j]`).
    ///
    /// # Safety
    /// AVX-512F and AVX512_BF16.
    #[inline(always)]
    pub(super) unsafe fn pairs_of_rows(even: __m512, odd: __m512) -> __m512i {
        let e = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(even));
        let o = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(odd));
        _mm512_or_si512(
            _mm512_cvtepu16_epi32(e),
            _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(o)),
        )
    }
}

/// # Safety
/// AVX-512F/BW and AVX512_BF16; `dst.len() == steps * A_STEP`, rows `r0..` of `op(a)` exist
/// `lda` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a_avx512<T: PackElem>(
    dst: &mut [u32],
    a: &[T],
    d: MatmulDims,
    lda: usize,
    r0: usize,
    steps: usize,
) {
    use avx512::*;
    use std::arch::x86_64::*;
    let MatmulDims { m, k, .. } = d;
    let rows = MB.min(m - r0);
    let kp = k.div_ceil(2);
    let out = dst.as_mut_ptr();
    if d.trans_a {
        // 16 k pairs x 16 rows of op(a) at a time: pairs of a's rows 2q, 2q + 1 (contiguous
        // over op(a)'s rows), transposed in registers so each row's 16 words store at once.
        for h in (0..rows).step_by(16) {
            let len = 16.min(rows - h);
            for q0 in (0..kp).step_by(KB) {
                let mut block = [_mm512_setzero_si512(); 16];
                for (qq, v) in block.iter_mut().enumerate().take(kp - q0) {
                    let q = q0 + qq;
                    let e = T::load16(a.as_ptr().add(2 * q * lda + r0 + h), len);
                    let o = if 2 * q + 1 < k {
                        T::load16(a.as_ptr().add((2 * q + 1) * lda + r0 + h), len)
                    } else {
                        _mm512_setzero_ps()
                    };
                    *v = pairs_of_rows(e, o);
                }
                let rows_words = transpose16(&block);
                for (j, w) in rows_words.iter().enumerate().take(len) {
                    _mm512_storeu_si512(out.add(a_index(h + j, q0)) as *mut _, *w);
                }
            }
        }
    } else {
        for r in 0..rows {
            let row = a.as_ptr().add((r0 + r) * lda);
            for s in 0..steps {
                let k0 = s * 2 * KB;
                let len = k.saturating_sub(k0).min(2 * KB);
                let lo = T::load16(row.add(k0), len);
                let hi = T::load16(row.add(k0 + 16), len.saturating_sub(16));
                let w = pairs_of_run(lo, hi);
                _mm512_storeu_si512(out.add(a_index(r, s * KB)) as *mut _, w);
            }
        }
    }
}

/// # Safety
/// AVX-512F/BW and AVX512_BF16; `dst` holds a whole panel, columns `c0..c_end` of `op(b)` exist
/// (stored rows `ldb` apart).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b_avx512<T: PackElem>(
    dst: &mut [u32],
    b: &[T],
    d: MatmulDims,
    ldb: usize,
    c0: usize,
    c_end: usize,
) {
    use avx512::*;
    use std::arch::x86_64::*;
    let k = d.k;
    let cols = NB.min(c_end - c0);
    let kp = k.div_ceil(2);
    let out = dst.as_mut_ptr();
    if d.trans_b {
        // Column c: 32 consecutive k make 16 words (k pairs q0..q0 + 16); 16 columns are
        // transposed in registers so each k-pair row's 16 words store at once.
        for h in (0..cols).step_by(16) {
            let ncols = 16.min(cols - h);
            for q0 in (0..kp).step_by(KB) {
                let k0 = 2 * q0;
                let len = (k - k0).min(2 * KB);
                let mut block = [_mm512_setzero_si512(); 16];
                for (cc, v) in block.iter_mut().enumerate().take(ncols) {
                    let col = b.as_ptr().add((c0 + h + cc) * ldb + k0);
                    *v = pairs_of_run(
                        T::load16(col, len),
                        T::load16(col.add(16), len.saturating_sub(16)),
                    );
                }
                let pair_rows = transpose16(&block);
                for (qq, w) in pair_rows.iter().enumerate().take(kp - q0) {
                    _mm512_storeu_si512(out.add((q0 + qq) * NB + h) as *mut _, *w);
                }
            }
        }
    } else {
        for q in 0..kp {
            let even = b.as_ptr().add(2 * q * ldb + c0);
            let odd = b.as_ptr().add((2 * q + 1) * ldb + c0);
            for h in (0..cols).step_by(16) {
                let len = 16.min(cols - h);
                let e = T::load16(even.add(h), len);
                let o = if 2 * q + 1 < k {
                    T::load16(odd.add(h), len)
                } else {
                    _mm512_setzero_ps()
                };
                _mm512_mask_storeu_epi32(
                    out.add(q * NB + h) as *mut _,
                    lanes(len),
                    pairs_of_rows(e, o),
                );
            }
        }
    }
}
