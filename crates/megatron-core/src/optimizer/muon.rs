//! Megatron's `--optimizer muon` (megatron-core's `TensorParallelMuon` on NVIDIA's
//! emerging-optimizers): every 2-D weight but the word embedding and the output layer steps on
//! the orthogonalized momentum of its gradient; the rest (embeddings, output layer, norms,
//! biases) on the scalar optimizer (`--muon-scalar-optimizer`, Adam by default), as megatron-core
//! routes them.
//!
//! For each Muon matrix `W` with gradient `G`, momentum `β` and rate `lr`: `W -= lr·wd·W`
//! (decoupled), `M ← M + (1-β)(G - M)`, `U = M` (or `G + β(M - G)` with Nesterov), then
//! `W -= lr · s · NS(U)` with `NS` the Newton–Schulz iteration and `s` the scale mode's factor
//! times `--muon-extra-scale-factor`. A fused QKV weight is orthogonalized as its query, key and
//! value blocks (`--muon-no-split-qkv` turns that off).
//!
//! Under tensor parallelism `NS` must see the whole matrix for the result not to depend on the
//! layout: `duplicated` gathers it on every TP rank, `distributed` completes the Gram matrices
//! with an all-reduce, `blockwise` orthogonalizes each shard alone (a different optimizer per
//! TP size, as in megatron-core).
//!
//! `--optimizer adaptive_muon` (megatron-core's `TensorParallelAdaptiveMuon`, AdaMuon) divides
//! the scaled orthogonalized update element-wise by the root of an EMA of its squares
//! (`moment2_buffer`), then applies the scale once more, as megatron-core does. megatron-core
//! takes that second factor from the local shard's shape, so its update changes with the TP size;
//! here it is the whole matrix's (the same at TP 1, and every layout trains the same model),
//! except under `blockwise`, whose shards are matrices of their own.

use super::megatron_optimizer::StatePiece;
use super::UpdateRule;
use super::{MegatronOptimizer, Moment, MomentReader, ParamGather, ReplicatedGrads, StepLr};
use crate::distributed::GradBuffer;
use crate::params::{view2d, Grads, ParamMeta, Params};
use crate::tensor_parallel::Tp;
use megatron_comm::{CommError, Communicator, ReduceOp};
use megatron_tensor::cpu::{
    adamuon_normalize, global_norm_squared, newton_schulz, scale_inplace, torch_lerp,
    AdaMuonParams, NewtonSchulz, NewtonSchulzDims, NsOrientation, NsPrecision,
};
use std::borrow::Cow;

/// `--muon-coefficient-type`: the `(a, b, c)` of each Newton–Schulz step (emerging-optimizers'
/// tables, rounded to f32 as there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsCoefficients {
    Simple,
    Quintic,
    PolarExpress,
    Cans,
    Aol,
    DeepseekV4,
}

const SIMPLE: [f32; 3] = [3.4445, -4.7750, 2.0315];
const QUINTIC: [[f32; 3]; 5] = [
    [4.0848, -6.8946, 2.9270],
    [3.9505, -6.3029, 2.6377],
    [3.7418, -5.5913, 2.3037],
    [2.8769, -3.1427, 1.2046],
    [2.8366, -3.0525, 1.2012],
];
const POLAR_EXPRESS: [[f32; 3]; 8] = [
    [8.2051, -22.9019, 16.4607],
    [4.0664, -2.8612, 0.5184],
    [3.9096, -2.8234, 0.5250],
    [3.2856, -2.4153, 0.4853],
    [2.2779, -1.6198, 0.3985],
    [1.8726, -1.2307, 0.3585],
    [1.8564, -1.2132, 0.3568],
    [1.8750, -1.2500, 0.3750],
];
const CANS: [[f32; 3]; 5] = [
    [8.4703, -25.1081, 18.6293],
    [4.1828, -3.1087, 0.5806],
    [3.9619, -2.9541, 0.5630],
    [3.2866, -2.4647, 0.5074],
    [2.2737, -1.6447, 0.4162],
];
const AOL: [[f32; 3]; 4] = [
    [4.0098, -7.0585, 2.4635],
    [3.4585, -5.5479, 2.5959],
    [2.7573, -3.2939, 1.4254],
    [2.7215, -3.0494, 1.3169],
];
const DEEPSEEK_V4: [[f32; 3]; 10] = [
    SIMPLE,
    SIMPLE,
    SIMPLE,
    SIMPLE,
    SIMPLE,
    SIMPLE,
    SIMPLE,
    SIMPLE,
    [2.0, -1.5, 0.5],
    [2.0, -1.5, 0.5],
];

