//! The shared expert's sigmoid gate (Qwen2-MoE's `shared_expert_gate`, megatron-core's
//! `moe_shared_expert_gate`): each token's shared-expert output scaled by `sigmoid(logit)`.

use super::operand::{with_operand, Element, Operand};
use rayon::prelude::*;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `gate[i] = sigmoid(logits[i])`, `out[i] = gate[i] * y[i]` (rows of `cols`).
pub fn sigmoid_gate_forward(
    out: &mut [f32],
    gate: &mut [f32],
    logits: &[f32],
    y: &[f32],
    cols: usize,
) {
    assert_eq!(out.len(), y.len());
    assert_eq!(gate.len(), logits.len());
    gate.iter_mut()
        .zip(logits)
        .for_each(|(g, l)| *g = sigmoid(*l));
    out.par_chunks_mut(cols.max(1))
        .zip(y.par_chunks(cols.max(1)))
        .zip(gate.par_iter())
        .for_each(|((o, yr), g)| o.iter_mut().zip(yr).for_each(|(a, b)| *a = g * b));
}

/// From `dout`: `dy[i] = gate[i] * dout[i]` and `dlogits[i] = <dout[i], y[i]> * g (1 - g)`.
/// `y` is the kept shared-expert output, read as stored (bf16 under `--bf16`, widened in
/// registers rather than through an f32 copy).
pub fn sigmoid_gate_backward<'y>(
    dy: &mut [f32],
    dlogits: &mut [f32],
    dout: &[f32],
    gate: &[f32],
    y: impl Into<Operand<'y>>,
    cols: usize,
) {
    assert_eq!(dy.len(), dout.len());
    with_operand!(y.into(), |y| sigmoid_gate_backward_as(
        dy, dlogits, dout, gate, y, cols
    ))
}

fn sigmoid_gate_backward_as<T: Element>(
    dy: &mut [f32],
    dlogits: &mut [f32],
    dout: &[f32],
    gate: &[f32],
    y: &[T],
    cols: usize,
) {
    assert_eq!(y.len(), dout.len());
    dy.par_chunks_mut(cols.max(1))
        .zip(dlogits.par_iter_mut())
        .zip(dout.par_chunks(cols.max(1)).zip(y.par_chunks(cols.max(1))))
        .zip(gate.par_iter())
        .for_each(|(((d, dl), (go, yr)), g)| {
            let mut dot = 0.0f32;
            for ((dv, gv), yv) in d.iter_mut().zip(go).zip(yr) {
                *dv = g * gv;
                dot += gv * yv.to_f32();
            }
            *dl = dot * g * (1.0 - g);
        });
}
