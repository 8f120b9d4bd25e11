//! Megatron's `MegatronOptimizer` interface: what the training loop asks of an optimizer —
//! reduce the gradients over data parallelism, their norm, scale (unscale, clip), step, and the
//! full state for checkpoints — so the loop never branches on which optimizer it has. Replicated
//! state ([`PlainOptimizer`]) and the distributed optimizer (ZeRO-1, [`DistributedOptimizer`])
//! implement it, each with any [`UpdateRule`] (`--optimizer adam|sgd`). Each keeps the exact reduction order it always had, so
//! losses are bit-identical to before the interface.

use super::{DistributedOptimizer, Moment, MomentBuf, ReplicatedGrads, UpdateRule};
use crate::distributed::{ExpertGrads, GradBuffer};
use crate::params::{Grads, Params};
use crate::tensor_parallel::Tp;
use megatron_comm::{CommError, Communicator, ReduceOp, TypedCollectives};
use megatron_tensor::cpu::{global_norm_squared, scale_inplace};

/// When the distributed optimizer's all-gather of updated parameters runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamGather {
    /// In the step.
    Now,
    /// Later (`--overlap-param-gather`: during the next forward), via
    /// [`MegatronOptimizer::gather_params`] or an overlapped gather over [`MegatronOptimizer::grad_buffer`].
    Deferred,
}

/// A piece of optimizer state this rank writes to a sharded checkpoint: elements `local` of
/// parameter `param`'s local (tensor-parallel) tensor, with the fp32 values the optimizer
/// steps on and each moment of its update rule.
pub struct StatePiece<'a> {
    pub param: usize,
    pub local: std::ops::Range<usize>,
    pub value: &'a [f32],
    /// Widened to f32 when a moment is stored in bf16.
    pub moments: Vec<(Moment, std::borrow::Cow<'a, [f32]>)>,
}

/// A step's learning rates: `base` for every parameter but the word embedding and the output
/// layer, which take `decoupled` when `--decoupled-lr` gives them their own (Megatron's
/// `is_embedding_or_output_parameter` group).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLr {
    pub base: f32,
    pub decoupled: Option<f32>,
}

impl From<f32> for StepLr {
    fn from(lr: f32) -> Self {
        StepLr::uniform(lr)
    }
}

impl StepLr {
    /// One rate for every parameter.
    pub fn uniform(lr: f32) -> Self {
        StepLr {
            base: lr,
            decoupled: None,
        }
    }

    /// The rate of parameter `m` (the pipeline's tied copy of the embedding included).
    pub fn of(&self, m: &crate::ParamMeta) -> f32 {
        match self.decoupled {
            Some(lr)
                if m.name == "embedding.word_embeddings.weight"
                    || m.name == "output_layer.weight" =>
            {
                lr
            }
            _ => self.base,
        }
    }
}

/// Fills `out` with elements `local` of parameter `param`'s local tensor of a moment.
pub type MomentReader<'a> =
    dyn FnMut(Moment, usize, std::ops::Range<usize>, &mut [f32]) -> Result<(), String> + 'a;

pub trait MegatronOptimizer: Send {
    /// The buckets gradients are reduced in over data parallelism.
    fn grad_buffer(&self) -> &GradBuffer;

