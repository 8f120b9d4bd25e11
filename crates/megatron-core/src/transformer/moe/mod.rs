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
pub mod router;
pub mod shared_experts;
pub mod token_dispatcher;

use super::config::{LoadBalancing, MoEConfig, RouterScore, TransformerConfig};
use super::layer::add_inplace;
use super::saved::{keep, linear_input_dtype, readable};
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::Tp;
use experts::GroupedMLP;
use megatron_comm::{CommError, Communicator, ReduceOp};
use megatron_tensor::cpu::moe_router::{
    aux_loss, topk_router_backward, topk_router_forward, z_loss, GroupLimit, RouterDims,
    ScoreFunction,
};
use megatron_tensor::cpu::{bias_backward, matmul, matmul_forward, MatmulDims};
use megatron_tensor::{DType, Tensor};
use router::{assign, update_expert_bias, Capacity};
use shared_experts::{SharedExpertMLP, SharedExpertSaved};
use std::sync::Mutex;
use token_dispatcher::DispatchPlan;

/// Where a layer's token rows sit in the micro-batch: row `i` of this rank is global row
/// `first + i` of `[sequences, seq_length]` (sequence parallelism gives each rank a block).
#[derive(Clone, Copy, Debug)]
pub struct TokenRows {
    pub first: usize,
    pub seq_length: usize,
}

/// Per-layer routing statistics since they were last taken (for the log line and metrics):
/// this rank's part, summed over ranks by the caller.
#[derive(Clone, Debug, Default)]
pub struct MoEMetrics {
    /// Rows each expert received from this rank's tokens.
    pub tokens_per_expert: Vec<f64>,
    /// Routed rows dropped over capacity, and all routed rows.
    pub dropped: f64,
    pub routed: f64,
    /// Load-balancing and z-loss values without their coefficients (this rank's share).
    pub load_balancing_loss: f64,
    pub z_loss: f64,
    /// Micro-batches counted.
    pub micro_batches: f64,
}

/// What the router keeps across micro-batches and steps.
struct RouterState {
    /// `router.expert_bias` (aux-loss-free balancing), fp32.
    expert_bias: Option<Vec<f32>>,
    /// Rows per expert routed by training forwards since the last bias update.
    step_tokens: Vec<f32>,
    metrics: MoEMetrics,
}

pub struct MoELayer {
    pub router: ParamId,
    /// The router's bias (megatron-core's `TopKRouter` has one unless `--disable-bias-linear`;
    /// gpt-oss's does), initialized as its weight.
    pub router_bias: Option<ParamId>,
    pub experts: GroupedMLP,
    pub shared_experts: Option<SharedExpertMLP>,
    /// Global layer number (the routing statistics').
    pub layer: usize,
    /// The layer's name prefix (`decoder.layers.3`; its buffers' names).
    prefix: String,
    cfg: MoEConfig,
    hidden: usize,
    state: Mutex<RouterState>,
}

/// What backward needs: the routing, the dispatch plan, the experts' input rows and fc1
/// outputs, and the expert output rows the probabilities multiplied.
pub struct MoESaved {
    logits: Tensor,
    top_idx: Vec<u32>,
    /// Top-k of the unbiased scores, where the expert bias changed the selection (the
    /// load-balancing loss counts these, as megatron-core does).
    aux_top_idx: Option<Vec<u32>>,
    plan: DispatchPlan,
    xe: Tensor,
    h1: Tensor,
    kept: Tensor,
    shared: Option<SharedExpertSaved>,
    rows: TokenRows,
}

impl MoESaved {
    pub fn size_in_bytes(&self) -> usize {
        self.logits.size_in_bytes()
            + self.top_idx.len() * 4
            + self.aux_top_idx.as_ref().map_or(0, |i| i.len() * 4)
            + self.plan.probs.len() * 8
            + self.xe.size_in_bytes()
            + self.h1.size_in_bytes()
            + self.kept.size_in_bytes()
            + self.shared.as_ref().map_or(0, |s| s.size_in_bytes())
    }
}

