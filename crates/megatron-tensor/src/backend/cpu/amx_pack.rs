//! Operands of the AMX GEMM (`matmul_amx.rs`) rounded to bf16 (nearest even) and packed into
//! the tile layouts: A tile-contiguous (`[k step][2 tiles][16 rows][16 words]` per 32-row
//! block), B in VNNI panels (`[k pair][32 words]` per 32 columns), a word being the bf16 values
//! of k = 2q (low half) and 2q + 1 (high half). Zero beyond the matrix, so every tile is whole.
//!
//! Packing converts every operand value once per call, which at AMX speed is a large share of
//! a GEMM: the AVX-512 paths convert 16 or 32 values per instruction (`vcvtne2ps2bf16`); the
//! scalar paths are for CPUs without AVX512_BF16 (none has AMX without it, but the layout is
//! tested on them too).

use super::matmul::MatmulDims;
use std::sync::OnceLock;

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

    /// `words` zeroed words (a multiple of 16), starting on a cache line.
    pub(crate) fn zeroed(&mut self, words: usize) -> &mut [u32] {
        debug_assert_eq!(words % 16, 0);
        self.0.clear();
        self.0.resize(words / 16, TileRow([0; 16]));
        // SAFETY: `TileRow` is exactly 16 `u32` (repr(C), no padding), so the Vec's storage is
        // `words` initialised `u32`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut u32, words) }
    }
}

fn simd() -> bool {
    static SIMD: OnceLock<bool> = OnceLock::new();
    *SIMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bf16")
                && is_x86_feature_detected!("avx512bw")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Index of (row `r` of the block, k pair `q`) in a packed A block.
#[inline(always)]
fn a_index(r: usize, q: usize) -> usize {
    ((q / KB) * 2 + r / 16) * 256 + (r % 16) * KB + q % KB
}

/// f32 to bf16 bits, round to nearest even (NaN stays NaN: quiet bit set).
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16
    }
}

/// Two f32 rounded to bf16 in one word, `lo` (the even k) in the low half.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    bf16_bits(lo) | (bf16_bits(hi) << 16)
}

/// Packs rows `[r0, r0 + 32)` of `op(a)` into `dst` (`steps` k steps; dst arrives zeroed).
pub(crate) fn pack_a(dst: &mut [u32], a: &[f32], d: MatmulDims, r0: usize, steps: usize) {
    debug_assert_eq!(dst.len(), steps * A_STEP);
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX-512F/BW/BF16 detected; indices in bounds as for the scalar path.
        return unsafe { pack_a_avx512(dst, a, d, r0, steps) };
    }
    pack_a_scalar(dst, a, d, r0, steps)
}

fn pack_a_scalar(dst: &mut [u32], a: &[f32], d: MatmulDims, r0: usize, steps: usize) {
    let MatmulDims { m, k, .. } = d;
    let rows = MB.min(m - r0);
    let kp = k.div_ceil(2);
    if d.trans_a {
        // a is [k, m]: rows 2q and 2q + 1 hold the pair for every row of op(a).
        for q in 0..kp {
            let lo = &a[2 * q * m + r0..2 * q * m + r0 + rows];
            for (r, l) in lo.iter().enumerate() {
                let h = if 2 * q + 1 < k {
                    a[(2 * q + 1) * m + r0 + r]
                } else {
                    0.0
                };
                dst[a_index(r, q)] = pair(*l, h);
            }
        }
    } else {
        for r in 0..rows {
            let row = &a[(r0 + r) * k..(r0 + r + 1) * k];
            for s in 0..steps {
                let src = &row[(s * 2 * KB).min(k)..((s + 1) * 2 * KB).min(k)];
                let at = a_index(r, s * KB);
                for (q, p) in src.chunks(2).enumerate() {
                    dst[at + q] = pair(p[0], p.get(1).copied().unwrap_or(0.0));
                }
            }
        }
    }
}

/// Packs columns `[c0, min(c0 + 32, c_end))` of `op(b)` into one panel `[k pair][32 words]`
/// (dst arrives zeroed).
pub(crate) fn pack_b(dst: &mut [u32], b: &[f32], d: MatmulDims, c0: usize, c_end: usize) {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX-512F/BW/BF16 detected; indices in bounds as for the scalar path.
        return unsafe { pack_b_avx512(dst, b, d, c0, c_end) };
    }
    pack_b_scalar(dst, b, d, c0, c_end)
}