    /// Averages the gradients over DP: the buckets `remaining` (those an overlapped reduction
    /// left), or all of them.
    fn reduce_gradients(
        &mut self,
        grads: &mut Grads,
        remaining: Option<&[usize]>,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError>;

    /// Multiplies the gradients this rank steps on by `coeff` (loss unscaling, clipping).
    fn scale_grads(&self, grads: &mut Grads, coeff: f32);

    /// Σ g² of the gradients this rank steps on: non-finite exactly when one overflowed.
    fn local_grad_norm_squared(&self, params: &Params, grads: &Grads) -> f64;

    /// The whole model's squared gradient norm, every element counted once over TP, PP and DP.
    fn grad_norm_squared(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError>;

    /// Zeros among those gradients (`--log-num-zeros-in-grad`), counted once.
    fn count_zeros(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError>;

    /// The update rule's step with learning rates `lr` on the (clipped) gradients.
    fn step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: StepLr,
        weight_decay: f32,
        dp: &mut dyn Communicator,
        gather: ParamGather,
    ) -> Result<(), CommError>;

    /// Completes a [`ParamGather::Deferred`] all-gather.
    fn gather_params(
        &mut self,
        params: &mut Params,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError>;

    /// Bytes of optimizer state this rank holds (moments, and fp32 mains kept here).
    fn state_bytes(&self) -> usize;

    /// Bytes of the staging buffer the distributed optimizer's collectives use.
    fn comm_buffer_bytes(&self) -> usize {
        0
    }

    /// Optimizer steps taken (Adam's bias correction).
    fn step_count(&self) -> u64;

    /// megatron-core's name of the optimizer (`--optimizer`), recorded in checkpoints.
    fn name(&self) -> &'static str;

    /// The state parameter `param` has (the element-wise rule's moments, or Muon's momentum).
    fn moments_of(&self, param: usize) -> &'static [Moment];

    /// Elements of optimizer state this rank holds, all moments together.
    fn state_elements(&self) -> usize;

    /// The state data-parallel rank `dp_rank` of `dp` writes to a sharded checkpoint, each
    /// element once over the DP group: state replicated over DP is split between the ranks
    /// (whole parameters, balanced by size; Megatron's fully parallel save); sharded state is
    /// written as the shards it lives in.
    fn state_pieces<'a>(
        &'a self,
        params: &'a Params,
        dp_rank: usize,
        dp: usize,
    ) -> Vec<StatePiece<'a>>;

    /// Restores the moments this rank holds, and the step count, from a checkpoint, reading
    /// exactly the elements it holds.
    fn load_state(
        &mut self,
        params: &Params,
        step: u64,
        read: &mut MomentReader,
    ) -> Result<(), String>;
}

/// The whole model's optimizer state on every DP rank; gradients all-reduced bucket by bucket.
pub struct PlainOptimizer {
    pub rule: UpdateRule,
    /// One vector per moment of the rule, laid out like the parameters.
    pub moments: Vec<Vec<f32>>,
    /// Successful optimizer steps taken (bias correction).
    pub step: u64,
    pub grads: ReplicatedGrads,
}

impl PlainOptimizer {
    pub fn new(params: &Params, rule: UpdateRule, buffer: GradBuffer) -> Self {
        PlainOptimizer {
            rule,
            moments: rule.new_state(params.numel()),
            step: 0,
            grads: ReplicatedGrads::new(buffer),
        }
    }

    /// The same optimizer with the experts reduced over their own group (`buffer` must then
    /// cover the dense parameters only).
    pub fn with_experts(mut self, expert: ExpertGrads) -> Self {
        self.grads.expert = Some(expert);
        self
    }
}

/// Which DP rank writes each parameter of DP-replicated state: largest first to the rank with
/// the fewest bytes so far (the same answer on every rank), so the ranks' files come out about
/// equal.
pub(super) fn balanced_writers(params: &Params, dp: usize) -> Vec<usize> {
    balanced_writers_of(params, dp, |_| true)
}

/// [`balanced_writers`] over the parameters `which` picks (the others get rank 0).
pub(super) fn balanced_writers_of(
    params: &Params,
    dp: usize,
    which: impl Fn(&crate::ParamMeta) -> bool,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..params.metas.len())
        .filter(|&i| which(&params.metas[i]))
        .collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(params.metas[i].numel), i));
    let mut load = vec![0usize; dp];
    let mut writer = vec![0usize; params.metas.len()];
    for i in order {
        let r = (0..dp).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        writer[i] = r;
        load[r] += params.metas[i].numel;
    }
    writer
}

/// Model-parallel filter of the norm and zero count: TP-replicated parameters on TP rank 0
/// only, the tied-embedding copy never.
pub(super) fn counted(params: &Params, tp_rank: usize) -> impl Iterator<Item = &crate::ParamMeta> {
    params
        .metas
        .iter()
        .filter(move |m| !m.shared && (!m.tp_replicated || tp_rank == 0))
}

