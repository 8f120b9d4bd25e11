//! megatron-core's `SharedExpertMLP`: an MLP every token goes through beside the routed experts
//! (DeepSeek, Qwen-MoE), tensor-parallel like the dense MLP (under sequence parallelism it
//! gathers the sequence itself), optionally scaled per token by a sigmoid gate.

use super::super::config::TransformerConfig;
use super::super::mlp::{MLPSaved, MLP};
use super::super::saved::{keep, readable};
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::Tp;
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::moe_gate::{sigmoid_gate_backward, sigmoid_gate_forward};
use megatron_tensor::cpu::{matmul, matmul_forward, MatmulDims};
use megatron_tensor::Tensor;

pub struct SharedExpertMLP {
    pub mlp: MLP,
    /// `shared_experts.gate_weight` `[1, h]`.
    pub gate: Option<ParamId>,
    hidden: usize,
}

pub struct SharedExpertSaved {
    mlp: MLPSaved,
    /// With a gate: the MLP's output and the gate values.
    gated: Option<(Tensor, Vec<f32>)>,
}

impl SharedExpertSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.mlp.size_in_bytes()
            + self
                .gated
                .as_ref()
                .map_or(0, |(y, g)| y.size_in_bytes() + g.len() * 4)
    }
}

impl SharedExpertMLP {
    pub fn new(
        cfg: &TransformerConfig,
        prefix: &str,
        ffn: usize,
        gated: bool,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let p = format!("{prefix}.mlp.shared_experts");
        // No biases (megatron-core refuses shared experts with them; a model with
        // biases elsewhere gets shared experts without).
        let mlp = MLP::new_named(cfg, &p, ffn, false, params, inits);
        let gate = gated.then(|| {
            params.add_sharded(
                inits,
                format!("{p}.gate_weight"),
                &[1, cfg.hidden_size],
                true,
                Init::Normal(cfg.init_method_std),
                Sharding::ReplicatedSequenceParallel,
            )
        });
        SharedExpertMLP {
            mlp,
            gate,
            hidden: cfg.hidden_size,
        }
    }

    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        ctx: &StepContext,
    ) -> Result<(Tensor, SharedExpertSaved), CommError> {
        let (y, mlp) = self.mlp.forward(params, tp, x, ctx)?;
        let Some(g) = self.gate else {
            return Ok((y, SharedExpertSaved { mlp, gated: None }));
        };
        let (n, h) = (x.shape()[0], self.hidden);
        let mut logits = vec![0.0f32; n];
        matmul_forward(
            &mut logits,
            x.data(),
            params.operand(g).operand(),
            None,
            n,
            h,
            1,
        );
        let mut gate = vec![0.0f32; n];
        let mut out = Tensor::for_overwrite(&[n, h]);
        sigmoid_gate_forward(out.data_mut(), &mut gate, &logits, y.data(), h);
        let saved = SharedExpertSaved {
            mlp,
            gated: Some((keep(y), gate)),
        };
        Ok((out, saved))
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: &SharedExpertSaved,
        x: &Tensor,
        dout: &Tensor,
    ) -> Result<Tensor, CommError> {
        let (n, h) = (x.shape()[0], self.hidden);
        let (Some(g), Some((y, gate))) = (self.gate, saved.gated.as_ref()) else {
            let mut dy = Tensor::for_overwrite(dout.shape());
            dy.data_mut().copy_from_slice(dout.data());
            return self.mlp.backward(params, grads, tp, &saved.mlp, x, dy);
        };
        // The kept output as stored: bf16 is read in place.
        let y = readable(y);
        let mut dy = Tensor::for_overwrite(&[n, h]);
        let mut dlogits = vec![0.0f32; n];
        sigmoid_gate_backward(
            dy.data_mut(),
            &mut dlogits,
            dout.data(),
            gate,
            y.operand(),
            h,
        );
        drop(y);
        let mut dx = self.mlp.backward(params, grads, tp, &saved.mlp, x, dy)?;
        // dWg += dlogits^T x; dx += dlogits Wg.
        matmul(
            grads.get_mut(g),
            &dlogits,
            x.data(),
            MatmulDims::new(1, h, n).ta().acc(),
        );
        matmul(
            dx.data_mut(),
            &dlogits,
            &params.get(g),
            MatmulDims::new(n, h, 1).acc(),
        );
        Ok(dx)
    }
}
