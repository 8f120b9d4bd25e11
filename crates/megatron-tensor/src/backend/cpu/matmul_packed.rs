//! The bf16 GEMM on packed operands (f32 accumulation), shared by the two instructions that
//! multiply bf16 blocks: Intel AMX tiles (`tdpbf16ps`, `matmul_amx.rs`) and the AVX512_BF16
//! dot product (`vdpbf16ps`, `matmul_bf16.rs`, which AMD Zen 4/5 and Intel Cooper Lake or
//! later have). Inputs are f32 (rounded to bf16, nearest even, while packed, as autocast rounds
//! a matmul's operands) or bf16 (packed as stored); outputs stay f32.
//!
//! Layout, after oneDNN's brgemm AMX kernel and OpenBLAS's SPR sbgemm (facts in
//! `shared/research/amx.md`): C in 32 x 32 blocks, each kernel call over one block of k;
//! A packed tile-contiguous (`[row block][k step][2][16 rows][16 words]`, a word = two bf16 of
//! adjacent k), B in VNNI panels of 32 columns (`[panel][k pair][32 words]`), both zero-padded
//! to whole blocks so one block shape serves every edge (`amx_pack.rs`). A is packed once per
//! call; B in column blocks that stay in L2 while every row block sweeps them, or once for many
//! calls ([`PackedB`], the output layer's weight). One packing for both instructions: the
//! vector packers (16 values per conversion, register transposes) were what made the
//! dot-product GEMM fast, whose own scalar packing had taken a third of its time.
//!
//! Every output element is the sum over k in a fixed order (k blocks carried through C in f32,
//! which is exact), and blocks of C are only spread over threads, so results are bit-identical
//! for every thread count. Both instructions treat bf16 subnormal inputs as zero and ignore
//! MXCSR; products of bf16 values are exact in f32, so both compute the products of the
//! rounded-FMA kernel, summed in another order.

use super::amx_pack::{pack_a, pack_b, PackBuffer, PackElem, A_STEP, KB, MB, NB};
use super::matmul::MatmulDims;
use super::sync_ptr::SyncPtr;
use rayon::prelude::*;
use std::cell::RefCell;

/// Which instructions multiply the packed 32 x 32 blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKernel {
    /// Intel AMX tiles: four 16 x 16 accumulator tiles per block.
    AmxTiles,
    /// `vdpbf16ps` (AVX512_BF16): the block in four passes of 8 rows x 32 columns.
    DotProduct,
}

impl BlockKernel {
    /// Whether this CPU (and, for AMX, the OS) runs it.
    pub fn available(self) -> bool {
        match self {
            BlockKernel::AmxTiles => super::amx::amx_available(),
            BlockKernel::DotProduct => super::matmul_bf16::bf16_gemm_available(),
        }
    }

    /// k steps (of 32) per kernel call for a product of `steps` in all: blocks of nearly equal
    /// size, so one B panel slice (2 KiB a step) and the group's A slices stay in L1/L2 while
    /// they are reused. The dot-product kernel reads each slice four times (once per 8-row
    /// pass): k up to 768 runs unblocked (its slice fits L1; blocking it measured 8 % slower),
    /// longer k in blocks of at most 12 steps (+5-15 % at k = 2048 and 3072, and what keeps
    /// the output layer's input gradient, k = vocabulary, from streaming its panels from
    /// memory). The tile kernel was tuned over whole k and blocks only k beyond 2,048.
    fn k_steps_per_block(self, steps: usize) -> usize {
        let (unblocked, most) = match self {
            BlockKernel::AmxTiles => (64, 64),
            BlockKernel::DotProduct => (24, 12),
        };
        if steps <= unblocked {
            return steps.max(1);
        }
        steps.div_ceil(steps.div_ceil(most))
    }

    /// Per-thread setup before a thread's first block (AMX: load the tile configuration).
    ///
    /// # Safety
    /// `self.available()`.
    #[inline]
    pub(crate) unsafe fn prepare_thread(self) {
        if self == BlockKernel::AmxTiles {
            // SAFETY: AMX is available (the caller's contract).
            unsafe { super::amx::configure_tiles() };
        }
    }

