//! bf16 matrix multiply with f32 accumulation on Intel AMX tiles (`tdpbf16ps`: a 16 x 16 f32
//! tile += 16 x 32 bf16 · 32 x 16 bf16, 16,384 flop per instruction, about 8-16x a core's f32
//! FMA rate). Inputs are f32 slices rounded to bf16 (round to nearest even) while they are
//! packed, as autocast rounds a matmul's operands; outputs stay f32.
//!
//! Layout, after oneDNN's brgemm AMX kernel and OpenBLAS's SPR sbgemm (facts in
//! `shared/research/amx.md`): C in 32 x 32 blocks held in four accumulator tiles (tmm0-3) over
//! the whole of k, A as two 16-row tiles (tmm4-5) and B as two 16-column tiles (tmm6-7) per
//! 32-deep k step. A is packed tile-contiguous (`[row block][k step][2][16 rows][16 words]`,
//! a word = two bf16 of adjacent k), B in VNNI panels of 32 columns (`[panel][k pair][32
//! words]`, loaded with a 128-byte stride), both zero-padded to whole tiles so one tile shape
//! serves every edge. B is packed in column blocks that stay in L2 while every row block
//! sweeps them.
//!
//! Every output element is one kernel call's sum over all of k in a fixed order, and row blocks
//! are only spread over threads, so results are bit-identical for every thread count.
//! `tdpbf16ps` treats bf16 subnormal inputs as zero and does not read MXCSR; products of bf16
//! values are exact in f32, so this computes the products of the dot-product and rounded-FMA
//! kernels, summed in another order.

use super::amx::{amx_available, configure_tiles};
use super::amx_pack::{pack_a, pack_b, PackBuffer, PackElem, A_STEP, KB, MB, NB};
use super::matmul::MatmulDims;
use super::sync_ptr::SyncPtr;
use rayon::prelude::*;
use std::cell::RefCell;

/// The 32 x 32 f32 block a kernel call stores, on a cache line like the packed operands.
#[repr(C, align(64))]
struct CTile([f32; MB * NB]);

/// Row blocks (of 32) per task: 256 rows of packed A stay in L2 while B panels pass through L1.
const GROUP: usize = 8;
/// Bytes of packed B a column block may take, so it stays in a core's L2 while row blocks sweep it.
const B_BLOCK_BYTES: usize = 1 << 20;

thread_local! {
    /// Packing buffers of the calling thread, kept between calls so a training step does not
    /// fault in fresh pages for every GEMM.
    static PACKED: RefCell<(PackBuffer, PackBuffer)> =
        const { RefCell::new((PackBuffer::new(), PackBuffer::new())) };
    /// Buffers of dropped [`PackedB`]s (the output layer's weight, twice per step).
    static SPARE: RefCell<Vec<PackBuffer>> = const { RefCell::new(Vec::new()) };
}

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
    let MatmulDims { m, n, k, .. } = d;
    if !amx_available() || m == 0 || n == 0 || k == 0 {
        assert_eq!(out.len(), m * n, "matmul out");
        return super::matmul_bf16::matmul_bf16_with_threads(out, a, b, d, threads);
    }
    matmul_amx_of(out, a, b, d, threads);
}

