//! Once per step, after all micro-batches: what tensor parallelism adds to Megatron's
//! `finalize_model_grads`, and the global gradient norm over shards.

use super::Tp;
use crate::params::{Grads, Params};
use megatron_comm::{CommError, ReduceOp};
use megatron_tensor::cpu::global_norm_squared;

/// Under sequence parallelism each TP rank saw only its token block, so the gradients of
/// replicated parameters marked `sequence_parallel_grad` (LayerNorms, row-parallel biases,
/// position embeddings) are partial; those marked `tp_partial_grad` (query/key norms, applied
/// to each rank's own heads) are partial always: one all-reduce over TP of all of them together.
pub fn allreduce_sequence_parallel_grads(
    params: &Params,
    grads: &mut Grads,
    tp: &mut Tp,
) -> Result<(), CommError> {
    let sp = tp.sequence_parallel;
    let metas: Vec<_> = params
        .metas
        .iter()
        .filter(|m| (sp && m.sequence_parallel_grad) || m.tp_partial_grad)
        .collect();
    if metas.is_empty() || (!sp && tp.size() == 1) {
        return Ok(());
    }
    let mut buf: Vec<f32> = Vec::with_capacity(metas.iter().map(|m| m.numel).sum());
    for m in &metas {
        buf.extend_from_slice(&grads.data[m.offset..m.offset + m.numel]);
    }
    tp.comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    let mut at = 0;
    for m in &metas {
        grads.data[m.offset..m.offset + m.numel].copy_from_slice(&buf[at..at + m.numel]);
        at += m.numel;
    }
    Ok(())
}

/// Squared L2 norm of the gradients of this pipeline stage's part of the (unsharded) model:
/// split parameters count on every TP rank, replicated ones on TP rank 0 only (Megatron's
/// `param_is_not_tensor_parallel_duplicate`), summed over the TP group; copies of parameters
/// owned by another stage (`shared`) are left to their owner. Sum it over the pipeline group
/// for the whole model's norm.
pub fn grad_norm_squared_tp(params: &Params, grads: &Grads, tp: &mut Tp) -> Result<f64, CommError> {
    let lead = tp.rank() == 0;
    let mut local = 0.0f64;
    for m in &params.metas {
        if m.shared || (m.tp_replicated && !lead) {
            continue;
        }
        local += global_norm_squared(&grads.data[m.offset..m.offset + m.numel]);
    }
    if tp.size() == 1 {
        return Ok(local);
    }
    sum_f64(tp.comm, local)
}

/// Sums an f64 over a group as two f32 halves, so the total keeps ~48 bits.
pub fn sum_f64(comm: &mut dyn megatron_comm::Communicator, x: f64) -> Result<f64, CommError> {
    let hi = x as f32;
    let mut v = [hi, (x - hi as f64) as f32];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v[0] as f64 + v[1] as f64)
}

/// Global L2 norm of the gradients over the TP group (one pipeline stage).
pub fn grad_norm_tp(params: &Params, grads: &Grads, tp: &mut Tp) -> Result<f64, CommError> {
    Ok(grad_norm_squared_tp(params, grads, tp)?.sqrt())
}
