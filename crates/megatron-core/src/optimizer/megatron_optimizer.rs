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
use std::borrow::Cow;

/// When the distributed optimizer's all-gather of updated parameters runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamGather {
    /// In the step.
    Now,
    /// Later (`--overlap-param-gather`: during the next forward), via
    /// [`MegatronOptimizer::gather_params`] or an overlapped gather over [`MegatronOptimizer::grad_buffer`].
    Deferred,
}

/// The optimizer state of the whole model in the whole-buffer layout, for a checkpoint.
pub struct FullState<'a> {
    pub adam: Cow<'a, Adam>,
    /// fp32 main parameters when the model's parameters are 16-bit and live only in the
    /// optimizer's shards.
    pub main: Option<Vec<f32>>,
}

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

    /// The state a checkpoint keeps. Every DP rank must call it.
    fn full_state(
        &mut self,
        numel: usize,
        dp: &mut dyn Communicator,
    ) -> Result<FullState<'_>, CommError>;

    /// Bytes of optimizer state this rank holds (moments, and fp32 mains kept here).
    fn state_bytes(&self) -> usize;
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

    fn full_state(
        &mut self,
        _numel: usize,
        _dp: &mut dyn Communicator,
    ) -> Result<FullState<'_>, CommError> {
        Ok(FullState {
            adam: Cow::Borrowed(&self.adam),
            main: None,
        })
    }

    fn state_bytes(&self) -> usize {
        (self.adam.exp_avg.capacity() + self.adam.exp_avg_sq.capacity()) * 4
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
            Some(rest) => {
                let mut scratch = Vec::new();
                self.buffer.reduce_some(rest, grads, dp, &mut scratch)
            }
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

    fn full_state(
        &mut self,
        numel: usize,
        dp: &mut dyn Communicator,
    ) -> Result<FullState<'_>, CommError> {
        let (exp_avg, exp_avg_sq) = self.full_moments(numel, dp)?;
        // 16-bit parameters: the fp32 main copy is saved, gathered from the shards.
        let main = if self.main.is_empty() {
            None
        } else {
            Some(self.full_main(numel, dp)?)
        };
        Ok(FullState {
            adam: Cow::Owned(Adam {
                exp_avg,
                exp_avg_sq,
                step: self.step,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
            }),
            main,
        })
    }

    fn state_bytes(&self) -> usize {
        (self.exp_avg.capacity() + self.exp_avg_sq.capacity() + self.main.capacity()) * 4
    }
}
