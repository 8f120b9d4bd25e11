//! Matrix multiply: our AVX-512 kernel (`sgemm.rs`) where the CPU has AVX-512, the `gemm` crate
//! (AVX2 / portable kernels) elsewhere. Both measured in BENCHMARKS.md.

use super::cast::{round_to_half, Half};
use super::matmul_packed::{matmul_packed_of, matmul_packed_prepacked_of, BlockKernel, PackedB};
pub use super::operand::Operand;
use crate::threads::gemm_threads;
use gemm::Parallelism;
use rayon::prelude::*;

/// `out[m, n] (= or +=) op(a)[m, k] · op(b)[k, n]`, all row-major. With `trans_a`, `a` is stored
/// `[k, m]`; with `trans_b`, `b` is stored `[n, k]` (a Megatron `[out, in]` weight).
#[derive(Clone, Copy, Debug)]
pub struct MatmulDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub accumulate: bool,
}

impl MatmulDims {
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        MatmulDims {
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        }
    }
    pub fn ta(mut self) -> Self {
        self.trans_a = true;
        self
    }
    pub fn tb(mut self) -> Self {
        self.trans_b = true;
        self
    }
    pub fn acc(mut self) -> Self {
        self.accumulate = true;
        self
    }
    /// Accumulates where `on` (onto a bias the output was set to).
    pub fn acc_if(mut self, on: bool) -> Self {
        self.accumulate |= on;
        self
    }
    /// Distance between stored rows of a dense `a`.
    pub fn lda(&self) -> usize {
        if self.trans_a {
            self.m
        } else {
            self.k
        }
    }
    /// Distance between stored rows of a dense `b`.
    pub fn ldb(&self) -> usize {
        if self.trans_b {
            self.k
        } else {
            self.n
        }
    }
}

/// Operand precision of matmuls (`--bf16`, `--fp16`; like autocast): operands are rounded to
/// the 16-bit format, products accumulate in f32, outputs are f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPrecision {
    F32,
    BF16,
    F16,
}

impl MatmulPrecision {
    /// Operands rounded to `half`, or f32 operands.
    pub fn of(half: Option<Half>) -> Self {
        match half {
            None => MatmulPrecision::F32,
            Some(Half::BF16) => MatmulPrecision::BF16,
            Some(Half::F16) => MatmulPrecision::F16,
        }
    }

    /// The 16-bit format operands are rounded to, if any.
    pub fn half(self) -> Option<Half> {
        match self {
            MatmulPrecision::F32 => None,
            MatmulPrecision::BF16 => Some(Half::BF16),
            MatmulPrecision::F16 => Some(Half::F16),
        }
    }
}

/// Which instructions a bf16 matmul runs on. Both give the same products (bf16 x bf16 is exact
/// in f32) and accumulate in f32; they differ only in speed, which depends on the CPU:
/// `vdpbf16ps` does twice the multiply-adds of an f32 FMA per instruction, but some CPUs issue
/// it at less than half the FMA rate (BENCHMARKS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// The bf16 dot-product instruction (AVX512_BF16).
    Dot,
    /// Operands rounded to bf16, then the f32 GEMM.
    Fma,
    /// Intel AMX tiles (`tdpbf16ps`); the dot-product kernel where the CPU or OS lacks them.
    Amx,
}

thread_local! {
    /// Per thread, so rank threads and concurrent tests choose independently.
    static PRECISION: std::cell::Cell<MatmulPrecision> =
        const { std::cell::Cell::new(MatmulPrecision::F32) };
    static BF16_KERNEL: std::cell::Cell<Bf16Kernel> = const { std::cell::Cell::new(Bf16Kernel::Dot) };
}

/// Sets the operand precision of every [`matmul`] called from this thread.
pub fn set_matmul_precision(p: MatmulPrecision) {
    PRECISION.with(|c| c.set(p));
}

pub fn matmul_precision() -> MatmulPrecision {
    PRECISION.with(|c| c.get())
}

/// Sets the instructions of this thread's bf16 matmuls (the dot-product kernel falls back to
/// [`Bf16Kernel::Fma`] where the CPU lacks it).
pub fn set_bf16_kernel(k: Bf16Kernel) {
    BF16_KERNEL.with(|c| c.set(k));
}

