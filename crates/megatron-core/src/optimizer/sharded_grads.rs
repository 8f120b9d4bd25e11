//! The gradient side of an optimizer whose state is sharded over data parallelism — the
//! distributed optimizer's byte-level shards and the layer-wise optimizer's whole matrices
//! alike: buckets reduce-scattered over DP (the experts' over expert DP), the pieces of the
//! buffer this rank owns, the norm and zero count of what it owns summed over every group, and
//! the all-gather of the updated parameters. The two optimizers differ only in the buckets'
//! layout and in how they step their pieces.

use super::megatron_optimizer::sum_zeros;
use crate::distributed::{ExpertGrads, GradBuffer};
use crate::params::{Grads, Params};
use crate::tensor_parallel::{sum_f64, Tp};
use megatron_comm::{CommError, Communicator};
use megatron_tensor::cpu::global_norm_squared;
use std::ops::Range;

/// A piece of the buffer this rank owns: part (or all) of one parameter.
#[derive(Clone, Debug)]
pub struct OwnedPiece {
    /// Flat-buffer range.
    pub range: Range<usize>,
    pub param: usize,
    /// In the experts' buckets (sharded over expert data parallelism).
    pub expert: bool,
}

pub struct ShardedGrads {
    /// Buckets of every parameter, or of the dense ones when the experts have their own.
    pub buffer: GradBuffer,
    pub expert: Option<ExpertGrads>,
    scratch: Vec<f32>,
}

impl ShardedGrads {
    pub fn new(buffer: GradBuffer, expert: Option<ExpertGrads>) -> Self {
        ShardedGrads {
            buffer,
            expert,
            scratch: Vec::new(),
        }
    }

    /// This rank's segments of every bucket cut at parameter boundaries, bucket by bucket
    /// (the dense buckets, then the experts').
    pub fn owned_pieces(&self, params: &Params) -> Vec<OwnedPiece> {
        let mut pieces = Vec::new();
        let buffers = std::iter::once((&self.buffer, false))
            .chain(self.expert.as_ref().map(|e| (&e.buffer, true)));
        for (buf, expert) in buffers {
            for (b, owned) in buf.buckets.iter().zip(buf.owned()) {
                for own in owned {
                    for param in b.params.clone() {
                        let m = &params.metas[param];
                        let lo = own.start.max(m.offset);
                        let hi = own.end.min(m.offset + m.numel);
                        if lo < hi {
                            pieces.push(OwnedPiece {
                                range: lo..hi,
                                param,
                                expert,
                            });
                        }
                    }
                }
            }
        }
        pieces
    }

