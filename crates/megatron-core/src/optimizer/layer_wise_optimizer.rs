//! megatron-core's `LayerWiseDistributedOptimizer`: Muon under `--use-distributed-optimizer`.
//! Newton–Schulz needs a whole matrix, so the ZeRO-1 split at arbitrary elements cannot hold
//! Muon's state; instead each data-parallel rank owns whole Muon matrices (the buckets'
//! layer-wise layout, [`GradBuffer::into_layer_wise`]), and the element-wise parameters (the
//! scalar optimizer's) are split at any element as in the distributed optimizer. Gradients are
//! reduce-scattered so each rank receives exactly what it owns; it steps that (Muon's momentum
//! and orthogonalization for its matrices, the scalar rule for its pieces, with fp32 mains for
//! them under 16-bit parameters), and the updated parameters are all-gathered. Each rank so
//! holds about 1/DP of the state and runs about 1/DP of the Newton–Schulz work, which on a
//! replicated optimizer every rank repeats.
//!
//! Under tensor parallelism the layout is the same on every TP rank (it depends only on the
//! parameters' shapes), so the TP peers that gather or reduce a matrix in Muon's step all own it.

use super::megatron_optimizer::StatePiece;
use super::muon::{muon_matrix_step, MuonMatrix, MuonMoments};
use super::sharded_grads::{owned_norm_squared, OwnedPiece, ShardedGrads};
use super::{
    is_muon_parameter, MegatronOptimizer, Moment, MomentReader, MuonConfig, ParamGather, StepLr,
};
use crate::distributed::{ExpertGrads, GradBuffer, Placement};
use crate::params::{Grads, ParamMeta, Params};
use crate::tensor_parallel::Tp;
use megatron_comm::{CommError, Communicator};
use megatron_tensor::cpu::scale_inplace;
use std::borrow::Cow;

/// Where a parameter goes in the layer-wise layout: Muon matrices whole, weighted by their
/// Newton–Schulz cost (`max(m, n) · min(m, n)²` of the whole matrix, the same on every TP
/// rank), the rest split.
pub fn layer_wise_placement(m: &ParamMeta) -> Placement {
    if !is_muon_parameter(m) {
        return Placement::Split;
    }
    let (a, b) = (m.shape[0] as u128, m.shape[1] as u128);
    Placement::Whole {
        cost: a.max(b) * a.min(b) * a.min(b),
    }
}

/// Which state an owned piece has: an offset into the Muon momenta or the scalar moments.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Muon(usize),
    Scalar(usize),
}

/// A piece of the buffer this rank owns: a whole Muon matrix, or part of a scalar parameter.
#[derive(Clone, Debug)]
struct Piece {
    owned: OwnedPiece,
    slot: Slot,
    /// Offset of its fp32 main values (under 16-bit parameters).
    main: usize,
}

pub struct LayerWiseDistributedOptimizer {
    pub config: MuonConfig,
    /// The layer-wise buckets (and the experts') and their collectives.
    pub grads: ShardedGrads,
    pieces: Vec<Piece>,
    /// Which parameters Muon steps (whether this rank owns them or not).
    is_muon: Vec<bool>,
    /// The owned Muon matrices' state, one after another.
    moments: MuonMoments,
    /// One vector per moment of the scalar rule, over the owned scalar pieces.
    scalar_moments: Vec<Vec<f32>>,
    /// fp32 main values of every owned piece when the parameters are 16-bit; empty otherwise.
    main: Vec<f32>,
    step: u64,
    tp: Option<Box<dyn Communicator>>,
    etp: Option<Box<dyn Communicator>>,
}

