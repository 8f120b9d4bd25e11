//! `MoELayer` (megatron-core's `transformer/moe/`), dropless, on one tensor-parallel rank: a
//! replicated fp32 router picks `topk` experts per token; each expert is the model's MLP
//! (GELU, or SwiGLU with a fused `[gate; up]` fc1) run on the rows routed to it; outputs are
//! summed weighted by the routing probabilities. The switch load-balancing loss and the z-loss
//! add their gradients to the router's logits in backward. Expert parallelism and the
//! all-to-all dispatcher are not built yet (the flags refuse them).

use super::config::{Activation, MoEConfig, RouterScore, TransformerConfig};
use super::saved::{keep, restore};
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use megatron_tensor::cpu::moe_permute::{
    gather_rows, gather_rows_scaled, rows_dot, scatter_add_rows,
};
use megatron_tensor::cpu::moe_router::{
    aux_loss, topk_router_backward, topk_router_forward, z_loss, RouterDims, ScoreFunction,
};
use megatron_tensor::cpu::{
    gelu_backward, gelu_forward, matmul, matmul_forward, swiglu_backward, swiglu_forward,
    MatmulDims,
};
use megatron_tensor::Tensor;

pub struct Expert {
    pub fc1: ParamId,
    pub fc2: ParamId,
}

pub struct MoELayer {
    pub router: ParamId,
    pub experts: Vec<Expert>,
    cfg: MoEConfig,
    activation: Activation,
    hidden: usize,
}

/// What backward needs: the routing and, per expert, its rows and fc1 output.
pub struct MoESaved {
    logits: Tensor,
    top_idx: Vec<u32>,
    probs: Vec<f32>,
    /// Per expert: (token rows, slot in the token's top-k, fc1 output, expert output).
    routed: Vec<(Vec<u32>, Vec<usize>, Tensor, Tensor)>,
}

impl MoESaved {
    pub fn size_in_bytes(&self) -> usize {
        self.logits.size_in_bytes()
            + self.probs.len() * 8
            + self
                .routed
                .iter()
                .map(|(r, _, h, y)| r.len() * 12 + h.size_in_bytes() + y.size_in_bytes())
                .sum::<usize>()
    }
}

