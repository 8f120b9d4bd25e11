//! Kernel operands as they are stored: f32, or bf16 (a `--bf16` weight's 16-bit copy, an
//! activation kept or written in bf16).
//!
//! The packed matmul kernels read bf16 operands as they are. The row kernels (norms, MLP
//! activations) compute on f32 rows: they widen a bf16 input, or narrow into a bf16 output, one
//! task's rows at a time in a scratch that stays in cache, so a 16-bit activation costs no
//! separate conversion pass over memory (the pass `Tensor::to_dtype` would make). Widening is
//! exact and narrowing rounds to nearest even, as a 16-bit matmul rounds its operands, so a
//! kernel that writes bf16 for a matmul hands it the bits it would have rounded to itself.

use super::cast::{bf16_to_f32, f32_to_bf16};
use half::bf16;

#[derive(Clone, Copy)]
pub enum Operand<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
}

impl<'a> Operand<'a> {
    /// Elements `r` (a block of rows of a row-major operand).
    pub fn slice(&self, r: std::ops::Range<usize>) -> Operand<'a> {
        match *self {
            Operand::F32(x) => Operand::F32(&x[r]),
            Operand::BF16(x) => Operand::BF16(&x[r]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Operand::F32(x) => x.len(),
            Operand::BF16(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> From<&'a [f32]> for Operand<'a> {
    fn from(x: &'a [f32]) -> Self {
        Operand::F32(x)
    }
}

impl<'a> From<&'a Vec<f32>> for Operand<'a> {
    fn from(x: &'a Vec<f32>) -> Self {
        Operand::F32(x)
    }
}

impl<'a, const N: usize> From<&'a [f32; N]> for Operand<'a> {
    fn from(x: &'a [f32; N]) -> Self {
        Operand::F32(x)
    }
}

impl<'a> From<&'a [bf16]> for Operand<'a> {
    fn from(x: &'a [bf16]) -> Self {
        Operand::BF16(x)
    }
}

/// A kernel's output as it is stored (see [`Operand`]).
pub enum OperandMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
}

impl<'a> OperandMut<'a> {
    /// Elements `r` (a block of rows of a row-major output).
    pub fn slice(self, r: std::ops::Range<usize>) -> OperandMut<'a> {
        match self {
            OperandMut::F32(x) => OperandMut::F32(&mut x[r]),
            OperandMut::BF16(x) => OperandMut::BF16(&mut x[r]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            OperandMut::F32(x) => x.len(),
            OperandMut::BF16(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> From<&'a mut [f32]> for OperandMut<'a> {
    fn from(x: &'a mut [f32]) -> Self {
        OperandMut::F32(x)
    }
}

impl<'a> From<&'a mut Vec<f32>> for OperandMut<'a> {
    fn from(x: &'a mut Vec<f32>) -> Self {
        OperandMut::F32(x)
    }
}

impl<'a, const N: usize> From<&'a mut [f32; N]> for OperandMut<'a> {
    fn from(x: &'a mut [f32; N]) -> Self {
        OperandMut::F32(x)
    }
}

impl<'a> From<&'a mut [bf16]> for OperandMut<'a> {
    fn from(x: &'a mut [bf16]) -> Self {
        OperandMut::BF16(x)
    }
}

/// An element type a row kernel reads its input from or writes its output to.
pub trait Element: Copy + Send + Sync + 'static {
    /// One value as f32 (widening is exact).
    fn to_f32(self) -> f32;

    /// `x` as f32: itself, or widened into `scratch`.
    fn as_f32<'a>(x: &'a [Self], scratch: &'a mut Vec<f32>) -> &'a [f32];

    /// Runs `f` on f32 rows that end up in `out`: `out` itself, or `scratch` narrowed into it
    /// afterwards (`f` must write every element).
    fn write_f32(out: &mut [Self], scratch: &mut Vec<f32>, f: impl FnOnce(&mut [f32]));
}

impl Element for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline]
    fn as_f32<'a>(x: &'a [f32], _: &'a mut Vec<f32>) -> &'a [f32] {
        x
    }

    #[inline]
    fn write_f32(out: &mut [f32], _: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
        f(out)
    }
}

impl Element for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    fn as_f32<'a>(x: &'a [bf16], scratch: &'a mut Vec<f32>) -> &'a [f32] {
        let rows = scratch_of(scratch, x.len());
        bf16_to_f32(rows, x);
        rows
    }

    fn write_f32(out: &mut [bf16], scratch: &mut Vec<f32>, f: impl FnOnce(&mut [f32])) {
        let rows = scratch_of(scratch, out.len());
        f(rows);
        f32_to_bf16(out, rows);
    }
}