pub fn bf16_kernel() -> Bf16Kernel {
    BF16_KERNEL.with(|c| c.get())
}

/// Matmul with the calling thread's GEMM budget and operand precision.
pub fn matmul(out: &mut [f32], a: &[f32], b: &[f32], d: MatmulDims) {
    let how = (matmul_precision(), bf16_kernel());
    matmul_as(out, a, b, d, gemm_threads(), how);
}

/// Fewer rows than this (a decoded token, a tiny micro-batch) do not pay for packing `b` for
/// the packed bf16 kernels: those products take the rounded-operand f32 GEMM (the same
/// products; the choice depends only on the shape, so it is the same for every thread count).
pub const PACKED_MIN_ROWS: usize = 32;

/// The packed-block kernel of this thread's bf16 matmuls, if any: AMX tiles where they are
/// chosen and usable, the dot-product instruction where it is chosen (or AMX is chosen but
/// not usable) and the CPU has it. What the log and the MFU's peak report.
pub fn bf16_block_kernel() -> Option<BlockKernel> {
    block_kernel_of((matmul_precision(), bf16_kernel()))
}

fn block_kernel_of((precision, kernel): (MatmulPrecision, Bf16Kernel)) -> Option<BlockKernel> {
    if precision != MatmulPrecision::BF16 {
        return None;
    }
    match kernel {
        Bf16Kernel::Amx if BlockKernel::AmxTiles.available() => Some(BlockKernel::AmxTiles),
        Bf16Kernel::Amx | Bf16Kernel::Dot if BlockKernel::DotProduct.available() => {
            Some(BlockKernel::DotProduct)
        }
        _ => None,
    }
}

/// The kernel of this thread's attention products (`attention_packed.rs`; the softmax stays f32):
/// wherever its bf16 matmuls run on packed blocks, so a `--bf16` model rounds the operands of
/// every product alike. The choice depends on no shape, so every layout (tensor-parallel heads,
/// context-parallel blocks) runs the same kernel as one rank.
pub fn attention_block_kernel() -> Option<BlockKernel> {
    attention_block_kernel_of(matmul_precision(), bf16_kernel())
}

/// [`attention_block_kernel`] of a thread with these settings (for predictions made before
/// the rank threads set theirs).
pub fn attention_block_kernel_of(
    precision: MatmulPrecision,
    kernel: Bf16Kernel,
) -> Option<BlockKernel> {
    block_kernel_of((precision, kernel))
}

/// The packed kernel a product of `d`'s shape goes to under these settings (the one rule;
/// [`matmul`], [`matmul_operands`], [`grouped_matmul`], [`matmul_on_rounded`] and
/// [`prepack_b`] all follow it).
fn product_kernel(how: (MatmulPrecision, Bf16Kernel), d: MatmulDims) -> Option<BlockKernel> {
    block_kernel_of(how).filter(|_| d.m >= PACKED_MIN_ROWS)
}

/// The one place a matmul's kernel is chosen: by precision, bf16 instructions and shape, on
/// `threads` threads.
fn matmul_as(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    d: MatmulDims,
    threads: usize,
    how: (MatmulPrecision, Bf16Kernel),
) {
    if let Some(kernel) = product_kernel(how, d) {
        return matmul_packed_of(out, a, b, d, threads, kernel);
    }
    match how.0.half() {
        None => matmul_with_threads(out, a, b, d, threads),
        Some(half) => {
            let ar = rounded_operand(a, half);
            let br = rounded_operand(b, half);
            matmul_with_threads(out, &ar, &br, d, threads);
        }
    }
}

impl<'a> Operand<'a> {
    /// The values as f32: borrowed, or widened into a pooled buffer (exact, so the rounding
    /// check of a 16-bit product finds them exact and borrows them).
    pub(crate) fn widened(&self) -> RoundedOperand<'a> {
        match *self {
            Operand::F32(x) => RoundedOperand::Exact(x),
            Operand::BF16(x) => {
                let mut t = crate::Tensor::for_overwrite(&[x.len()]);
                super::cast::bf16_to_f32_parallel(t.data_mut(), x);
                RoundedOperand::Rounded(t)
            }
        }
    }
}