/// [`matmul_amx_with_threads`] for operands of either element type (bf16 operands are packed
/// as they are); AMX must be usable.
pub(crate) fn matmul_amx_of<A: PackElem, B: PackElem>(
    out: &mut [f32],
    a: &[A],
    b: &[B],
    d: MatmulDims,
    threads: usize,
) {
    let MatmulDims { m, n, k, .. } = d;
    assert_eq!(out.len(), m * n, "matmul out");
    assert_eq!(a.len(), m * k, "matmul a");
    assert_eq!(b.len(), k * n, "matmul b");
    assert!(amx_available(), "matmul_amx_of without AMX");
    if m == 0 || n == 0 || k == 0 {
        if k == 0 && !d.accumulate {
            out.fill(0.0);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    PACKED.with(|bufs| {
        // A nested call (none today) would find the buffers borrowed and use fresh ones.
        let mut fresh = (PackBuffer::new(), PackBuffer::new());
        let mut guard = bufs.try_borrow_mut();
        let (ap, bp) = match guard.as_deref_mut() {
            Ok(b) => b,
            Err(_) => &mut fresh,
        };
        amx_gemm(out, a, BSource::Pack(b, bp), d, threads, ap);
    });
}

/// A `b` operand packed once for many products (the output layer's weight across its token
/// tiles): the packing, a large share of an AMX GEMM, is paid once instead of once per call.
pub struct PackedB {
    words: PackBuffer,
    k: usize,
    n: usize,
    trans_b: bool,
}

impl PackedB {
    /// Packs all of `op(b)` (`d.k` x `d.n`, `d.trans_b`; `d.m` is ignored). `None` where AMX is
    /// not usable.
    pub fn new(b: &[f32], d: MatmulDims, threads: usize) -> Option<Self> {
        let MatmulDims { n, k, .. } = d;
        assert_eq!(b.len(), k * n, "matmul b");
        if !amx_available() || n == 0 || k == 0 {
            return None;
        }
        let kpp = k.div_ceil(2 * KB) * KB;
        let mut words = SPARE
            .with(|s| s.borrow_mut().pop())
            .unwrap_or_else(PackBuffer::new);
        pack_b_panels(
            words.zeroed(n.div_ceil(NB) * kpp * NB),
            b,
            d,
            0,
            n,
            threads > 1,
        );
        Some(PackedB {
            words,
            k,
            n,
            trans_b: d.trans_b,
        })
    }
}

impl Drop for PackedB {
    /// The buffer goes back to this thread's spares: a weight the size of the output layer's is
    /// tens of MiB, and fresh pages for it every step cost more than packing.
    fn drop(&mut self) {
        let words = std::mem::replace(&mut self.words, PackBuffer::new());
        SPARE.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < 2 {
                s.push(words);
            }
        });
    }
}

/// `out (=|+=) op(a) · op(b)` with `b` packed beforehand; `d` must describe the same `b`.
pub fn matmul_amx_prepacked(
    out: &mut [f32],
    a: &[f32],
    b: &PackedB,
    d: MatmulDims,
    threads: usize,
) {
    assert!(
        d.k == b.k && d.n == b.n && d.trans_b == b.trans_b,
        "packed b is {}x{} (trans {}), the product wants {}x{} (trans {})",
        b.k,
        b.n,
        b.trans_b,
        d.k,
        d.n,
        d.trans_b
    );
    assert_eq!(out.len(), d.m * d.n, "matmul out");
    assert_eq!(a.len(), d.m * d.k, "matmul a");
    if d.m == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    PACKED.with(|bufs| {
        let mut fresh = PackBuffer::new();
        let mut guard = bufs.try_borrow_mut();
        let ap = match guard.as_deref_mut() {
            Ok(b) => &mut b.0,
            Err(_) => &mut fresh,
        };
        amx_gemm::<f32, f32>(out, a, BSource::Packed(&b.words), d, threads, ap);
    });
}

/// Where a product's B panels come from.
enum BSource<'a, B> {
    /// Packed per column block into the buffer.
    Pack(&'a [B], &'a mut PackBuffer),
    /// All panels packed beforehand.
    Packed(&'a PackBuffer),
}

/// Packs columns `[c_blk, c_blk + nc)` of `op(b)` into panels of NB columns.
fn pack_b_panels<B: PackElem>(
    dst: &mut [u32],
    b: &[B],
    d: MatmulDims,
    c_blk: usize,
    nc: usize,
    parallel: bool,
) {
    let kpp = d.k.div_ceil(2 * KB) * KB;
    let pack_b_panel =
        |(p, dst): (usize, &mut [u32])| pack_b(dst, b, d, d.ldb(), c_blk + p * NB, c_blk + nc);
    if parallel {
        dst.par_chunks_mut(kpp * NB)
            .enumerate()
            .for_each(pack_b_panel);
    } else {
        dst.chunks_mut(kpp * NB).enumerate().for_each(pack_b_panel);
    }
}

