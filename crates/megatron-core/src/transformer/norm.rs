//! The residual stream's normalizations: `LayerNorm` (GPT) and `RMSNorm` (Llama), and [`Norm`],
//! the one a config chooses (`--normalization`). Both keep per-row statistics for backward and
//! recompute their output there.

use super::config::Normalization;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use megatron_tensor::cpu::layernorm::LayerNormDims;
use megatron_tensor::cpu::{
    layernorm_backward, layernorm_forward, rmsnorm_backward, rmsnorm_forward, RMSNormDims,
};
use megatron_tensor::{DType, Tensor};

/// A LayerNorm's parameters.
#[derive(Clone, Copy)]
pub struct LayerNorm {
    pub weight: ParamId,
    pub bias: ParamId,
    pub eps: f32,
}

/// Saved normalization statistics per row (`mean` is empty for RMSNorm).
pub struct LayerNormSaved {
    pub mean: Tensor,
    pub rstd: Tensor,
}

impl LayerNormSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.mean.size_in_bytes() + self.rstd.size_in_bytes()
    }
}

impl LayerNorm {
    pub fn new(
        name: &str,
        h: usize,
        eps: f32,
        sharding: Sharding,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let weight = params.add_sharded(
            inits,
            format!("{name}.weight"),
            &[h],
            false,
            Init::Const(1.0),
            sharding,
        );
        let bias = params.add_sharded(
            inits,
            format!("{name}.bias"),
            &[h],
            false,
            Init::Const(0.0),
            sharding,
        );
        LayerNorm { weight, bias, eps }
    }

    /// `x` in either storage type; an f32 output.
    pub fn forward(&self, params: &Params, x: &Tensor) -> (Tensor, LayerNormSaved) {
        self.forward_as(params, x, DType::F32)
    }

    /// The output in `dtype` (f32, or bf16 for a 16-bit matmul).
    pub fn forward_as(
        &self,
        params: &Params,
        x: &Tensor,
        dtype: DType,
    ) -> (Tensor, LayerNormSaved) {
        let (n, h) = (x.shape()[0], x.shape()[1]);
        let mut out = Tensor::for_overwrite_as(&[n, h], dtype);
        let mut mean = Tensor::for_overwrite(&[n]);
        let mut rstd = Tensor::for_overwrite(&[n]);
        let d = LayerNormDims {
            rows: n,
            cols: h,
            eps: self.eps,
        };
        layernorm_forward(
            out.operand_mut(),
            mean.data_mut(),
            rstd.data_mut(),
            x.operand(),
            &params.get(self.weight),
            &params.get(self.bias),
            d,
        );
        (out, LayerNormSaved { mean, rstd })
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &LayerNormSaved,
        x: &Tensor,
        dout: &Tensor,
    ) -> Tensor {
        let (n, h) = (x.shape()[0], x.shape()[1]);
        let mut dx = Tensor::for_overwrite(&[n, h]);
        let [dw, db] = grads.many_mut([self.weight, self.bias]);
        let d = LayerNormDims {
            rows: n,
            cols: h,
            eps: self.eps,
        };
        layernorm_backward(
            dx.data_mut(),
            dw,
            db,
            dout.data(),
            x.operand(),
            &params.get(self.weight),
            saved.mean.data(),
            saved.rstd.data(),
            d,
        );
        dx
    }
}

/// RMSNorm's parameter: a scale, no bias.
#[derive(Clone, Copy)]
pub struct RMSNorm {
    pub weight: ParamId,
    pub eps: f32,
}

impl RMSNorm {
    pub fn new(
        name: &str,
        h: usize,
        eps: f32,
        sharding: Sharding,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let weight = params.add_sharded(
            inits,
            format!("{name}.weight"),
            &[h],
            false,
            Init::Const(1.0),
            sharding,
        );
        RMSNorm { weight, eps }
    }

    fn dims(&self, x: &Tensor) -> RMSNormDims {
        RMSNormDims {
            rows: x.shape()[0],
            cols: x.shape()[1],
            eps: self.eps,
        }
    }

    /// As [`LayerNorm::forward_as`].
    pub fn forward_as(
        &self,
        params: &Params,
        x: &Tensor,
        dtype: DType,
    ) -> (Tensor, LayerNormSaved) {
        let d = self.dims(x);
        let mut out = Tensor::for_overwrite_as(&[d.rows, d.cols], dtype);
        let mut rstd = Tensor::for_overwrite(&[d.rows]);
        rmsnorm_forward(
            out.operand_mut(),
            rstd.data_mut(),
            x.operand(),
            &params.get(self.weight),
            d,
        );
        let mean = Tensor::for_overwrite(&[0]);
        (out, LayerNormSaved { mean, rstd })
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &LayerNormSaved,
        x: &Tensor,
        dout: &Tensor,
    ) -> Tensor {
        let d = self.dims(x);
        let mut dx = Tensor::for_overwrite(&[d.rows, d.cols]);
        rmsnorm_backward(
            dx.data_mut(),
            grads.get_mut(self.weight),
            dout.data(),
            x.operand(),
            &params.get(self.weight),
            saved.rstd.data(),
            d,
        );
        dx
    }
}

/// The normalization a config chooses.
#[derive(Clone, Copy)]
pub enum Norm {
    LayerNorm(LayerNorm),
    RMSNorm(RMSNorm),
}

impl Norm {
    /// Registers `{name}.weight` (and `{name}.bias` for LayerNorm), megatron-core's names: a
    /// norm of the residual stream (replicated; partial gradients under sequence parallelism).
    pub fn new(
        kind: Normalization,
        name: &str,
        h: usize,
        eps: f32,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let sharding = Sharding::ReplicatedSequenceParallel;
        Self::new_sharded(kind, name, h, eps, sharding, params, inits)
    }

    /// [`Norm::new`] with the parameters' sharding given.
    pub fn new_sharded(
        kind: Normalization,
        name: &str,
        h: usize,
        eps: f32,
        sharding: Sharding,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        match kind {
            Normalization::LayerNorm => {
                Norm::LayerNorm(LayerNorm::new(name, h, eps, sharding, params, inits))
            }
            Normalization::RMSNorm => {
                Norm::RMSNorm(RMSNorm::new(name, h, eps, sharding, params, inits))
            }
        }
    }

    /// The first parameter registered (gradients from here on are complete once backward has
    /// passed this norm).
    pub fn weight(&self) -> ParamId {
        match self {
            Norm::LayerNorm(n) => n.weight,
            Norm::RMSNorm(n) => n.weight,
        }
    }

    /// `x` in either storage type (a kept bf16 residual is read as it is); an f32 output.
    pub fn forward(&self, params: &Params, x: &Tensor) -> (Tensor, LayerNormSaved) {
        self.forward_as(params, x, DType::F32)
    }

    /// [`Norm::forward`] with the output in `dtype`: [`super::saved::linear_input_dtype`] where
    /// only linear layers read it.
    pub fn forward_as(
        &self,
        params: &Params,
        x: &Tensor,
        dtype: DType,
    ) -> (Tensor, LayerNormSaved) {
        match self {
            Norm::LayerNorm(n) => n.forward_as(params, x, dtype),
            Norm::RMSNorm(n) => n.forward_as(params, x, dtype),
        }
    }

    /// `x` (the forward input) in either storage type.
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &LayerNormSaved,
        x: &Tensor,
        dout: &Tensor,
    ) -> Tensor {
        match self {
            Norm::LayerNorm(n) => n.backward(params, grads, saved, x, dout),
            Norm::RMSNorm(n) => n.backward(params, grads, saved, x, dout),
        }
    }
}
