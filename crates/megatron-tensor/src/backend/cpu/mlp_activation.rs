//! The MLP's activation on fc1's output, chosen in one place: GELU, ReLU (the original T5's
//! `DenseReluDense`), squared ReLU (megatron-core's `squared_relu`, `--squared-relu`; So et
//! al.'s Primer, Nemotron), or a gated unit on megatron-core's fused `[gate | up]` rows —
//! SwiGLU (`silu(gate) * up`, Llama), GeGLU (`gelu(gate) * up`, T5 v1.1 / Flan-T5's
//! `"gated-gelu"`, Shazeer 2020) or Quick-GEGLU (`--quick-geglu`), the gated ones with gpt-oss's
//! clamp and offset ([`GluLimits`]) where set. Backward recomputes from fc1's output. The fused bias + GELU
//! of Megatron's GPT stays in [`super::gelu`].

use super::gelu::{gelu, gelu_backward, gelu_forward, gelu_grad, GeluApprox};
use super::glu_limits::{limited_glu_backward, limited_glu_forward, GateFunction, GluLimits};
use super::operand::{staged_grad_rows, staged_rows, with_operands, Operand, OperandMut};
use super::quick_geglu::{quick_geglu_backward, quick_geglu_forward};
use super::simd::multiversion;
use super::swiglu::{swiglu_backward, swiglu_forward};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// Which activation, with the GELU's form where it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpActivation {
    Gelu(GeluApprox),
    Relu,
    SquaredRelu,
    /// With gpt-oss's clamp (`--activation-func-clamp-value`), if any.
    SwiGLU(GluLimits),
    GeGLU(GeluApprox),
    /// With gpt-oss's clamp and linear offset, if any.
    QuickGeGLU(GluLimits),
}

impl MlpActivation {
    /// fc1's outputs per activation output: 2 for the gated units.
    pub fn fc1_factor(self) -> usize {
        match self {
            MlpActivation::Gelu(_) | MlpActivation::Relu | MlpActivation::SquaredRelu => 1,
            MlpActivation::SwiGLU(_) | MlpActivation::GeGLU(_) | MlpActivation::QuickGeGLU(_) => 2,
        }
    }
}

/// `out` (`[rows, f]`) from fc1's output `inp` (`[rows, f x fc1_factor]`), each in either
/// storage type (see [`Operand`]): a bf16 side is staged a block of rows at a time, in cache.
pub fn mlp_activation_forward<'o, 'i>(
    out: impl Into<OperandMut<'o>>,
    inp: impl Into<Operand<'i>>,
    f: usize,
    act: MlpActivation,
) {
    let widths = (f, f * act.fc1_factor());
    match (inp.into(), out.into()) {
        (Operand::F32(x), OperandMut::F32(o)) => activation_forward_f32(o, x, f, act),
        (x, o) => with_operands!(x, o, |x, o| staged_rows(o, x, widths, |o, x| {
            activation_forward_f32(o, x, f, act)
        })),
    }
}

fn activation_forward_f32(out: &mut [f32], inp: &[f32], f: usize, act: MlpActivation) {
    match act {
        MlpActivation::Gelu(a) => gelu_forward(out, inp, a),
        MlpActivation::Relu => relu_forward(out, inp),
        MlpActivation::SquaredRelu => squared_relu_forward(out, inp),
        MlpActivation::SwiGLU(l) if l.is_none() => swiglu_forward(out, inp, f),
        MlpActivation::SwiGLU(l) => limited_glu_forward(out, inp, f, GateFunction::Silu, l),
        MlpActivation::GeGLU(a) => geglu_forward(out, inp, f, a),
        MlpActivation::QuickGeGLU(l) if l.is_none() => quick_geglu_forward(out, inp, f),
        MlpActivation::QuickGeGLU(l) => {
            limited_glu_forward(out, inp, f, GateFunction::QuickGelu, l)
        }
    }
}

/// `dinp` (overwritten, fc1's output's shape) from `dout` and fc1's output `inp` (in either
/// storage type).
pub fn mlp_activation_backward<'i>(
    dinp: &mut [f32],
    dout: &[f32],
    inp: impl Into<Operand<'i>>,
    f: usize,
    act: MlpActivation,
) {
    let widths = (f, f * act.fc1_factor());
    match inp.into() {
        Operand::F32(x) => activation_backward_f32(dinp, dout, x, f, act),
        Operand::BF16(x) => staged_grad_rows(dinp, dout, x, widths, |di, dy, x| {
            activation_backward_f32(di, dy, x, f, act)
        }),
    }
}