/// The first `n` elements of `scratch`, grown (zero-filled once) if it is shorter.
fn scratch_of(scratch: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if scratch.len() < n {
        scratch.resize(n, 0.0);
    }
    &mut scratch[..n]
}

thread_local! {
    /// Each thread's two staging scratches, reused across calls.
    static SCRATCH: std::cell::Cell<(Vec<f32>, Vec<f32>)> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

/// `f` with this thread's staging scratches. They are taken out for the call, so a kernel
/// that waits inside `f` and meanwhile runs another staged task on this thread (rayon's work
/// stealing) finds empty ones and grows its own instead of aliasing these.
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Vec<f32>, &mut Vec<f32>) -> R) -> R {
    let (mut a, mut b) = SCRATCH.with(|s| s.take());
    let r = f(&mut a, &mut b);
    SCRATCH.with(|s| s.set((a, b)));
    r
}

/// `$body` with `$x` bound to the input's typed slice (`&[f32]` or `&[bf16]`): one
/// monomorphized call per storage type.
macro_rules! with_operand {
    ($inp:expr, |$x:ident| $body:expr) => {
        match $inp {
            $crate::backend::cpu::operand::Operand::F32($x) => $body,
            $crate::backend::cpu::operand::Operand::BF16($x) => $body,
        }
    };
}
pub(crate) use with_operand;

/// `$body` with `$x` and `$o` bound to the input's and the output's typed slices.
macro_rules! with_operands {
    ($inp:expr, $out:expr, |$x:ident, $o:ident| $body:expr) => {
        match ($inp, $out) {
            (
                $crate::backend::cpu::operand::Operand::F32($x),
                $crate::backend::cpu::operand::OperandMut::F32($o),
            ) => $body,
            (
                $crate::backend::cpu::operand::Operand::F32($x),
                $crate::backend::cpu::operand::OperandMut::BF16($o),
            ) => $body,
            (
                $crate::backend::cpu::operand::Operand::BF16($x),
                $crate::backend::cpu::operand::OperandMut::F32($o),
            ) => $body,
            (
                $crate::backend::cpu::operand::Operand::BF16($x),
                $crate::backend::cpu::operand::OperandMut::BF16($o),
            ) => $body,
        }
    };
}
pub(crate) use with_operands;

/// Elements of the wider side a staged block holds: a few rows of an MLP's activation, well
/// inside L2 with both scratches.
const STAGED_BLOCK: usize = 1 << 14;

/// Runs the f32 kernel `f(out_rows, inp_rows)` over blocks of rows of `out` (`out_w` wide) and
/// `inp` (`in_w` wide) in parallel, each block's bf16 side widened or narrowed in a scratch.
/// Kernels whose rows are independent (activations) give the same bits as on the whole tensor.
pub(crate) fn staged_rows<X: Element, O: Element>(
    out: &mut [O],
    inp: &[X],
    (out_w, in_w): (usize, usize),
    f: impl Fn(&mut [f32], &[f32]) + Sync,
) {
    use rayon::prelude::*;
    let rows = (STAGED_BLOCK / out_w.max(in_w).max(1)).max(1);
    out.par_chunks_mut(rows * out_w)
        .zip(inp.par_chunks(rows * in_w))
        .for_each(|(o, x)| {
            with_scratch(|sx, so| {
                let x = X::as_f32(x, sx);
                O::write_f32(o, so, |o| f(o, x));
            })
        });
}

/// [`staged_rows`] for a backward kernel `f(dinp_rows, dout_rows, inp_rows)`: only the saved
/// input `inp` (`in_w` wide, as `dinp`) may be bf16; `dout` is `out_w` wide.
pub(crate) fn staged_grad_rows<X: Element>(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[X],
    (out_w, in_w): (usize, usize),
    f: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) {
    use rayon::prelude::*;
    let rows = (STAGED_BLOCK / out_w.max(in_w).max(1)).max(1);
    dinp.par_chunks_mut(rows * in_w)
        .zip(dout.par_chunks(rows * out_w))
        .zip(inp.par_chunks(rows * in_w))
        .for_each(|((di, dy), x)| with_scratch(|sx, _| f(di, dy, X::as_f32(x, sx))));
}
