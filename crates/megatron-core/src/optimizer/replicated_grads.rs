//! The gradient side of an optimizer whose state is replicated over data parallelism (every
//! DP rank steps on every element): buckets all-reduced over DP, the experts' over their own
//! group, the norm and zero count over TP and PP, and which DP rank writes each parameter's
//! state to a sharded checkpoint. Shared by the element-wise [`super::PlainOptimizer`] and
//! [`super::MuonOptimizer`], which differ only in how they step.

use super::megatron_optimizer::{balanced_writers, balanced_writers_of, counted, sum_zeros};
use crate::distributed::{ExpertGrads, GradBuffer};
use crate::params::{Grads, Params};
use crate::tensor_parallel::{grad_norm_squared_tp, sum_f64, Tp};
use megatron_comm::{CommError, Communicator};
use megatron_tensor::cpu::global_norm_squared;

pub struct ReplicatedGrads {
    /// Buckets of every parameter, or of the dense ones when the experts have their own.
    pub buffer: GradBuffer,
    /// Under expert parallelism: the experts' buckets and groups.
    pub expert: Option<ExpertGrads>,
    scratch: Vec<f32>,
}

/// Σ g² over the parameters `metas`.
fn norm_squared_of<'a>(metas: impl Iterator<Item = &'a crate::ParamMeta>, grads: &Grads) -> f64 {
    metas
        .map(|m| global_norm_squared(&grads.data[m.offset..m.offset + m.numel]))
        .sum()
}

fn zeros_of<'a>(metas: impl Iterator<Item = &'a crate::ParamMeta>, grads: &Grads) -> u64 {
    metas
        .map(|m| {
            grads.data[m.offset..m.offset + m.numel]
                .iter()
                .filter(|g| **g == 0.0)
                .count() as u64
        })
        .sum()
}

impl ReplicatedGrads {
    pub fn new(buffer: GradBuffer) -> Self {
        ReplicatedGrads {
            buffer,
            expert: None,
            scratch: Vec::new(),
        }
    }

    /// Averages the gradients over DP: the buckets `remaining` (an overlapped reduction left),
    /// or all of them.
    pub fn reduce(
        &mut self,
        grads: &mut Grads,
        remaining: Option<&[usize]>,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        match remaining {
            Some(rest) => self
                .buffer
                .reduce_some(rest, grads, dp, &mut self.scratch)?,
            None => self.buffer.reduce_gradients(grads, dp, &mut self.scratch)?,
        }
        match self.expert.as_mut() {
            Some(e) => e.reduce(grads),
            None => Ok(()),
        }
    }

    /// DP replicas hold the same gradients: summed over TP and PP only.
    pub fn norm_squared(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
    ) -> Result<f64, CommError> {
        let Some(e) = self.expert.as_mut() else {
            let x = grad_norm_squared_tp(params, grads, tp)?;
            return if pp.size() > 1 { sum_f64(pp, x) } else { Ok(x) };
        };
        // Dense parameters over TP and PP; each expert once over every rank (its
        // expert-data-parallel replicas hold the same reduced gradient: the first counts).
        let local = norm_squared_of(counted(params, tp.rank()).filter(|m| !m.expert), grads);
        let mut x = sum_f64(tp.comm, local)?;
        x = sum_f64(pp, x)?;
        let mine = if e.edp.rank() == 0 {
            norm_squared_of(params.metas.iter().filter(|m| m.expert), grads)
        } else {
            0.0
        };
        Ok(x + e.sum_norm(mine)?)
    }

    pub fn count_zeros(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
    ) -> Result<u64, CommError> {
        let Some(e) = self.expert.as_mut() else {
            return sum_zeros(zeros_of(counted(params, tp.rank()), grads), tp, pp, None);
        };
        let local = zeros_of(counted(params, tp.rank()).filter(|m| !m.expert), grads);
        let dense = sum_zeros(local, tp, pp, None)?;
        let mine = if e.edp.rank() == 0 {
            zeros_of(params.metas.iter().filter(|m| m.expert), grads)
        } else {
            0
        };
        Ok(dense + e.sum_zeros(mine)?)
    }

    pub fn scratch_bytes(&self) -> usize {
        self.scratch.capacity() * 4
    }

    /// Which DP rank writes each parameter's state (`usize::MAX`: another expert-DP replica
    /// does): dense parameters split over DP, experts over their expert-DP replicas.
    pub fn state_writers(&self, params: &Params, dp_rank: usize, dp: usize) -> Vec<usize> {
        let Some(e) = &self.expert else {
            return balanced_writers(params, dp.max(1));
        };
        let dense = balanced_writers_of(params, dp.max(1), |m| !m.expert);
        let experts = balanced_writers_of(params, e.edp.size(), |m| m.expert);
        let er = e.edp.rank();
        params
            .metas
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !m.expert {
                    dense[i]
                } else if experts[i] == er {
                    dp_rank
                } else {
                    usize::MAX
                }
            })
            .collect()
    }
}
