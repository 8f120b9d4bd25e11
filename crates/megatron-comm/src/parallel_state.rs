//! `ParallelState`: Megatron's rank layout (`parallel_state.py`, `RankGenerator`,
//! `generate_masked_orthogonal_rank_groups`). Pure arithmetic: from the world size, the parallel
//! sizes and the order string (first axis varies fastest; default `tp-cp-ep-dp-pp`), each rank's
//! coordinates and every group, in Megatron's order, so layouts and papers transfer.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Tp,
    Cp,
    Ep,
    Dp,
    Pp,
}

impl Axis {
    fn parse(s: &str) -> Option<Axis> {
        Some(match s {
            "tp" => Axis::Tp,
            "cp" => Axis::Cp,
            "ep" => Axis::Ep,
            "dp" => Axis::Dp,
            "pp" => Axis::Pp,
            _ => return None,
        })
    }
    fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ParallelError {
    #[error("{flag} must be positive")]
    Zero { flag: &'static str },
    #[error("world size {world} is not divisible by --tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = {prod}")]
    NotDivisible {
        world: usize,
        tp: usize,
        pp: usize,
        cp: usize,
        prod: usize,
    },
    #[error("--expert-model-parallel-size ({ep}) must divide the world size {world} / (--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp})")]
    ExpertNotDivisible {
        world: usize,
        tp: usize,
        pp: usize,
        ep: usize,
    },
    #[error("parallel order '{0}': expected a permutation of tp, cp, ep, dp, pp joined by '-' (e.g. tp-cp-ep-dp-pp)")]
    BadOrder(String),
    #[error("order {order} with --context-parallel-size {cp} and --expert-model-parallel-size {ep} gives the expert layout other pipeline groups than the dense one (Megatron refuses this too); use tp-cp-ep-dp-pp")]
    InconsistentPipelineGroups { order: String, cp: usize, ep: usize },
    #[error("--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp}) must divide the world size {world}")]
    ExpertTensorNotDivisible {
        world: usize,
        etp: usize,
        ep: usize,
        pp: usize,
    },
    #[error("rank {rank} is outside the world of {world}")]
    BadRank { rank: usize, world: usize },
}

/// A rank's coordinate along every axis (dense layout; `ep` from the expert layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Coords {
    pub tp: usize,
    pub cp: usize,
    pub ep: usize,
    pub etp: usize,
    pub edp: usize,
    pub dp: usize,
    pub pp: usize,
}

/// One rank generator: axis sizes in order (first fastest).
#[derive(Clone, Debug)]
struct Generator {
    order: Vec<Axis>,
    sizes: Vec<usize>,
}

impl Generator {
    fn new(order: &[Axis], size: impl Fn(Axis) -> usize) -> Self {
        Generator {
            order: order.to_vec(),
            sizes: order.iter().map(|&a| size(a)).collect(),
        }
    }

    fn strides(&self) -> Vec<usize> {
        let mut s = Vec::with_capacity(self.sizes.len());
        let mut acc = 1;
        for &n in &self.sizes {
            s.push(acc);
            acc *= n;
        }
        s
    }

    fn coord(&self, rank: usize, axis: Axis) -> usize {
        let k = self
            .order
            .iter()
            .position(|&a| a == axis)
            .expect("every axis is in the order");
        (rank / self.strides()[k]) % self.sizes[k]
    }