impl NsCoefficients {
    pub const ALL: [NsCoefficients; 6] = [
        NsCoefficients::Simple,
        NsCoefficients::Quintic,
        NsCoefficients::PolarExpress,
        NsCoefficients::Cans,
        NsCoefficients::Aol,
        NsCoefficients::DeepseekV4,
    ];

    /// emerging-optimizers' name.
    pub fn name(self) -> &'static str {
        match self {
            NsCoefficients::Simple => "simple",
            NsCoefficients::Quintic => "quintic",
            NsCoefficients::PolarExpress => "polar_express",
            NsCoefficients::Cans => "cans",
            NsCoefficients::Aol => "aol",
            NsCoefficients::DeepseekV4 => "deepseekv4",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    fn table(self) -> &'static [[f32; 3]] {
        match self {
            NsCoefficients::Simple => std::slice::from_ref(&SIMPLE),
            NsCoefficients::Quintic => &QUINTIC,
            NsCoefficients::PolarExpress => &POLAR_EXPRESS,
            NsCoefficients::Cans => &CANS,
            NsCoefficients::Aol => &AOL,
            NsCoefficients::DeepseekV4 => &DEEPSEEK_V4,
        }
    }

    /// The coefficients of `steps` steps: past the table's end the sets designed as a
    /// schedule keep their last step, the others start over (emerging-optimizers'
    /// `repeat_last` and `cycle`).
    pub fn schedule(self, steps: usize) -> Vec<[f32; 3]> {
        let t = self.table();
        let repeat_last = matches!(
            self,
            NsCoefficients::PolarExpress | NsCoefficients::Cans | NsCoefficients::DeepseekV4
        );
        (0..steps)
            .map(|i| {
                if repeat_last {
                    t[i.min(t.len() - 1)]
                } else {
                    t[i % t.len()]
                }
            })
            .collect()
    }
}

/// `--muon-scale-mode`: the factor on the orthogonalized update of an `out × in` matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonScaleMode {
    /// `sqrt(max(out, in))` (Kimi's, for learning rates transferred from AdamW).
    Spectral,
    /// `sqrt(out / in)`.
    UnitRmsNorm,
    /// `sqrt(max(1, out / in))` (Keller Jordan's Muon).
    ShapeScaling,
}

impl MuonScaleMode {
    pub fn factor(self, out: usize, inp: usize) -> f32 {
        let (o, i) = (out as f64, inp as f64);
        (match self {
            MuonScaleMode::Spectral => o.max(i).sqrt(),
            MuonScaleMode::UnitRmsNorm => (o / i).sqrt(),
            MuonScaleMode::ShapeScaling => (o / i).max(1.0).sqrt(),
        }) as f32
    }
}

/// `--muon-tp-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonTpMode {
    /// Each TP shard orthogonalized on its own.
    Blockwise,
    /// The whole matrix gathered on every TP rank.
    Duplicated,
    /// Each rank iterates on its shard; Gram matrices all-reduced over TP.
    Distributed,
}

/// The update with `--momentum` or Nesterov's look-ahead (`--muon-nesterov`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonMomentum {
    /// `U = M`.
    Plain,
    /// `U = G + β(M - G)`.
    Nesterov,
}

/// What divides the orthogonalized update: `--optimizer muon` or `adaptive_muon`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MuonMoment2 {
    /// Muon: the scaled orthogonalized update as it is.
    None,
    /// AdaMuon (megatron-core's `adaptive_muon`, `moment2_method="adamuon"`; Megatron's
    /// `OptimizerConfig.adaptive_muon_beta2` / `_eps`, which have no flags).
    AdaMuon(AdaMuonParams),
}

/// Validated Muon settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MuonConfig {
    pub momentum: f32,
    pub momentum_kind: MuonMomentum,
    pub coefficients: NsCoefficients,
    pub num_ns_steps: usize,
    pub precision: NsPrecision,
    pub scale_mode: MuonScaleMode,
    pub extra_scale_factor: f32,
    pub tp_mode: MuonTpMode,
    /// Rows of one query group's `[query; key; value]` in a fused QKV weight, when QKV weights
    /// are orthogonalized block by block (`None`: `--muon-no-split-qkv`, or a model without one).
    pub qkv_split: Option<[usize; 3]>,
    /// The optimizer of the parameters Muon does not take.
    pub scalar: UpdateRule,
    pub moment2: MuonMoment2,
}

