//! The distributed optimizer (ZeRO-1, Megatron's `DistribOptimizer`): each data-parallel rank
//! keeps the update rule's state (Adam's moments, SGD's momentum buffer) (and, with 16-bit parameters, the fp32 main parameters) only for its shard of
//! every gradient bucket, updates that shard after the gradients were reduce-scattered, and the
//! updated parameters are all-gathered back. Shards ignore parameter boundaries; the pieces
//! below split them where the weight-decay flag or the norm filters change.

use super::moment_buf::{apply_rule, MomentBuf, MomentDtypes};
use super::sharded_grads::{owned_norm_squared, OwnedPiece, ShardedGrads};
use super::{StepLr, UpdateRule};
use crate::distributed::{ExpertGrads, GradBuffer};
use crate::params::{Grads, Params};
use crate::tensor_parallel::Tp;
use megatron_comm::{CommError, Communicator};
use megatron_tensor::cpu::scale_inplace;
use std::ops::Range;

/// A piece of an owned shard inside one parameter.
#[derive(Clone, Debug)]
struct Piece {
    owned: OwnedPiece,
    /// Offset of the piece in this rank's optimizer state.
    state: usize,
}

pub struct DistributedOptimizer {
    /// The buckets (and the experts', sharded over their own group) and their collectives.
    pub grads: ShardedGrads,
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
        let grads = ShardedGrads::new(buffer, expert);
        let mut state = 0;
        let pieces: Vec<Piece> = grads
            .owned_pieces(params)
            .into_iter()
            .map(|owned| {
                state += owned.range.len();
                Piece {
                    state: state - owned.range.len(),
                    owned,
                }
            })
            .collect();
        let mut main = Vec::new();
        if params.half.format().is_some() {
            main = vec![0.0; state];
            for p in &pieces {
                main[p.state..p.state + p.owned.range.len()]
                    .copy_from_slice(&params.data[p.owned.range.clone()]);
            }
        }
        DistributedOptimizer {
            grads,
            pieces,
            state_len: state,
            rule,
            moments: MomentDtypes::default().new_state(rule, state),
            main,
            step: 0,
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
            .map(|p| (p.owned.param, p.owned.range.clone(), p.state))
    }

    /// The whole model's squared gradient norm: each element owned by one DP rank.
    pub fn grad_norm_squared(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<f64, CommError> {
        let owned = self.pieces.iter().map(|p| &p.owned);
        self.grads.norm_squared(params, grads, owned, tp, pp, dp)
    }

    /// Zeros among the gradients, each counted once.
    pub fn count_zeros(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError> {
        let owned = self.pieces.iter().map(|p| &p.owned);
        self.grads.count_zeros(params, grads, owned, tp, pp, dp)
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
        self.grads.reduce(grads, None, dp)
    }

    /// This rank's part of the squared gradient norm: its shards, with the model-parallel
    /// filters (TP-replicated parameters on TP rank 0 only, the tied-embedding copy never).
    pub fn grad_norm_squared_local(&self, params: &Params, grads: &Grads, tp_rank: usize) -> f64 {
        let all = self.pieces.iter().map(|p| (p.owned.param, &p.owned.range));
        owned_norm_squared(params, grads, tp_rank, all)
    }

    /// Scales this rank's shards of the gradients (clipping).
    pub fn scale_grads(&self, grads: &mut Grads, coeff: f32) {
        for p in &self.pieces {
            scale_inplace(&mut grads.data[p.owned.range.clone()], coeff);
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
            let (range, param) = (p.owned.range.clone(), p.owned.param);
            let wd = params.metas[param].weight_decay;
            let rate = lr.of(&params.metas[param]);
            let s = p.state..p.state + range.len();
            // The fp32 values the rule updates: the parameters themselves, or this rank's main copy
            // of 16-bit ones (re-rounded into the model's copy right after).
            let fp32 = if self.main.is_empty() {
                &mut params.data[range.clone()]
            } else {
                &mut self.main[s.clone()]
            };
            apply_rule(
                self.rule,
                fp32,
                &grads.data[range.clone()],
                &mut self.moments,
                s.clone(),
                rate,
                if wd { weight_decay } else { 0.0 },
                self.step,
            );
            if !self.main.is_empty() {
                params.half.write(range, &self.main[s]);
            }
        }
    }

    /// All-gathers the updated parameters over DP (the 16-bit ones when there are any).
    pub fn gather(
        &mut self,
        params: &mut Params,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.grads.gather_params(params, dp)
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
            let r = p.owned.range.clone();
            out[r.clone()].copy_from_slice(&which(self, p.state..p.state + r.len()));
        }
        self.grads.gather_dense(&mut out, dp)?;
        Ok(out)
    }

    /// Takes this rank's shards of whole-buffer moments (one per moment of the rule).
    pub fn load_moments(&mut self, full: &[Vec<f32>], step: u64) {
        assert_eq!(full.len(), self.moments.len());
        for p in &self.pieces {
            let r = p.owned.range.clone();
            for (mine, whole) in self.moments.iter_mut().zip(full) {
                mine.store(p.state, &whole[r.clone()]);
            }
        }
        self.step = step;
    }
}
