//! The conjugate region operators of DESIGN.md section 5, each a forward/backward pair over the
//! TP group. Tensors are `[rows, cols]` with rows = tokens (batch-major `b * s`); the
//! "sequence" dimension of Megatron's `[s, b, h]` is the token rows here, and a sequence-parallel
//! shard is a contiguous block of `rows / t` tokens (LayerNorm, dropout and residual are
//! per-token, so any equal split of the tokens is valid). With one rank every operator is the
//! identity and moves nothing.

use super::Tp;
use megatron_comm::{CommError, ReduceOp, TypedCollectives};
use megatron_tensor::cpu::{concat_columns, split_columns, Operand, OperandMut};
use megatron_tensor::Tensor;

fn dims(x: &Tensor) -> (usize, usize) {
    (x.shape()[0], x.shape()[1])
}

/// `f`: identity forward.
pub fn copy_to_tensor_model_parallel_region_forward(x: Tensor) -> Tensor {
    x
}

/// `f` backward: all-reduce of the input gradient.
pub fn copy_to_tensor_model_parallel_region_backward(
    tp: &mut Tp,
    mut dx: Tensor,
) -> Result<Tensor, CommError> {
    if tp.size() > 1 {
        tp.comm.all_reduce(dx.data_mut(), ReduceOp::Sum)?;
    }
    Ok(dx)
}

/// `g`: all-reduce forward.
pub fn reduce_from_tensor_model_parallel_region_forward(
    tp: &mut Tp,
    mut x: Tensor,
) -> Result<Tensor, CommError> {
    if tp.size() > 1 {
        tp.comm.all_reduce(x.data_mut(), ReduceOp::Sum)?;
    }
    Ok(x)
}

/// `g` backward: identity.
pub fn reduce_from_tensor_model_parallel_region_backward(dy: Tensor) -> Tensor {
    dy
}

fn split_last_dim(tp: &Tp, x: &Tensor) -> Tensor {
    let (r, c) = dims(x);
    let mut out = Tensor::for_overwrite(&[r, c / tp.size()]);
    split_columns(out.data_mut(), x.data(), r, c, tp.size(), tp.rank());
    out
}

fn gather_last_dim(tp: &mut Tp, x: &Tensor) -> Result<Tensor, CommError> {
    let (r, w) = dims(x);
    let p = tp.size();
    let mut blocks = Tensor::for_overwrite(&[p * r, w]);
    tp.comm.all_gather(x.data(), blocks.data_mut())?;
    let mut out = Tensor::for_overwrite(&[r, p * w]);
    concat_columns(out.data_mut(), blocks.data(), r, w, p);
    Ok(out)
}

/// Keeps this rank's slice of the last dimension.
pub fn scatter_to_tensor_model_parallel_region_forward(tp: &Tp, x: Tensor) -> Tensor {
    if tp.size() == 1 {
        return x;
    }
    split_last_dim(tp, &x)
}

pub fn scatter_to_tensor_model_parallel_region_backward(
    tp: &mut Tp,
    dy: Tensor,
) -> Result<Tensor, CommError> {
    if tp.size() == 1 {
        return Ok(dy);
    }
    gather_last_dim(tp, &dy)
}

/// All-gathers the last dimension.
pub fn gather_from_tensor_model_parallel_region_forward(
    tp: &mut Tp,
    x: Tensor,
) -> Result<Tensor, CommError> {
    if tp.size() == 1 {
        return Ok(x);
    }
    gather_last_dim(tp, &x)
}

pub fn gather_from_tensor_model_parallel_region_backward(tp: &Tp, dy: Tensor) -> Tensor {
    if tp.size() == 1 {
        return dy;
    }
    split_last_dim(tp, &dy)
}

