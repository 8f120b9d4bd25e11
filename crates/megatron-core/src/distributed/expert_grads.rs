//! The experts' own gradient buckets (megatron-core's expert-parallel DDP buffers): under
//! expert parallelism a rank's expert weights are shared with the ranks of its expert-data-
//! parallel group, not with its data-parallel group, so their gradients are reduced there, and
//! the distributed optimizer shards their state there.
//!
//! Scaling: an expert's gradient on one rank already sums the tokens of every rank of its
//! expert-parallel group; summed over the expert-data-parallel group it covers every token of
//! the step once, which must be averaged over the data-parallel replicas like the dense
//! gradients: `sum / dp` (megatron-core's `expert_gradient_scaling_factor`). The buckets
//! average over `edp`, so the gradients are first multiplied by `edp / dp`.

use super::param_and_grad_buffer::{Gathered, GradBuffer, ParamGroup};
use crate::params::{Grads, Params};
use crate::tensor_parallel::sum_f64;
use megatron_comm::{CommError, Communicator, ReduceOp, TypedCollectives};
use megatron_tensor::cpu::scale_inplace;

pub struct ExpertGrads {
    pub buffer: GradBuffer,
    /// Expert data parallel: the ranks holding the same experts.
    pub edp: Box<dyn Communicator>,
    /// Every rank: sums of the experts' contributions to the gradient norm.
    pub all: Box<dyn Communicator>,
    pre_scale: f32,
    /// Flat-buffer ranges of the expert weights.
    ranges: Vec<std::ops::Range<usize>>,
    scratch: Vec<f32>,
}

impl ExpertGrads {
    /// Buckets over `params`' expert weights, reduced over `edp`, for a job of `dp`
    /// data-parallel replicas.
    pub fn new(
        params: &Params,
        bucket_size: usize,
        distributed: bool,
        dp: usize,
        edp: Box<dyn Communicator>,
        all: Box<dyn Communicator>,
    ) -> Self {
        let buffer = GradBuffer::new_for(
            params,
            ParamGroup::Expert,
            bucket_size,
            edp.size(),
            edp.rank(),
            distributed,
        );
        let ranges = params
            .metas
            .iter()
            .filter(|m| m.expert)
            .map(|m| m.offset..m.offset + m.numel)
            .collect();
        ExpertGrads {
            ranges,
            pre_scale: edp.size() as f32 / dp as f32,
            buffer,
            edp,
            all,
            scratch: Vec::new(),
        }
    }

    /// Scales the experts' gradients to the data-parallel average and reduces them over
    /// expert data parallelism.
    pub fn reduce(&mut self, grads: &mut Grads) -> Result<(), CommError> {
        if self.pre_scale != 1.0 {
            for r in &self.ranges {
                scale_inplace(&mut grads.data[r.clone()], self.pre_scale);
            }
        }
        self.buffer
            .reduce_gradients(grads, self.edp.as_mut(), &mut self.scratch)
    }

    /// All-gathers the experts' updated shards over expert data parallelism.
    pub fn gather<T: Gathered>(&mut self, data: &mut [T]) -> Result<(), CommError> {
        self.buffer
            .all_gather(data, self.edp.as_mut(), &mut self.scratch)
    }

    /// Sums the experts' contributions to the squared norm over every rank.
    pub fn sum_norm(&mut self, local: f64) -> Result<f64, CommError> {
        sum_f64(self.all.as_mut(), local)
    }

    /// Sums the experts' zero counts over every rank.
    pub fn sum_zeros(&mut self, local: u64) -> Result<u64, CommError> {
        let mut v = [local as i64];
        self.all.all_reduce_i64(&mut v, ReduceOp::Sum)?;
        Ok(v[0] as u64)
    }
}
