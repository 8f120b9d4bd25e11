//! Parameters and gradients, each one contiguous buffer per dtype.
//!
//! One buffer per dtype is what the optimizer, the gradient norm and the data-parallel
//! collectives want to see as a single slice. Each parameter is a named range with the metadata
//! of DESIGN.md section 5; checkpointing and the optimizer read that metadata, nothing guesses it.
//!
//! Under `--bf16` / `--fp16` the model reads a 16-bit copy ([`HalfParams`]) and `data` holds the
//! fp32 main parameters the optimizer updates (Megatron's `Float16OptimizerWithFloat16Params`);
//! with the distributed optimizer `data` is empty and each rank's optimizer holds the fp32 main
//! parameters of its shard only: 2 + 4 + 12/d bytes per parameter instead of 18.

use half::{bf16, f16};
use megatron_tensor::cpu::cast::{bf16_to_f32, f16_to_f32, Half};
use megatron_tensor::cpu::matmul::Operand;
use megatron_tensor::{RngKey, Tensor};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::ops::{Deref, Range};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParamId(pub usize);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParamMeta {
    /// Megatron-core global name, e.g. `decoder.layers.3.self_attention.linear_qkv.weight`.
    pub name: String,
    /// Global (unsharded) shape.
    pub shape: Vec<usize>,
    /// This rank's shard: `shape` with `tp_split_dim` divided by the TP size.
    pub local_shape: Vec<usize>,
    pub offset: usize,
    /// Elements of the local shard.
    pub numel: usize,
    pub weight_decay: bool,
    /// Dimension split across tensor-parallel ranks, if any.
    pub tp_split_dim: Option<usize>,
    /// Same values on every tensor-parallel rank (counted once in the gradient norm).
    pub tp_replicated: bool,
    /// Under sequence parallelism each TP rank sees only its tokens, so the gradient of this
    /// replicated parameter is partial and must be all-reduced over TP (LayerNorms, row-parallel
    /// biases, position embeddings).
    pub sequence_parallel_grad: bool,
    /// Same on every TP rank, but each rank's gradient covers only its heads, so it is
    /// all-reduced over TP whether or not sequence parallelism is on (`--qk-layernorm`).
    #[serde(default)]
    pub tp_partial_grad: bool,
    /// The split dimension holds this many equal blocks, each split over TP on its own (the
    /// SwiGLU `linear_fc1` is `[gate; up]`: a rank holds `[gate_r; up_r]`). 1 for a plain split.
    #[serde(default = "one")]
    pub tp_chunks: usize,
    /// Index of this shard along `tp_split_dim` and the number of shards.
    pub tp_rank: usize,
    pub tp_size: usize,
    /// A copy of a parameter owned by another pipeline stage (the last stage's copy of the tied
    /// word embedding, Megatron's `shared=True`): counted once in the gradient norm and not
    /// saved, since the owner saves it.
    #[serde(default)]
    pub shared: bool,
    /// An expert's weight (MoE): held by the ranks of one expert-parallel coordinate, its
    /// gradient reduced over the expert-data-parallel group, not the data-parallel one.
    #[serde(default)]
    pub expert: bool,
}

fn one() -> usize {
    1
}

impl ParamMeta {
    /// Global flat index of local element `i` (row-major in both shapes).
    pub fn global_index(&self, i: usize) -> usize {
        self.global_index_on(i, self.tp_rank)
    }

    /// Global flat index of element `i` of TP rank `rank`'s shard.
    pub fn global_index_on(&self, i: usize, rank: usize) -> usize {
        let Some(d) = self.tp_split_dim else {
            return i;
        };
        // Split dim `d`: the local tensor is [outer, local_d, inner]; global [outer, d, inner].
        let inner: usize = self.shape[d + 1..].iter().product();
        let ld = self.local_shape[d];
        let gd = self.shape[d];
        let (o, rest) = (i / (ld * inner), i % (ld * inner));
        if self.tp_chunks <= 1 {
            return (o * gd + rank * ld) * inner + rest;
        }
        // Local row `r` of block `c` is global row `c * gd/chunks + rank * ld/chunks + r`.
        let (lb, gb) = (ld / self.tp_chunks, gd / self.tp_chunks);
        let (row, col) = (rest / inner, rest % inner);
        let (c, r) = (row / lb, row % lb);
        (o * gd + c * gb + rank * lb + r) * inner + col
    }
}