impl LayerWiseDistributedOptimizer {
    /// `buffer` (and the experts' buffer) must have the layer-wise layout of
    /// [`layer_wise_placement`]; `tp` / `etp` are this optimizer's own copies of the TP groups.
    pub fn new(
        params: &Params,
        config: MuonConfig,
        buffer: GradBuffer,
        expert: Option<ExpertGrads>,
        tp: Option<Box<dyn Communicator>>,
        etp: Option<Box<dyn Communicator>>,
    ) -> Self {
        let grads = ShardedGrads::new(buffer, expert);
        let (mut muon, mut scalar, mut main) = (0, 0, 0);
        let mut pieces: Vec<Piece> = grads
            .owned_pieces(params)
            .into_iter()
            .map(|owned| {
                let m = &params.metas[owned.param];
                let n = owned.range.len();
                let slot = if is_muon_parameter(m) {
                    assert_eq!(
                        owned.range,
                        m.offset..m.offset + m.numel,
                        "{}: a Muon matrix must be owned whole",
                        m.name
                    );
                    muon += n;
                    Slot::Muon(muon - n)
                } else {
                    scalar += n;
                    Slot::Scalar(scalar - n)
                };
                main += n;
                Piece {
                    owned,
                    slot,
                    main: main - n,
                }
            })
            .collect();
        // Muon steps the matrices in the same order on every TP rank (their collectives pair).
        pieces.sort_by_key(|p| p.owned.range.start);
        let main = if params.half.format().is_some() {
            let mut v = vec![0.0; main];
            for p in &pieces {
                let r = p.owned.range.clone();
                v[p.main..p.main + r.len()].copy_from_slice(&params.data[r]);
            }
            v
        } else {
            Vec::new()
        };
        LayerWiseDistributedOptimizer {
            config,
            grads,
            pieces,
            is_muon: params.metas.iter().map(is_muon_parameter).collect(),
            moments: MuonMoments::new(&config, muon),
            scalar_moments: config.scalar.new_state(scalar),
            main,
            step: 0,
            tp,
            etp,
        }
    }

    /// Elements of the Muon matrices this rank owns (their momenta).
    pub fn muon_elements(&self) -> usize {
        self.moments.len()
    }

    /// The rules on the owned pieces only; the rest of the parameters are stale until the
    /// all-gather.
    fn update(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: StepLr,
        weight_decay: f32,
    ) -> Result<(), CommError> {
        self.step += 1;
        let c = self.config;
        let half = !self.main.is_empty();
        for p in &self.pieces {
            let range = p.owned.range.clone();
            let m = &params.metas[p.owned.param];
            let rate = lr.of(m);
            let wd = if m.weight_decay { weight_decay } else { 0.0 };
            let g = &grads.data[range.clone()];
            let main = p.main..p.main + range.len();
            let w = if half {
                &mut self.main[main.clone()]
            } else {
                &mut params.data[range.clone()]
            };
            match p.slot {
                Slot::Muon(s) => {
                    let group = if m.expert {
                        self.etp.as_mut()
                    } else {
                        self.tp.as_mut()
                    };
                    let (momentum, moment2) = self.moments.matrix(s, m.numel);
                    let x = MuonMatrix {
                        w,
                        g,
                        momentum,
                        moment2,
                    };
                    muon_matrix_step(&c, m, x, rate, wd, group)?;
                }
                Slot::Scalar(s) => {
                    let n = range.len();
                    let mut state: Vec<&mut [f32]> = self
                        .scalar_moments
                        .iter_mut()
                        .map(|v| &mut v[s..s + n])
                        .collect();
                    c.scalar.apply(w, g, &mut state, rate, wd, self.step);
                }
            }
            if half {
                params.half.write(range, &self.main[main]);
            }
        }
        Ok(())
    }

    /// The gradient side and the owned pieces, borrowed apart.
    fn grads_and_owned(
        &mut self,
    ) -> (&mut ShardedGrads, impl Iterator<Item = &OwnedPiece> + Clone) {
        (&mut self.grads, self.pieces.iter().map(|p| &p.owned))
    }