impl MuonConfig {
    /// The state of a Muon matrix, named as megatron-core's optimizer state.
    pub fn moments(&self) -> &'static [Moment] {
        match self.moment2 {
            MuonMoment2::None => &[Moment::MomentumBuffer],
            MuonMoment2::AdaMuon(_) => &[Moment::MomentumBuffer, Moment::Moment2Buffer],
        }
    }

    /// megatron-core's name (`--optimizer`, recorded in checkpoints).
    pub fn name(&self) -> &'static str {
        match self.moment2 {
            MuonMoment2::None => "muon",
            MuonMoment2::AdaMuon(_) => "adaptive_muon",
        }
    }
}

/// The state of a rank's Muon matrices, one after another in each vector: the momentum, and
/// under AdaMuon the second moment.
#[derive(Clone, Debug)]
pub(super) struct MuonMoments {
    kinds: &'static [Moment],
    values: Vec<Vec<f32>>,
}

impl MuonMoments {
    pub(super) fn new(config: &MuonConfig, n: usize) -> Self {
        let kinds = config.moments();
        MuonMoments {
            kinds,
            values: kinds.iter().map(|_| vec![0.0; n]).collect(),
        }
    }

    /// Elements of the matrices (each moment's length).
    pub(super) fn len(&self) -> usize {
        self.values[0].len()
    }

    /// Elements of every moment together.
    pub(super) fn elements(&self) -> usize {
        self.values.iter().map(Vec::len).sum()
    }

    pub(super) fn bytes(&self) -> usize {
        self.values.iter().map(Vec::capacity).sum::<usize>() * 4
    }

    /// The matrix at `s..s + n`: its momentum and second moment (empty under plain Muon).
    pub(super) fn matrix(&mut self, s: usize, n: usize) -> (&mut [f32], &mut [f32]) {
        let (first, rest) = self.values.split_at_mut(1);
        let moment2 = match rest.first_mut() {
            Some(v) => &mut v[s..s + n],
            None => &mut [][..],
        };
        (&mut first[0][s..s + n], moment2)
    }

    /// The matrix at `s..s + n` for a checkpoint.
    pub(super) fn pieces(&self, s: usize, n: usize) -> Vec<(Moment, Cow<'_, [f32]>)> {
        self.kinds
            .iter()
            .zip(&self.values)
            .map(|(k, v)| (*k, Cow::Borrowed(&v[s..s + n])))
            .collect()
    }

    /// Reads parameter `param`'s moments into the matrix at `s..s + n`.
    pub(super) fn read(
        &mut self,
        read: &mut MomentReader,
        param: usize,
        s: usize,
        n: usize,
    ) -> Result<(), String> {
        for (k, v) in self.kinds.iter().zip(&mut self.values) {
            read(*k, param, 0..n, &mut v[s..s + n])?;
        }
        Ok(())
    }
}

/// Whether megatron-core's Muon takes a parameter: 2-D and neither the word embedding nor the
/// output layer (`is_embedding_or_output_parameter`). Position embeddings and MoE routers are
/// 2-D, so Muon takes them, as megatron-core does.
pub fn is_muon_parameter(m: &ParamMeta) -> bool {
    m.shape.len() == 2
        && !matches!(
            m.name.as_str(),
            "embedding.word_embeddings.weight" | "output_layer.weight"
        )
        && !m.name.ends_with(".embedding.word_embeddings.weight")
        && !m.name.ends_with(".output_layer.weight")
}

/// Which state a parameter has: an offset into the Muon momenta or into the scalar moments.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Muon(usize),
    Scalar(usize),
}

/// Muon over replicated state: every DP rank steps on every parameter.
pub struct MuonOptimizer {
    pub config: MuonConfig,
    slots: Vec<Slot>,
    /// The Muon parameters' state, one after another.
    moments: MuonMoments,
    /// One vector per moment of the scalar rule, over the scalar parameters one after another.
    scalar_moments: Vec<Vec<f32>>,
    step: u64,
    grads: ReplicatedGrads,
    /// Private duplicates of the TP groups (dense weights and experts): the step gathers or
    /// reduces over them, and the optimizer's interface passes only the DP group.
    tp: Option<Box<dyn Communicator>>,
    etp: Option<Box<dyn Communicator>>,
}