/// A rectangle of a parameter's global tensor (seen as 2-D: `[rows, cols]`, a 1-D tensor as one
/// row) that a contiguous run of this rank's local elements maps to: `rows` local rows starting
/// at local flat element `local_start`, `local_stride` apart, each `cols` long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalSegment {
    pub row: usize,
    pub col: usize,
    pub rows: usize,
    pub cols: usize,
    pub local_start: usize,
    pub local_stride: usize,
}

/// A shape seen as `[rows, cols]`: the last dimension is the columns.
pub fn view2d(shape: &[usize]) -> (usize, usize) {
    match shape {
        [] => (1, 1),
        [n] => (1, *n),
        _ => (
            shape[..shape.len() - 1].iter().product(),
            shape[shape.len() - 1],
        ),
    }
}

impl ParamMeta {
    /// Where local elements `local` of TP rank `rank`'s shard sit in the global tensor, as
    /// rectangles (what sharded checkpoints read and write instead of whole tensors). Checked
    /// against [`ParamMeta::global_index_on`] in the tests.
    pub fn global_segments(&self, local: Range<usize>, rank: usize) -> Vec<GlobalSegment> {
        let (lr, lc) = view2d(&self.local_shape);
        let (gr, gc) = view2d(&self.shape);
        // Which axis of the 2-D view the tensor-parallel split runs along.
        let split_rows = match self.tp_split_dim {
            None => None,
            Some(d) if d + 1 == self.shape.len() => Some(false),
            Some(0) if self.shape.len() == 2 => Some(true),
            Some(d) => panic!(
                "{}: split of dim {d} of a {}-D tensor",
                self.name,
                self.shape.len()
            ),
        };
        let k = self.tp_chunks.max(1);
        let map = |x: usize, l: usize, g: usize| {
            let (lb, gb) = (l / k, g / k);
            (x / lb) * gb + rank * lb + x % lb
        };
        let mut out: Vec<GlobalSegment> = Vec::new();
        if local.is_empty() || lc == 0 {
            return out;
        }
        let (first, last) = (local.start / lc, (local.end - 1) / lc);
        for r in first..=last {
            let c0 = if r == first { local.start % lc } else { 0 };
            let c1 = if r == last {
                (local.end - 1) % lc + 1
            } else {
                lc
            };
            // Column runs that stay contiguous in the global tensor.
            let mut runs = Vec::new();
            match split_rows {
                Some(false) => {
                    let lb = lc / k;
                    let mut c = c0;
                    while c < c1 {
                        let end = c1.min((c / lb + 1) * lb);
                        runs.push((c, map(c, lc, gc), end - c));
                        c = end;
                    }
                }
                _ => runs.push((c0, c0, c1 - c0)),
            }
            let grow = match split_rows {
                Some(true) => map(r, lr, gr),
                _ => r,
            };
            for (lcol, gcol, n) in runs {
                let local_start = r * lc + lcol;
                if let Some(prev) = out.last_mut() {
                    if prev.col == gcol
                        && prev.cols == n
                        && prev.row + prev.rows == grow
                        && prev.local_start + prev.rows * lc == local_start
                    {
                        prev.rows += 1;
                        continue;
                    }
                }
                out.push(GlobalSegment {
                    row: grow,
                    col: gcol,
                    rows: 1,
                    cols: n,
                    local_start,
                    local_stride: lc,
                });
            }
        }
        out
    }
}

/// How a parameter starts out.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    Normal(f32),
    Const(f32),
}

/// How a parameter is laid out over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Same on every TP rank; the gradient is complete on each.
    Replicated,
    /// Same on every TP rank; under sequence parallelism its gradient is partial per rank.
    ReplicatedSequenceParallel,
    /// Same on every TP rank; its gradient is always partial per rank (each rank applies it to
    /// its own heads: the query/key norms of `--qk-layernorm`).
    ReplicatedPartialGrad,
    /// Split along this dimension.
    Split(usize),
    /// Dimension 0 holds `chunks` equal blocks, each split over TP (fused `[gate; up]`).
    SplitChunks(usize),
    /// An expert's weight, whole on every rank that holds the expert (expert tensor
    /// parallelism 1).
    Expert,
    /// An expert's weight split along this dimension over expert tensor parallelism.
    ExpertSplit(usize),
    /// An expert's fused `[gate; up]` split blockwise over expert tensor parallelism.
    ExpertSplitChunks(usize),
}