    /// `C (=|+=) Σ_steps a · b` on one 32 x 32 block; only the first `rows` rows of C are
    /// needed (the dot-product kernel skips the others; the tiles compute all 32).
    ///
    /// # Safety
    /// `self.available()` and [`BlockKernel::prepare_thread`] called on this thread; `a` points
    /// at `steps` k steps of a packed 32-row A block (2,048 bytes each), `b` at `steps * 16`
    /// rows of 32 words of a B panel; C's 32 rows of 32 f32 are writable (and readable) at
    /// `row_bytes` apart; `steps >= 1`.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub(crate) unsafe fn block_32x32(
        self,
        c: CBlock,
        a: *const u32,
        b: *const u32,
        steps: usize,
        rows: usize,
    ) {
        // SAFETY: the caller's contract, which is both kernels' contract.
        unsafe {
            match self {
                BlockKernel::AmxTiles => super::matmul_amx::tile_kernel_32x32(c, a, b, steps),
                BlockKernel::DotProduct => {
                    super::matmul_bf16::dot_kernel_32x32(c, a, b, steps, rows)
                }
            }
        }
    }
}

/// Where a kernel call's 32 x 32 block of C goes, and whether it starts from what is there.
#[derive(Clone, Copy)]
pub(crate) enum CBlock {
    /// `C = A · B`, rows `row_bytes` apart.
    Store { ptr: *mut f32, row_bytes: usize },
    /// `C += A · B`: the accumulators start from C's values, so products add to them one k
    /// step at a time (the scratch path adds the finished sum instead; each output element
    /// always takes the same path, whatever the thread count).
    Accumulate { ptr: *mut f32, row_bytes: usize },
}

impl CBlock {
    /// The block's first element, the bytes between its rows, and whether it accumulates.
    #[inline(always)]
    pub(crate) fn parts(self) -> (*mut f32, usize, bool) {
        match self {
            CBlock::Store { ptr, row_bytes } => (ptr, row_bytes, false),
            CBlock::Accumulate { ptr, row_bytes } => (ptr, row_bytes, true),
        }
    }
}

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

/// Bytes of the calling thread's two packing buffers one product `d` needs on the packed
/// kernels: all of `op(a)` (rows and k padded to 32) and one column block of `op(b)` (at most
/// [`B_BLOCK_BYTES`], or one 32-column panel where k is longer). The thread keeps each buffer
/// at the largest size it has needed.
pub fn packed_gemm_bytes(d: MatmulDims) -> (usize, usize) {
    let MatmulDims { m, n, k, .. } = d;
    if m == 0 || n == 0 || k == 0 {
        return (0, 0);
    }
    let steps = k.div_ceil(2 * KB);
    let kpp = steps * KB;
    let a = packed_a_words(m, steps);
    let b = packed_b_words(b_block_columns(kpp).min(n), kpp);
    (4 * a, 4 * b)
}

/// Bytes of a [`PackedB`] of `op(b)` for products of dims `d` (the output layer's weight: each
/// one stays allocated on its thread for reuse once dropped, up to two).
pub fn prepacked_b_bytes(d: MatmulDims) -> usize {
    4 * packed_b_words(d.n, d.k.div_ceil(2 * KB) * KB)
}

/// Words of `m` rows of A packed over `steps` k steps (whole 32-row blocks).
fn packed_a_words(m: usize, steps: usize) -> usize {
    m.div_ceil(MB) * steps * A_STEP
}

/// Words of `n` columns of B packed in panels of `kpp` k pairs (whole 32-column panels).
fn packed_b_words(n: usize, kpp: usize) -> usize {
    n.div_ceil(NB) * kpp * NB
}

/// Columns of one block of B packed per product (whole panels, within [`B_BLOCK_BYTES`]).
fn b_block_columns(kpp: usize) -> usize {
    (B_BLOCK_BYTES / (kpp * 4) / NB).max(1) * NB
}

/// `out (=|+=) op(a) · op(b)` of f32 operands (rounded to bf16 while packed) on `kernel`, which
/// must be available; [`MatmulDims`] as [`super::matmul::matmul`].
pub fn matmul_packed(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    d: MatmulDims,
    threads: usize,
    kernel: BlockKernel,
) {
    matmul_packed_of(out, a, b, d, threads, kernel);
}

