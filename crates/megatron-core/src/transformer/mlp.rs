//! `MLP`: fc1 (column-parallel), fused bias + GELU, fc2 (row-parallel). The fc2 bias is left to
//! the layer's bias-dropout-add.

use super::config::TransformerConfig;
use super::saved::{keep, restore};
use crate::params::{Grads, Init, ParamId, Params};
use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, Tp};
use megatron_comm::CommError;
use megatron_tensor::cpu::gelu::bias_gelu_recompute;
use megatron_tensor::cpu::{bias_backward, bias_gelu_backward, bias_gelu_forward};
use megatron_tensor::Tensor;

pub struct MLP {
    pub linear_fc1: ColumnParallelLinear,
    pub linear_fc2: RowParallelLinear,
    pub fc1_weight: ParamId,
    pub fc1_bias: ParamId,
    pub fc2_weight: ParamId,
    pub fc2_bias: ParamId,
    /// fc1 outputs on this TP rank.
    ffn_local: usize,
}

/// Only the fc1 output before its bias: the activation is recomputed in backward.
pub struct MLPSaved {
    pub fc1_pre: Tensor,
}

impl MLP {
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let (h, f) = (cfg.hidden_size, cfg.ffn_hidden_size);
        let p = format!("decoder.layers.{layer}.mlp");
        let linear_fc1 = ColumnParallelLinear::new(
            params,
            inits,
            &format!("{p}.linear_fc1"),
            h,
            f,
            true,
            cfg.init_method_std,
            false,
            true,
        );
        let linear_fc2 = RowParallelLinear::new(
            params,
            inits,
            &format!("{p}.linear_fc2"),
            f,
            h,
            cfg.output_layer_init_std(),
            true,
        );
        MLP {
            fc1_weight: linear_fc1.weight,
            fc1_bias: linear_fc1.bias.expect("fc1 has a bias"),
            fc2_weight: linear_fc2.weight,
            fc2_bias: linear_fc2.bias,
            ffn_local: linear_fc1.output_size_per_partition,
            linear_fc1,
            linear_fc2,
        }
    }

    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
    ) -> Result<(Tensor, MLPSaved), CommError> {
        let fc1_pre = self.linear_fc1.forward(params, tp, x)?;
        let mut act = Tensor::for_overwrite(fc1_pre.shape());
        bias_gelu_forward(act.data_mut(), fc1_pre.data(), &params.get(self.fc1_bias));
        let out = self.linear_fc2.forward(params, tp, &act)?;
        Ok((
            out,
            MLPSaved {
                fc1_pre: keep(fc1_pre),
            },
        ))
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: &MLPSaved,
        x: &Tensor,
        dout: Tensor,
    ) -> Result<Tensor, CommError> {
        let fc1_pre = restore(&saved.fc1_pre);
        let n = fc1_pre.shape()[0];
        let f = self.ffn_local;
        let mut act = Tensor::for_overwrite(&[n, f]);
        bias_gelu_recompute(act.data_mut(), fc1_pre.data(), &params.get(self.fc1_bias));
        let dact = self.linear_fc2.backward(params, grads, tp, &act, dout)?;
        // Reuse the activation buffer for the pre-activation gradient.
        let mut dpre = act;
        bias_gelu_backward(
            dpre.data_mut(),
            dact.data(),
            fc1_pre.data(),
            &params.get(self.fc1_bias),
        );
        drop(dact);
        bias_backward(grads.get_mut(self.fc1_bias), dpre.data(), n, f);
        self.linear_fc1.backward(params, grads, tp, x, dpre)
    }
}