impl Sharding {
    fn is_expert(self) -> bool {
        matches!(
            self,
            Sharding::Expert | Sharding::ExpertSplit(_) | Sharding::ExpertSplitChunks(_)
        )
    }
}

/// Which experts this rank holds: `ep` expert-parallel ranks hold equal consecutive blocks of
/// them (megatron-core's local experts); this rank is number `ep_rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    pub ep: usize,
    pub ep_rank: usize,
    /// Expert tensor parallelism: each expert's weights split over `etp` ranks.
    pub etp: usize,
    pub etp_rank: usize,
}

impl Default for ExpertLayout {
    fn default() -> Self {
        ExpertLayout {
            ep: 1,
            ep_rank: 0,
            etp: 1,
            etp_rank: 0,
        }
    }
}

impl ExpertLayout {
    /// Global indices of the experts this rank holds, of `num_experts`.
    pub fn local_experts(&self, num_experts: usize) -> std::ops::Range<usize> {
        let per = num_experts / self.ep;
        self.ep_rank * per..(self.ep_rank + 1) * per
    }
}

/// The 16-bit parameters the model reads under mixed precision.
#[derive(Clone, Debug, Default)]
pub enum HalfParams {
    #[default]
    None,
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl HalfParams {
    pub fn format(&self) -> Option<Half> {
        match self {
            HalfParams::None => None,
            HalfParams::BF16(_) => Some(Half::BF16),
            HalfParams::F16(_) => Some(Half::F16),
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        match self {
            HalfParams::None => 0,
            HalfParams::BF16(v) => v.capacity() * 2,
            HalfParams::F16(v) => v.capacity() * 2,
        }
    }

    /// Rounds `values` into elements `range`.
    pub fn write(&mut self, range: Range<usize>, values: &[f32]) {
        const CHUNK: usize = 1 << 16;
        match self {
            HalfParams::None => panic!("no 16-bit parameters to write"),
            HalfParams::BF16(v) => v[range]
                .par_chunks_mut(CHUNK)
                .zip(values.par_chunks(CHUNK))
                .for_each(|(o, i)| megatron_tensor::cpu::cast::f32_to_bf16(o, i)),
            HalfParams::F16(v) => v[range]
                .par_chunks_mut(CHUNK)
                .zip(values.par_chunks(CHUNK))
                .for_each(|(o, i)| megatron_tensor::cpu::cast::f32_to_f16(o, i)),
        }
    }

    /// Elements `range` widened to f32.
    pub fn read(&self, range: Range<usize>, out: &mut [f32]) {
        const CHUNK: usize = 1 << 16;
        match self {
            HalfParams::None => panic!("no 16-bit parameters to read"),
            HalfParams::BF16(v) => out
                .par_chunks_mut(CHUNK)
                .zip(part(v, range).par_chunks(CHUNK))
                .for_each(|(o, i)| bf16_to_f32(o, i)),
            HalfParams::F16(v) => out
                .par_chunks_mut(CHUNK)
                .zip(part(v, range).par_chunks(CHUNK))
                .for_each(|(o, i)| f16_to_f32(o, i)),
        }
    }

    /// The raw 16-bit patterns (for collectives that only move bits).
    pub fn bits_mut(&mut self) -> &mut [u16] {
        match self {
            HalfParams::None => &mut [],
            // SAFETY: bf16 and f16 are `repr(transparent)` over u16.
            HalfParams::BF16(v) => unsafe {
                std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u16, v.len())
            },
            HalfParams::F16(v) => unsafe {
                std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u16, v.len())
            },
        }
    }
}

/// Elements `r` of `v` through the raw pointer rather than a reference to the whole buffer:
/// under `--overlap-param-gather` another thread is writing other buckets of it.
#[allow(clippy::ptr_arg)] // `&[T]` would be a reference to the whole buffer
fn part<T>(v: &Vec<T>, r: Range<usize>) -> &[T] {
    assert!(r.start <= r.end && r.end <= v.len());
    // SAFETY: in bounds (checked).
    unsafe { std::slice::from_raw_parts(v.as_ptr().add(r.start), r.len()) }
}

