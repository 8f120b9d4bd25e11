//! `TransformerBlock`: a stage's run of `TransformerLayer`s, forward and backward of one
//! micro-batch, with activation recomputation (Megatron's `--recompute-granularity full`:
//! uniform groups or the first layers of the block keep only their input and run again in
//! backward with the same dropout masks). Shared by every model built of transformer layers.

use super::layer::{TransformerLayer, TransformerLayerSaved};
use super::step::{Recompute, RecomputeMethod, StepContext};
use crate::params::{Grads, ParamId, Params};
use crate::tensor_parallel::Tp;
use megatron_comm::CommError;
use megatron_tensor::cpu::AttentionMask;
use megatron_tensor::Tensor;
use std::ops::Range;

/// What the block keeps of one micro-batch for backward.
pub struct TransformerBlockSaved {
    saved: Vec<SavedLayers>,
}

impl TransformerBlockSaved {
    /// Bytes of activations kept.
    pub fn size_in_bytes(&self) -> usize {
        self.saved.iter().map(|s| s.size_in_bytes()).sum()
    }
}

/// What a stage keeps of one layer, or of a group of layers under full recomputation.
enum SavedLayers {
    Layer(Box<TransformerLayerSaved>),
    /// The input of the chunk's layers `layers`, run again in backward.
    Recompute {
        input: Tensor,
        layers: Range<usize>,
    },
}

impl SavedLayers {
    fn size_in_bytes(&self) -> usize {
        match self {
            SavedLayers::Layer(s) => s.size_in_bytes(),
            SavedLayers::Recompute { input, .. } => input.size_in_bytes(),
        }
    }
}

/// The block's input in the residual stream's storage (see [`TransformerLayer::into_stream`]).
fn into_residual_stream(layers: &[TransformerLayer], x: Tensor) -> Tensor {
    match layers.first() {
        Some(l) => l.into_stream(x),
        None => x,
    }
}

/// The chunk's `n` layers in the groups full recomputation treats as one (`true`: keep only
/// the group's input), or one layer each.
fn recompute_groups(n: usize, recompute: Recompute) -> Vec<(Range<usize>, bool)> {
    match recompute {
        Recompute::Full {
            method: RecomputeMethod::Uniform,
            num_layers,
        } => {
            let k = num_layers.max(1);
            (0..n)
                .step_by(k)
                .map(|lo| (lo..(lo + k).min(n), true))
                .collect()
        }
        Recompute::Full {
            method: RecomputeMethod::Block,
            num_layers,
        } => (0..n).map(|i| (i..i + 1, i < num_layers)).collect(),
        _ => (0..n).map(|i| (i..i + 1, false)).collect(),
    }
}

/// Whether a forward is followed by a backward (keeps activations) or not (evaluation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardMode {
    Train,
    Eval,
}

/// Forward of `layers` on this rank's rows `x` of a `[b, t]` micro-batch.
#[allow(clippy::too_many_arguments)]
pub fn transformer_block_forward(
    layers: &[TransformerLayer],
    params: &Params,
    tp: &mut Tp,
    mut x: Tensor,
    (b, t): (usize, usize),
    ctx: &StepContext,
    mask: AttentionMask,
    mode: ForwardMode,
) -> Result<(Tensor, TransformerBlockSaved), CommError> {
    x = into_residual_stream(layers, x);
    let keep = mode == ForwardMode::Train;
    let mut saved = Vec::with_capacity(if keep { layers.len() } else { 0 });
    let recompute = if keep { ctx.recompute } else { Recompute::None };
    for (range, again) in recompute_groups(layers.len(), recompute) {
        if !keep || again {
            let input = keep.then(|| x.clone());
            for layer in &layers[range.clone()] {
                x = layer.forward_no_grad(params, tp, x, b, t, ctx, mask)?;
            }
            if let Some(input) = input {
                saved.push(SavedLayers::Recompute {
                    input,
                    layers: range,
                });
            }
        } else {
            for layer in &layers[range] {
                let (y, s) = layer.forward(params, tp, x, b, t, ctx, mask)?;
                saved.push(SavedLayers::Layer(Box::new(s)));
                x = y;
            }
        }
    }
    Ok((x, TransformerBlockSaved { saved }))
}

/// Backward of [`transformer_block_forward`]: `dx` is the gradient of the block's output;
/// returns the gradient of its input. `on_ready(offset)` after each layer, with the offset of
/// its first parameter (the layer's parameters' gradients are complete).
#[allow(clippy::too_many_arguments)]
pub fn transformer_block_backward(
    layers: &[TransformerLayer],
    params: &Params,
    grads: &mut Grads,
    tp: &mut Tp,
    saved: TransformerBlockSaved,
    mut dx: Tensor,
    (b, t): (usize, usize),
    ctx: &StepContext,
    mask: AttentionMask,
    on_ready: &mut dyn FnMut(usize),
) -> Result<Tensor, CommError> {
    let offset = |id: ParamId| params.metas[id.0].offset;
    let mut hi = layers.len();
    for seg in saved.saved.into_iter().rev() {
        let (range, kept) = match seg {
            SavedLayers::Layer(s) => (hi - 1..hi, vec![*s]),
            SavedLayers::Recompute { input, layers: r } => {
                // The group's forward again, from its input, with the same dropout masks.
                let again = ctx.recomputing();
                // The input as the stream stored it, so the forward reads what it first read.
                let mut x = input;
                let mut kept = Vec::with_capacity(r.len());
                for layer in &layers[r.clone()] {
                    let (y, s) = layer.forward(params, tp, x, b, t, &again, mask)?;
                    kept.push(s);
                    x = y;
                }
                (r, kept)
            }
        };
        for (layer, s) in layers[range.clone()].iter().zip(kept).rev() {
            dx = layer.backward(params, grads, tp, s, dx, b, t, ctx, mask)?;
            on_ready(offset(layer.input_layernorm.weight()));
        }
        hi = range.start;
    }
    Ok(dx)
}