#[cfg(target_arch = "x86_64")]
fn amx_gemm<A: PackElem, B: PackElem>(
    out: &mut [f32],
    a: &[A],
    mut b_src: BSource<'_, B>,
    d: MatmulDims,
    threads: usize,
    ap: &mut PackBuffer,
) {
    let MatmulDims { m, n, k, .. } = d;
    let steps = k.div_ceil(2 * KB);
    let kpp = steps * KB;
    let row_blocks = m.div_ceil(MB);
    let parallel = threads > 1 && m * n * k >= 1 << 18;

    let ap = ap.zeroed(row_blocks * steps * A_STEP);
    let pack_a_block =
        |(blk, dst): (usize, &mut [u32])| pack_a(dst, a, d, d.lda(), blk * MB, steps);
    if parallel {
        ap.par_chunks_mut(steps * A_STEP)
            .enumerate()
            .for_each(pack_a_block);
    } else {
        ap.chunks_mut(steps * A_STEP)
            .enumerate()
            .for_each(pack_a_block);
    }

    let nc_max = (B_BLOCK_BYTES / (kpp * 4) / NB).max(1) * NB;
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let mut c_blk = 0;
    while c_blk < n {
        let nc = nc_max.min(n - c_blk);
        let panels = nc.div_ceil(NB);
        let bp: &[u32] = match &mut b_src {
            BSource::Pack(b, buf) => {
                let dst = buf.zeroed(panels * kpp * NB);
                pack_b_panels(dst, b, d, c_blk, nc, parallel);
                dst
            }
            BSource::Packed(all) => {
                let first = c_blk / NB;
                &all.words()[first * kpp * NB..(first + panels) * kpp * NB]
            }
        };
        let ap = &ap[..];
        // A task is a group of row blocks; each B panel is loaded once per group and used by
        // all its row blocks from L1, while the group's packed A stays in L2.
        let groups = row_blocks.div_ceil(GROUP);
        let work = |g: usize| {
            // SAFETY: `amx_gemm` runs only when `amx_available()`.
            unsafe { configure_tiles() };
            let mut tile = CTile([0.0; MB * NB]);
            for p in 0..panels {
                let b_panel = &bp[p * kpp * NB..(p + 1) * kpp * NB];
                let c0 = c_blk + p * NB;
                let cols = NB.min(c_blk + nc - c0);
                for blk in g * GROUP..row_blocks.min((g + 1) * GROUP) {
                    let a_blk = &ap[blk * steps * A_STEP..(blk + 1) * steps * A_STEP];
                    let r0 = blk * MB;
                    let rows = MB.min(m - r0);
                    if rows == MB && cols == NB {
                        // A whole block: the tiles store to (and start from) C itself.
                        // SAFETY: row groups are disjoint between tasks, so the block's 32 rows
                        // of 32 f32 at `(r0 + r) * n + c0` are this task's; tiles configured.
                        let ptr = unsafe { out_ptr.ptr().add(r0 * n + c0) };
                        let row_bytes = n * 4;
                        let c = if d.accumulate {
                            CBlock::Accumulate { ptr, row_bytes }
                        } else {
                            CBlock::Store { ptr, row_bytes }
                        };
                        // SAFETY: `a_blk` holds `steps` k steps of two A tiles, `b_panel`
                        // `kpp` rows of NB words; C as above.
                        unsafe { tile_kernel_32x32(c, a_blk.as_ptr(), b_panel.as_ptr(), steps) };
                        continue;
                    }
                    let scratch = CBlock::Store {
                        ptr: tile.0.as_mut_ptr(),
                        row_bytes: NB * 4,
                    };
                    // SAFETY: as above, C being the 32 x 32 scratch tile.
                    unsafe { tile_kernel_32x32(scratch, a_blk.as_ptr(), b_panel.as_ptr(), steps) };
                    for r in 0..rows {
                        // SAFETY: row groups are disjoint between tasks; `(r0 + r) * n + c0 +
                        // cols <= m * n`.
                        let row = unsafe { out_ptr.slice((r0 + r) * n + c0, cols) };
                        let t = &tile.0[r * NB..r * NB + cols];
                        if d.accumulate {
                            row.iter_mut().zip(t).for_each(|(x, y)| *x += y);
                        } else {
                            row.copy_from_slice(t);
                        }
                    }
                }
            }
        };
        if parallel && groups > 1 {
            (0..groups)
                .into_par_iter()
                .with_min_len(groups.div_ceil(threads))
                .for_each(work);
        } else {
            (0..groups).for_each(work);
        }
        c_blk += nc;
    }
}

/// Where a kernel call's 32 x 32 block of C goes, and whether it starts from what is there.
#[derive(Clone, Copy)]
pub(crate) enum CBlock {
    /// `C = A · B`, rows `row_bytes` apart.
    Store { ptr: *mut f32, row_bytes: usize },
    /// `C += A · B`: the tiles start from C's values, so products add to them one k step at a
    /// time (the scratch path adds the finished sum instead; each output element always takes
    /// the same path, whatever the thread count).
    Accumulate { ptr: *mut f32, row_bytes: usize },
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
    let (ptr, row_bytes, load) = match c {
        CBlock::Store { ptr, row_bytes } => (ptr, row_bytes, 0usize),
        CBlock::Accumulate { ptr, row_bytes } => (ptr, row_bytes, 1),
    };
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