/// [`matmul`] of operands in either storage form, with this thread's GEMM budget and operand
/// precision (bf16 operands of an f32-precision product are widened: exact).
pub fn matmul_operands(out: &mut [f32], a: Operand<'_>, b: Operand<'_>, d: MatmulDims) {
    let how = (matmul_precision(), bf16_kernel());
    matmul_operands_as(out, a, b, d, gemm_threads(), how);
}

/// [`matmul_operands`] on `t` threads (1 inside already-parallel work) with the given operand
/// precision and bf16 kernel (a pool worker does not share its rank's thread-local settings).
fn matmul_operands_as(
    out: &mut [f32],
    a: Operand<'_>,
    b: Operand<'_>,
    d: MatmulDims,
    t: usize,
    how: (MatmulPrecision, Bf16Kernel),
) {
    match (product_kernel(how, d), a, b) {
        (_, Operand::F32(a), Operand::F32(b)) => matmul_as(out, a, b, d, t, how),
        (Some(k), Operand::F32(a), Operand::BF16(b)) => matmul_packed_of(out, a, b, d, t, k),
        (Some(k), Operand::BF16(a), Operand::F32(b)) => matmul_packed_of(out, a, b, d, t, k),
        (Some(k), Operand::BF16(a), Operand::BF16(b)) => matmul_packed_of(out, a, b, d, t, k),
        (None, a, b) => matmul_as(out, &a.widened(), &b.widened(), d, t, how),
    }
}

/// Matmul of operands already rounded to this thread's 16-bit precision (the output layer rounds
/// its weight once per call, not once per tile): the packed kernels convert while packing
/// anyway; the others run the f32 GEMM, skipping the rounding check.
pub fn matmul_on_rounded(out: &mut [f32], a: &[f32], b: &[f32], d: MatmulDims) {
    match product_kernel((matmul_precision(), bf16_kernel()), d) {
        Some(kernel) => matmul_packed_of(out, a, b, d, gemm_threads(), kernel),
        None => matmul_with_threads(out, a, b, d, gemm_threads()),
    }
}

/// `op(b)` packed once for many products with different `a` (the output layer's weight across
/// its token tiles), where this thread's matmuls run on a packed kernel and `d.m`, the rows
/// all those products have together, is at least [`PACKED_MIN_ROWS`]; `None` elsewhere, and
/// the caller multiplies as usual.
pub fn prepack_b(b: Operand<'_>, d: MatmulDims) -> Option<PackedB> {
    product_kernel((matmul_precision(), bf16_kernel()), d)?;
    match b {
        Operand::F32(b) => PackedB::of(b, d, gemm_threads()),
        Operand::BF16(b) => PackedB::of(b, d, gemm_threads()),
    }
}

/// `out (=|+=) op(a) · op(b)` with `b` from [`prepack_b`] (the same dims but `m`), on this
/// thread's packed kernel whatever `m` (the packing is paid already); `a` in either storage
/// form (bf16 packed as stored).
pub fn matmul_prepacked(out: &mut [f32], a: Operand<'_>, b: &PackedB, d: MatmulDims) {
    let kernel = bf16_block_kernel().expect("prepack_b packs only for a packed bf16 kernel");
    match a {
        Operand::F32(a) => matmul_packed_prepacked_of(out, a, b, d, gemm_threads(), kernel),
        Operand::BF16(a) => matmul_packed_prepacked_of(out, a, b, d, gemm_threads(), kernel),
    }
}

/// One of the independent products of [`grouped_matmul`], its operands as stored (an MoE
/// expert's bf16 weight is read in place, as a dense layer's).
pub struct GemmProblem<'a> {
    pub out: &'a mut [f32],
    pub a: Operand<'a>,
    pub b: Operand<'a>,
    pub dims: MatmulDims,
}