impl MuonOptimizer {
    /// `tp` / `etp`: this optimizer's own copies of the dense and the experts' TP groups
    /// (`None` on one rank).
    pub fn new(
        params: &Params,
        config: MuonConfig,
        buffer: GradBuffer,
        tp: Option<Box<dyn Communicator>>,
        etp: Option<Box<dyn Communicator>>,
    ) -> Self {
        let (mut muon, mut scalar) = (0, 0);
        let slots = params
            .metas
            .iter()
            .map(|m| {
                if is_muon_parameter(m) {
                    muon += m.numel;
                    Slot::Muon(muon - m.numel)
                } else {
                    scalar += m.numel;
                    Slot::Scalar(scalar - m.numel)
                }
            })
            .collect();
        MuonOptimizer {
            config,
            slots,
            moments: MuonMoments::new(&config, muon),
            scalar_moments: config.scalar.new_state(scalar),
            step: 0,
            grads: ReplicatedGrads::new(buffer),
            tp,
            etp,
        }
    }

    pub fn with_experts(mut self, expert: crate::distributed::ExpertGrads) -> Self {
        self.grads.expert = Some(expert);
        self
    }

    /// Elements of the Muon parameters (their momenta).
    pub fn muon_elements(&self) -> usize {
        self.moments.len()
    }

    fn scalar_step(&mut self, params: &mut Params, grads: &Grads, lr: StepLr, wd: f32) {
        // Consecutive scalar parameters with the same decay and rate are one call.
        let mut runs: Vec<(usize, usize, usize, bool, f32)> = Vec::new();
        for (m, slot) in params.metas.iter().zip(&self.slots) {
            let Slot::Scalar(s) = *slot else { continue };
            let rate = lr.of(m);
            match runs.last_mut() {
                Some(r) if r.3 == m.weight_decay && r.4 == rate && r.1 == m.offset => {
                    r.1 += m.numel
                }
                _ => runs.push((m.offset, m.offset + m.numel, s, m.weight_decay, rate)),
            }
        }
        for (start, end, s, decay, rate) in runs {
            let mut state: Vec<&mut [f32]> = self
                .scalar_moments
                .iter_mut()
                .map(|v| &mut v[s..s + end - start])
                .collect();
            self.config.scalar.apply(
                &mut params.data[start..end],
                &grads.data[start..end],
                &mut state,
                rate,
                if decay { wd } else { 0.0 },
                self.step,
            );
        }
    }

    fn muon_step(
        &mut self,
        params: &mut Params,
        grads: &Grads,
        lr: StepLr,
        wd: f32,
    ) -> Result<(), CommError> {
        let c = self.config;
        for (i, m) in params.metas.iter().enumerate() {
            let Slot::Muon(s) = self.slots[i] else {
                continue;
            };
            let r = m.offset..m.offset + m.numel;
            let group = if m.expert {
                self.etp.as_mut()
            } else {
                self.tp.as_mut()
            };
            let (momentum, moment2) = self.moments.matrix(s, m.numel);
            muon_matrix_step(
                &c,
                m,
                MuonMatrix {
                    w: &mut params.data[r.clone()],
                    g: &grads.data[r],
                    momentum,
                    moment2,
                },
                lr.of(m),
                if m.weight_decay { wd } else { 0.0 },
                group,
            )?;
        }
        Ok(())
    }
}

/// One Muon matrix's local values, gradient and state.
pub(super) struct MuonMatrix<'a> {
    pub w: &'a mut [f32],
    pub g: &'a [f32],
    pub momentum: &'a mut [f32],
    /// AdaMuon's second moment (empty under plain Muon).
    pub moment2: &'a mut [f32],
}

