//! Moving token rows to and from experts (the token dispatcher's local permutation): gather the
//! rows an expert processes, scatter its outputs back weighted by the routing probabilities,
//! and the per-row dot products that give those probabilities' gradients.

use super::operand::{with_operand, Element, Operand};
use rayon::prelude::*;

/// `out[i] = x[rows[i]]` (rows of `cols`).
pub fn gather_rows(out: &mut [f32], x: &[f32], rows: &[u32], cols: usize) {
    assert_eq!(out.len(), rows.len() * cols);
    out.par_chunks_mut(cols.max(1))
        .zip(rows.par_iter())
        .for_each(|(o, &r)| o.copy_from_slice(&x[r as usize * cols..(r as usize + 1) * cols]));
}

/// `out[rows[i]] += scales[i] * y[i]` (or `+= y[i]` without scales), in order of `i` (rows of
/// `cols`).
pub fn scatter_add_rows(
    out: &mut [f32],
    y: &[f32],
    rows: &[u32],
    scales: Option<&[f32]>,
    cols: usize,
) {
    assert_eq!(y.len(), rows.len() * cols);
    if let Some(s) = scales {
        assert_eq!(s.len(), rows.len());
    }
    for (i, &r) in rows.iter().enumerate() {
        let o = &mut out[r as usize * cols..(r as usize + 1) * cols];
        let s = scales.map_or(1.0, |s| s[i]);
        for (ov, yv) in o.iter_mut().zip(&y[i * cols..(i + 1) * cols]) {
            *ov += s * yv;
        }
    }
}

/// `out[i] = scales[i] * x[rows[i]]` (the gradient reaching an expert's output rows).
pub fn gather_rows_scaled(out: &mut [f32], x: &[f32], rows: &[u32], scales: &[f32], cols: usize) {
    assert_eq!(out.len(), rows.len() * cols);
    out.par_chunks_mut(cols.max(1))
        .zip(rows.par_iter().zip(scales.par_iter()))
        .for_each(|(o, (&r, &s))| {
            for (ov, xv) in o
                .iter_mut()
                .zip(&x[r as usize * cols..(r as usize + 1) * cols])
            {
                *ov = s * xv;
            }
        });
}

/// `out[i] = <x[rows[i]], y[i]>`. `y` may be bf16 (the expert outputs a `--bf16` layer keeps):
/// each value is widened as it is read, so the sums are those of its f32 copy, bit for bit.
pub fn rows_dot<'y>(
    out: &mut [f32],
    x: &[f32],
    rows: &[u32],
    y: impl Into<Operand<'y>>,
    cols: usize,
) {
    assert_eq!(out.len(), rows.len());
    with_operand!(y.into(), |y| rows_dot_as(out, x, rows, y, cols))
}

fn rows_dot_as<T: Element>(out: &mut [f32], x: &[f32], rows: &[u32], y: &[T], cols: usize) {
    out.par_iter_mut().enumerate().for_each(|(i, o)| {
        let r = rows[i] as usize;
        *o = x[r * cols..(r + 1) * cols]
            .iter()
            .zip(&y[i * cols..(i + 1) * cols])
            .map(|(a, b)| a * b.to_f32())
            .sum();
    });
}