/// Many independent matmuls at once (the experts' token blocks of a mixture-of-experts layer,
/// megatron-core's grouped GEMM): each product runs on one thread and the products are spread
/// over the calling rank's threads, so small blocks keep every core busy where one
/// multi-threaded GEMM per block would leave cores idle on each. Every product is
/// bit-identical to [`matmul`] of it (the kernels give the same bits for every thread count).
pub fn grouped_matmul(problems: &mut [GemmProblem<'_>]) {
    let how = (matmul_precision(), bf16_kernel());
    let threads = gemm_threads();
    if threads < 2 || problems.len() < 2 {
        for p in problems.iter_mut() {
            matmul_operands_as(p.out, p.a, p.b, p.dims, threads, how);
        }
        return;
    }
    problems
        .par_iter_mut()
        .with_max_len(1)
        .for_each(|p| matmul_operands_as(p.out, p.a, p.b, p.dims, 1, how));
}

/// A matmul operand rounded to a 16-bit format (or widened from one): borrowed when every value
/// already is one (a weight widened from 16-bit storage, a kept activation), else a pooled copy.
pub enum RoundedOperand<'a> {
    Exact(&'a [f32]),
    Rounded(crate::Tensor),
}

impl std::ops::Deref for RoundedOperand<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            RoundedOperand::Exact(x) => x,
            RoundedOperand::Rounded(t) => t.data(),
        }
    }
}

pub fn rounded_operand(x: &[f32], half: Half) -> RoundedOperand<'_> {
    // A read-only pass that stops at the first value needing rounding: much cheaper than a
    // copy of a large weight, and nothing is allocated.
    if x.par_chunks(1 << 14).all(|c| is_half_exact(c, half)) {
        return RoundedOperand::Exact(x);
    }
    let mut t = crate::Tensor::for_overwrite(&[x.len()]);
    round_operand_into(t.data_mut(), x, half);
    RoundedOperand::Rounded(t)
}

fn is_half_exact(x: &[f32], half: Half) -> bool {
    match half {
        Half::BF16 => x.iter().fold(0u32, |acc, v| acc | (v.to_bits() & 0xffff)) == 0,
        Half::F16 => {
            let mut r = [0.0f32; 1024];
            x.chunks(1024).all(|c| {
                let r = &mut r[..c.len()];
                round_to_half(r, c, half);
                r.iter().zip(c).all(|(a, b)| a.to_bits() == b.to_bits())
            })
        }
    }
}

fn round_operand_into(out: &mut [f32], x: &[f32], half: Half) {
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, i)| round_to_half(o, i, half));
}

/// Matmul with an explicit thread count (1 inside already-parallel kernels).
pub fn matmul_with_threads(out: &mut [f32], a: &[f32], b: &[f32], d: MatmulDims, threads: usize) {
    let MatmulDims { m, n, k, .. } = d;
    assert_eq!(out.len(), m * n, "matmul out");
    assert_eq!(a.len(), m * k, "matmul a");
    assert_eq!(b.len(), k * n, "matmul b");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !d.accumulate {
            out.fill(0.0);
        }
        return;
    }
    let (a_cs, a_rs) = if d.trans_a { (m, 1) } else { (1, k) };
    let (b_cs, b_rs) = if d.trans_b { (k, 1) } else { (1, n) };
    #[cfg(target_arch = "x86_64")]
    if super::sgemm::available() {
        use super::sgemm::{sgemm, MatRef};
        let a = MatRef {
            ptr: a.as_ptr(),
            rs: a_rs,
            cs: a_cs,
        };
        let b = MatRef {
            ptr: b.as_ptr(),
            rs: b_rs,
            cs: b_cs,
        };
        // Small products do not pay for a parallel dispatch.
        let threads = if m * n * k >= 1 << 18 { threads } else { 1 };
        // SAFETY: the strides above describe exactly the asserted buffer sizes; `out` is a
        // distinct mutable borrow.
        unsafe { sgemm(m, n, k, out.as_mut_ptr(), n, a, b, d.accumulate, threads) };
        return;
    }
    gemm_crate(out, a, b, d, threads);
}

/// Rows of a panel of [`syrk_with_threads`]: the panels' GEMMs stay large enough to run at the
/// GEMM's rate while the computed part stays close to the upper triangle (128 measured fastest
/// of 64, 128 and 256 on GPT M's matrices; BENCHMARKS.md).
const SYRK_PANEL: usize = 128;

