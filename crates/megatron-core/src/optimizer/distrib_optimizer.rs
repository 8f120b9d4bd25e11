//! The distributed optimizer (ZeRO-1, Megatron's `DistribOptimizer`): each data-parallel rank
//! keeps the update rule's state (Adam's moments, SGD's momentum buffer) (and, with 16-bit parameters, the fp32 main parameters) only for its shard of
//! every gradient bucket, updates that shard after the gradients were reduce-scattered, and the
//! updated parameters are all-gathered back. Shards ignore parameter boundaries; the pieces
//! below split them where the weight-decay flag or the norm filters change.

use super::moment_buf::{apply_rule, MomentBuf, MomentDtypes};
use super::{StepLr, UpdateRule};
use crate::distributed::{ExpertGrads, GradBuffer};
use crate::params::{Grads, Params};
use megatron_comm::{CommError, Communicator};
use megatron_tensor::cpu::{global_norm_squared, scale_inplace};
use std::ops::Range;

/// A piece of an owned shard inside one parameter.
#[derive(Clone, Debug)]
struct Piece {
    /// Flat-buffer range.
    range: Range<usize>,
    /// Offset of the piece in this rank's optimizer state.
    state: usize,
    param: usize,
    /// In the experts' buckets (sharded over expert data parallelism).
    expert: bool,
}

pub struct DistributedOptimizer {
    pub buffer: GradBuffer,
    /// Under expert parallelism: the experts' buckets, sharded over their own group.
    pub expert: Option<ExpertGrads>,
    pieces: Vec<Piece>,
    /// Elements of this rank's shards.
    state_len: usize,
    pub rule: UpdateRule,
    /// One buffer per moment of the rule, over this rank's shards (f32, or bf16 under
    /// `--exp-avg-dtype` / `--exp-avg-sq-dtype`).
    pub moments: Vec<MomentBuf>,
    /// fp32 main parameters of this rank's shards when the model's parameters are 16-bit
    /// (laid out like the moments); empty otherwise.
    pub main: Vec<f32>,
    pub step: u64,
    pub(crate) scratch: Vec<f32>,
}

impl DistributedOptimizer {
    pub fn new(params: &Params, buffer: GradBuffer, rule: UpdateRule) -> Self {
        Self::new_with_experts(params, buffer, None, rule)
    }

    /// With the experts' buckets in `expert` (then `buffer` covers the dense parameters).
    pub fn new_with_experts(
        params: &Params,
        buffer: GradBuffer,
        expert: Option<ExpertGrads>,
        rule: UpdateRule,
    ) -> Self {
        let mut pieces = Vec::new();
        let mut state = 0;
        let buffers =
            std::iter::once((&buffer, false)).chain(expert.as_ref().map(|e| (&e.buffer, true)));
        for (buf, is_expert) in buffers {
            for (b, owned) in buf.buckets.iter().zip(buf.owned()) {
                for own in owned {
                    for p in b.params.clone() {
                        let m = &params.metas[p];
                        let lo = own.start.max(m.offset);
                        let hi = own.end.min(m.offset + m.numel);
                        if lo < hi {
                            pieces.push(Piece {
                                range: lo..hi,
                                state,
                                param: p,
                                expert: is_expert,
                            });
                            state += hi - lo;
                        }
                    }
                }
            }
        }
        let mut main = Vec::new();
        if params.half.format().is_some() {
            main = vec![0.0; state];
            for p in &pieces {
                main[p.state..p.state + p.range.len()]
                    .copy_from_slice(&params.data[p.range.clone()]);
            }
        }
        DistributedOptimizer {
            buffer,
            expert,
            pieces,
            state_len: state,
            rule,
            moments: MomentDtypes::default().new_state(rule, state),
            main,
            step: 0,
            scratch: Vec::new(),
        }
    }

    /// The same optimizer with its moments stored as `dtypes` say (before any step or load).
    pub fn with_moment_dtypes(mut self, dtypes: MomentDtypes) -> Self {
        self.moments = dtypes.new_state(self.rule, self.state_len);
        self
    }