fn activation_backward_f32(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    f: usize,
    act: MlpActivation,
) {
    match act {
        MlpActivation::Gelu(a) => gelu_backward(dinp, dout, inp, a),
        MlpActivation::Relu => relu_backward(dinp, dout, inp),
        MlpActivation::SquaredRelu => squared_relu_backward(dinp, dout, inp),
        MlpActivation::SwiGLU(l) if l.is_none() => swiglu_backward(dinp, dout, inp, f),
        MlpActivation::SwiGLU(l) => limited_glu_backward(dinp, dout, inp, f, GateFunction::Silu, l),
        MlpActivation::GeGLU(a) => geglu_backward(dinp, dout, inp, f, a),
        MlpActivation::QuickGeGLU(l) if l.is_none() => quick_geglu_backward(dinp, dout, inp, f),
        MlpActivation::QuickGeGLU(l) => {
            limited_glu_backward(dinp, dout, inp, f, GateFunction::QuickGelu, l)
        }
    }
}

/// `out = max(inp, 0)`.
pub fn relu_forward(out: &mut [f32], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| relu_plain(o, x));
}

/// `dinp = dout` where `inp > 0`, else 0 (torch's choice at 0).
pub fn relu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32]) {
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(dout.len(), inp.len());
    dinp.par_chunks_mut(CHUNK)
        .zip(dout.par_chunks(CHUNK))
        .zip(inp.par_chunks(CHUNK))
        .for_each(|((di, dy), x)| relu_grad_plain(di, dy, x));
}

/// `out = max(inp, 0)²`.
pub fn squared_relu_forward(out: &mut [f32], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| squared_relu_plain(o, x));
}

/// `dinp = 2 max(inp, 0) dout`.
pub fn squared_relu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32]) {
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(dout.len(), inp.len());
    dinp.par_chunks_mut(CHUNK)
        .zip(dout.par_chunks(CHUNK))
        .zip(inp.par_chunks(CHUNK))
        .for_each(|((di, dy), x)| squared_relu_grad_plain(di, dy, x));
}

multiversion! {
    fn squared_relu_plain(o: &mut [f32], x: &[f32]) {
        for (ov, xv) in o.iter_mut().zip(x) {
            let r = xv.max(0.0);
            *ov = r * r;
        }
    }
}

multiversion! {
    fn squared_relu_grad_plain(di: &mut [f32], dy: &[f32], x: &[f32]) {
        for ((dv, yv), xv) in di.iter_mut().zip(dy).zip(x) {
            *dv = 2.0 * xv.max(0.0) * *yv;
        }
    }
}

multiversion! {
    fn relu_plain(o: &mut [f32], x: &[f32]) {
        for (ov, xv) in o.iter_mut().zip(x) {
            *ov = xv.max(0.0);
        }
    }
}

multiversion! {
    fn relu_grad_plain(di: &mut [f32], dy: &[f32], x: &[f32]) {
        for ((dv, yv), xv) in di.iter_mut().zip(dy).zip(x) {
            *dv = if *xv > 0.0 { *yv } else { 0.0 };
        }
    }
}

/// `out[r, j] = gelu(inp[r, j]) * inp[r, f + j]`; `inp` is `[rows, 2f]`, `out` `[rows, f]`.
pub fn geglu_forward(out: &mut [f32], inp: &[f32], f: usize, a: GeluApprox) {
    assert!(f > 0);
    assert_eq!(inp.len(), 2 * out.len());
    assert_eq!(out.len() % f, 0);
    let rows = (CHUNK / f).max(1);
    out.par_chunks_mut(rows * f)
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|(o, x)| geglu_rows(o, x, f, a));
}

/// `dinp` (`[rows, 2f]`, overwritten) from `dout` (`[rows, f]`) and the forward input.
pub fn geglu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], f: usize, a: GeluApprox) {
    assert!(f > 0);
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(inp.len(), 2 * dout.len());
    let rows = (CHUNK / f).max(1);
    dinp.par_chunks_mut(rows * 2 * f)
        .zip(dout.par_chunks(rows * f))
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|((di, dy), x)| geglu_backward_rows(di, dy, x, f, a));
}

multiversion! {
    fn geglu_rows(o: &mut [f32], x: &[f32], f: usize, a: GeluApprox) {
        for (orow, xrow) in o.chunks_exact_mut(f).zip(x.chunks_exact(2 * f)) {
            let (g, u) = xrow.split_at(f);
            for j in 0..f {
                orow[j] = gelu(g[j], a) * u[j];
            }
        }
    }
}

multiversion! {
    fn geglu_backward_rows(di: &mut [f32], dy: &[f32], x: &[f32], f: usize, a: GeluApprox) {
        for ((drow, dyrow), xrow) in di.chunks_exact_mut(2 * f).zip(dy.chunks_exact(f)).zip(x.chunks_exact(2 * f)) {
            let (g, u) = xrow.split_at(f);
            let (dg, du) = drow.split_at_mut(f);
            for j in 0..f {
                du[j] = dyrow[j] * gelu(g[j], a);
                dg[j] = dyrow[j] * u[j] * gelu_grad(g[j], a);
            }
        }
    }
}