/// `out = x·xᵀ` for `x` `[m, k]` (`out` `[m, m]`): the product is symmetric, so only the upper
/// triangle is computed, in panels of rows (`out[i.., i..] = x[i..i+p] · x[i..]ᵀ`), and mirrored
/// into the lower one — about half the multiply-adds of the full product once `m` spans a few
/// panels (BLAS's `ssyrk`; megatron-core's `--muon-use-syrk` kernel on a GPU). `out` comes out
/// exactly symmetric. Below two panels it is the full product.
pub fn syrk_with_threads(out: &mut [f32], x: &[f32], m: usize, k: usize, threads: usize) {
    assert_eq!(out.len(), m * m, "syrk out");
    assert_eq!(x.len(), m * k, "syrk x");
    if m < 2 * SYRK_PANEL {
        matmul_with_threads(out, x, x, MatmulDims::new(m, m, k).tb(), threads);
    } else {
        let mut panel = vec![0.0f32; SYRK_PANEL * m];
        for i0 in (0..m).step_by(SYRK_PANEL) {
            let rows = SYRK_PANEL.min(m - i0);
            let cols = m - i0;
            let p = &mut panel[..rows * cols];
            let lhs = &x[i0 * k..(i0 + rows) * k];
            let rhs = &x[i0 * k..];
            matmul_with_threads(p, lhs, rhs, MatmulDims::new(rows, cols, k).tb(), threads);
            for (r, row) in p.chunks_exact(cols).enumerate() {
                out[(i0 + r) * m + i0..(i0 + r + 1) * m].copy_from_slice(row);
            }
        }
    }
    mirror_upper(out, m);
}

/// Copies the upper triangle of the `[m, m]` matrix onto the lower one (also evening out a full
/// product's rounding), in tiles so that the column-wise reads stay in cache.
fn mirror_upper(out: &mut [f32], m: usize) {
    const TILE: usize = 32;
    for r0 in (0..m).step_by(TILE) {
        let r1 = (r0 + TILE).min(m);
        for c0 in (0..=r0).step_by(TILE) {
            let c1 = (c0 + TILE).min(m);
            for r in r0..r1 {
                for c in c0..c1.min(r) {
                    out[r * m + c] = out[c * m + r];
                }
            }
        }
    }
}

/// Rows of the output one call into the `gemm` crate computes (more are split into slabs of
/// this many).
///
/// Why: the crate works on the transposed, column-major product, so our rows are its columns,
/// and it sizes its packed right-hand panel by the L3 cache (its `kernel_params`: up to
/// ~15/16 of it, e.g. 30 MiB beside a 32 MiB L3) whenever there are that many columns. On a
/// 20-200 MiB model that one panel was the largest thing the memory prediction missed (a
/// 32000-word output layer's weight gradient: 26 MiB). Capped, the panel is at most
/// `2048 x kc` floats (4 MiB at kc = 512), the same on every machine, and
/// [`gemm_workspace`]'s probe, which multiplies at most [`PROBE_MAX_DIM`] rows, sees all of
/// it. Measured on Zen 4 (`megatron bench gemm --gemm-impl gemm-crate`, BENCHMARKS.md):
/// within the run-to-run noise of the uncapped calls.
pub const GEMM_CRATE_MAX_ROWS: usize = 2048;
const _: () = assert!(GEMM_CRATE_MAX_ROWS <= PROBE_MAX_DIM);