    /// Megatron's `generate_masked_orthogonal_rank_groups`: the groups in which the `masked`
    /// axes vary and the others are fixed; groups enumerated by the unmasked coordinates and
    /// ranks within a group by the masked ones, first axis fastest in both.
    fn groups(&self, masked: &[Axis]) -> Vec<Vec<usize>> {
        let strides = self.strides();
        let is_masked: Vec<bool> = self.order.iter().map(|a| masked.contains(a)).collect();
        let pick = |m: bool| -> (Vec<usize>, Vec<usize>) {
            self.sizes
                .iter()
                .zip(&strides)
                .zip(&is_masked)
                .filter(|(_, &x)| x == m)
                .map(|((&s, &d), _)| (s, d))
                .unzip()
        };
        let (m_shape, m_stride) = pick(true);
        let (u_shape, u_stride) = pick(false);
        let group_size: usize = m_shape.iter().product();
        let num_groups: usize = u_shape.iter().product();
        let decompose = |mut i: usize, shape: &[usize]| -> Vec<usize> {
            shape
                .iter()
                .map(|&s| {
                    let c = i % s;
                    i /= s;
                    c
                })
                .collect()
        };
        let dot = |a: &[usize], b: &[usize]| a.iter().zip(b).map(|(x, y)| x * y).sum::<usize>();
        (0..num_groups)
            .map(|g| {
                let base = dot(&decompose(g, &u_shape), &u_stride);
                (0..group_size)
                    .map(|r| base + dot(&decompose(r, &m_shape), &m_stride))
                    .collect()
            })
            .collect()
    }
}

/// The layout of one job. Dense groups (tp, cp, dp, pp and combinations) come from the generator
/// over `(tp, cp, ep=1, dp, pp)`; expert groups from the one over `(tp, cp=1, ep, edp, pp)` with
/// `edp = world / (tp x ep x pp)`, as Megatron builds them (both give the same pipeline groups).
#[derive(Clone, Debug)]
pub struct ParallelState {
    pub world: usize,
    pub tp: usize,
    pub pp: usize,
    pub cp: usize,
    pub ep: usize,
    /// Tensor parallelism inside the experts (`--expert-tensor-parallel-size`; Megatron's
    /// default is the dense TP size).
    pub etp: usize,
    pub dp: usize,
    pub expert_dp: usize,
    order: Vec<Axis>,
    dense: Generator,
    expert: Generator,
}

impl ParallelState {
    pub const DEFAULT_ORDER: &'static str = "tp-cp-ep-dp-pp";

    pub fn new(
        world: usize,
        tp: usize,
        pp: usize,
        cp: usize,
        ep: usize,
        order: &str,
    ) -> Result<Self, ParallelError> {
        for (flag, v) in [
            ("world size", world),
            ("--tensor-model-parallel-size", tp),
            ("--pipeline-model-parallel-size", pp),
            ("--context-parallel-size", cp),
            ("--expert-model-parallel-size", ep),
        ] {
            if v == 0 {
                return Err(ParallelError::Zero { flag });
            }
        }
        let prod = tp * pp * cp;
        if !world.is_multiple_of(prod) {
            return Err(ParallelError::NotDivisible {
                world,
                tp,
                pp,
                cp,
                prod,
            });
        }
        let mut axes = Vec::new();
        for part in order.to_ascii_lowercase().split('-') {
            let a = Axis::parse(part).ok_or_else(|| ParallelError::BadOrder(order.to_string()))?;
            if axes.contains(&a) {
                return Err(ParallelError::BadOrder(order.to_string()));
            }
            axes.push(a);
        }
        // Axes missing from the order string are appended (Megatron allows that for size-1 axes).
        for a in [Axis::Tp, Axis::Cp, Axis::Ep, Axis::Dp, Axis::Pp] {
            if !axes.contains(&a) {
                axes.push(a);
            }
        }
        let dp = world / prod;
        let dense = Generator::new(&axes, |a| match a {
            Axis::Tp => tp,
            Axis::Cp => cp,
            Axis::Ep => 1,
            Axis::Dp => dp,
            Axis::Pp => pp,
        });
        let state = ParallelState {
            world,
            tp,
            pp,
            cp,
            ep,
            etp: tp,
            dp,
            expert_dp: 0,
            order: axes,
            expert: dense.clone(),
            dense,
        };
        state.with_expert_tensor_parallel(tp)
    }

    /// The same layout with `etp`-way tensor parallelism inside the experts: the expert
    /// generator runs over `(etp, cp=1, ep, edp, pp)`, `edp = world / (etp x ep x pp)`
    /// (megatron-core's "parallel folding": the expert groups may span dense TP and DP ranks).
    pub fn with_expert_tensor_parallel(mut self, etp: usize) -> Result<Self, ParallelError> {
        let (world, ep, pp) = (self.world, self.ep, self.pp);
        if etp == 0 {
            return Err(ParallelError::Zero {
                flag: "--expert-tensor-parallel-size",
            });
        }
        if !world.is_multiple_of(etp * ep * pp) {
            return Err(if etp == self.tp {
                ParallelError::ExpertNotDivisible {
                    world,
                    tp: etp,
                    pp,
                    ep,
                }
            } else {
                ParallelError::ExpertTensorNotDivisible { world, etp, ep, pp }
            });
        }
        let expert_dp = world / (etp * ep * pp);
        let expert = Generator::new(&self.order, |a| match a {
            Axis::Tp => etp,
            Axis::Cp => 1,
            Axis::Ep => ep,
            Axis::Dp => expert_dp,
            Axis::Pp => pp,
        });
        if self.dense.groups(&[Axis::Pp]) != expert.groups(&[Axis::Pp]) {
            return Err(ParallelError::InconsistentPipelineGroups {
                order: self.order(),
                cp: self.cp,
                ep,
            });
        }
        self.etp = etp;
        self.expert_dp = expert_dp;
        self.expert = expert;
        Ok(self)
    }

