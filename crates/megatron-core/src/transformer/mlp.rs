//! `MLP`: fc1 (column-parallel), the activation, fc2 (row-parallel). GELU: fc1's bias is fused
//! into the activation; ReLU and squared ReLU add it in the GEMM. Gated units (SwiGLU
//! `--swiglu`, GeGLU, Quick-GEGLU `--quick-geglu`): fc1
//! is megatron-core's fused `[gate; up]`, each rank holding `[gate_r; up_r]`, with its bias (if
//! any) added in the GEMM. The fc2 bias is left to the layer's bias-dropout-add.

use super::config::{Activation, TransformerConfig};
use super::saved::{keep, linear_input_dtype, readable, recomputed};
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params};
use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, Tp};
use megatron_comm::CommError;
use megatron_tensor::cpu::gelu::bias_gelu_recompute;
use megatron_tensor::cpu::GeluApprox;
use megatron_tensor::cpu::{
    bias_backward, bias_gelu_backward, mlp_activation_backward, mlp_activation_forward,
    MlpActivation,
};
use megatron_tensor::{DType, Tensor};

pub struct MLP {
    pub linear_fc1: ColumnParallelLinear,
    pub linear_fc2: RowParallelLinear,
    pub fc1_weight: ParamId,
    pub fc1_bias: Option<ParamId>,
    pub fc2_weight: ParamId,
    pub fc2_bias: Option<ParamId>,
    pub activation: Activation,
    kernel: MlpActivation,
    gelu: GeluApprox,
    /// Activation outputs on this TP rank (fc2's input features).
    ffn_local: usize,
}

/// Only the fc1 output (before GELU's bias): the activation is recomputed in backward. `None`
/// under selective recomputation of `mlp` (backward reruns fc1 on its recomputed input).
pub struct MLPSaved {
    pub fc1_pre: Option<Tensor>,
}

impl MLPSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.fc1_pre.as_ref().map_or(0, |t| t.size_in_bytes())
    }
}

impl MLP {
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let p = format!("decoder.layers.{layer}.mlp");
        let f = cfg.ffn_hidden_size;
        Self::new_named(cfg, &p, f, cfg.add_bias_linear, params, inits)
    }

    /// An MLP of width `f` under the names `{p}.linear_fc1` / `{p}.linear_fc2` (an MoE layer's
    /// shared experts).
    pub fn new_named(
        cfg: &TransformerConfig,
        p: &str,
        f: usize,
        bias: bool,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let fc1_name = format!("{p}.linear_fc1");
        let std = cfg.init_method_std;
        // GELU's bias is fused into the activation; the others add theirs in the GEMM.
        let linear_fc1 = match cfg.activation {
            Activation::Gelu => {
                ColumnParallelLinear::new(params, inits, &fc1_name, h, f, bias, std, false, true)
            }
            Activation::Relu | Activation::SquaredRelu => {
                ColumnParallelLinear::new(params, inits, &fc1_name, h, f, bias, std, false, false)
            }
            Activation::SwiGLU | Activation::GeGLU | Activation::QuickGeGLU => {
                ColumnParallelLinear::new_gated(params, inits, &fc1_name, h, f, bias, std)
            }
        };
        let linear_fc2 = RowParallelLinear::new(
            params,
            inits,
            &format!("{p}.linear_fc2"),
            f,
            h,
            bias,
            cfg.output_layer_init_std(),
            true,
        );
        MLP {
            fc1_weight: linear_fc1.weight,
            fc1_bias: linear_fc1.bias,
            fc2_weight: linear_fc2.weight,
            fc2_bias: linear_fc2.bias,
            activation: cfg.activation,
            kernel: cfg.activation_kernel(),
            gelu: cfg.gelu.kernel(),
            ffn_local: linear_fc2.input_size_per_partition,
            linear_fc1,
            linear_fc2,
        }
    }

    /// `activation(fc1_pre)`, `fc1_pre` in either storage type (kept in bf16 under `--bf16`),
    /// written in the storage type fc2's matmul reads ([`linear_input_dtype`]).
    fn activate(&self, params: &Params, fc1_pre: &Tensor) -> Tensor {
        let n = fc1_pre.shape()[0];
        let mut act = Tensor::for_overwrite_as(&[n, self.ffn_local], linear_input_dtype());
        let (out, inp) = (act.operand_mut(), fc1_pre.operand());
        match (self.activation, self.fc1_bias) {
            (Activation::Gelu, Some(b)) => bias_gelu_recompute(out, inp, &params.get(b), self.gelu),
            _ => mlp_activation_forward(out, inp, self.ffn_local, self.kernel),
        }
        act
    }

    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        ctx: &StepContext,
    ) -> Result<(Tensor, MLPSaved), CommError> {
        let fc1_pre = self.linear_fc1.forward(params, tp, x)?;
        let act = self.activate(params, &fc1_pre);
        let out = self.linear_fc2.forward(params, tp, &act)?;
        let fc1_pre = (!ctx.drops(|m| m.mlp)).then(|| keep(fc1_pre));
        Ok((out, MLPSaved { fc1_pre }))
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
        let fc1_pre = match &saved.fc1_pre {
            Some(t) => readable(t),
            None => std::borrow::Cow::Owned(recomputed(self.linear_fc1.forward(params, tp, x)?)),
        };
        let fc1_pre = &*fc1_pre;
        let n = fc1_pre.shape()[0];
        let f = self.ffn_local;
        let act = self.activate(params, fc1_pre);
        let dact = self.linear_fc2.backward(params, grads, tp, &act, dout)?;
        // The pre-activation gradient reuses the activation's buffer where it has fc1's shape
        // and is f32 (non-gated units outside `--bf16`).
        let same_buffer = !self.activation.is_gated() && act.dtype() == DType::F32;
        let mut dpre = if same_buffer {
            act
        } else {
            drop(act);
            Tensor::for_overwrite(fc1_pre.shape())
        };
        match (self.activation, self.fc1_bias) {
            (Activation::Gelu, Some(b)) => {
                let bias = params.get(b);
                bias_gelu_backward(
                    dpre.data_mut(),
                    dact.data(),
                    fc1_pre.operand(),
                    &bias,
                    self.gelu,
                );
                drop(bias);
                bias_backward(grads.get_mut(b), dpre.data(), n, f);
            }
            _ => mlp_activation_backward(
                dpre.data_mut(),
                dact.data(),
                fc1_pre.operand(),
                f,
                self.kernel,
            ),
        }
        drop(dact);
        self.linear_fc1.backward(params, grads, tp, x, dpre)
    }
}
