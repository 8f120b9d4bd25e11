//! bf16 matrix multiply with f32 accumulation on Intel AMX tiles (`tdpbf16ps`: a 16 x 16 f32
//! tile += 16 x 32 bf16 · 32 x 16 bf16, 16,384 flop per instruction, about 8-16x a core's f32
//! FMA rate): the tile kernel of one packed 32 x 32 block and the unit's peak. Packing, blocking
//! and threads are the packed GEMM's (`matmul_packed.rs`), shared with the dot-product kernel.
//!
//! C's 32 x 32 block is held in four accumulator tiles (tmm0-3) over the whole of k, A as two
//! 16-row tiles (tmm4-5) and B as two 16-column tiles (tmm6-7) per 32-deep k step.
//! `tdpbf16ps` treats bf16 subnormal inputs as zero and does not read MXCSR.

use super::amx::{amx_available, configure_tiles};
use super::matmul::MatmulDims;
use super::matmul_packed::{matmul_packed_of, BlockKernel, CBlock};

/// `out (=|+=) op(a) · op(b)` with bf16 operands and f32 accumulation on AMX tiles;
/// [`MatmulDims`] as [`super::matmul::matmul`]. Without AMX the bf16 dot-product kernel runs
/// (and without that, the rounded-operand f32 GEMM).
pub fn matmul_amx_with_threads(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    d: MatmulDims,
    threads: usize,
) {
    if !amx_available() {
        return super::matmul_bf16::matmul_bf16_with_threads(out, a, b, d, threads);
    }
    matmul_packed_of(out, a, b, d, threads, BlockKernel::AmxTiles);
}

/// `C (=|+=) Σ_steps a · b` on a 32 x 32 block: four accumulator tiles over `steps` k steps
/// of 32, stored straight to C (no scratch pass).
///
/// # Safety
/// The calling thread's tiles are configured ([`configure_tiles`]); `a` points at `steps` k
/// steps of two packed A tiles (2,048 bytes each step), `b` at `steps * 16` rows of 32 words;
/// C's 32 rows of 32 f32 are writable (and readable) at `row_bytes` apart; `steps >= 1`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn tile_kernel_32x32(c: CBlock, a: *const u32, b: *const u32, steps: usize) {
    debug_assert!(steps >= 1);
    let (ptr, row_bytes, load) = c.parts();
    let load = load as usize;
    let c16 = (ptr as *mut u8).add(16 * row_bytes);
    // SAFETY: the caller's contract; the whole micro-kernel is one block because tile
    // registers cannot be carried between `asm!` blocks.
    std::arch::asm!(
        "test {load}, {load}",
        "jz 3f",
        "tileloadd tmm0, [{c} + {cs}*1]",
        "tileloadd tmm1, [{c} + {cs}*1 + 64]",
        "tileloadd tmm2, [{c16} + {cs}*1]",
        "tileloadd tmm3, [{c16} + {cs}*1 + 64]",
        "jmp 2f",
        "3:",
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        "2:",
        "tileloadd tmm4, [{a} + {s64}*1]",
        "tileloadd tmm6, [{b} + {s128}*1]",
        "tileloadd tmm7, [{b} + {s128}*1 + 64]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "tileloadd tmm5, [{a} + {s64}*1 + 1024]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "add {a}, 2048",
        "add {b}, 2048",
        "dec {steps}",
        "jnz 2b",
        "tilestored [{c} + {cs}*1], tmm0",
        "tilestored [{c} + {cs}*1 + 64], tmm1",
        "tilestored [{c16} + {cs}*1], tmm2",
        "tilestored [{c16} + {cs}*1 + 64], tmm3",
        a = inout(reg) a => _,
        b = inout(reg) b => _,
        steps = inout(reg) steps => _,
        load = in(reg) load,
        c = in(reg) ptr,
        c16 = in(reg) c16,
        cs = in(reg) row_bytes,
        s64 = in(reg) 64usize,
        s128 = in(reg) 128usize,
        out("tmm0") _,
        out("tmm1") _,
        out("tmm2") _,
        out("tmm3") _,
        out("tmm4") _,
        out("tmm5") _,
        out("tmm6") _,
        out("tmm7") _,
        options(nostack),
    );
}

/// The tile unit's throughput on `threads` threads (GFLOP/s, 16,384 flop per `tdpbf16ps`):
/// four independent accumulators, no loads. `None` without AMX. The MFU of a `--bf16` run whose
/// matmuls run on AMX is against this peak.
pub fn amx_peak_gflops(threads: usize) -> Option<f64> {
    if !amx_available() {
        return None;
    }
    const ITERS: usize = 2_000_000;
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            // SAFETY: AMX was detected and granted above; tiles are configured on this thread.
            s.spawn(|| unsafe {
                configure_tiles();
                peak_loop(ITERS)
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    Some((threads.max(1) * ITERS * 4 * 16_384) as f64 / secs / 1e9)
}

/// # Safety
/// The calling thread's tiles are configured.
#[cfg(target_arch = "x86_64")]
unsafe fn peak_loop(iters: usize) {
    // SAFETY: the caller's contract; operand tiles are zeroed, so every product is defined.
    std::arch::asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        "tilezero tmm4",
        "tilezero tmm5",
        "tilezero tmm6",
        "tilezero tmm7",
        "2:",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "dec {n}",
        "jnz 2b",
        n = inout(reg) iters => _,
        out("tmm0") _,
        out("tmm1") _,
        out("tmm2") _,
        out("tmm3") _,
        out("tmm4") _,
        out("tmm5") _,
        out("tmm6") _,
        out("tmm7") _,
        options(nostack, nomem),
    );
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn peak_loop(_: usize) {}
