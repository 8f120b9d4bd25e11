//! `MLP`: fc1, fused bias + GELU, fc2. The fc2 bias is left to the layer's bias-dropout-add.

use super::config::TransformerConfig;
use crate::params::{Grads, Init, ParamId, Params};
use megatron_tensor::cpu::gelu::bias_gelu_recompute;
use megatron_tensor::cpu::{
    bias_backward, bias_gelu_backward, bias_gelu_forward, matmul_backward, matmul_forward,
};
use megatron_tensor::Tensor;

pub struct MLP {
    pub fc1_weight: ParamId,
    pub fc1_bias: ParamId,
    pub fc2_weight: ParamId,
    pub fc2_bias: ParamId,
    hidden: usize,
    ffn: usize,
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
        let out_std = cfg.output_layer_init_std();
        let mut reg = |name: &str, shape: &[usize], wd: bool, init: Init| {
            params.add(inits, format!("{p}.{name}"), shape, wd, init)
        };
        MLP {
            fc1_weight: reg(
                "linear_fc1.weight",
                &[f, h],
                true,
                Init::Normal(cfg.init_method_std),
            ),
            fc1_bias: reg("linear_fc1.bias", &[f], false, Init::Const(0.0)),
            fc2_weight: reg("linear_fc2.weight", &[h, f], true, Init::Normal(out_std)),
            fc2_bias: reg("linear_fc2.bias", &[h], false, Init::Const(0.0)),
            hidden: h,
            ffn: f,
        }
    }

    pub fn forward(&self, params: &Params, x: &Tensor, n: usize) -> (Tensor, MLPSaved) {
        let (h, f) = (self.hidden, self.ffn);
        let mut fc1_pre = Tensor::for_overwrite(&[n, f]);
        matmul_forward(
            fc1_pre.data_mut(),
            x.data(),
            params.get(self.fc1_weight),
            None,
            n,
            h,
            f,
        );
        let mut act = Tensor::for_overwrite(&[n, f]);
        bias_gelu_forward(act.data_mut(), fc1_pre.data(), params.get(self.fc1_bias));
        let mut out = Tensor::for_overwrite(&[n, h]);
        matmul_forward(
            out.data_mut(),
            act.data(),
            params.get(self.fc2_weight),
            None,
            n,
            f,
            h,
        );
        (out, MLPSaved { fc1_pre })
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &MLPSaved,
        x: &Tensor,
        dout: &Tensor,
        n: usize,
    ) -> Tensor {
        let (h, f) = (self.hidden, self.ffn);
        let mut act = Tensor::for_overwrite(&[n, f]);
        bias_gelu_recompute(
            act.data_mut(),
            saved.fc1_pre.data(),
            params.get(self.fc1_bias),
        );
        let mut dact = Tensor::for_overwrite(&[n, f]);
        matmul_backward(
            Some(dact.data_mut()),
            grads.get_mut(self.fc2_weight),
            None,
            dout.data(),
            act.data(),
            params.get(self.fc2_weight),
            n,
            f,
            h,
        );
        // Reuse the activation buffer for the pre-activation gradient.
        let mut dpre = act;
        bias_gelu_backward(
            dpre.data_mut(),
            dact.data(),
            saved.fc1_pre.data(),
            params.get(self.fc1_bias),
        );
        drop(dact);
        bias_backward(grads.get_mut(self.fc1_bias), dpre.data(), n, f);
        let mut dx = Tensor::for_overwrite(&[n, h]);
        matmul_backward(
            Some(dx.data_mut()),
            grads.get_mut(self.fc1_weight),
            None,
            dpre.data(),
            x.data(),
            params.get(self.fc1_weight),
            n,
            h,
            f,
        );
        dx
    }
}
