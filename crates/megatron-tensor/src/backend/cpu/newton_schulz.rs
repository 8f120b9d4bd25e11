//! Newton–Schulz orthogonalization, the heart of Muon (megatron-core's `--optimizer muon`, run by
//! NVIDIA's emerging-optimizers `newton_schulz`): `X ← a·X + (b·A + c·A²)·X` with `A = X·Xᵀ`,
//! from `X = G / ‖G‖_F`, which drives every singular value of `G` towards 1. The iteration runs
//! on the orientation whose Gram matrix is the smaller (`X` is `m × n` with `m ≤ n`), as the
//! reference does, unless the caller fixes it: when the columns of `X` are split over ranks
//! (megatron-core's `--muon-tp-mode distributed`) the Gram matrix and the norm are partial sums
//! that `sum` completes.
//!
//! Hand-written on the engine's GEMM (no crate orthogonalizes); the products are matmuls (the
//! two symmetric ones computed as their upper triangles), so the choice of GEMM kernel stays in
//! `matmul.rs`. A step costs `m²n + m³ + m²n` multiply-adds as full products and about
//! `m²n/2 + m³/2 + m²n` with the symmetric ones: a third less for a square matrix.

use super::cast::{round_to_half_inplace, Half};
use super::matmul::{matmul_with_threads, syrk_with_threads, MatmulDims};
use crate::threads::gemm_threads;

/// `x` is `[rows, cols]`, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewtonSchulzDims {
    pub rows: usize,
    pub cols: usize,
}

/// The precision of the iteration's products (megatron-core's `--muon-fp32-matmul-prec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsPrecision {
    /// f32 operands and results.
    F32,
    /// The iterate and every product rounded to bf16, products accumulated in f32: what the
    /// reference does under `medium` ("we explicitly convert to BF16 and back to FP32").
    Bf16,
}

/// Which side the Gram matrix is formed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsOrientation {
    /// The smaller side (the reference's `transpose=None`).
    Smaller,
    /// `X = G` (Gram over the columns of `G`).
    Rows,
    /// `X = Gᵀ` (Gram over the rows of `G`).
    Columns,
}

/// A run of the iteration.
#[derive(Clone, Copy, Debug)]
pub struct NewtonSchulz<'a> {
    /// `(a, b, c)` of each step, in order.
    pub coefficients: &'a [[f32; 3]],
    pub precision: NsPrecision,
    pub orientation: NsOrientation,
    /// Floor of the norm `G` is divided by (the reference's 1e-7).
    pub eps: f32,
}

/// `out = NS(x)`; `sum` completes a partial Gram matrix or squared norm (the identity when `X`
/// is whole on this rank).
pub fn newton_schulz(
    out: &mut [f32],
    x: &[f32],
    d: NewtonSchulzDims,
    ns: &NewtonSchulz<'_>,
    sum: &mut dyn FnMut(&mut [f32]),
) {
    let NewtonSchulzDims { rows, cols } = d;
    assert_eq!(x.len(), rows * cols, "newton_schulz x");
    assert_eq!(out.len(), rows * cols, "newton_schulz out");
    let transpose = match ns.orientation {
        NsOrientation::Smaller => rows > cols,
        NsOrientation::Rows => false,
        NsOrientation::Columns => true,
    };
    let (m, n) = if transpose {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let mut xw = if transpose {
        transposed(x, rows, cols)
    } else {
        x.to_vec()
    };
    let mut ss = [xw.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() as f32];
    sum(&mut ss);
    let inv = 1.0 / ss[0].sqrt().max(ns.eps);
    xw.iter_mut().for_each(|v| *v *= inv);
    let round = |v: &mut [f32]| {
        if ns.precision == NsPrecision::Bf16 {
            round_to_half_inplace(v, Half::BF16)
        }
    };
    round(&mut xw);
    let threads = gemm_threads();
    let mut a = vec![0.0f32; m * m];
    let mut b = vec![0.0f32; m * m];
    let mut bx = vec![0.0f32; m * n];
    for &[ca, cb, cc] in ns.coefficients {
        // A = X·Xᵀ and A² = A·Aᵀ (A is symmetric, exactly: the sum and the rounding work
        // element by element) are symmetric: the upper triangles are enough.
        syrk_with_threads(&mut a, &xw, m, n, threads);
        sum(&mut a);
        round(&mut a);
        syrk_with_threads(&mut b, &a, m, m, threads);
        b.iter_mut()
            .zip(&a)
            .for_each(|(bv, av)| *bv = cb * av + cc * *bv);
        round(&mut b);
        matmul_with_threads(&mut bx, &b, &xw, MatmulDims::new(m, n, m), threads);
        xw.iter_mut()
            .zip(&bx)
            .for_each(|(xv, t)| *xv = ca * *xv + t);
        round(&mut xw);
    }
    if transpose {
        out.copy_from_slice(&transposed(&xw, m, n));
    } else {
        out.copy_from_slice(&xw);
    }
}

fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}