/// The same product on the `gemm` crate: the portable path, and the reference `megatron bench
/// gemm --gemm-impl versus` measures the engine against.
pub fn gemm_crate(out: &mut [f32], a: &[f32], b: &[f32], d: MatmulDims, threads: usize) {
    let MatmulDims { m, n, k, .. } = d;
    let (a_cs, a_rs) = if d.trans_a { (m, 1) } else { (1, k) };
    let (b_cs, b_rs) = if d.trans_b { (k, 1) } else { (1, n) };
    // Small products do not pay for thread start-up.
    let par = if threads > 1 && m * n * k >= 1 << 18 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    for i0 in (0..m).step_by(GEMM_CRATE_MAX_ROWS) {
        let h = GEMM_CRATE_MAX_ROWS.min(m - i0);
        // SAFETY: the strides above describe exactly the asserted buffer sizes; rows
        // `i0..i0 + h` of `out` and of `op(a)` start `i0 * n` and `i0 * a_rs` elements in.
        unsafe {
            gemm::gemm(
                h,
                n,
                k,
                out.as_mut_ptr().add(i0 * n),
                1,
                n as isize,
                d.accumulate,
                a.as_ptr().add(i0 * a_rs),
                a_cs as isize,
                a_rs as isize,
                b.as_ptr(),
                b_cs as isize,
                b_rs as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    }
}

/// Every row of `out` (rows of `bias.len()`) set to `bias`: where a product then accumulates
/// onto its bias (a linear layer's bias, blockwise per expert).
pub fn bias_rows_forward(out: &mut [f32], bias: &[f32]) {
    assert!(!bias.is_empty() && out.len().is_multiple_of(bias.len()));
    out.par_chunks_mut(bias.len())
        .for_each(|row| row.copy_from_slice(bias));
}

/// `dbias[c] += Σ_rows dout[row, c]`, with a fixed row chunking so the sum is deterministic.
pub fn bias_backward(dbias: &mut [f32], dout: &[f32], rows: usize, cols: usize) {
    assert_eq!(dout.len(), rows * cols);
    assert_eq!(dbias.len(), cols);
    const CHUNK: usize = 64;
    let partials: Vec<Vec<f32>> = dout
        .par_chunks(CHUNK * cols)
        .map(|chunk| {
            let mut p = vec![0.0f32; cols];
            for row in chunk.chunks_exact(cols) {
                for (a, b) in p.iter_mut().zip(row) {
                    *a += b;
                }
            }
            p
        })
        .collect();
    for p in partials {
        for (a, b) in dbias.iter_mut().zip(&p) {
            *a += b;
        }
    }
}

/// Linear layer forward, Megatron layout: `out[n, o] = inp[n, i] · weight[o, i]^T (+ bias[o])`.
/// The weight as stored: a `--bf16` weight's 16-bit copy goes to the packed kernels' packing as
/// it is, with no widened copy per call (the same bits either way, see [`Operand`]); so does
/// an input a `--bf16` layer wrote in bf16 (a norm's output, an MLP activation).
pub fn matmul_forward<'i>(
    out: &mut [f32],
    inp: impl Into<Operand<'i>>,
    weight: Operand<'_>,
    bias: Option<&[f32]>,
    n: usize,
    i: usize,
    o: usize,
) {
    let acc = if let Some(b) = bias {
        out.par_chunks_mut(o).for_each(|row| row.copy_from_slice(b));
        true
    } else {
        false
    };
    let mut d = MatmulDims::new(n, o, i).tb();
    d.accumulate = acc;
    matmul_operands(out, inp.into(), weight, d);
}

/// Linear layer backward: writes `dinp` (if given), accumulates `dweight` and `dbias`. The
/// forward input in either storage type, as in [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<'i>(
    dinp: Option<&mut [f32]>,
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: impl Into<Operand<'i>>,
    weight: Operand<'_>,
    n: usize,
    i: usize,
    o: usize,
) {
    if let Some(di) = dinp {
        matmul_operands(di, Operand::F32(dout), weight, MatmulDims::new(n, i, o));
    }
    let d = MatmulDims::new(o, i, n).ta().acc();
    matmul_operands(dweight, Operand::F32(dout), inp.into(), d);
    if let Some(db) = dbias {
        bias_backward(db, dout, n, o);
    }
}

/// Strides of one operand in a batched matmul, in elements between consecutive batch entries.
#[derive(Clone, Copy, Debug)]
pub struct BatchStrides {
    pub out: usize,
    pub a: usize,
    pub b: usize,
}

/// `batch` independent matmuls `out[i] (= or +=) op(a[i]) · op(b[i])`, entry `i` of each operand
/// starting `i * stride` elements in. A stride of 0 broadcasts that operand (e.g. one weight for
/// every batch entry).
pub fn matmul_batched(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    d: MatmulDims,
    batch: usize,
    s: BatchStrides,
) {
    let (on, an, bn) = (d.m * d.n, d.m * d.k, d.k * d.n);
    for i in 0..batch {
        matmul(
            &mut out[i * s.out..i * s.out + on],
            &a[i * s.a..i * s.a + an],
            &b[i * s.b..i * s.b + bn],
            d,
        );
    }
}