/// `out (=|+=) op(a) · op(b)` on `kernel` (which must be available), operands of either element
/// type (bf16 operands are packed as they are); [`MatmulDims`] as [`super::matmul::matmul`].
pub(crate) fn matmul_packed_of<A: PackElem, B: PackElem>(
    out: &mut [f32],
    a: &[A],
    b: &[B],
    d: MatmulDims,
    threads: usize,
    kernel: BlockKernel,
) {
    let MatmulDims { m, n, k, .. } = d;
    assert_eq!(out.len(), m * n, "matmul out");
    assert_eq!(a.len(), m * k, "matmul a");
    assert_eq!(b.len(), k * n, "matmul b");
    assert!(kernel.available(), "{kernel:?} is not available here");
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
        packed_gemm(out, a, BSource::Pack(b, bp), d, threads, ap, kernel);
    });
}

/// A `b` operand packed once for many products (the output layer's weight across its token
/// tiles): the packing, a large share of a bf16 GEMM, is paid once instead of once per call.
/// The layout is the same for both kernels.
pub struct PackedB {
    words: PackBuffer,
    k: usize,
    n: usize,
    trans_b: bool,
}

impl PackedB {
    /// Packs all of `op(b)` (`d.k` x `d.n`, `d.trans_b`; `d.m` is ignored). `None` where no
    /// packed kernel runs (no AVX512_BF16).
    pub fn new(b: &[f32], d: MatmulDims, threads: usize) -> Option<Self> {
        Self::of(b, d, threads)
    }