    /// Reduce-scatters the gradients over DP (the buckets `remaining` an overlapped reduction
    /// left, or all), and the experts' over expert DP: this rank's pieces then hold the averages.
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
        self.reduce_experts(grads)
    }

    fn reduce_experts(&mut self, grads: &mut Grads) -> Result<(), CommError> {
        match self.expert.as_mut() {
            Some(e) => e.reduce(grads),
            None => Ok(()),
        }
    }

    /// All-gathers the updated parameters over DP, the experts' over expert DP: the 16-bit
    /// copies when the parameters have them (the fp32 mains then live in the optimizer's
    /// pieces; Megatron gathers the 16-bit parameters, half the bytes), else the f32 values.
    pub fn gather_params(
        &mut self,
        params: &mut Params,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        if params.half.format().is_some() {
            self.buffer
                .all_gather(params.half.bits_mut(), dp, &mut self.scratch)?;
        } else {
            self.buffer
                .all_gather(&mut params.data, dp, &mut self.scratch)?;
        }
        self.gather_expert_params(params)
    }

    /// The experts' part of [`ShardedGrads::gather_params`] (the rest gathered by an
    /// overlapped gather).
    pub fn gather_expert_params(&mut self, params: &mut Params) -> Result<(), CommError> {
        let Some(e) = self.expert.as_mut() else {
            return Ok(());
        };
        if params.half.format().is_some() {
            e.gather(params.half.bits_mut())
        } else {
            e.gather(&mut params.data)
        }
    }

    /// All-gathers per-element state laid out like the whole buffer, each rank having filled
    /// its pieces (dense buckets only, as checkpoints of it are taken).
    pub fn gather_dense(
        &mut self,
        data: &mut [f32],
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.buffer.all_gather(data, dp, &mut self.scratch)
    }

    /// The squared norm of the gradients, each element counted once: `owned` (this rank's
    /// pieces) with the model-parallel filters, summed over TP, PP and DP, the experts' over
    /// every rank.
    pub fn norm_squared<'a>(
        &mut self,
        params: &Params,
        grads: &Grads,
        owned: impl Iterator<Item = &'a OwnedPiece> + Clone,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError> {
        let r = tp.rank();
        let has_experts = self.expert.is_some();
        let norm = |expert: bool| {
            let of = owned
                .clone()
                .filter(|p| (has_experts && p.expert) == expert);
            owned_norm_squared(params, grads, r, of.map(|p| (p.param, &p.range)))
        };
        let (dense, mine) = (norm(false), norm(true));
        let mut x = sum_f64(tp.comm, dense)?;
        x = sum_f64(pp, x)?;
        if let Some(c) = dp {
            x = sum_f64(c, x)?;
        }
        match self.expert.as_mut() {
            // Each expert element is owned by one expert-DP rank: summed over every rank.
            Some(e) => Ok(x + e.sum_norm(mine)?),
            None => Ok(x),
        }
    }

    /// [`ShardedGrads::norm_squared`] for the zero count.
    pub fn count_zeros<'a>(
        &mut self,
        params: &Params,
        grads: &Grads,
        owned: impl Iterator<Item = &'a OwnedPiece> + Clone,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError> {
        let r = tp.rank();
        let has_experts = self.expert.is_some();
        let zeros = |expert: bool| {
            let of = owned
                .clone()
                .filter(|p| (has_experts && p.expert) == expert);
            owned_zeros(params, grads, r, of.map(|p| (p.param, &p.range)))
        };
        let (dense, mine) = (zeros(false), zeros(true));
        let x = sum_zeros(dense, tp, pp, dp)?;
        match self.expert.as_mut() {
            Some(e) => Ok(x + e.sum_zeros(mine)?),
            None => Ok(x),
        }
    }

    pub fn scratch_bytes(&self) -> usize {
        self.scratch.capacity() * 4
    }
}

/// Whether an owned piece of parameter `m` counts in the norm and zero count: TP-replicated
/// parameters on TP rank 0 only, the tied-embedding copy never.
fn counted_piece(m: &crate::ParamMeta, tp_rank: usize) -> bool {
    !m.shared && (!m.tp_replicated || tp_rank == 0)
}

/// Σ g² over owned pieces `(parameter, flat range)`, with the model-parallel filters.
pub fn owned_norm_squared<'a>(
    params: &Params,
    grads: &Grads,
    tp_rank: usize,
    pieces: impl Iterator<Item = (usize, &'a Range<usize>)>,
) -> f64 {
    pieces
        .filter(|(p, _)| counted_piece(&params.metas[*p], tp_rank))
        .map(|(_, r)| global_norm_squared(&grads.data[r.clone()]))
        .sum()
}

/// Zeros among owned pieces, with the same filters.
pub fn owned_zeros<'a>(
    params: &Params,
    grads: &Grads,
    tp_rank: usize,
    pieces: impl Iterator<Item = (usize, &'a Range<usize>)>,
) -> u64 {
    pieces
        .filter(|(p, _)| counted_piece(&params.metas[*p], tp_rank))
        .map(|(_, r)| grads.data[r.clone()].iter().filter(|g| **g == 0.0).count() as u64)
        .sum()
}