    fn moments_of_slot(&self, slot: Slot, n: usize) -> Vec<(Moment, Cow<'_, [f32]>)> {
        match slot {
            Slot::Muon(s) => self.moments.pieces(s, n),
            Slot::Scalar(s) => self
                .config
                .scalar
                .moments()
                .iter()
                .zip(&self.scalar_moments)
                .map(|(k, v)| (*k, Cow::Borrowed(&v[s..s + n])))
                .collect(),
        }
    }
}

impl MegatronOptimizer for LayerWiseDistributedOptimizer {
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
        for p in &self.pieces {
            scale_inplace(&mut grads.data[p.owned.range.clone()], coeff);
        }
    }

    fn local_grad_norm_squared(&self, params: &Params, grads: &Grads) -> f64 {
        let all = self.pieces.iter().map(|p| (p.owned.param, &p.owned.range));
        owned_norm_squared(params, grads, 0, all)
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
        let (sharded, owned) = self.grads_and_owned();
        sharded.norm_squared(params, grads, owned, tp, pp, dp)
    }

    fn count_zeros(
        &mut self,
        params: &Params,
        grads: &Grads,
        tp: &mut Tp,
        pp: &mut dyn Communicator,
        dp: Option<&mut dyn Communicator>,
    ) -> Result<u64, CommError> {
        let (sharded, owned) = self.grads_and_owned();
        sharded.count_zeros(params, grads, owned, tp, pp, dp)
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
        self.update(params, grads, lr, weight_decay)?;
        match gather {
            ParamGather::Now => self.grads.gather_params(params, dp),
            // The overlapped gather covers the dense buckets; the experts' go now.
            ParamGather::Deferred => self.grads.gather_expert_params(params),
        }
    }

    fn gather_params(
        &mut self,
        params: &mut Params,
        dp: &mut dyn Communicator,
    ) -> Result<(), CommError> {
        self.grads.gather_params(params, dp)
    }

    fn state_bytes(&self) -> usize {
        self.moments.bytes()
            + (self.main.capacity() + self.scalar_moments.iter().map(Vec::capacity).sum::<usize>())
                * 4
    }

    fn comm_buffer_bytes(&self) -> usize {
        self.grads.scratch_bytes()
    }

    fn step_count(&self) -> u64 {
        self.step
    }

    fn name(&self) -> &'static str {
        self.config.name()
    }

    fn moments_of(&self, param: usize) -> &'static [Moment] {
        if self.is_muon[param] {
            self.config.moments()
        } else {
            self.config.scalar.moments()
        }
    }

    fn state_elements(&self) -> usize {
        self.moments.elements() + self.scalar_moments.iter().map(Vec::len).sum::<usize>()
    }

    fn state_pieces<'a>(
        &'a self,
        params: &'a Params,
        _dp_rank: usize,
        _dp: usize,
    ) -> Vec<StatePiece<'a>> {
        self.pieces
            .iter()
            .map(|p| {
                let r = p.owned.range.clone();
                let m = &params.metas[p.owned.param];
                let n = r.len();
                StatePiece {
                    param: p.owned.param,
                    local: r.start - m.offset..r.end - m.offset,
                    value: if self.main.is_empty() {
                        &params.data[r]
                    } else {
                        &self.main[p.main..p.main + n]
                    },
                    moments: self.moments_of_slot(p.slot, n),
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
        for p in &self.pieces {
            let (param, r) = (p.owned.param, p.owned.range.clone());
            let m = &params.metas[param];
            let local = r.start - m.offset..r.end - m.offset;
            let n = r.len();
            match p.slot {
                // A Muon matrix is owned whole: `local` is all of it.
                Slot::Muon(s) => self.moments.read(read, param, s, n)?,
                Slot::Scalar(s) => {
                    let kinds = self.config.scalar.moments();
                    for (k, v) in kinds.iter().zip(&mut self.scalar_moments) {
                        read(*k, param, local.clone(), &mut v[s..s + n])?;
                    }
                }
            }
        }
        self.step = step;
        Ok(())
    }
}