/// Bytes of GEMM workspace one thread keeps once it has multiplied (the f32 kernel's packing
/// panels), for memory predictions; 0 where that kernel does not run (see
/// [`gemm_workspace`] for the `gemm` crate's).
pub fn gemm_workspace_bytes_per_thread() -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::sgemm::available() {
        return super::sgemm::pack_bytes_per_thread();
    }
    0
}

/// What one product costs in GEMM workspace beyond its operands: `kept`, the bytes each GEMM
/// thread still holds after it (grown once, then reused by later calls); `kept_by_caller`, the
/// bytes the calling thread alone holds after it (the packed bf16 kernels pack into the
/// caller's buffers); `in_flight`, the bytes alive only while it runs (packed operands).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmWorkspace {
    pub kept: usize,
    pub kept_by_caller: usize,
    pub in_flight: usize,
}

/// [`GemmWorkspace`] of each of the products `shapes`, run in that order on one rank thread
/// whose matmuls have `precision` and bf16 instructions `kernel` (what `set_matmul_precision`
/// and `set_bf16_kernel` set): the packed bf16 kernels' buffers where a product runs on one
/// ([`super::matmul_packed::packed_gemm_bytes`], counted as they grow), the f32 kernels'
/// ([`gemm_workspace`]) elsewhere. The copies a 16-bit product on the f32 kernel rounds or
/// widens its operands into are not in it (they are skipped for operands already exact).
pub fn matmul_workspace(
    shapes: &[MatmulDims],
    precision: MatmulPrecision,
    kernel: Bf16Kernel,
) -> Vec<GemmWorkspace> {
    let packed: Vec<bool> = shapes
        .iter()
        .map(|&d| product_kernel((precision, kernel), d).is_some())
        .collect();
    let on_f32: Vec<MatmulDims> = shapes
        .iter()
        .zip(&packed)
        .filter_map(|(&d, &p)| (!p).then_some(d))
        .collect();
    let mut f32_calls = gemm_workspace(&on_f32).into_iter();
    let (mut a_max, mut b_max) = (0, 0);
    shapes
        .iter()
        .zip(packed)
        .map(|(&d, packed)| {
            if !packed {
                return f32_calls.next().unwrap_or_default();
            }
            let (a, b) = super::matmul_packed::packed_gemm_bytes(d);
            let grown = a.saturating_sub(a_max) + b.saturating_sub(b_max);
            (a_max, b_max) = (a_max.max(a), b_max.max(b));
            GemmWorkspace {
                kept_by_caller: grown,
                ..Default::default()
            }
        })
        .collect()
}

/// The packed-block kernel product `d` runs on under `precision` and bf16 instructions
/// `kernel`, if any (`None`: the f32 GEMM, on operands rounded or widened to f32 under 16-bit
/// precision): for predictions, which may be made before a rank thread sets them.
pub fn product_block_kernel(
    precision: MatmulPrecision,
    kernel: Bf16Kernel,
    d: MatmulDims,
) -> Option<BlockKernel> {
    product_kernel((precision, kernel), d)
}

/// [`GemmWorkspace`] of each of the products `shapes`, run in that order on one thread: our
/// kernel's panels where it runs (all kept, counted on the first), otherwise the `gemm`
/// crate's, measured by running each shape once on a probe thread under the counting allocator
/// (zeros where none is installed): a slab per thread that it keeps (the L2 cache's size) and
/// the packed operands of the call in flight.
///
/// Why measured: the crate sizes both from the cache hierarchy it detects and each call's
/// shape and transposition (its `kernel_params`), which is its own business; on a model of
/// 20 MiB the ~1.6 MiB they come to is 8 % of the peak.
pub fn gemm_workspace(shapes: &[MatmulDims]) -> Vec<GemmWorkspace> {
    let ours = gemm_workspace_bytes_per_thread();
    if shapes.is_empty() {
        return Vec::new();
    }
    if ours > 0 || !crate::alloc::installed() {
        return (0..shapes.len())
            .map(|i| GemmWorkspace {
                kept: if i == 0 { ours } else { 0 },
                ..Default::default()
            })
            .collect();
    }
    gemm_crate_workspace(shapes)
}