pub(super) fn sum_zeros(
    local: u64,
    tp: &mut Tp,
    pp: &mut dyn Communicator,
    dp: Option<&mut dyn Communicator>,
) -> Result<u64, CommError> {
    let mut v = [local as i64];
    tp.comm.all_reduce_i64(&mut v, ReduceOp::Sum)?;
    pp.all_reduce_i64(&mut v, ReduceOp::Sum)?;
    if let Some(c) = dp {
        c.all_reduce_i64(&mut v, ReduceOp::Sum)?;
    }
    Ok(v[0] as u64)
}

impl MegatronOptimizer for PlainOptimizer {
    fn grad_buffer(&self) -> &GradBuffer {
        &self.grads.buffer
    }

    fn reduce_gradients(
        &mut self,
        grads: &mut Grads,
        remaining: Option<&[usize]>,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.grads.reduce(grads, remaining, dp)
    }

    fn scale_grads(&self, grads: &mut Grads, coeff: f32) {
        scale_inplace(&mut grads.data, coeff);
    }

    fn local_grad_norm_squared(&self, _params: &Params, grads: &Grads) -> f64 {
        global_norm_squared(&grads.data)
    }

    fn grad_norm_squared(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        _dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError> {
        self.grads.norm_squared(params, grads, tp, pp)
    }

    fn count_zeros(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        _dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError> {
        self.grads.count_zeros(params, grads, tp, pp)
    }

    fn step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: StepLr,
        weight_decay: f32,
        _dp: &mut dyn Communicator,
        _gather: ParamGather,
    ) -> Result<(), CommError> {
        self.step += 1;
        // Consecutive parameters with the same decay flag and rate are updated in one call.
        let mut runs: Vec<(usize, usize, bool, f32)> = Vec::new();
        for m in &params.metas {
            let rate = lr.of(m);
            match runs.last_mut() {
                Some(r) if r.2 == m.weight_decay && r.3 == rate && r.1 == m.offset => {
                    r.1 += m.numel
                }
                _ => runs.push((m.offset, m.offset + m.numel, m.weight_decay, rate)),
            }
        }
        for (start, end, wd, lr) in runs {
            let mut state: Vec<&mut [f32]> = self
                .moments
                .iter_mut()
                .map(|m| &mut m[start..end])
                .collect();
            self.rule.apply(
                &mut params.data[start..end],
                &grads.data[start..end],
                &mut state,
                lr,
                if wd { weight_decay } else { 0.0 },
                self.step,
            );
        }
        // Under 16-bit storage `data` holds the fp32 main parameters; the model reads their
        // rounding.
        params.refresh_half(0..params.numel());
        Ok(())
    }

    fn gather_params(
        &mut self,
        _params: &mut Params,
        _dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        self.moments.iter().map(|m| m.capacity() * 4).sum()
    }

    fn comm_buffer_bytes(&self) -> usize {
        self.grads.scratch_bytes()
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn name(&self) -> &'static str {
        self.rule.name()
    }

    fn moments_of(&self, _param: usize) -> &'static [Moment] {
        self.rule.moments()
    }

    fn state_elements(&self) -> usize {
        self.moments.iter().map(Vec::len).sum()
    }

    fn state_pieces<'a>(
        &'a self,
        params: &'a Params,
        dp_rank: usize,
        dp: usize,
    ) -> Vec<StatePiece<'a>> {
        let writer = self.grads.state_writers(params, dp_rank, dp);
        params
            .metas
            .iter()
            .enumerate()
            .filter(|(i, _)| writer[*i] == dp_rank)
            .map(|(i, m)| {
                let r = m.offset..m.offset + m.numel;
                StatePiece {
                    param: i,
                    local: 0..m.numel,
                    value: &params.data[r.clone()],
                    moments: self
                        .rule
                        .moments()
                        .iter()
                        .zip(&self.moments)
                        .map(|(k, v)| (*k, std::borrow::Cow::Borrowed(&v[r.clone()])))
                        .collect(),
                }
            })
            .collect()
    }

    fn load_state(
        &mut self,
        params: &Params,
        step: u64,
        read: &mut MomentReader,
    ) -> Result<(), String> {
        for (i, m) in params.metas.iter().enumerate() {
            let r = m.offset..m.offset + m.numel;
            for (k, v) in self.rule.moments().iter().zip(&mut self.moments) {
                read(*k, i, 0..m.numel, &mut v[r.clone()])?;
            }
        }
        self.step = step;
        Ok(())
    }
}

