//! Bias + GELU fused, as Megatron's `bias_gelu_impl`. The pre-bias input is what backward
//! needs; the activation itself is recomputed there instead of stored. Two forms: the tanh
//! approximation (Megatron's fused kernel, GPT-2's `gelu_new`) and the exact `x Φ(x)` with
//! `erf` (torch's default `F.gelu`, Hugging Face BERT's `"gelu"`), which converted BERT
//! checkpoints need to reproduce their reference to 1e-4.

use super::operand::{staged_grad_rows, staged_rows, with_operands, Operand, OperandMut};
use super::simd::{multiversion, tanh};
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
const CHUNK: usize = 1 << 14;

/// Which GELU: `Tanh`, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, or `Erf`,
/// `0.5 x (1 + erf(x / sqrt 2))`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GeluApprox {
    #[default]
    Tanh,
    Erf,
}

#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
}

#[inline(always)]
fn gelu_tanh_grad(x: f32) -> f32 {
    let cube = 0.044715 * x * x * x;
    let t = tanh(SQRT_2_OVER_PI * (x + cube));
    let sech2 = 1.0 - t * t;
    0.5 * (1.0 + t) + 0.5 * x * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
}

/// `erf` from `libm` (correctly rounded to within an ulp; the SIMD `tanh` has no `erf`
/// counterpart, and converted checkpoints are not where speed matters).
#[inline(always)]
fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * FRAC_1_SQRT_2))
}

/// `Φ(x) + x φ(x)`.
#[inline(always)]
fn gelu_erf_grad(x: f32) -> f32 {
    0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2)) + x * FRAC_1_SQRT_2PI * (-0.5 * x * x).exp()
}

#[inline(always)]
pub(super) fn gelu(x: f32, a: GeluApprox) -> f32 {
    match a {
        GeluApprox::Tanh => gelu_tanh(x),
        GeluApprox::Erf => gelu_erf(x),
    }
}

#[inline(always)]
pub(super) fn gelu_grad(x: f32, a: GeluApprox) -> f32 {
    match a {
        GeluApprox::Tanh => gelu_tanh_grad(x),
        GeluApprox::Erf => gelu_erf_grad(x),
    }
}

/// `out = gelu(inp + bias)`, `inp` is `[rows, bias.len()]`.
pub fn bias_gelu_forward(out: &mut [f32], inp: &[f32], bias: &[f32], a: GeluApprox) {
    let c = bias.len();
    assert_eq!(out.len(), inp.len());
    assert_eq!(inp.len() % c, 0);
    let chunk = (CHUNK / c).max(1) * c;
    out.par_chunks_mut(chunk)
        .zip(inp.par_chunks(chunk))
        .for_each(|(o, x)| gelu_rows(o, x, bias, a));
}

/// `dinp = dout * gelu'(inp + bias)` (overwrites); the bias gradient is `bias_backward(dinp)`.
/// The saved input in either storage type (see [`Operand`]).
pub fn bias_gelu_backward<'i>(
    dinp: &mut [f32],
    dout: &[f32],
    inp: impl Into<Operand<'i>>,
    bias: &[f32],
    a: GeluApprox,
) {
    let c = bias.len();
    match inp.into() {
        Operand::F32(x) => bias_gelu_backward_f32(dinp, dout, x, bias, a),
        Operand::BF16(x) => staged_grad_rows(dinp, dout, x, (c, c), |di, dy, x| {
            bias_gelu_backward_f32(di, dy, x, bias, a)
        }),
    }
}

fn bias_gelu_backward_f32(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    bias: &[f32],
    a: GeluApprox,
) {
    let c = bias.len();
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(dout.len(), inp.len());
    let chunk = (CHUNK / c).max(1) * c;
    dinp.par_chunks_mut(chunk)
        .zip(dout.par_chunks(chunk))
        .zip(inp.par_chunks(chunk))
        .for_each(|((di, dy), x)| gelu_grad_rows(di, dy, x, bias, a));
}

/// `out = gelu(inp)`: the activation of a layer without biases (`--disable-bias-linear`).
pub fn gelu_forward(out: &mut [f32], inp: &[f32], a: GeluApprox) {
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| gelu_plain(o, x, a));
}

/// `dinp = dout * gelu'(inp)` (overwrites).
pub fn gelu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], a: GeluApprox) {
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(dout.len(), inp.len());
    dinp.par_chunks_mut(CHUNK)
        .zip(dout.par_chunks(CHUNK))
        .zip(inp.par_chunks(CHUNK))
        .for_each(|((di, dy), x)| gelu_grad_plain(di, dy, x, a));
}

multiversion! {
    fn gelu_plain(o: &mut [f32], x: &[f32], a: GeluApprox) {
        for (ov, xv) in o.iter_mut().zip(x) {
            *ov = gelu(*xv, a);
        }
    }
}

multiversion! {
    fn gelu_grad_plain(di: &mut [f32], dy: &[f32], x: &[f32], a: GeluApprox) {
        for ((dv, yv), xv) in di.iter_mut().zip(dy).zip(x) {
            *dv = yv * gelu_grad(*xv, a);
        }
    }
}

/// Computes or recomputes `gelu(inp + bias)` into `out` (backward needs it for the fc2 weight
/// gradient), each in either storage type: under `--bf16` the activation is written in bf16
/// for fc2's matmul, which would round it to that anyway.
pub fn bias_gelu_recompute<'o, 'i>(
    out: impl Into<OperandMut<'o>>,
    inp: impl Into<Operand<'i>>,
    bias: &[f32],
    a: GeluApprox,
) {
    let c = bias.len();
    match (inp.into(), out.into()) {
        (Operand::F32(x), OperandMut::F32(o)) => bias_gelu_forward(o, x, bias, a),
        (x, o) => with_operands!(x, o, |x, o| staged_rows(o, x, (c, c), |o, x| {
            bias_gelu_forward(o, x, bias, a)
        })),
    }
}

multiversion! {
    fn gelu_rows(o: &mut [f32], x: &[f32], bias: &[f32], a: GeluApprox) {
        let c = bias.len();
        for (orow, xrow) in o.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
            for ((ov, xv), bv) in orow.iter_mut().zip(xrow).zip(bias) {
                *ov = gelu(xv + bv, a);
            }
        }
    }
}

multiversion! {
    fn gelu_grad_rows(di: &mut [f32], dy: &[f32], x: &[f32], bias: &[f32], a: GeluApprox) {
        let c = bias.len();
        for ((dirow, dyrow), xrow) in di.chunks_exact_mut(c).zip(dy.chunks_exact(c)).zip(x.chunks_exact(c)) {
            for (((dv, yv), xv), bv) in dirow.iter_mut().zip(dyrow).zip(xrow).zip(bias) {
                *dv = yv * gelu_grad(xv + bv, a);
            }
        }
    }
}
