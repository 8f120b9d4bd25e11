//! How activations are kept between forward and backward. Under `--bf16` the large saved
//! tensors (layer input, mid-layer residual, QKV, attention output, fc1 pre-activation) are
//! stored in bf16, as Megatron keeps bf16 activations, halving activation memory; backward
//! widens them back to f32 when it reads them. Small statistics (LayerNorm mean/rstd, attention
//! log-sum-exp) stay f32.

use megatron_tensor::{DType, Tensor};
use std::borrow::Cow;

/// The tensor as it is kept for backward on this thread.
pub fn keep(t: Tensor) -> Tensor {
    if megatron_tensor::cpu::matmul::bf16_matmuls() && t.dtype() == DType::F32 {
        t.to_dtype(DType::BF16)
    } else {
        t
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
