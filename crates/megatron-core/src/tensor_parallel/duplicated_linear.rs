//! A linear layer every tensor-parallel rank holds whole and runs on its own rows (Transformer
//! Engine's `parallel_mode="duplicated"`, megatron-core's MLA down projections): no
//! communication. Under sequence parallelism each rank sees only its token rows, so the weight's
//! gradient is partial and is all-reduced over TP with the LayerNorms'
//! (`Sharding::ReplicatedSequenceParallel`); without it every rank computes the same gradient.

use crate::params::{Grads, Init, ParamId, Params, Sharding};
use megatron_tensor::cpu::{matmul_backward, matmul_forward};
use megatron_tensor::Tensor;

/// `Y = X A^T`, no bias (MLA's down projections have none).
pub struct DuplicatedLinear {
    pub weight: ParamId,
    pub input_size: usize,
    pub output_size: usize,
}

impl DuplicatedLinear {
    pub fn new(
        params: &mut Params,
        inits: &mut Vec<Init>,
        prefix: &str,
        input_size: usize,
        output_size: usize,
        init_std: f32,
    ) -> Self {
        let weight = params.add_sharded(
            inits,
            format!("{prefix}.weight"),
            &[output_size, input_size],
            true,
            Init::Normal(init_std),
            Sharding::ReplicatedSequenceParallel,
        );
        DuplicatedLinear {
            weight,
            input_size,
            output_size,
        }
    }

    /// `x` is `[rows, in]`: whatever rows this rank holds.
    pub fn forward(&self, params: &Params, x: &Tensor) -> Tensor {
        let n = x.shape()[0];
        let mut y = Tensor::for_overwrite(&[n, self.output_size]);
        matmul_forward(
            y.data_mut(),
            x.operand(),
            params.operand(self.weight).operand(),
            None,
            n,
            self.input_size,
            self.output_size,
        );
        y
    }

    /// Accumulates the weight gradient; returns `dx`.
    pub fn backward(&self, params: &Params, grads: &mut Grads, x: &Tensor, dy: &Tensor) -> Tensor {
        let n = x.shape()[0];
        let mut dx = Tensor::for_overwrite(&[n, self.input_size]);
        matmul_backward(
            Some(dx.data_mut()),
            grads.get_mut(self.weight),
            None,
            dy.data(),
            x.operand(),
            params.operand(self.weight).operand(),
            n,
            self.input_size,
            self.output_size,
        );
        dx
    }
}