/// Muon's step on matrix `m` with rate `rate` and decoupled decay `wd`: the momentum, its
/// orthogonalization (over `group` when `m` is split over TP), the update.
pub(super) fn muon_matrix_step(
    c: &MuonConfig,
    m: &ParamMeta,
    x: MuonMatrix<'_>,
    rate: f32,
    wd: f32,
    group: Option<&mut Box<dyn Communicator>>,
) -> Result<(), CommError> {
    let MuonMatrix {
        w,
        g,
        momentum: buf,
        moment2,
    } = x;
    if wd != 0.0 {
        let decay = -rate * wd;
        w.iter_mut().for_each(|x| *x += decay * *x);
    }
    for (b, gv) in buf.iter_mut().zip(g) {
        *b = torch_lerp(*b, *gv, 1.0 - c.momentum);
    }
    let update: Vec<f32> = match c.momentum_kind {
        MuonMomentum::Plain => buf.to_vec(),
        MuonMomentum::Nesterov => g
            .iter()
            .zip(buf.iter())
            .map(|(gv, b)| torch_lerp(*gv, *b, c.momentum))
            .collect(),
    };
    let mut orth = orthogonalize(c, m, &update, group)?;
    if let MuonMoment2::AdaMuon(h) = c.moment2 {
        adamuon_normalize(&mut orth, moment2, h);
        // megatron-core's second `update * scale * extra`, over the whole matrix (see the
        // module's note); a blockwise shard is a matrix of its own.
        let shape = if c.tp_mode == MuonTpMode::Blockwise {
            &m.local_shape
        } else {
            &m.shape
        };
        let (rows, cols) = view2d(shape);
        scale_inplace(&mut orth, c.scale_mode.factor(rows, cols));
        if c.extra_scale_factor != 1.0 {
            scale_inplace(&mut orth, c.extra_scale_factor);
        }
    }
    for (x, o) in w.iter_mut().zip(&orth) {
        *x -= rate * o;
    }
    Ok(())
}