impl MegatronOptimizer for DistributedOptimizer {
    fn grad_buffer(&self) -> &GradBuffer {
        &self.grads.buffer
    }

    fn reduce_gradients(
        &mut self,
        grads: &mut Grads,
        remaining: Option<&[usize]>,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.grads.reduce(grads, remaining, dp)
    }

    fn scale_grads(&self, grads: &mut Grads, coeff: f32) {
        DistributedOptimizer::scale_grads(self, grads, coeff)
    }

    fn local_grad_norm_squared(&self, params: &Params, grads: &Grads) -> f64 {
        self.grad_norm_squared_local(params, grads, 0)
    }

    /// Each element is owned by one DP rank: summed over TP, PP and DP.
    fn grad_norm_squared(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError> {
        DistributedOptimizer::grad_norm_squared(self, params, grads, tp, pp, dp)
    }

    fn count_zeros(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError> {
        DistributedOptimizer::count_zeros(self, params, grads, tp, pp, dp)
    }

    fn step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: StepLr,
        weight_decay: f32,
        dp: &mut dyn Communicator,
        gather: ParamGather,
    ) -> Result<(), CommError> {
        match gather {
            ParamGather::Now => {
                DistributedOptimizer::step(self, params, grads, lr, weight_decay, dp)
            }
            ParamGather::Deferred => {
                self.update(params, grads, lr, weight_decay);
                // The overlapped gather covers the dense buckets; the experts' go now.
                self.grads.gather_expert_params(params)
            }
        }
    }

    fn gather_params(
        &mut self,
        params: &mut Params,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.gather(params, dp)
    }

    fn state_bytes(&self) -> usize {
        self.moments.iter().map(MomentBuf::bytes).sum::<usize>() + self.main.capacity() * 4
    }

    fn comm_buffer_bytes(&self) -> usize {
        self.grads.scratch_bytes()
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn name(&self) -> &'static str {
        self.rule.name()
    }

    fn moments_of(&self, _param: usize) -> &'static [Moment] {
        self.rule.moments()
    }

    fn state_elements(&self) -> usize {
        self.moments.iter().map(MomentBuf::len).sum()
    }

    fn state_pieces<'a>(
        &'a self,
        params: &'a Params,
        _dp_rank: usize,
        _dp: usize,
    ) -> Vec<StatePiece<'a>> {
        self.owned_pieces()
            .map(|(param, range, state)| {
                let m = &params.metas[param];
                let s = state..state + range.len();
                StatePiece {
                    param,
                    local: range.start - m.offset..range.end - m.offset,
                    value: if self.main.is_empty() {
                        &params.data[range.clone()]
                    } else {
                        &self.main[s.clone()]
                    },
                    moments: self
                        .rule
                        .moments()
                        .iter()
                        .zip(&self.moments)
                        .map(|(k, v)| (*k, v.f32s(s.clone())))
                        .collect(),
                }
            })
            .collect()
    }

    fn load_state(
        &mut self,
        params: &Params,
        step: u64,
        read: &mut MomentReader,
    ) -> Result<(), String> {
        let pieces: Vec<_> = self.owned_pieces().collect();
        for (param, range, state) in pieces {
            let m = &params.metas[param];
            let local = range.start - m.offset..range.end - m.offset;
            let s = state..state + range.len();
            for (k, v) in self.rule.moments().iter().zip(&mut self.moments) {
                match v {
                    MomentBuf::F32(v) => read(*k, param, local.clone(), &mut v[s.clone()])?,
                    MomentBuf::Bf16(_) => {
                        let mut wide = vec![0.0f32; s.len()];
                        read(*k, param, local.clone(), &mut wide)?;
                        v.store(s.start, &wide);
                    }
                }
            }
        }
        self.step = step;
        Ok(())
    }
}
