//! How activations are kept between forward and backward. Under `--bf16` (`--fp16`) the large saved
//! tensors (layer input, mid-layer residual, QKV, attention output, fc1 pre-activation) are
//! stored in bf16 (f16), as Megatron keeps 16-bit activations, halving activation memory; backward
//! widens them back to f32 when it reads them. Small statistics (LayerNorm mean/rstd, attention
//! log-sum-exp) stay f32.

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