    /// Whether expert parameters are laid out other than the dense ones (then their gradients
    /// are reduced over the expert-data-parallel group instead of the data-parallel one).
    pub fn experts_folded(&self) -> bool {
        self.ep > 1 || self.etp != self.tp || self.cp > 1
    }

    pub fn order(&self) -> String {
        self.order
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join("-")
    }

    pub fn coords(&self, rank: usize) -> Result<Coords, ParallelError> {
        if rank >= self.world {
            return Err(ParallelError::BadRank {
                rank,
                world: self.world,
            });
        }
        Ok(Coords {
            tp: self.dense.coord(rank, Axis::Tp),
            cp: self.dense.coord(rank, Axis::Cp),
            ep: self.expert.coord(rank, Axis::Ep),
            etp: self.expert.coord(rank, Axis::Tp),
            edp: self.expert.coord(rank, Axis::Dp),
            dp: self.dense.coord(rank, Axis::Dp),
            pp: self.dense.coord(rank, Axis::Pp),
        })
    }

    /// Dense groups in which `axes` vary (e.g. `[Tp]`, `[Dp, Cp]`, `[Tp, Pp]`).
    pub fn groups(&self, axes: &[Axis]) -> Vec<Vec<usize>> {
        self.dense.groups(axes)
    }

    /// Expert groups in which `axes` vary over the expert layout (`[Ep]`, `[Tp, Ep]`, `[Dp]` = expert data parallel).
    pub fn expert_groups(&self, axes: &[Axis]) -> Vec<Vec<usize>> {
        self.expert.groups(axes)
    }

    pub fn tensor_model_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.groups(&[Axis::Tp])
    }
    pub fn pipeline_model_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.groups(&[Axis::Pp])
    }
    pub fn data_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.groups(&[Axis::Dp])
    }
    pub fn context_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.groups(&[Axis::Cp])
    }
    /// `dp-cp`: the group over which gradients are reduced.
    pub fn data_parallel_groups_with_cp(&self) -> Vec<Vec<usize>> {
        self.groups(&[Axis::Dp, Axis::Cp])
    }
    /// `tp-pp`.
    pub fn model_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.groups(&[Axis::Tp, Axis::Pp])
    }
    pub fn expert_model_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.expert_groups(&[Axis::Ep])
    }
    pub fn expert_tensor_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.expert_groups(&[Axis::Tp])
    }
    /// The group over which expert gradients are reduced (and the distributed optimizer shards
    /// expert state).
    pub fn expert_data_parallel_groups(&self) -> Vec<Vec<usize>> {
        self.expert_groups(&[Axis::Dp])
    }
    /// First and last stage of each pipeline group (the tied word embeddings).
    pub fn embedding_groups(&self) -> Vec<Vec<usize>> {
        self.pipeline_model_parallel_groups()
            .into_iter()
            .map(|g| {
                if g.len() > 1 {
                    vec![g[0], g[g.len() - 1]]
                } else {
                    g
                }
            })
            .collect()
    }

    /// The group of `rank` among `groups` and the rank's position in it.
    pub fn group_of(groups: &[Vec<usize>], rank: usize) -> Option<(&[usize], usize)> {
        groups
            .iter()
            .find_map(|g| g.iter().position(|&r| r == rank).map(|p| (g.as_slice(), p)))
    }

    /// A human-readable table of the layout, printed by rank 0 at start-up.
    pub fn describe(&self) -> String {
        let fmt = |gs: Vec<Vec<usize>>| {
            gs.iter()
                .map(|g| format!("{g:?}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        format!(
            "world {} = tp {} x cp {} x dp {} x pp {} (ep {}, etp {}, edp {}, order {})\n  TP groups: {}\n  CP groups: {}\n  DP groups: {}\n  PP groups: {}\n  EP groups: {}\n  EDP groups: {}",
            self.world,
            self.tp,
            self.cp,
            self.dp,
            self.pp,
            self.ep,
            self.etp,
            self.expert_dp,
            self.order(),
            fmt(self.tensor_model_parallel_groups()),
            fmt(self.context_parallel_groups()),
            fmt(self.data_parallel_groups()),
            fmt(self.pipeline_model_parallel_groups()),
            fmt(self.expert_model_parallel_groups()),
            fmt(self.expert_data_parallel_groups())
        )
    }
}
