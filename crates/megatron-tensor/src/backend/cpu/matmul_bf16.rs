//! bf16 matrix multiply with f32 accumulation on the CPU's bf16 dot-product instruction
//! (`vdpbf16ps`, AVX512_BF16: AMD Zen 4/5, Intel Cooper Lake and later): each instruction
//! multiplies 16 pairs of bf16 and adds both products to 16 f32 accumulators, twice the
//! multiply-adds of an f32 FMA. Operands are packed (and rounded, nearest even) exactly as for
//! the AMX tiles (`matmul_packed.rs`), and this kernel computes the same 32 x 32 blocks from
//! the same packed words: a `--bf16` model gets the same packing, prepacked weights and
//! bf16-operand reads whichever instruction the CPU has. Without the instruction the f32 GEMM
//! runs on rounded operands.

use super::cast::Half;
use super::matmul::{matmul_with_threads, rounded_operand, MatmulDims};
use super::matmul_packed::{matmul_packed_of, BlockKernel, CBlock};

/// True when the bf16 dot-product path is available on this CPU (its packers also use
/// AVX-512BW, which every AVX512_BF16 CPU has).
pub fn bf16_gemm_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx512bf16")
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out (=|+=) op(a) · op(b)` with bf16 operands and f32 accumulation on `threads` threads;
/// [`MatmulDims`] as [`super::matmul::matmul`].
pub fn matmul_bf16_with_threads(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    d: MatmulDims,
    threads: usize,
) {
    if !bf16_gemm_available() {
        // Same operand rounding, f32 arithmetic.
        let ar = rounded_operand(a, Half::BF16);
        let br = rounded_operand(b, Half::BF16);
        return matmul_with_threads(out, &ar, &br, d, threads);
    }
    matmul_packed_of(out, a, b, d, threads, BlockKernel::DotProduct);
}

/// `C (=|+=) Σ_steps a · b` on one packed 32 x 32 block ([`BlockKernel::block_32x32`]'s
/// contract), as four passes of 8 rows x 32 columns: 16 accumulators, each k pair two loads of
/// B and 8 broadcasts of A words. Passes past `rows` are skipped. Each output element is the
/// sum over k in order, as the tile kernel's is.
///
/// # Safety
/// AVX-512F and AVX512_BF16; `a` points at `steps` k steps of a packed 32-row A block, `b` at
/// `steps * 16` rows of 32 words; C's first `rows` (rounded up to 8) rows of 32 f32 are
/// writable (and readable) at `row_bytes` apart; `steps >= 1`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn dot_kernel_32x32(
    c: CBlock,
    a: *const u32,
    b: *const u32,
    steps: usize,
    rows: usize,
) {
    use super::amx_pack::{A_STEP, KB, NB};
    use std::arch::x86_64::*;
    const PASS: usize = 8;
    let (ptr, row_bytes, accumulate) = c.parts();
    let ldc = row_bytes / 4;
    for pass in 0..rows.min(32).div_ceil(PASS) {
        // Rows 8 * pass.. sit in A tile pass / 2, 16 words per row, KB words per k step.
        let a0 = a.add((pass / 2) * 16 * KB + (pass % 2) * PASS * KB);
        let c0 = ptr.add(pass * PASS * ldc);
        let mut acc = [[_mm512_setzero_ps(); 2]; PASS];
        if accumulate {
            for (r, accr) in acc.iter_mut().enumerate() {
                accr[0] = _mm512_loadu_ps(c0.add(r * ldc));
                accr[1] = _mm512_loadu_ps(c0.add(r * ldc + 16));
            }
        }
        for s in 0..steps {
            let a_s = a0.add(s * A_STEP);
            let b_s = b.add(s * KB * NB);
            for q in 0..KB {
                let b0 = _mm512_loadu_si512(b_s.add(q * NB) as *const _);
                let b1 = _mm512_loadu_si512(b_s.add(q * NB + 16) as *const _);
                let b0 = std::mem::transmute::<__m512i, __m512bh>(b0);
                let b1 = std::mem::transmute::<__m512i, __m512bh>(b1);
                for (r, accr) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_epi32(*a_s.add(r * KB + q) as i32);
                    let av = std::mem::transmute::<__m512i, __m512bh>(av);
                    accr[0] = _mm512_dpbf16_ps(accr[0], b0, av);
                    accr[1] = _mm512_dpbf16_ps(accr[1], b1, av);
                }
            }
        }
        for (r, accr) in acc.iter().enumerate() {
            _mm512_storeu_ps(c0.add(r * ldc), accr[0]);
            _mm512_storeu_ps(c0.add(r * ldc + 16), accr[1]);
        }
    }
}

/// The bf16 dot-product instruction's throughput on `threads` threads (GFLOP/s counting 2 per
/// multiply-add: 64 per instruction): 16 independent accumulators, registers only. `None`
/// without AVX512_BF16. The MFU of a `--bf16` run whose matmuls run on this instruction is
/// against this peak.
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
    // The operands are opaque once, outside the loop (inside, `black_box` made every
    // instruction wait on a store and reload, and the loop measured a third of the rate).
    let a = std::mem::transmute::<__m512i, __m512bh>(std::hint::black_box(_mm512_set1_epi32(
        0x3f80_3f80,
    )));
    let b = std::mem::transmute::<__m512i, __m512bh>(std::hint::black_box(_mm512_set1_epi32(
        0x3c00_3c00,
    )));
    let mut acc = [_mm512_setzero_ps(); 16];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, a, b);
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