/// The token rows of every rank, in the input's storage type (a `--bf16` norm's output travels
/// as bf16).
fn gather_rows(tp: &mut Tp, x: &Tensor) -> Result<Tensor, CommError> {
    let (r, c) = dims(x);
    let mut out = Tensor::for_overwrite_as(&[r * tp.size(), c], x.dtype());
    match (x.operand(), out.operand_mut()) {
        (Operand::F32(x), OperandMut::F32(o)) => tp.comm.all_gather(x, o)?,
        (Operand::BF16(x), OperandMut::BF16(o)) => tp.comm.all_gather_bf16(x, o)?,
        _ => unreachable!("the output has the input's dtype"),
    }
    Ok(out)
}

fn reduce_scatter_rows(tp: &mut Tp, x: &Tensor) -> Result<Tensor, CommError> {
    let (r, c) = dims(x);
    let p = tp.size();
    assert_eq!(r % p, 0, "{r} token rows do not split over {p} TP ranks");
    let mut out = Tensor::for_overwrite(&[r / p, c]);
    tp.comm
        .reduce_scatter(x.data(), out.data_mut(), ReduceOp::Sum)?;
    Ok(out)
}

fn split_rows(tp: &Tp, x: &Tensor) -> Tensor {
    let (r, c) = dims(x);
    let p = tp.size();
    assert_eq!(r % p, 0, "{r} token rows do not split over {p} TP ranks");
    let s = r / p;
    let mut out = Tensor::for_overwrite(&[s, c]);
    out.data_mut()
        .copy_from_slice(&x.data()[tp.rank() * s * c..(tp.rank() + 1) * s * c]);
    out
}

/// Sequence-parallel `f`: all-gather the token rows.
pub fn gather_from_sequence_parallel_region_forward(
    tp: &mut Tp,
    x: &Tensor,
) -> Result<Tensor, CommError> {
    gather_rows(tp, x)
}

/// Its backward: reduce-scatter the token rows.
pub fn gather_from_sequence_parallel_region_backward(
    tp: &mut Tp,
    dy: &Tensor,
) -> Result<Tensor, CommError> {
    reduce_scatter_rows(tp, dy)
}

/// Sequence-parallel `g`: reduce-scatter the token rows.
pub fn reduce_scatter_to_sequence_parallel_region_forward(
    tp: &mut Tp,
    x: &Tensor,
) -> Result<Tensor, CommError> {
    reduce_scatter_rows(tp, x)
}

/// Its backward: all-gather the token rows.
pub fn reduce_scatter_to_sequence_parallel_region_backward(
    tp: &mut Tp,
    dy: &Tensor,
) -> Result<Tensor, CommError> {
    gather_rows(tp, dy)
}

/// Keeps this rank's block of token rows.
pub fn scatter_to_sequence_parallel_region_forward(tp: &Tp, x: &Tensor) -> Tensor {
    split_rows(tp, x)
}

/// Its backward: all-gather the token rows.
pub fn scatter_to_sequence_parallel_region_backward(
    tp: &mut Tp,
    dy: &Tensor,
) -> Result<Tensor, CommError> {
    gather_rows(tp, dy)
}

/// The row-parallel output's `g`: all-reduce, or under sequence parallelism reduce-scatter to
/// this rank's token block.
pub fn reduce_to_output_region_forward(tp: &mut Tp, x: Tensor) -> Result<Tensor, CommError> {
    if tp.sequence_parallel {
        reduce_scatter_to_sequence_parallel_region_forward(tp, &x)
    } else {
        reduce_from_tensor_model_parallel_region_forward(tp, x)
    }
}

/// Its backward: identity, or under sequence parallelism all-gather of the token blocks.
pub fn reduce_to_output_region_backward(tp: &mut Tp, dy: Tensor) -> Result<Tensor, CommError> {
    if tp.sequence_parallel {
        reduce_scatter_to_sequence_parallel_region_backward(tp, &dy)
    } else {
        Ok(reduce_from_tensor_model_parallel_region_backward(dy))
    }
}