/// A parameter's values as f32: borrowed from the fp32 buffer, or widened from the 16-bit one
/// into a pooled buffer that goes back to the pool when dropped.
pub enum ParamRef<'a> {
    Borrowed(&'a [f32]),
    Widened(Tensor),
}

impl Deref for ParamRef<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            ParamRef::Borrowed(s) => s,
            ParamRef::Widened(t) => t.data(),
        }
    }
}

/// A parameter as a matmul operand: under `--bf16` the 16-bit copy itself (the packed bf16
/// kernels read it without a widened copy; the other kernels widen it, exactly); otherwise the
/// values [`Params::get`] gives.
pub enum ParamOperand<'a> {
    Values(ParamRef<'a>),
    BF16(&'a [bf16]),
}

impl ParamOperand<'_> {
    pub fn operand(&self) -> Operand<'_> {
        match self {
            ParamOperand::Values(v) => Operand::F32(v),
            ParamOperand::BF16(v) => Operand::BF16(v),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Params {
    /// fp32 values: the model's parameters, or under 16-bit storage the fp32 main parameters
    /// (empty when the distributed optimizer holds them).
    pub data: Vec<f32>,
    /// The 16-bit parameters the model reads, under `--bf16` / `--fp16`.
    pub half: HalfParams,
    pub metas: Vec<ParamMeta>,
    /// (TP rank, TP size) the parameters are registered for; (0, 1) by default.
    pub tp: (usize, usize),
    /// Which experts this rank holds (MoE layers register only those).
    pub experts: ExpertLayout,
    /// While an overlapped parameter all-gather runs: `get` waits for its parameter's bucket.
    pub gate: Option<std::sync::Arc<crate::distributed::overlap_param_gather::ParamGate>>,
}

impl Params {
    /// `--apply-wd-to-qk-layernorm` (Qwen3-Next's rule): megatron-core exempts every 1-D tensor
    /// and bias from weight decay except, here, the per-head query and key norms, which it picks
    /// by name (`q_layernorm.` / `k_layernorm.`); so do we. Returns how many tensors now decay.
    pub fn apply_weight_decay_to_qk_layernorm(&mut self) -> usize {
        let mut n = 0;
        for m in &mut self.metas {
            if m.name.contains("q_layernorm.") || m.name.contains("k_layernorm.") {
                n += usize::from(!m.weight_decay);
                m.weight_decay = true;
            }
        }
        n
    }

    /// Parameters of one tensor-parallel rank.
    pub fn for_tp_rank(tp_rank: usize, tp_size: usize) -> Self {
        Params {
            tp: (tp_rank, tp_size.max(1)),
            ..Default::default()
        }
    }

    /// Registers a replicated parameter; values are drawn when [`Params::initialize`] runs.
    pub fn register(&mut self, name: String, shape: &[usize], weight_decay: bool) -> ParamId {
        self.register_sharded(name, shape, weight_decay, Sharding::Replicated)
    }

    pub fn register_sharded(
        &mut self,
        name: String,
        shape: &[usize],
        weight_decay: bool,
        sharding: Sharding,
    ) -> ParamId {
        let (tp_rank, tp_size) = if sharding.is_expert() {
            (self.experts.etp_rank, self.experts.etp.max(1))
        } else if self.tp.1 == 0 {
            (0, 1)
        } else {
            self.tp
        };
        let mut local_shape = shape.to_vec();
        let split = match sharding {
            Sharding::Split(d) | Sharding::ExpertSplit(d) => {
                assert!(
                    shape[d].is_multiple_of(tp_size),
                    "{name}: dimension {d} ({}) is not divisible by the TP size {tp_size}",
                    shape[d]
                );
                local_shape[d] /= tp_size;
                Some(d)
            }
            Sharding::SplitChunks(c) | Sharding::ExpertSplitChunks(c) => {
                assert!(
                    shape[0].is_multiple_of(tp_size * c),
                    "{name}: dimension 0 ({}) is not {c} blocks divisible by the TP size {tp_size}",
                    shape[0]
                );
                local_shape[0] /= tp_size;
                Some(0)
            }
            _ => None,
        };
        let tp_chunks = match sharding {
            Sharding::SplitChunks(c) | Sharding::ExpertSplitChunks(c) => c,
            _ => 1,
        };
        let numel = local_shape.iter().product();
        let offset = self.metas.last().map_or(0, |m| m.offset + m.numel);
        self.metas.push(ParamMeta {
            name,
            shape: shape.to_vec(),
            local_shape,
            offset,
            numel,
            weight_decay,
            tp_split_dim: split,
            tp_replicated: split.is_none() && !sharding.is_expert(),
            sequence_parallel_grad: sharding == Sharding::ReplicatedSequenceParallel,
            tp_partial_grad: sharding == Sharding::ReplicatedPartialGrad,
            tp_chunks,
            tp_rank,
            tp_size,
            shared: false,
            expert: sharding.is_expert(),
        });
        ParamId(self.metas.len() - 1)
    }

    /// Registers a replicated parameter and records how it starts out.
    pub fn add(
        &mut self,
        inits: &mut Vec<Init>,
        name: String,
        shape: &[usize],
        weight_decay: bool,
        init: Init,
    ) -> ParamId {
        self.add_sharded(inits, name, shape, weight_decay, init, Sharding::Replicated)
    }

    /// Registers a parameter with its sharding and records how it starts out.
    pub fn add_sharded(
        &mut self,
        inits: &mut Vec<Init>,
        name: String,
        shape: &[usize],
        weight_decay: bool,
        init: Init,
        sharding: Sharding,
    ) -> ParamId {
        inits.push(init);
        self.register_sharded(name, shape, weight_decay, sharding)
    }

    pub fn numel(&self) -> usize {
        self.metas.last().map_or(0, |m| m.offset + m.numel)
    }

    /// Draws every parameter from a stream keyed by its global name and numbered by global
    /// element index, so values depend neither on registration order nor on the sharding: the
    /// gathered shards of any TP size equal the TP = 1 initialization (Megatron's
    /// `--use-cpu-initialization` semantics, without building the master weight).
    pub fn initialize(&mut self, seed: u64, inits: &[Init]) {
        assert_eq!(inits.len(), self.metas.len());
        self.data = vec![0.0; self.numel()];
        let base = RngKey::new(seed).fold(0x1417);
        for (m, init) in self.metas.iter().zip(inits) {
            let dst = &mut self.data[m.offset..m.offset + m.numel];
            match *init {
                Init::Const(c) => dst.fill(c),
                Init::Normal(std) => {
                    // Every value is a function of its global index alone (counter-based RNG), so
                    // the chunks fill in parallel with exactly the serial result.
                    const CHUNK: usize = 1 << 14;
                    let key = base.fold(name_hash(&m.name));
                    dst.par_chunks_mut(CHUNK)
                        .enumerate()
                        .for_each(|(c, chunk)| {
                            for (j, v) in chunk.iter_mut().enumerate() {
                                *v = key.normal(m.global_index(c * CHUNK + j) as u64) * std;
                            }
                        });
                }
            }
        }
    }

    /// The values the model computes with: the 16-bit parameters when there are any.
    pub fn get(&self, id: ParamId) -> ParamRef<'_> {
        let r = self.gathered_range(id);
        match self.half {
            HalfParams::None => ParamRef::Borrowed(part(&self.data, r)),
            _ => {
                let mut t = Tensor::for_overwrite(&[r.len()]);
                self.half.read(r, t.data_mut());
                ParamRef::Widened(t)
            }
        }
    }

    /// The values the model multiplies by, as stored (see [`ParamOperand`]).
    pub fn operand(&self, id: ParamId) -> ParamOperand<'_> {
        match &self.half {
            HalfParams::BF16(v) => ParamOperand::BF16(part(v, self.gathered_range(id))),
            _ => ParamOperand::Values(self.get(id)),
        }
    }

    /// The parameter's elements, once an overlapped all-gather has brought its bucket.
    fn gathered_range(&self, id: ParamId) -> Range<usize> {
        let m = &self.metas[id.0];
        let r = m.offset..m.offset + m.numel;
        if let Some(g) = &self.gate {
            g.wait_for(r.end);
        }
        r
    }

    /// The fp32 values (main parameters under 16-bit storage).
    pub fn get_mut(&mut self, id: ParamId) -> &mut [f32] {
        let m = &self.metas[id.0];
        &mut self.data[m.offset..m.offset + m.numel]
    }

    /// Keeps a 16-bit copy of `data` for the model to read (`None`: compute from `data`).
    pub fn set_half(&mut self, format: Option<Half>) {
        let n = self.numel();
        self.half = match format {
            None => HalfParams::None,
            Some(Half::BF16) => HalfParams::BF16(vec![bf16::ZERO; n]),
            Some(Half::F16) => HalfParams::F16(vec![f16::ZERO; n]),
        };
        if format.is_some() {
            assert_eq!(self.data.len(), n, "set_half needs the fp32 values");
            let data = std::mem::take(&mut self.data);
            self.half.write(0..n, &data);
            self.data = data;
        }
    }

    /// Re-rounds elements `range` of the 16-bit copy from `data` (after an optimizer step).
    pub fn refresh_half(&mut self, range: Range<usize>) {
        if !matches!(self.half, HalfParams::None) {
            let r = range.clone();
            let Params { data, half, .. } = self;
            half.write(r, &data[range]);
        }
    }

    /// Every parameter's values as the model computes with them (the 16-bit ones widened).
    pub fn values(&self) -> Vec<f32> {
        if matches!(self.half, HalfParams::None) {
            return self.data.clone();
        }
        let mut out = vec![0.0; self.numel()];
        self.half.read(0..self.numel(), &mut out);
        out
    }

    pub fn find(&self, name: &str) -> Option<ParamId> {
        self.metas.iter().position(|m| m.name == name).map(ParamId)
    }
}

