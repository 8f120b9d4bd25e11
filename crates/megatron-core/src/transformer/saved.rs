//! How activations are kept between forward and backward. Under `--bf16` (`--fp16`) the large saved
//! tensors (QKV, attention output, fc1 pre-activation) are stored in bf16 (f16), as Megatron keeps
//! 16-bit activations, halving activation memory; the residual stream's own tensors (layer input,
//! mid-layer residual) are kept as the stream stores them (bf16 under `--bf16`, f32 under `--fp16`
//! and `--fp32-residual-connection`), so backward reads what forward read. Small statistics
//! (LayerNorm mean/rstd, attention log-sum-exp) stay f32. Kernels read kept bf16 tensors as they
//! are (see `megatron_tensor::cpu::operand`: [`readable`]), widening rows in cache; f16 ones are
//! widened to f32 copies. `restore` is for the few that read f32 only (the attention output the
//! projection's backward reads, ring attention). A tensor recomputed in backward is rounded as its
//! kept copy would be ([`as_kept`], [`recomputed`]), so recomputation trains bit-identically.

use megatron_tensor::{DType, Tensor};
use std::borrow::Cow;

/// The tensor as it is kept for backward on this thread.
pub fn keep(t: Tensor) -> Tensor {
    use megatron_tensor::cpu::matmul::{matmul_precision, MatmulPrecision};
    match (matmul_precision(), t.dtype()) {
        (MatmulPrecision::BF16, DType::F32) => t.to_dtype(DType::BF16),
        (MatmulPrecision::F16, DType::F32) => t.to_dtype(DType::F16),
        _ => t,
    }
}

/// A kept tensor as f32 (borrowed when it already is).
pub fn restore(t: &Tensor) -> Cow<'_, Tensor> {
    if t.dtype() == DType::F32 {
        Cow::Borrowed(t)
    } else {
        Cow::Owned(t.to_dtype(DType::F32))
    }
}

/// `t` as f32, moved when it already is (a bf16 residual stream handed to f32-only code).
pub fn widened(t: Tensor) -> Tensor {
    match t.dtype() {
        DType::F32 => t,
        _ => t.to_dtype(DType::F32),
    }
}

/// A recomputed tensor with the values backward reads when it is kept instead: rounded to the
/// kept storage type and widened back. Recomputation then trains bit-identically to keeping
/// (under `--bf16` the kept attention output is bf16, and attention's backward reads it).
pub fn as_kept(t: Tensor) -> Tensor {
    widened(keep(t))
}

/// A recomputed tensor as backward reads the kept one ([`readable`] of [`keep`]): rounded to
/// the kept storage type, so recomputation trains bit-identically to keeping.
pub fn recomputed(t: Tensor) -> Tensor {
    let kept = keep(t);
    match kept.dtype() {
        DType::F16 => kept.to_dtype(DType::F32),
        _ => kept,
    }
}

/// A kept tensor as the kernels read it: as stored when f32 or bf16 (they widen bf16 rows in
/// cache), widened when f16 (no kernel reads f16 operands).
pub fn readable(t: &Tensor) -> Cow<'_, Tensor> {
    match t.dtype() {
        DType::F16 => Cow::Owned(t.to_dtype(DType::F32)),
        _ => Cow::Borrowed(t),
    }
}

/// The storage type for a tensor that only this thread's matmuls read (a norm's output before a
/// linear layer, the MLP's activation): bf16 under `--bf16`, whose matmuls round their operands
/// to bf16 anyway, so writing it rounded gives them the same bits at half the bytes; f32
/// otherwise (an `--fp16` matmul rounds to f16, which bf16 storage would not hold).
pub fn linear_input_dtype() -> DType {
    use megatron_tensor::cpu::matmul::{matmul_precision, MatmulPrecision};
    match matmul_precision() {
        MatmulPrecision::BF16 => DType::BF16,
        _ => DType::F32,
    }
}
