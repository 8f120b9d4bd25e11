//! `MoELayer` (megatron-core's `transformer/moe/`), dropless: a replicated fp32 router picks
//! `topk` experts per token; the token dispatcher moves each routed row to the rank holding
//! its expert (expert parallelism) and back; each expert is the model's MLP; outputs are summed
//! weighted by the routing probabilities. The switch load-balancing loss and the z-loss add
//! their gradients to the router's logits in backward.
//!
//! Under sequence parallelism each tensor-parallel rank routes its own block of tokens; the
//! load-balancing loss is taken over the whole sequence (tokens per expert summed over TP, as
//! megatron-core does) and the z-loss mean too, so every layout trains the one-rank model.

pub mod experts;
pub mod token_dispatcher;

use super::config::{MoEConfig, RouterScore, TransformerConfig};
use super::saved::{keep, restore};
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::Tp;
use experts::GroupedMLP;
use megatron_comm::{CommError, ReduceOp};
use megatron_tensor::cpu::moe_router::{
    aux_loss, topk_router_backward, topk_router_forward, z_loss, RouterDims, ScoreFunction,
};
use megatron_tensor::cpu::{matmul, matmul_forward, MatmulDims};
use megatron_tensor::Tensor;
use token_dispatcher::{DispatchPlan, Routing};

pub struct MoELayer {
    pub router: ParamId,
    pub experts: GroupedMLP,
    cfg: MoEConfig,
    hidden: usize,
}

/// What backward needs: the routing, the dispatch plan, the experts' input rows and fc1
/// outputs, and the expert output rows the probabilities multiplied.
pub struct MoESaved {
    logits: Tensor,
    routing: Routing,
    plan: DispatchPlan,
    xe: Tensor,
    h1: Tensor,
    kept: Tensor,
}

impl MoESaved {
    pub fn size_in_bytes(&self) -> usize {
        self.logits.size_in_bytes()
            + self.routing.probs.len() * 8
            + self.xe.size_in_bytes()
            + self.h1.size_in_bytes()
            + self.kept.size_in_bytes()
    }

    /// Rows this rank's tokens sent to each expert.
    pub fn tokens_per_expert(&self) -> &[usize] {
        &self.plan.tokens_per_expert
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
        let h = cfg.hidden_size;
        let router = params.add_sharded(
            inits,
            format!("decoder.layers.{layer}.mlp.router.weight"),
            &[m.num_experts, h],
            true,
            Init::Normal(cfg.init_method_std),
            Sharding::ReplicatedSequenceParallel,
        );
        let which = params.experts.local_experts(m.num_experts);
        let experts = GroupedMLP::new(cfg, layer, which, params, inits);
        MoELayer {
            router,
            experts,
            cfg: m,
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

    /// `x` is `[tokens, h]` (this rank's tokens); returns `[tokens, h]`.
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
    ) -> Result<(Tensor, MoESaved), CommError> {
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
        let mut routing = Routing {
            top_idx: vec![0u32; n * k],
            probs: vec![0.0f32; n * k],
            topk: k,
        };
        topk_router_forward(
            &mut routing.top_idx,
            &mut routing.probs,
            logits.data(),
            None,
            self.dims(n),
        );
        let kind = self.cfg.dispatcher;
        let plan = DispatchPlan::new(&routing, e, h, kind, tp)?;
        let xe = plan.dispatch(x, tp)?;
        let (y, h1) = self.experts.forward(params, &xe, &plan.local_counts);
        let (out, kept) = plan.combine(y, &routing.probs, tp)?;
        let saved = MoESaved {
            logits,
            routing,
            plan,
            xe: keep(xe),
            h1: keep(h1),
            kept: keep(kept),
        };
        Ok((out, saved))
    }

    /// `dout` is `[tokens, h]`, `x` the forward input; returns `dx`. The load-balancing and
    /// z-loss gradients are scaled by `ctx.grad_scale`, as the language-model loss's are.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: &MoESaved,
        x: &Tensor,
        dout: &Tensor,
        ctx: &StepContext,
    ) -> Result<Tensor, CommError> {
        let (n, h) = (x.shape()[0], self.hidden);
        let e = self.cfg.num_experts;
        let plan = &saved.plan;
        let kept = restore(&saved.kept);
        let (dy, dprobs) = plan.combine_backward(dout, &kept, &saved.routing.probs, tp)?;
        drop(kept);
        let (xe, h1) = (restore(&saved.xe), restore(&saved.h1));
        let dxe = self
            .experts
            .backward(params, grads, &xe, &h1, &dy, &plan.local_counts);
        drop((xe, h1, dy));
        let mut dx = plan.dispatch_backward(dxe, tp)?;
        // Router: through top-k, plus the auxiliary losses over the whole sequence.
        let d = self.dims(n);
        let mut dlogits = vec![0.0f32; n * e];
        topk_router_backward(
            &mut dlogits,
            &dprobs,
            saved.logits.data(),
            &saved.routing.top_idx,
            d,
        );
        let sp = tp.sequence_parallel;
        let total = if sp { n * tp.size() } else { n };
        if self.cfg.aux_loss_coeff > 0.0 {
            let mut tokens: Vec<f32> = plan.tokens_per_expert.iter().map(|&c| c as f32).collect();
            if sp {
                tp.comm.all_reduce(&mut tokens, ReduceOp::Sum)?;
            }
            aux_loss(
                Some(&mut dlogits),
                saved.logits.data(),
                &tokens,
                total as f32,
                self.cfg.aux_loss_coeff,
                ctx.grad_scale,
                d,
            );
        }
        if self.cfg.z_loss_coeff > 0.0 {
            // The mean over the whole sequence: this rank's share of it.
            let share = n as f32 / total as f32;
            z_loss(
                Some(&mut dlogits),
                saved.logits.data(),
                self.cfg.z_loss_coeff * share,
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
        Ok(dx)
    }
}