/// FNV-1a: a stable hash of a parameter name for its RNG stream.
pub fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Gradients, laid out exactly like [`Params`].
#[derive(Clone, Debug)]
pub struct Grads {
    pub data: Vec<f32>,
    ranges: Vec<(usize, usize)>,
}

impl Grads {
    pub fn zeros_like(p: &Params) -> Grads {
        Grads {
            data: vec![0.0; p.numel()],
            ranges: p.metas.iter().map(|m| (m.offset, m.numel)).collect(),
        }
    }

    pub fn zero(&mut self) {
        // A memset of 4 bytes per parameter every step: both cores write their half.
        self.data.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
    }

    pub fn get(&self, id: ParamId) -> &[f32] {
        let (o, n) = self.ranges[id.0];
        &self.data[o..o + n]
    }

    pub fn get_mut(&mut self, id: ParamId) -> &mut [f32] {
        let (o, n) = self.ranges[id.0];
        assert!(o + n <= self.data.len());
        // SAFETY: in bounds (checked). Through the raw pointer, not a reference to the whole
        // buffer: under `--overlap-grad-reduce` another thread owns other parameters' ranges.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr().add(o), n) }
    }

    /// Disjoint mutable views of several parameters' gradients at once.
    pub fn many_mut<const N: usize>(&mut self, ids: [ParamId; N]) -> [&mut [f32]; N] {
        for i in 0..N {
            for j in i + 1..N {
                assert_ne!(ids[i], ids[j], "many_mut: the same parameter twice");
            }
        }
        let base = self.data.as_mut_ptr();
        let len = self.data.len();
        ids.map(|id| {
            let (o, n) = self.ranges[id.0];
            assert!(o + n <= len);
            // SAFETY: parameter ranges never overlap and the ids are distinct (checked above).
            unsafe { std::slice::from_raw_parts_mut(base.add(o), n) }
        })
    }

    /// The gradients of `ids` (distinct, in increasing order of their offsets) at once, for
    /// kernels that write many parameters' gradients together (the experts' grouped GEMM).
    pub fn disjoint_mut(&mut self, ids: &[ParamId]) -> Vec<&mut [f32]> {
        let mut out = Vec::with_capacity(ids.len());
        let mut rest: &mut [f32] = &mut self.data;
        let mut at = 0;
        for id in ids {
            let (o, n) = self.ranges[id.0];
            assert!(o >= at, "disjoint_mut: parameters out of order or repeated");
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(o - at);
            let (mine, tail) = tail.split_at_mut(n);
            out.push(mine);
            rest = tail;
            at = o + n;
        }
        out
    }
}