/// The scaled orthogonalized update of parameter `m`'s local shard `u`.
fn orthogonalize(
    c: &MuonConfig,
    m: &ParamMeta,
    u: &[f32],
    group: Option<&mut Box<dyn Communicator>>,
) -> Result<Vec<f32>, CommError> {
    let split = m.tp_split_dim.filter(|_| m.tp_size > 1);
    let (group, split) = match (group, split) {
        (Some(g), Some(d)) if g.size() > 1 && c.tp_mode != MuonTpMode::Blockwise => (g, d),
        _ => {
            let (rows, cols) = view2d(&m.local_shape);
            return Ok(orthogonalize_blocks(c, m, u, rows, cols, None));
        }
    };
    match c.tp_mode {
        MuonTpMode::Duplicated => {
            // The whole matrix on every rank, each shard placed where the global layout has it.
            let size = group.size();
            let mut all = vec![0.0f32; u.len() * size];
            group.all_gather(u, &mut all)?;
            let (rows, cols) = view2d(&m.shape);
            let mut whole = vec![0.0f32; rows * cols];
            for (rank, shard) in all.chunks(u.len()).enumerate() {
                for (i, v) in shard.iter().enumerate() {
                    whole[m.global_index_on(i, rank)] = *v;
                }
            }
            let orth = orthogonalize_blocks(c, m, &whole, rows, cols, None);
            Ok((0..u.len())
                .map(|i| orth[m.global_index_on(i, m.tp_rank)])
                .collect())
        }
        MuonTpMode::Distributed => {
            let (rows, cols) = view2d(&m.local_shape);
            let sharded = if split == 0 {
                ShardedAxis::Rows
            } else {
                ShardedAxis::Cols
            };
            let mut failure = None;
            let mut sum = |x: &mut [f32]| {
                if failure.is_none() {
                    if let Err(e) = group.all_reduce(x, ReduceOp::Sum) {
                        failure = Some(e);
                    }
                }
            };
            let out = orthogonalize_blocks(
                c,
                m,
                u,
                rows,
                cols,
                Some(Sharding {
                    axis: sharded,
                    ranks: m.tp_size,
                    sum: &mut sum,
                }),
            );
            match failure {
                Some(e) => Err(e),
                None => Ok(out),
            }
        }
        MuonTpMode::Blockwise => unreachable!("blockwise handled above"),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ShardedAxis {
    Rows,
    Cols,
}

/// This rank's part of a matrix split along `axis` over `ranks` ranks; `sum` completes the
/// iteration's partial Gram matrices and norm over them.
struct Sharding<'a> {
    axis: ShardedAxis,
    ranks: usize,
    sum: &'a mut dyn FnMut(&mut [f32]),
}

/// NS of the `rows × cols` matrix `x`, block by block for a split QKV weight; with `sharded`,
/// `x` is this rank's part of a larger matrix.
fn orthogonalize_blocks(
    c: &MuonConfig,
    m: &ParamMeta,
    x: &[f32],
    rows: usize,
    cols: usize,
    mut sharded: Option<Sharding<'_>>,
) -> Vec<f32> {
    let coefficients = c.coefficients.schedule(c.num_ns_steps);
    let mut run = |block: &[f32], r: usize| -> Vec<f32> {
        let (orientation, whole_r, whole_c) = match sharded.as_ref() {
            None => (NsOrientation::Smaller, r, cols),
            Some(Sharding {
                axis: ShardedAxis::Rows,
                ranks,
                ..
            }) => (NsOrientation::Columns, r * ranks, cols),
            Some(Sharding {
                axis: ShardedAxis::Cols,
                ranks,
                ..
            }) => (NsOrientation::Rows, r, cols * ranks),
        };
        let ns = NewtonSchulz {
            coefficients: &coefficients,
            precision: c.precision,
            orientation,
            eps: 1e-7,
        };
        let mut out = vec![0.0f32; block.len()];
        let d = NewtonSchulzDims { rows: r, cols };
        match sharded.as_mut() {
            Some(Sharding { sum, .. }) => newton_schulz(&mut out, block, d, &ns, &mut **sum),
            None => newton_schulz(&mut out, block, d, &ns, &mut |_| {}),
        }
        // Two products, as the reference: `orth * scale * extra`.
        scale_inplace(&mut out, c.scale_mode.factor(whole_r, whole_c));
        if c.extra_scale_factor != 1.0 {
            scale_inplace(&mut out, c.extra_scale_factor);
        }
        out
    };
    let split = c
        .qkv_split
        .filter(|q| is_fused_qkv(m) && rows.is_multiple_of(q.iter().sum::<usize>()));
    let Some(parts) = split else {
        return run(x, rows);
    };
    // [groups, q + k + v, cols]: each of the three blocks gathered, orthogonalized, put back.
    let per_group: usize = parts.iter().sum();
    let groups = rows / per_group;
    let mut out = vec![0.0f32; x.len()];
    let mut first = 0;
    for &p in &parts {
        let mut block = Vec::with_capacity(groups * p * cols);
        for g in 0..groups {
            let r0 = g * per_group + first;
            block.extend_from_slice(&x[r0 * cols..(r0 + p) * cols]);
        }
        let orth = run(&block, groups * p);
        for g in 0..groups {
            let r0 = g * per_group + first;
            out[r0 * cols..(r0 + p) * cols]
                .copy_from_slice(&orth[g * p * cols..(g + 1) * p * cols]);
        }
        first += p;
    }
    out
}

/// megatron-core tags `linear_qkv.weight` (`is_qkv`) for the split.
fn is_fused_qkv(m: &ParamMeta) -> bool {
    m.name.ends_with("linear_qkv.weight")
}

impl MegatronOptimizer for MuonOptimizer {
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
        self.scalar_step(params, grads, lr, weight_decay);
        self.muon_step(params, grads, lr, weight_decay)?;
        // Under 16-bit storage `data` holds the fp32 main parameters.
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
        self.moments.bytes() + self.scalar_moments.iter().map(Vec::capacity).sum::<usize>() * 4
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
        match self.slots[param] {
            Slot::Muon(_) => self.config.moments(),
            Slot::Scalar(_) => self.config.scalar.moments(),
        }
    }

    fn state_elements(&self) -> usize {
        self.moments.elements() + self.scalar_moments.iter().map(Vec::len).sum::<usize>()
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
                let moments = match self.slots[i] {
                    Slot::Muon(s) => self.moments.pieces(s, m.numel),
                    Slot::Scalar(s) => self
                        .config
                        .scalar
                        .moments()
                        .iter()
                        .zip(&self.scalar_moments)
                        .map(|(k, v)| (*k, Cow::Borrowed(&v[s..s + m.numel])))
                        .collect(),
                };
                StatePiece {
                    param: i,
                    local: 0..m.numel,
                    value: &params.data[m.offset..m.offset + m.numel],
                    moments,
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
            match self.slots[i] {
                Slot::Muon(s) => self.moments.read(read, i, s, m.numel)?,
                Slot::Scalar(s) => {
                    for (k, v) in self
                        .config
                        .scalar
                        .moments()
                        .iter()
                        .zip(&mut self.scalar_moments)
                    {
                        read(*k, i, 0..m.numel, &mut v[s..s + m.numel])?;
                    }
                }
            }
        }
        self.step = step;
        Ok(())
    }
}
