//! Bias + dropout + residual add fused, as Megatron's `bias_dropout_add`. The dropout mask is
//! regenerated from the counter-based RNG in backward, never stored.

use super::operand::{with_operands, with_scratch, Element, Operand, OperandMut};
use crate::rng::RngKey;
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// `out = residual + dropout(inp + bias)`; `inp`, `residual` and `out` are `[rows, bias.len()]`.
/// With `p == 0` no random numbers are drawn. `residual` and `out` may be bf16 (the residual
/// stream under `--bf16`, as Megatron keeps it): the sum is taken in f32 and rounded once.
pub fn bias_dropout_add_forward<'o, 'r>(
    out: impl Into<OperandMut<'o>>,
    inp: &[f32],
    bias: &[f32],
    residual: impl Into<Operand<'r>>,
    p: f32,
    key: RngKey,
) {
    dropout_add(out.into(), inp, Some(bias), residual.into(), p, key)
}

/// `out = residual + dropout(inp)`: [`bias_dropout_add_forward`] for layers without a bias
/// (`--disable-bias-linear`). Its backward is [`dropout_backward`] (same mask numbering).
pub fn dropout_add_forward<'o, 'r>(
    out: impl Into<OperandMut<'o>>,
    inp: &[f32],
    residual: impl Into<Operand<'r>>,
    p: f32,
    key: RngKey,
) {
    dropout_add(out.into(), inp, None, residual.into(), p, key)
}

fn dropout_add(
    out: OperandMut<'_>,
    inp: &[f32],
    bias: Option<&[f32]>,
    residual: Operand<'_>,
    p: f32,
    key: RngKey,
) {
    assert_eq!(out.len(), inp.len());
    assert_eq!(out.len(), residual.len());
    with_operands!(residual, out, |r, o| dropout_add_as(
        o, inp, bias, r, p, key
    ))
}

fn dropout_add_as<R: Element, O: Element>(
    out: &mut [O],
    inp: &[f32],
    bias: Option<&[f32]>,
    residual: &[R],
    p: f32,
    key: RngKey,
) {
    let c = bias.map_or(1, |b| b.len());
    let chunk = (CHUNK / c).max(1) * c;
    let scale = if p > 0.0 { 1.0 / (1.0 - p) } else { 1.0 };
    out.par_chunks_mut(chunk)
        .zip(inp.par_chunks(chunk))
        .zip(residual.par_chunks(chunk))
        .enumerate()
        .for_each(|(ci, ((o, x), r))| {
            let base = (ci * chunk) as u64;
            with_scratch(|sr, so| {
                let r = R::as_f32(r, sr);
                O::write_f32(o, so, |o| {
                    for (i, ((ov, xv), rv)) in o.iter_mut().zip(x).zip(r).enumerate() {
                        let v = match bias {
                            Some(b) => xv + b[i % c],
                            None => *xv,
                        };
                        let keep = p == 0.0 || key.keep(base + i as u64, p);
                        *ov = rv + if keep { v * scale } else { 0.0 };
                    }
                })
            })
        });
}

/// `dinp = dropout'(dout)` (overwrites) and `dbias += Σ_rows dinp`. The residual's gradient is
/// `dout` itself, which the caller keeps.
pub fn bias_dropout_add_backward(
    dinp: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    p: f32,
    key: RngKey,
) {
    let c = dbias.len();
    assert_eq!(dinp.len(), dout.len());
    let chunk = (CHUNK / c).max(1) * c;
    let scale = if p > 0.0 { 1.0 / (1.0 - p) } else { 1.0 };
    dinp.par_chunks_mut(chunk)
        .zip(dout.par_chunks(chunk))
        .enumerate()
        .for_each(|(ci, (di, dy))| {
            let base = (ci * chunk) as u64;
            for (i, (dv, yv)) in di.iter_mut().zip(dy).enumerate() {
                let keep = p == 0.0 || key.keep(base + i as u64, p);
                *dv = if keep { yv * scale } else { 0.0 };
            }
        });
    super::bias_backward(dbias, dinp, dinp.len() / c, c);
}

/// Plain dropout (`out = inp * mask / (1-p)`), e.g. on the embedding output.
pub fn dropout_forward(out: &mut [f32], inp: &[f32], p: f32, key: RngKey) {
    assert_eq!(out.len(), inp.len());
    let scale = if p > 0.0 { 1.0 / (1.0 - p) } else { 1.0 };
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(ci, (o, x))| {
            let base = (ci * CHUNK) as u64;
            for (i, (ov, xv)) in o.iter_mut().zip(x).enumerate() {
                let keep = p == 0.0 || key.keep(base + i as u64, p);
                *ov = if keep { xv * scale } else { 0.0 };
            }
        });
}

/// Backward of [`dropout_forward`]: the same mask applied to `dout`.
pub fn dropout_backward(dinp: &mut [f32], dout: &[f32], p: f32, key: RngKey) {
    dropout_forward(dinp, dout, p, key)
}