impl MoELayer {
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        prefix: &str,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let m = cfg.moe.clone().expect("an MoE layer needs --num-experts");
        let h = cfg.hidden_size;
        let router = params.add_sharded(
            inits,
            format!("{prefix}.mlp.router.weight"),
            &[m.num_experts, h],
            true,
            Init::Normal(cfg.init_method_std),
            Sharding::ReplicatedSequenceParallel,
        );
        let router_bias = m.biases.then(|| {
            params.add_sharded(
                inits,
                format!("{prefix}.mlp.router.bias"),
                &[m.num_experts],
                false,
                Init::Normal(cfg.init_method_std),
                Sharding::ReplicatedSequenceParallel,
            )
        });
        let which = params.experts.local_experts(m.num_experts);
        let experts = GroupedMLP::new(cfg, prefix, which, params, inits);
        let shared_experts = m
            .shared_expert_ffn
            .map(|f| SharedExpertMLP::new(cfg, prefix, f, m.shared_expert_gate, params, inits));
        let state = RouterState {
            expert_bias: m.expert_bias_update_rate.map(|_| vec![0.0; m.num_experts]),
            step_tokens: vec![0.0; m.num_experts],
            metrics: MoEMetrics::default(),
        };
        MoELayer {
            router,
            router_bias,
            experts,
            shared_experts,
            layer,
            prefix: prefix.to_string(),
            cfg: m,
            hidden: h,
            state: Mutex::new(state),
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
            group_limit: self
                .cfg
                .router_groups
                .map(|(groups, topk_groups)| GroupLimit {
                    groups,
                    topk_groups,
                }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, RouterState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `x` is `[tokens, h]` (this rank's tokens, at `rows`); returns `[tokens, h]`.
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        rows: TokenRows,
        ctx: &StepContext,
    ) -> Result<(Tensor, MoESaved), CommError> {
        let (n, h) = (x.shape()[0], self.hidden);
        let (e, k) = (self.cfg.num_experts, self.cfg.topk);
        let mut logits = Tensor::for_overwrite(&[n, e]);
        let bias = self.router_bias.map(|b| params.get(b));
        matmul_forward(
            logits.data_mut(),
            x.data(),
            params.operand(self.router).operand(),
            bias.as_deref(),
            n,
            h,
            e,
        );
        drop(bias);
        let mut top_idx = vec![0u32; n * k];
        let mut probs = vec![0.0f32; n * k];
        let bias = self.state().expert_bias.clone();
        topk_router_forward(
            &mut top_idx,
            &mut probs,
            logits.data(),
            bias.as_deref(),
            self.dims(n),
        );
        let aux_top_idx = bias.as_ref().map(|_| {
            let (mut idx, mut p) = (vec![0u32; n * k], vec![0.0f32; n * k]);
            topk_router_forward(&mut idx, &mut p, logits.data(), None, self.dims(n));
            idx
        });
        let capacity = self.cfg.capacity_factor.map(|factor| Capacity {
            factor,
            policy: self.cfg.drop_policy,
            pad: self.cfg.pad_to_capacity,
        });
        let (assignment, dropped) = assign(&top_idx, probs, n, k, e, capacity);
        if ctx.training && !ctx.recomputing {
            let mut st = self.state();
            let mut counts = vec![0.0f32; e];
            for &(_, slot) in &assignment.rows {
                if slot != token_dispatcher::NO_SLOT {
                    counts[top_idx[slot as usize] as usize] += 1.0;
                }
            }
            st.step_tokens
                .iter_mut()
                .zip(&counts)
                .for_each(|(a, b)| *a += b);
            let m = &mut st.metrics;
            m.tokens_per_expert.resize(e, 0.0);
            m.tokens_per_expert
                .iter_mut()
                .zip(&counts)
                .for_each(|(a, b)| *a += *b as f64);
            m.dropped += dropped as f64;
            m.routed += (n * k) as f64;
            m.micro_batches += 1.0;
        }
        let kind = self.cfg.dispatcher;
        let plan = DispatchPlan::new(&assignment, e, h, kind, tp)?;
        drop(assignment);
        // The experts' GEMMs read their input rows in the storage type of the layer's other
        // matmul inputs: bf16 under `--bf16` (the rounding they would do themselves), so the
        // rows are dispatched at half the bytes and kept as they arrive.
        let xe = match linear_input_dtype() {
            DType::F32 => plan.dispatch(x, tp)?,
            dtype => plan.dispatch(&x.to_dtype(dtype), tp)?,
        };
        let (y, h1) = self.experts.forward(params, &xe, &plan.local_counts);
        let (mut out, kept) = plan.combine(y, tp)?;
        let shared = match &self.shared_experts {
            Some(s) => {
                let (ys, saved) = s.forward(params, tp, x, ctx)?;
                add_inplace(&mut out, &ys);
                Some(saved)
            }
            None => None,
        };
        let saved = MoESaved {
            logits,
            top_idx,
            aux_top_idx,
            plan,
            xe: keep(xe),
            h1: keep(h1),
            kept: keep(kept),
            shared,
            rows,
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
        // The expert outputs combine kept, read as stored (bf16 under `--bf16`).
        let kept = readable(&saved.kept);
        let (dy, dprobs) = plan.combine_backward(dout, &kept, tp)?;
        drop(kept);
        // The experts read their kept input and fc1 output as stored (bf16 under `--bf16`).
        let (xe, h1) = (readable(&saved.xe), readable(&saved.h1));
        let dxe = self
            .experts
            .backward(params, grads, &xe, &h1, &dy, &plan.local_counts);
        drop((xe, h1, dy));
        let mut dx = plan.dispatch_backward(dxe, tp)?;
        if let (Some(s), Some(ss)) = (&self.shared_experts, &saved.shared) {
            let dxs = s.backward(params, grads, tp, ss, x, dout)?;
            add_inplace(&mut dx, &dxs);
        }
        // Router: through top-k, plus the auxiliary losses over the whole sequence.
        let d = self.dims(n);
        let mut dlogits = vec![0.0f32; n * e];
        topk_router_backward(
            &mut dlogits,
            &dprobs,
            saved.logits.data(),
            &saved.top_idx,
            d,
        );
        let (lb, zl) = self.aux_losses_backward(&mut dlogits, tp, saved, ctx)?;
        {
            let mut st = self.state();
            st.metrics.load_balancing_loss += lb;
            st.metrics.z_loss += zl;
        }
        // dWr += dlogits^T x; dbr += column sums; dx += dlogits Wr.
        if let Some(b) = self.router_bias {
            bias_backward(grads.get_mut(b), &dlogits, n, e);
        }
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

    /// Adds the load-balancing and z-loss gradients to `dlogits`; returns their values
    /// without coefficients (this rank's share of the whole sequence's).
    fn aux_losses_backward(
        &self,
        dlogits: &mut [f32],
        tp: &mut Tp,
        saved: &MoESaved,
        ctx: &StepContext,
    ) -> Result<(f64, f64), CommError> {
        let e = self.cfg.num_experts;
        let logits = saved.logits.data();
        let n = logits.len() / e;
        let d = self.dims(n);
        // The micro-batch's tokens are spread over the TP ranks (sequence parallelism) and the
        // context-parallel ranks: megatron-core's `tp_cp_group` for the loss statistics.
        let sp = tp.sequence_parallel;
        let cp = tp.cp_layout().size;
        let total = n * if sp { tp.size() } else { 1 } * cp;
        let top = saved.aux_top_idx.as_ref().unwrap_or(&saved.top_idx);
        let coeff = self.cfg.aux_loss_coeff;
        let mut lb = 0.0f64;
        match self.cfg.load_balancing {
            LoadBalancing::None => {}
            _ if coeff <= 0.0 => {}
            LoadBalancing::AuxLoss => {
                let mut tokens = vec![0.0f32; e];
                for &i in top {
                    tokens[i as usize] += 1.0;
                }
                sum_over_tp_cp(tp, sp, &mut tokens)?;
                let v = aux_loss(
                    Some(dlogits),
                    logits,
                    &tokens,
                    total as f32,
                    coeff,
                    ctx.grad_scale,
                    d,
                );
                lb = v as f64 / coeff as f64;
            }
            LoadBalancing::SeqAuxLoss => {
                // Per sequence: its tokens' counts over the whole sequence, the switch loss with
                // T = seq_length, averaged over the micro-batch's sequences.
                // A sequence's rows are consecutive here (under context parallelism its two
                // chunks); the loss of a sequence takes T = its whole length.
                let t = saved.rows.seq_length;
                let t_whole = t * cp;
                let seqs = total.div_ceil(t_whole);
                let (k, first) = (self.cfg.topk, saved.rows.first);
                let mut tokens = vec![0.0f32; seqs * e];
                for (j, &i) in top.iter().enumerate() {
                    let s = (first + j / k) / t;
                    tokens[s * e + i as usize] += 1.0;
                }
                sum_over_tp_cp(tp, sp, &mut tokens)?;
                let mut r = 0;
                while r < n {
                    let s = (first + r) / t;
                    let end = ((s + 1) * t - first).min(n);
                    let dims = RouterDims {
                        tokens: end - r,
                        ..d
                    };
                    let v = aux_loss(
                        Some(&mut dlogits[r * e..end * e]),
                        &logits[r * e..end * e],
                        &tokens[s * e..(s + 1) * e],
                        t_whole as f32,
                        coeff / seqs as f32,
                        ctx.grad_scale,
                        dims,
                    );
                    lb += v as f64 / coeff as f64;
                    r = end;
                }
            }
        }
        let mut zl = 0.0f64;
        if self.cfg.z_loss_coeff > 0.0 {
            // The mean over the whole sequence: this rank's share of it.
            let share = n as f32 / total as f32;
            let c = self.cfg.z_loss_coeff * share;
            let v = z_loss(Some(dlogits), logits, c, ctx.grad_scale, e);
            zl = v as f64 / self.cfg.z_loss_coeff as f64;
        }
        Ok((lb, zl))
    }

    /// Takes the statistics gathered since the last call.
    pub fn take_metrics(&self) -> MoEMetrics {
        let mut st = self.state();
        let e = self.cfg.num_experts;
        let mut m = std::mem::take(&mut st.metrics);
        m.tokens_per_expert.resize(e, 0.0);
        m
    }

    /// After a step's backward passes: sums the step's routed rows over the model's replicas
    /// (`tp`, then `dp`) and moves the expert bias toward balance (megatron-core's
    /// `_update_router_expert_bias` in `finalize_model_grads`). Collective over both groups.
    pub fn update_expert_bias(
        &self,
        tp: &mut Tp,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<(), CommError> {
        let Some(rate) = self.cfg.expert_bias_update_rate else {
            return Ok(());
        };
        let mut tokens = std::mem::take(&mut self.state().step_tokens);
        tokens.resize(self.cfg.num_experts, 0.0);
        tp.comm.all_reduce(&mut tokens, ReduceOp::Sum)?;
        if let Some(c) = dp {
            c.all_reduce(&mut tokens, ReduceOp::Sum)?;
        }
        let mut st = self.state();
        if let Some(b) = st.expert_bias.as_mut() {
            update_expert_bias(b, &tokens, rate);
        }
        st.step_tokens = vec![0.0; self.cfg.num_experts];
        Ok(())
    }

    /// The router's expert bias (a buffer saved with checkpoints), if it has one.
    pub fn expert_bias(&self) -> Option<(String, Vec<f32>)> {
        let b = self.state().expert_bias.clone()?;
        Some((self.expert_bias_name(), b))
    }

    pub fn expert_bias_name(&self) -> String {
        format!("{}.mlp.router.expert_bias", self.prefix)
    }

    /// Restores the expert bias from a checkpoint.
    pub fn set_expert_bias(&self, values: &[f32]) {
        if let Some(b) = self.state().expert_bias.as_mut() {
            b.copy_from_slice(values);
        }
    }
}

/// Sums per-expert counts over the ranks sharing the micro-batch's tokens: TP under sequence
/// parallelism, and the context-parallel group.
fn sum_over_tp_cp(tp: &mut Tp, sp: bool, counts: &mut [f32]) -> Result<(), CommError> {
    if sp {
        tp.comm.all_reduce(counts, ReduceOp::Sum)?;
    }
    if let Some(c) = tp.cp() {
        c.all_reduce(counts, ReduceOp::Sum)?;
    }
    Ok(())
}