/// [`GemmWorkspace`] of each of the products `shapes` on [`gemm_crate`], measured on a probe
/// thread (zeros where the counting allocator is not installed).
pub fn gemm_crate_workspace(shapes: &[MatmulDims]) -> Vec<GemmWorkspace> {
    if !crate::alloc::installed() {
        return vec![GemmWorkspace::default(); shapes.len()];
    }
    // Each dimension clamped: the crate's blocking is bounded by the caches and
    // [`GEMM_CRATE_MAX_ROWS`], not the shape, so a large model's products pack no more than
    // these, and the probe stays fast.
    let shapes: Vec<MatmulDims> = shapes
        .iter()
        .map(|&d| MatmulDims {
            m: d.m.min(PROBE_MAX_DIM),
            n: d.n.min(probe_max_columns()),
            k: d.k.min(PROBE_MAX_DIM),
            ..d
        })
        .collect();
    let key: Vec<_> = shapes
        .iter()
        .map(|d| (d.m, d.n, d.k, d.trans_a, d.trans_b))
        .collect();
    // One probe at a time (ranks predicting at once would count in the same slot), each shape
    // list once per process (`megatron plan` predicts many layouts).
    type Probed =
        std::collections::HashMap<Vec<(usize, usize, usize, bool, bool)>, Vec<GemmWorkspace>>;
    static PROBED: std::sync::Mutex<Option<Probed>> = std::sync::Mutex::new(None);
    let mut probed = PROBED.lock().unwrap_or_else(|e| e.into_inner());
    let n = shapes.len();
    probed
        .get_or_insert_with(Default::default)
        .entry(key)
        .or_insert_with(|| {
            std::thread::spawn(move || {
                crate::alloc::set_probe_slot();
                shapes
                    .into_iter()
                    .map(|d| {
                        if d.m * d.n * d.k == 0 {
                            return GemmWorkspace::default();
                        }
                        let a = vec![0.0f32; d.m * d.k];
                        let b = vec![0.0f32; d.k * d.n];
                        let mut out = vec![0.0f32; d.m * d.n];
                        crate::alloc::start_epoch();
                        gemm_crate(&mut out, &a, &b, d, 1);
                        let (now, peak) = (
                            crate::alloc::current().reserved,
                            crate::alloc::peak().reserved,
                        );
                        GemmWorkspace {
                            kept: now.max(0) as usize,
                            in_flight: (peak - now).max(0) as usize,
                            ..Default::default()
                        }
                    })
                    .collect()
            })
            .join()
            .unwrap_or_else(|_| vec![GemmWorkspace::default(); n])
        })
        .clone()
}

/// The largest dimension [`gemm_workspace`] multiplies (products of at most 2 x 2048^3
/// flops, a few tenths of a second each on one core).
const PROBE_MAX_DIM: usize = 2048;

/// The most output columns [`gemm_workspace`]'s probe multiplies: [`PROBE_MAX_DIM`], or one more
/// than the `gemm` crate's packing line where that is higher.
///
/// Why: the crate works on the transposed product, so our columns are its rows, and it packs
/// its right-hand operand only where it has more than `get_rhs_packing_threshold()` (128) times
/// its f32 micro-kernel's rows: two vector registers, 16 under AVX2 (2048 columns), 32 under
/// AVX-512 (4096). Beyond that line what it packs no longer depends on the column count
/// (measured on Zen 3: the same 2.4 MB from 2496 to 16000 columns), but a probe clamped below
/// it packs nothing (a 2500-column product's 2048-column probe on AVX2).
fn probe_max_columns() -> usize {
    // The f32 lanes of the crate's kernel: its AVX-512, FMA (AVX2) or scalar one.
    #[cfg(target_arch = "x86_64")]
    let lanes = if is_x86_feature_detected!("avx512f") {
        16
    } else if is_x86_feature_detected!("fma") {
        8
    } else {
        1
    };
    #[cfg(not(target_arch = "x86_64"))]
    let lanes = 4;
    PROBE_MAX_DIM.max(gemm::get_rhs_packing_threshold() * 2 * lanes + 1)
}