    /// This rank's shards: (parameter index, range in the flat buffer, offset in the state).
    pub fn owned_pieces(
        &self,
    ) -> impl Iterator<Item = (usize, std::ops::Range<usize>, usize)> + '_ {
        self.pieces
            .iter()
            .map(|p| (p.param, p.range.clone(), p.state))
    }

    /// Elements of optimizer state this rank holds.
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// Reduce-scatters the gradients over DP: this rank's shards then hold the averages.
    pub fn reduce_gradients(
        &mut self,
        grads: &mut Grads,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.buffer.reduce_gradients(grads, dp, &mut self.scratch)?;
        self.reduce_expert_gradients(grads)
    }

    /// Reduce-scatters the experts' gradients over expert data parallelism.
    pub fn reduce_expert_gradients(&mut self, grads: &mut Grads) -> Result<(), CommError> {
        match self.expert.as_mut() {
            Some(e) => e.reduce(grads),
            None => Ok(()),
        }
    }

    /// Reduce-scatters only the buckets `which` (those an overlapped reduction left).
    pub fn reduce_some_gradients(
        &mut self,
        which: &[usize],
        grads: &mut Grads,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.buffer
            .reduce_some(which, grads, dp, &mut self.scratch)?;
        self.reduce_expert_gradients(grads)
    }

    /// This rank's part of the squared gradient norm: its shards, with the model-parallel
    /// filters (TP-replicated parameters on TP rank 0 only, the tied-embedding copy never).
    pub fn grad_norm_squared_local(&self, params: &Params, grads: &Grads, tp_rank: usize) -> f64 {
        self.grad_norm_squared_of(params, grads, tp_rank, |_| true)
    }

    /// [`DistributedOptimizer::grad_norm_squared_local`] over the pieces `which` picks by their
    /// `expert` flag.
    pub fn grad_norm_squared_of(
        &self,
        params: &Params,
        grads: &Grads,
        tp_rank: usize,
        which: impl Fn(bool) -> bool,
    ) -> f64 {
        let owned = self.pieces.iter().filter(|p| which(p.expert));
        owned_norm_squared(params, grads, tp_rank, owned.map(|p| (p.param, &p.range)))
    }

    /// Zeros among this rank's shards (same filters as the norm).
    pub fn count_zeros_local(&self, params: &Params, grads: &Grads, tp_rank: usize) -> u64 {
        self.count_zeros_of(params, grads, tp_rank, |_| true)
    }

    pub fn count_zeros_of(
        &self,
        params: &Params,
        grads: &Grads,
        tp_rank: usize,
        which: impl Fn(bool) -> bool,
    ) -> u64 {
        let owned = self.pieces.iter().filter(|p| which(p.expert));
        owned_zeros(params, grads, tp_rank, owned.map(|p| (p.param, &p.range)))
    }

    /// Scales this rank's shards of the gradients (clipping).
    pub fn scale_grads(&self, grads: &mut Grads, coeff: f32) {
        for p in &self.pieces {
            scale_inplace(&mut grads.data[p.range.clone()], coeff);
        }
    }

    /// The update rule on the owned shards, then all-gathers the updated parameters over DP.
    pub fn step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: impl Into<StepLr>,
        weight_decay: f32,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.update(params, grads, lr, weight_decay);
        self.gather(params, dp)
    }

    /// The update rule on the owned shards only: the rest of the parameters are stale until
    /// [`DistributedOptimizer::gather`] (or an overlapped gather) has run.
    pub fn update(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: impl Into<StepLr>,
        weight_decay: f32,
    ) {
        let lr: StepLr = lr.into();
        self.step += 1;
        for p in &self.pieces {
            let wd = params.metas[p.param].weight_decay;
            let rate = lr.of(&params.metas[p.param]);
            let s = p.state..p.state + p.range.len();
            // The fp32 values the rule updates: the parameters themselves, or this rank's main copy
            // of 16-bit ones (re-rounded into the model's copy right after).
            let fp32 = if self.main.is_empty() {
                &mut params.data[p.range.clone()]
            } else {
                &mut self.main[s.clone()]
            };
            apply_rule(
                self.rule,
                fp32,
                &grads.data[p.range.clone()],
                &mut self.moments,
                s.clone(),
                rate,
                if wd { weight_decay } else { 0.0 },
                self.step,
            );
            if !self.main.is_empty() {
                params.half.write(p.range.clone(), &self.main[s]);
            }
        }
    }

    /// All-gathers the updated parameters over DP (the 16-bit ones when there are any).
    pub fn gather(
        &mut self,
        params: &mut Params,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        if self.main.is_empty() {
            self.buffer
                .all_gather(&mut params.data, dp, &mut self.scratch)?;
        } else {
            // Megatron all-gathers the 16-bit parameters: half the bytes of fp32.
            self.buffer
                .all_gather(params.half.bits_mut(), dp, &mut self.scratch)?;
        }
        self.gather_experts(params)
    }

    /// All-gathers the experts' updated shards over expert data parallelism.
    pub fn gather_experts(&mut self, params: &mut Params) -> Result<(), CommError> {
        let Some(e) = self.expert.as_mut() else {
            return Ok(());
        };
        if self.main.is_empty() {
            e.gather(&mut params.data)
        } else {
            e.gather(params.half.bits_mut())
        }
    }

    /// Each moment laid out like the whole parameter buffer (all-gathered over DP). Every DP
    /// rank must call it.
    pub fn full_moments(
        &mut self,
        numel: usize,
        dp: &mut dyn Communicator,
    ) -> Result<Vec<Vec<f32>>, CommError> {
        (0..self.moments.len())
            .map(|k| self.full_state(|d, r| d.moments[k].f32s(r), numel, dp))
            .collect()
    }

    /// The fp32 main parameters laid out like the whole parameter buffer (all-gathered over
    /// DP), for checkpoints under 16-bit parameters. Every DP rank must call it.
    pub fn full_main(
        &mut self,
        numel: usize,
        dp: &mut dyn Communicator,
    ) -> Result<Vec<f32>, CommError> {
        self.full_state(|d, r| std::borrow::Cow::Borrowed(&d.main[r]), numel, dp)
    }

    /// One piece of per-shard state (laid out like the moments) spread over the whole buffer
    /// and all-gathered over DP.
    fn full_state(
        &mut self,
        which: impl Fn(&Self, Range<usize>) -> std::borrow::Cow<'_, [f32]>,
        numel: usize,
        dp: &mut dyn Communicator,
    ) -> Result<Vec<f32>, CommError> {
        let mut out = vec![0.0f32; numel];
        for p in &self.pieces {
            out[p.range.clone()].copy_from_slice(&which(self, p.state..p.state + p.range.len()));
        }
        self.buffer.all_gather(&mut out, dp, &mut self.scratch)?;
        Ok(out)
    }

    /// Takes this rank's shards of whole-buffer moments (one per moment of the rule).
    pub fn load_moments(&mut self, full: &[Vec<f32>], step: u64) {
        assert_eq!(full.len(), self.moments.len());
        for p in &self.pieces {
            let s = p.state..p.state + p.range.len();
            for (mine, whole) in self.moments.iter_mut().zip(full) {
                mine.store(s.start, &whole[p.range.clone()]);
            }
        }
        self.step = step;
    }
}

/// Whether an owned piece of parameter `m` counts in the norm and zero count: TP-replicated
/// parameters on TP rank 0 only, the tied-embedding copy never.
fn counted_piece(m: &crate::ParamMeta, tp_rank: usize) -> bool {
    !m.shared && (!m.tp_replicated || tp_rank == 0)
}

/// Σ g² over owned pieces `(parameter, flat range)`, with the model-parallel filters.
pub(super) fn owned_norm_squared<'a>(
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
pub(super) fn owned_zeros<'a>(
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
