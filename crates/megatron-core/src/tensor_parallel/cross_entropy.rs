//! `vocab_parallel_cross_entropy`: the output layer's logits and the softmax cross entropy over
//! a vocabulary split across TP ranks, with three `[tokens]`-sized all-reduces per logits tile
//! (max, target logit, sum of exponentials); the full-vocabulary logits are never gathered.

use super::Tp;
use megatron_comm::{CommError, ReduceOp};
use megatron_tensor::cpu::matmul::Operand;
use megatron_tensor::cpu::{
    fused_classifier, vocab_parallel_classifier, ClassifierBias, ClassifierDims, ClassifierReduce,
};

/// Per-token losses for `x [n, c]` against this rank's output-weight shard (vocabulary rows
/// `[vocab_start, vocab_start + d.v)`; `bias`, if any, is this rank's slice of the output
/// layer's bias). With `grads`, `dx` gets this rank's partial input
/// gradient (the caller reduces it over TP) and the shard's weight gradient accumulates.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn vocab_parallel_cross_entropy(
    tp: &mut Tp,
    losses: &mut [f32],
    grads: Option<(&mut [f32], &mut [f32])>,
    x: &[f32],
    weight: Operand<'_>,
    bias: Option<ClassifierBias>,
    targets: &[u32],
    dloss: &[f32],
    d: ClassifierDims,
    vocab_start: usize,
) -> Result<(), CommError> {
    if tp.size() == 1 {
        fused_classifier(losses, grads, x, weight, bias, targets, dloss, d);
        return Ok(());
    }
    let comm = &mut *tp.comm;
    let mut reduce = |buf: &mut [f32], op: ClassifierReduce| {
        let op = match op {
            ClassifierReduce::Max => ReduceOp::Max,
            ClassifierReduce::Sum => ReduceOp::Sum,
        };
        comm.all_reduce(buf, op)
    };
    vocab_parallel_classifier(
        losses,
        grads,
        x,
        weight,
        bias,
        targets,
        dloss,
        d,
        vocab_start,
        &mut reduce,
    )
}
