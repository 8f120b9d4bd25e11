//! Gated units with megatron-core's `--activation-func-clamp-value` and `--glu-linear-offset`
//! (gpt-oss's MLP): the gate clamped from above at `c`, the linear half to `[-c, c]`, then
//! `act(gate) * (linear + offset)`. Separate from the plain SwiGLU / Quick-GEGLU loops so those
//! keep their bits; backward passes a clamped element's gradient only inside the clamp's
//! range, boundaries included, as torch's `clamp` does.

use super::simd::{exp, multiversion};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// The clamp and offset of a gated unit. Compared by bits, so a configuration is `Eq`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GluLimits {
    /// Added to the linear half before the product (`--glu-linear-offset`).
    pub linear_offset: f32,
    /// `--activation-func-clamp-value`: the gate's upper bound and the linear half's bound.
    pub clamp: Option<f32>,
}

impl PartialEq for GluLimits {
    fn eq(&self, o: &Self) -> bool {
        self.linear_offset.to_bits() == o.linear_offset.to_bits()
            && self.clamp.map(f32::to_bits) == o.clamp.map(f32::to_bits)
    }
}
impl Eq for GluLimits {}

impl GluLimits {
    /// No clamp, no offset: the plain unit.
    pub const NONE: GluLimits = GluLimits {
        linear_offset: 0.0,
        clamp: None,
    };

    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }

    /// The clamped gate and whether its gradient passes.
    #[inline(always)]
    fn gate(&self, g: f32) -> (f32, f32) {
        match self.clamp {
            Some(c) if g > c => (c, 0.0),
            _ => (g, 1.0),
        }
    }

    /// The clamped linear half plus the offset, and whether its gradient passes.
    #[inline(always)]
    fn linear(&self, u: f32) -> (f32, f32) {
        let (v, pass) = match self.clamp {
            Some(c) if u > c => (c, 0.0),
            Some(c) if u < -c => (-c, 0.0),
            _ => (u, 1.0),
        };
        (v + self.linear_offset, pass)
    }
}

/// Which activation gates: `silu` (SwiGLU) or quick GELU `x * sigmoid(1.702 x)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateFunction {
    Silu,
    QuickGelu,
}

impl GateFunction {
    /// The sigmoid's input scale.
    #[inline(always)]
    fn alpha(self) -> f32 {
        match self {
            GateFunction::Silu => 1.0,
            GateFunction::QuickGelu => 1.702,
        }
    }
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `out[r, j] = act(clamp(gate)) * (clamp(up) + offset)` on `[gate | up]` rows of `2f`.
pub fn limited_glu_forward(
    out: &mut [f32],
    inp: &[f32],
    f: usize,
    gate: GateFunction,
    limits: GluLimits,
) {
    assert!(f > 0);
    assert_eq!(inp.len(), 2 * out.len());
    assert_eq!(out.len() % f, 0);
    let rows = (CHUNK / f).max(1);
    out.par_chunks_mut(rows * f)
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|(o, x)| limited_rows(o, x, f, gate.alpha(), limits));
}

/// `dinp` (`[rows, 2f]`, overwritten) from `dout` (`[rows, f]`) and the forward input.
pub fn limited_glu_backward(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    f: usize,
    gate: GateFunction,
    limits: GluLimits,
) {
    assert!(f > 0);
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(inp.len(), 2 * dout.len());
    let rows = (CHUNK / f).max(1);
    dinp.par_chunks_mut(rows * 2 * f)
        .zip(dout.par_chunks(rows * f))
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|((di, dy), x)| limited_backward_rows(di, dy, x, f, gate.alpha(), limits));
}

multiversion! {
    fn limited_rows(o: &mut [f32], x: &[f32], f: usize, alpha: f32, limits: GluLimits) {
        for (orow, xrow) in o.chunks_exact_mut(f).zip(x.chunks_exact(2 * f)) {
            let (g, u) = xrow.split_at(f);
            for j in 0..f {
                let (gc, _) = limits.gate(g[j]);
                let (uc, _) = limits.linear(u[j]);
                orow[j] = gc * sigmoid(alpha * gc) * uc;
            }
        }
    }
}

multiversion! {
    fn limited_backward_rows(di: &mut [f32], dy: &[f32], x: &[f32], f: usize, alpha: f32, limits: GluLimits) {
        for ((drow, dyrow), xrow) in di.chunks_exact_mut(2 * f).zip(dy.chunks_exact(f)).zip(x.chunks_exact(2 * f)) {
            let (g, u) = xrow.split_at(f);
            let (dg, du) = drow.split_at_mut(f);
            for j in 0..f {
                let (gc, gpass) = limits.gate(g[j]);
                let (uc, upass) = limits.linear(u[j]);
                let s = sigmoid(alpha * gc);
                du[j] = dyrow[j] * gc * s * upass;
                dg[j] = dyrow[j] * uc * s * (1.0 + alpha * gc * (1.0 - s)) * gpass;
            }
        }
    }
}