    /// [`PackedB::new`] of `b` as stored (f32, or bf16 packed without widening).
    pub(crate) fn of<B: PackElem>(b: &[B], d: MatmulDims, threads: usize) -> Option<Self> {
        let MatmulDims { n, k, .. } = d;
        assert_eq!(b.len(), k * n, "matmul b");
        if !BlockKernel::DotProduct.available() || n == 0 || k == 0 {
            return None;
        }
        let kpp = k.div_ceil(2 * KB) * KB;
        let mut words = SPARE
            .with(|s| s.borrow_mut().pop())
            .unwrap_or_else(PackBuffer::new);
        pack_b_panels(
            words.zeroed(packed_b_words(n, kpp)),
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

/// `out (=|+=) op(a) · op(b)` with `b` packed beforehand, on `kernel` (which must be
/// available); `d` must describe the same `b`.
pub fn matmul_packed_prepacked(
    out: &mut [f32],
    a: &[f32],
    b: &PackedB,
    d: MatmulDims,
    threads: usize,
    kernel: BlockKernel,
) {
    matmul_packed_prepacked_of(out, a, b, d, threads, kernel);
}

/// [`matmul_packed_prepacked`] for an `a` of either element type (bf16 packed as stored).
pub(crate) fn matmul_packed_prepacked_of<A: PackElem>(
    out: &mut [f32],
    a: &[A],
    b: &PackedB,
    d: MatmulDims,
    threads: usize,
    kernel: BlockKernel,
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
    assert!(kernel.available(), "{kernel:?} is not available here");
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
        packed_gemm::<A, f32>(out, a, BSource::Packed(&b.words), d, threads, ap, kernel);
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
fn packed_gemm<A: PackElem, B: PackElem>(
    out: &mut [f32],
    a: &[A],
    mut b_src: BSource<'_, B>,
    d: MatmulDims,
    threads: usize,
    ap: &mut PackBuffer,
    kernel: BlockKernel,
) {
    let MatmulDims { m, n, k, .. } = d;
    let steps = k.div_ceil(2 * KB);
    let kpp = steps * KB;
    let row_blocks = m.div_ceil(MB);
    let parallel = threads > 1 && m * n * k >= 1 << 18;

    let ap = ap.zeroed(packed_a_words(m, steps));
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

    let nc_max = b_block_columns(kpp);
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let mut c_blk = 0;
    while c_blk < n {
        let nc = nc_max.min(n - c_blk);
        let panels = nc.div_ceil(NB);
        let bp: &[u32] = match &mut b_src {
            BSource::Pack(b, buf) => {
                let dst = buf.zeroed(packed_b_words(nc, kpp));
                pack_b_panels(dst, b, d, c_blk, nc, parallel);
                dst
            }
            BSource::Packed(all) => {
                let first = c_blk / NB;
                &all.words()[first * kpp * NB..(first + panels) * kpp * NB]
            }
        };
        let ap = &ap[..];
        // A task is a group of row blocks and a run of panels; each B panel slice is loaded
        // once per group and used by all its row blocks from L1, while the group's packed A
        // stays in L2. Fewer row blocks than a group per thread (the output layer's 256-token
        // tiles) make smaller groups, and fewer groups than threads split the panels too, so
        // every thread has work; each block's sum runs in the same order either way, so
        // neither changes a bit.
        let group = if parallel {
            GROUP.min(row_blocks.div_ceil(threads)).max(1)
        } else {
            GROUP
        };
        let groups = row_blocks.div_ceil(group);
        let splits = if parallel {
            threads.div_ceil(groups).min(panels).max(1)
        } else {
            1
        };
        let per_split = panels.div_ceil(splits);
        let k_block = kernel.k_steps_per_block(steps);
        let work = |task: usize| {
            let (g, split) = (task / splits, task % splits);
            // SAFETY: `matmul_packed_of` and `matmul_packed_prepacked` assert availability.
            unsafe { kernel.prepare_thread() };
            let mut tile = CTile([0.0; MB * NB]);
            // k in blocks of `k_block` steps, so a panel's slice stays in L1 across the
            // group's row blocks however long k is (the output layer's input gradient has
            // k = vocabulary). A whole C block carries its f32 sums from one k block to the
            // next through C itself (stored and reloaded exactly), so its sum is the one
            // unblocked call would give.
            for s0 in (0..steps).step_by(k_block) {
                let ks = k_block.min(steps - s0);
                let add = d.accumulate || s0 > 0;
                for p in split * per_split..panels.min((split + 1) * per_split) {
                    let b_panel = &bp[p * kpp * NB + s0 * KB * NB..(p + 1) * kpp * NB];
                    let c0 = c_blk + p * NB;
                    let cols = NB.min(c_blk + nc - c0);
                    for blk in g * group..row_blocks.min((g + 1) * group) {
                        let a_blk = &ap[(blk * steps + s0) * A_STEP..(blk + 1) * steps * A_STEP];
                        let r0 = blk * MB;
                        let rows = MB.min(m - r0);
                        if rows == MB && cols == NB {
                            // A whole block: the kernel stores to (and starts from) C itself.
                            // SAFETY: tasks own disjoint (row group, panel run) blocks of C,
                            // so the block's 32 rows of 32 f32 at `(r0 + r) * n + c0` are this
                            // task's; thread prepared.
                            let ptr = unsafe { out_ptr.ptr().add(r0 * n + c0) };
                            let row_bytes = n * 4;
                            let c = if add {
                                CBlock::Accumulate { ptr, row_bytes }
                            } else {
                                CBlock::Store { ptr, row_bytes }
                            };
                            // SAFETY: `a_blk` holds `ks` k steps of a packed A block, `b_panel`
                            // `ks * KB` rows of NB words; C as above.
                            unsafe {
                                kernel.block_32x32(c, a_blk.as_ptr(), b_panel.as_ptr(), ks, MB)
                            };
                            continue;
                        }
                        let scratch = CBlock::Store {
                            ptr: tile.0.as_mut_ptr(),
                            row_bytes: NB * 4,
                        };
                        // SAFETY: as above, C being the 32 x 32 scratch block.
                        unsafe {
                            kernel.block_32x32(scratch, a_blk.as_ptr(), b_panel.as_ptr(), ks, rows)
                        };
                        for r in 0..rows {
                            // SAFETY: tasks own disjoint blocks of C; `(r0 + r) * n + c0 +
                            // cols <= m * n`.
                            let row = unsafe { out_ptr.slice((r0 + r) * n + c0, cols) };
                            let t = &tile.0[r * NB..r * NB + cols];
                            if add {
                                row.iter_mut().zip(t).for_each(|(x, y)| *x += y);
                            } else {
                                row.copy_from_slice(t);
                            }
                        }
                    }
                }
            }
        };
        let tasks = groups * splits;
        if parallel && tasks > 1 {
            (0..tasks)
                .into_par_iter()
                .with_min_len(tasks.div_ceil(threads))
                .for_each(work);
        } else {
            (0..tasks).for_each(work);
        }
        c_blk += nc;
    }
}
