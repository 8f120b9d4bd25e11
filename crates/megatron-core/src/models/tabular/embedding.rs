//! The tabular model's cell embedding: a learned linear map of each cell's input features
//! (`megatron_tensor::cpu::table_features`: standardised value, missing flag, random column
//! identity, target known or unknown) to the model width. Replicated over tensor parallelism
//! (it is small, and every rank needs every cell).

use crate::params::{Grads, Init, ParamId, Params};
use megatron_tensor::cpu::table_features::FEATURES;
use megatron_tensor::cpu::{matmul_backward, matmul_forward};
use megatron_tensor::Tensor;

pub struct CellEmbedding {
    pub weight: ParamId,
    pub bias: ParamId,
    emb: usize,
}

impl CellEmbedding {
    pub fn new(emb: usize, init_std: f32, params: &mut Params, inits: &mut Vec<Init>) -> Self {
        let weight = params.add(
            inits,
            "tabular.embedding.weight".into(),
            &[emb, FEATURES],
            true,
            Init::Normal(init_std),
        );
        let bias = params.add(
            inits,
            "tabular.embedding.bias".into(),
            &[emb],
            false,
            Init::Const(0.0),
        );
        CellEmbedding { weight, bias, emb }
    }

    /// `features`: `[cells, FEATURES]` -> `[cells, emb]`.
    pub fn forward(&self, params: &Params, features: &Tensor) -> Tensor {
        let n = features.shape()[0];
        let mut out = Tensor::for_overwrite(&[n, self.emb]);
        matmul_forward(
            out.data_mut(),
            features.data(),
            params.operand(self.weight).operand(),
            Some(&params.get(self.bias)),
            n,
            FEATURES,
            self.emb,
        );
        out
    }

    /// Accumulates the weight and bias gradients (the features are data: no input gradient).
    pub fn backward(&self, params: &Params, grads: &mut Grads, features: &Tensor, dout: &Tensor) {
        let n = features.shape()[0];
        let [dw, db] = grads.many_mut([self.weight, self.bias]);
        matmul_backward(
            None,
            dw,
            Some(db),
            dout.data(),
            features.data(),
            params.operand(self.weight).operand(),
            n,
            FEATURES,
            self.emb,
        );
    }
}