impl MoELayer {
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let m = cfg.moe.clone().expect("an MoE layer needs --num-experts");
        let (h, f) = (cfg.hidden_size, m.ffn_hidden_size);
        let p = format!("decoder.layers.{layer}.mlp");
        let router = params.add_sharded(
            inits,
            format!("{p}.router.weight"),
            &[m.num_experts, h],
            true,
            Init::Normal(cfg.init_method_std),
            Sharding::Replicated,
        );
        let fc1_rows = match cfg.activation {
            Activation::Gelu => f,
            Activation::SwiGLU => 2 * f,
        };
        let experts = (0..m.num_experts)
            .map(|e| {
                let q = format!("{p}.experts.local_experts.{e}");
                Expert {
                    fc1: params.add_sharded(
                        inits,
                        format!("{q}.linear_fc1.weight"),
                        &[fc1_rows, h],
                        true,
                        Init::Normal(cfg.init_method_std),
                        Sharding::Replicated,
                    ),
                    fc2: params.add_sharded(
                        inits,
                        format!("{q}.linear_fc2.weight"),
                        &[h, f],
                        true,
                        Init::Normal(cfg.output_layer_init_std()),
                        Sharding::Replicated,
                    ),
                }
            })
            .collect();
        MoELayer {
            router,
            experts,
            cfg: m,
            activation: cfg.activation,
            hidden: h,
        }
    }

    fn dims(&self, tokens: usize) -> RouterDims {
        RouterDims {
            tokens,
            experts: self.cfg.num_experts,
            topk: self.cfg.topk,
            score: match self.cfg.score {
                RouterScore::Softmax => ScoreFunction::Softmax,
                RouterScore::Sigmoid => ScoreFunction::Sigmoid,
            },
            pre_softmax: self.cfg.pre_softmax,
            scaling: self.cfg.topk_scaling_factor,
        }
    }

    fn act_width(&self, h1: &Tensor) -> usize {
        match self.activation {
            Activation::Gelu => h1.shape()[1],
            Activation::SwiGLU => h1.shape()[1] / 2,
        }
    }

    fn activate(&self, h1: &Tensor) -> Tensor {
        let (n, f) = (h1.shape()[0], self.act_width(h1));
        let mut act = Tensor::for_overwrite(&[n, f]);
        match self.activation {
            Activation::Gelu => gelu_forward(act.data_mut(), h1.data()),
            Activation::SwiGLU => swiglu_forward(act.data_mut(), h1.data(), f),
        }
        act
    }

    /// `x` is `[tokens, h]`; returns `[tokens, h]`.
    pub fn forward(&self, params: &Params, x: &Tensor) -> (Tensor, MoESaved) {
        let (n, h) = (x.shape()[0], self.hidden);
        let (e, k) = (self.cfg.num_experts, self.cfg.topk);
        let mut logits = Tensor::for_overwrite(&[n, e]);
        matmul_forward(
            logits.data_mut(),
            x.data(),
            &params.get(self.router),
            None,
            n,
            h,
            e,
        );
        let mut top_idx = vec![0u32; n * k];
        let mut probs = vec![0.0f32; n * k];
        topk_router_forward(&mut top_idx, &mut probs, logits.data(), None, self.dims(n));
        let mut out = Tensor::zeros(&[n, h]);
        let mut routed = Vec::with_capacity(e);
        for (ei, ex) in self.experts.iter().enumerate() {
            let (mut rows, mut slots) = (Vec::new(), Vec::new());
            for (j, &i) in top_idx.iter().enumerate() {
                if i as usize == ei {
                    rows.push((j / k) as u32);
                    slots.push(j);
                }
            }
            let m = rows.len();
            let w1 = params.get(ex.fc1);
            let fc1 = w1.len() / h;
            let mut xe = Tensor::for_overwrite(&[m, h]);
            gather_rows(xe.data_mut(), x.data(), &rows, h);
            let mut h1 = Tensor::for_overwrite(&[m, fc1]);
            matmul_forward(h1.data_mut(), xe.data(), &w1, None, m, h, fc1);
            let act = self.activate(&h1);
            let f = act.shape()[1];
            let mut ye = Tensor::for_overwrite(&[m, h]);
            matmul_forward(
                ye.data_mut(),
                act.data(),
                &params.get(ex.fc2),
                None,
                m,
                f,
                h,
            );
            let scales: Vec<f32> = slots.iter().map(|&s| probs[s]).collect();
            scatter_add_rows(out.data_mut(), ye.data(), &rows, Some(&scales), h);
            routed.push((rows, slots, keep(h1), keep(ye)));
        }
        let saved = MoESaved {
            logits,
            top_idx,
            probs,
            routed,
        };
        (out, saved)
    }

    /// `dout` is `[tokens, h]`, `x` the forward input; returns `dx`. The load-balancing and
    /// z-loss gradients are scaled by `ctx.grad_scale`, as the language-model loss's are.
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &MoESaved,
        x: &Tensor,
        dout: &Tensor,
        ctx: &StepContext,
    ) -> Tensor {
        let (n, h) = (x.shape()[0], self.hidden);
        let (e, k) = (self.cfg.num_experts, self.cfg.topk);
        let mut dx = Tensor::zeros(&[n, h]);
        let mut dprobs = vec![0.0f32; n * k];
        for (ex, (rows, slots, h1, ye)) in self.experts.iter().zip(&saved.routed) {
            let m = rows.len();
            if m == 0 {
                continue;
            }
            let (h1, ye) = (restore(h1), restore(ye));
            // d(prob) = <dout[row], y_e[row]>; d(y_e) = prob * dout[row].
            let mut dp = vec![0.0f32; m];
            rows_dot(&mut dp, dout.data(), rows, ye.data(), h);
            for (&s, v) in slots.iter().zip(&dp) {
                dprobs[s] = *v;
            }
            let scales: Vec<f32> = slots.iter().map(|&s| saved.probs[s]).collect();
            let mut dye = Tensor::for_overwrite(&[m, h]);
            gather_rows_scaled(dye.data_mut(), dout.data(), rows, &scales, h);
            let act = self.activate(&h1);
            let f = act.shape()[1];
            let fc1 = h1.shape()[1];
            // fc2: dW2 += dye^T act, dact = dye W2.
            let w2 = params.get(ex.fc2);
            matmul(
                grads.get_mut(ex.fc2),
                dye.data(),
                act.data(),
                MatmulDims::new(h, f, m).ta().acc(),
            );
            let mut dact = Tensor::for_overwrite(&[m, f]);
            matmul(dact.data_mut(), dye.data(), &w2, MatmulDims::new(m, f, h));
            let mut dh1 = Tensor::for_overwrite(&[m, fc1]);
            match self.activation {
                Activation::Gelu => gelu_backward(dh1.data_mut(), dact.data(), h1.data()),
                Activation::SwiGLU => swiglu_backward(dh1.data_mut(), dact.data(), h1.data(), f),
            }
            // fc1: dW1 += dh1^T xe, dxe = dh1 W1.
            let mut xe = Tensor::for_overwrite(&[m, h]);
            gather_rows(xe.data_mut(), x.data(), rows, h);
            matmul(
                grads.get_mut(ex.fc1),
                dh1.data(),
                xe.data(),
                MatmulDims::new(fc1, h, m).ta().acc(),
            );
            let mut dxe = Tensor::for_overwrite(&[m, h]);
            matmul(
                dxe.data_mut(),
                dh1.data(),
                &params.get(ex.fc1),
                MatmulDims::new(m, h, fc1),
            );
            scatter_add_rows(dx.data_mut(), dxe.data(), rows, None, h);
        }
        // Router: through top-k, plus the auxiliary losses.
        let d = self.dims(n);
        let mut dlogits = vec![0.0f32; n * e];
        topk_router_backward(
            &mut dlogits,
            &dprobs,
            saved.logits.data(),
            &saved.top_idx,
            d,
        );
        if self.cfg.aux_loss_coeff > 0.0 {
            let mut tokens = vec![0.0f32; e];
            for &i in &saved.top_idx {
                tokens[i as usize] += 1.0;
            }
            let c = self.cfg.aux_loss_coeff;
            aux_loss(
                Some(&mut dlogits),
                saved.logits.data(),
                &tokens,
                n as f32,
                c,
                ctx.grad_scale,
                d,
            );
        }
        if self.cfg.z_loss_coeff > 0.0 {
            z_loss(
                Some(&mut dlogits),
                saved.logits.data(),
                self.cfg.z_loss_coeff,
                ctx.grad_scale,
                e,
            );
        }
        // dWr += dlogits^T x; dx += dlogits Wr.
        matmul(
            grads.get_mut(self.router),
            &dlogits,
            x.data(),
            MatmulDims::new(e, h, n).ta().acc(),
        );
        matmul(
            dx.data_mut(),
            &dlogits,
            &params.get(self.router),
            MatmulDims::new(n, h, e).acc(),
        );
        dx
    }
}
