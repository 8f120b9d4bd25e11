//! Megatron's `MegatronOptimizer` interface: what the training loop asks of an optimizer —
//! reduce the gradients over data parallelism, their norm, scale (unscale, clip), step, and the
//! full state for checkpoints — so the loop never branches on which optimizer it has. Plain
//! AdamW over replicated state ([`PlainOptimizer`]) and the distributed optimizer (ZeRO-1,
//! [`DistributedOptimizer`]) implement it. Each keeps the exact reduction order it always had, so
//! losses are bit-identical to before the interface.

use super::{Adam, DistributedOptimizer};
use crate::distributed::GradBuffer;
use crate::params::{Grads, Params};
use crate::tensor_parallel::{grad_norm_squared_tp, sum_f64, Tp};
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
/// steps on and both moments.
pub struct StatePiece<'a> {
    pub param: usize,
    pub local: std::ops::Range<usize>,
    pub value: &'a [f32],
    pub exp_avg: &'a [f32],
    pub exp_avg_sq: &'a [f32],
}

/// Which moment a checkpoint reader is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    ExpAvg,
    ExpAvgSq,
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
        &self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError>;

    /// Zeros among those gradients (`--log-num-zeros-in-grad`), counted once.
    fn count_zeros(
        &self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError>;

    /// AdamW with learning rate `lr` on the (clipped) gradients.
    fn step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: f32,
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

    /// Optimizer steps taken (Adam's bias correction).
    fn step_count(&self) -> u64;

    /// Elements of each moment this rank holds.
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

/// AdamW with the whole model's state on every DP rank; gradients all-reduced bucket by bucket.
pub struct PlainOptimizer {
    pub adam: Adam,
    pub buffer: GradBuffer,
    scratch: Vec<f32>,
}

impl PlainOptimizer {
    pub fn new(adam: Adam, buffer: GradBuffer) -> Self {
        PlainOptimizer {
            adam,
            buffer,
            scratch: Vec::new(),
        }
    }
}

/// Which DP rank writes each parameter of DP-replicated state: largest first to the rank with
/// the fewest bytes so far (the same answer on every rank), so the ranks' files come out about
/// equal.
fn balanced_writers(params: &Params, dp: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..params.metas.len()).collect();
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
fn counted(params: &Params, tp_rank: usize) -> impl Iterator<Item = &crate::ParamMeta> {
    params
        .metas
        .iter()
        .filter(move |m| !m.shared && (!m.tp_replicated || tp_rank == 0))
}

fn sum_zeros(
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
        &self.buffer
    }

    fn reduce_gradients(
        &mut self,
        grads: &mut Grads,
        remaining: Option<&[usize]>,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        match remaining {
            Some(rest) => self.buffer.reduce_some(rest, grads, dp, &mut self.scratch),
            None => self.buffer.reduce_gradients(grads, dp, &mut self.scratch),
        }
    }

    fn scale_grads(&self, grads: &mut Grads, coeff: f32) {
        scale_inplace(&mut grads.data, coeff);
    }

    fn local_grad_norm_squared(&self, _params: &Params, grads: &Grads) -> f64 {
        global_norm_squared(&grads.data)
    }

    /// DP replicas hold the same gradients: summed over TP and PP only.
    fn grad_norm_squared(
        &self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        _dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError> {
        let x = grad_norm_squared_tp(params, grads, tp)?;
        if pp.size() > 1 {
            sum_f64(pp, x)
        } else {
            Ok(x)
        }
    }

    fn count_zeros(
        &self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        _dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError> {
        let local = counted(params, tp.rank())
            .map(|m| {
                grads.data[m.offset..m.offset + m.numel]
                    .iter()
                    .filter(|g| **g == 0.0)
                    .count() as u64
            })
            .sum();
        sum_zeros(local, tp, pp, None)
    }

    fn step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: f32,
        weight_decay: f32,
        _dp: &mut dyn Communicator,
        _gather: ParamGather,
    ) -> Result<(), CommError> {
        self.adam.step(params, grads, lr, weight_decay);
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
        (self.adam.exp_avg.capacity() + self.adam.exp_avg_sq.capacity()) * 4
    }

    fn step_count(&self) -> u64 {
        self.adam.step
    }

    fn state_elements(&self) -> usize {
        self.adam.exp_avg.len()
    }

    fn state_pieces<'a>(
        &'a self,
        params: &'a Params,
        dp_rank: usize,
        dp: usize,
    ) -> Vec<StatePiece<'a>> {
        let writer = balanced_writers(params, dp.max(1));
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
                    exp_avg: &self.adam.exp_avg[r.clone()],
                    exp_avg_sq: &self.adam.exp_avg_sq[r],
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
            read(
                Moment::ExpAvg,
                i,
                0..m.numel,
                &mut self.adam.exp_avg[r.clone()],
            )?;
            read(
                Moment::ExpAvgSq,
                i,
                0..m.numel,
                &mut self.adam.exp_avg_sq[r],
            )?;
        }
        self.adam.step = step;
        Ok(())
    }
}

impl MegatronOptimizer for DistributedOptimizer {
    fn grad_buffer(&self) -> &GradBuffer {
        &self.buffer
    }

    fn reduce_gradients(
        &mut self,
        grads: &mut Grads,
        remaining: Option<&[usize]>,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        match remaining {
            Some(rest) => self.reduce_some_gradients(rest, grads, dp),
            None => DistributedOptimizer::reduce_gradients(self, grads, dp),
        }
    }

    fn scale_grads(&self, grads: &mut Grads, coeff: f32) {
        DistributedOptimizer::scale_grads(self, grads, coeff)
    }

    fn local_grad_norm_squared(&self, params: &Params, grads: &Grads) -> f64 {
        self.grad_norm_squared_local(params, grads, 0)
    }

    /// Each element is owned by one DP rank: summed over TP, PP and DP.
    fn grad_norm_squared(
        &self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError> {
        let local = self.grad_norm_squared_local(params, grads, tp.rank());
        let mut x = sum_f64(tp.comm, local)?;
        x = sum_f64(pp, x)?;
        if let Some(c) = dp {
            x = sum_f64(c, x)?;
        }
        Ok(x)
    }

    fn count_zeros(
        &self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError> {
        let local = self.count_zeros_local(params, grads, tp.rank());
        sum_zeros(local, tp, pp, dp)
    }

    fn step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: f32,
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
                Ok(())
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
        (self.exp_avg.capacity() + self.exp_avg_sq.capacity() + self.main.capacity()) * 4
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn state_elements(&self) -> usize {
        self.exp_avg.len()
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
                    exp_avg: &self.exp_avg[s.clone()],
                    exp_avg_sq: &self.exp_avg_sq[s],
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
            read(
                Moment::ExpAvg,
                param,
                local.clone(),
                &mut self.exp_avg[s.clone()],
            )?;
            read(Moment::ExpAvgSq, param, local, &mut self.exp_avg_sq[s])?;
        }
        self.step = step;
        Ok(())
    }
}