fn pack_b_scalar(dst: &mut [u32], b: &[f32], d: MatmulDims, c0: usize, c_end: usize) {
    let MatmulDims { n, k, .. } = d;
    let cols = NB.min(c_end - c0);
    let kp = k.div_ceil(2);
    if d.trans_b {
        // b is [n, k]: column c's k values are contiguous, pairs adjacent.
        for c in 0..cols {
            let col = &b[(c0 + c) * k..(c0 + c + 1) * k];
            for (q, p) in col.chunks(2).enumerate() {
                dst[q * NB + c] = pair(p[0], p.get(1).copied().unwrap_or(0.0));
            }
        }
    } else {
        // b is [k, n]: rows 2q and 2q + 1 interleave.
        for q in 0..kp {
            let lo = &b[2 * q * n + c0..2 * q * n + c0 + cols];
            for (c, l) in lo.iter().enumerate() {
                let h = if 2 * q + 1 < k {
                    b[(2 * q + 1) * n + c0 + c]
                } else {
                    0.0
                };
                dst[q * NB + c] = pair(*l, h);
            }
        }
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

    /// Up to 16 f32 from `p` (zero past `len`).
    ///
    /// # Safety
    /// AVX-512F; `p..p + min(len, 16)` readable.
    #[inline(always)]
    pub(super) unsafe fn load(p: *const f32, len: usize) -> __m512 {
        _mm512_maskz_loadu_ps(lanes(len), p)
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
/// AVX-512F/BW and AVX512_BF16; `dst.len() == steps * A_STEP`, rows `r0..` of `op(a)` exist.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a_avx512(dst: &mut [u32], a: &[f32], d: MatmulDims, r0: usize, steps: usize) {
    use avx512::*;
    use std::arch::x86_64::*;
    let MatmulDims { m, k, .. } = d;
    let rows = MB.min(m - r0);
    let kp = k.div_ceil(2);
    let out = dst.as_mut_ptr();
    if d.trans_a {
        // 16 rows of op(a) per vector; their words go 16 words apart in the packed tile.
        let stride = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(KB as i32),
        );
        for q in 0..kp {
            let even = a.as_ptr().add(2 * q * m + r0);
            let odd = a.as_ptr().add((2 * q + 1) * m + r0);
            for h in (0..rows).step_by(16) {
                let len = 16.min(rows - h);
                let e = load(even.add(h), len);
                let o = if 2 * q + 1 < k {
                    load(odd.add(h), len)
                } else {
                    _mm512_setzero_ps()
                };
                let w = pairs_of_rows(e, o);
                let base = out.add(a_index(h, q)) as *mut i32;
                _mm512_mask_i32scatter_epi32::<4>(base as *mut _, lanes(len), stride, w);
            }
        }
    } else {
        for r in 0..rows {
            let row = a.as_ptr().add((r0 + r) * k);
            for s in 0..steps {
                let k0 = s * 2 * KB;
                let len = k.saturating_sub(k0).min(2 * KB);
                let lo = load(row.add(k0), len);
                let hi = load(row.add(k0 + 16), len.saturating_sub(16));
                let w = pairs_of_run(lo, hi);
                _mm512_storeu_si512(out.add(a_index(r, s * KB)) as *mut _, w);
            }
        }
    }
}

/// # Safety
/// AVX-512F/BW and AVX512_BF16; `dst` holds a whole panel, columns `c0..c_end` of `op(b)` exist.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b_avx512(dst: &mut [u32], b: &[f32], d: MatmulDims, c0: usize, c_end: usize) {
    use avx512::*;
    use std::arch::x86_64::*;
    let MatmulDims { n, k, .. } = d;
    let cols = NB.min(c_end - c0);
    let kp = k.div_ceil(2);
    let out = dst.as_mut_ptr();
    if d.trans_b {
        // Column c: 32 consecutive k make 16 words, one per k-pair row (NB words apart).
        let stride = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(NB as i32),
        );
        for c in 0..cols {
            let col = b.as_ptr().add((c0 + c) * k);
            for q0 in (0..kp).step_by(KB) {
                let k0 = 2 * q0;
                let len = (k - k0).min(2 * KB);
                let lo = load(col.add(k0), len);
                let hi = load(col.add(k0 + 16), len.saturating_sub(16));
                let w = pairs_of_run(lo, hi);
                let words = (kp - q0).min(KB);
                let base = out.add(q0 * NB + c) as *mut i32;
                _mm512_mask_i32scatter_epi32::<4>(base as *mut _, lanes(words), stride, w);
            }
        }
    } else {
        for q in 0..kp {
            let even = b.as_ptr().add(2 * q * n + c0);
            let odd = b.as_ptr().add((2 * q + 1) * n + c0);
            for h in (0..cols).step_by(16) {
                let len = 16.min(cols - h);
                let e = load(even.add(h), len);
                let o = if 2 * q + 1 < k {
                    load(odd.add(h), len)
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
