//! What `--optimizer muon` costs a rank: one momentum (4 bytes; with `adaptive_muon` also the
//! second moment, 8 in all) for each element of its Muon matrices instead of the scalar rule's
//! moments, and the Newton–Schulz iteration on every
//! matrix it orthogonalizes, once per optimizer step. Under tensor parallelism `duplicated`
//! orthogonalizes the whole matrix on every TP rank (after an all-gather), `distributed` splits
//! the two Gram-side products over them, `blockwise` orthogonalizes each shard; the layer-wise
//! distributed optimizer (`--use-distributed-optimizer`) gives each data-parallel rank whole
//! matrices, so the iteration and the momenta divide by DP.
//!
//! The matrices are megatron-core's Muon parameters: every 2-D weight but the word embedding
//! and the output layer (so position embeddings and MoE routers too), a fused QKV weight as its
//! query, key and value blocks unless `--muon-no-split-qkv`.

use crate::arguments::{OptimizerKind, TrainConfig};
use megatron_core::optimizer::MuonTpMode;
use megatron_core::transformer::config::PositionEmbeddingType;

/// A rank's share of Muon.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MuonShare {
    /// Elements of the Muon matrices this rank holds (their momenta, before any DP sharding).
    pub params: f64,
    /// FLOPs of the Newton–Schulz iterations this rank runs per optimizer step.
    pub ns_flops: f64,
    /// Bytes this rank receives in the TP all-gathers of `duplicated` per step.
    pub tp_gather_bytes: f64,
}

/// One kind of matrix: `rows x cols` globally, `count` of them, split over `split` ranks
/// (its TP or expert-TP group; 1 when every rank holds it whole).
struct Matrix {
    rows: f64,
    cols: f64,
    count: f64,
    split: f64,
    /// An expert's (sharded over expert data parallelism by the layer-wise optimizer).
    expert: bool,
}

/// FLOPs of `steps` Newton–Schulz steps on an `r x c` matrix, its Gram-side products split
/// over `gram_split` ranks: per step `X·Xᵀ` and `B·X` (`2m²n` each, `m ≤ n`) and `A·A` (`2m³`).
fn ns_flops(r: f64, c: f64, steps: f64, gram_split: f64) -> f64 {
    let (m, n) = (r.min(c), r.max(c));
    steps * (4.0 * m * m * n / gram_split + 2.0 * m * m * m)
}

fn matrices_of_stage(cfg: &TrainConfig, stage: usize, split_qkv: bool) -> Vec<Matrix> {
    let m = &cfg.model;
    let h = m.hidden_size as f64;
    let (t, etp) = (cfg.tp as f64, cfg.etp as f64);
    let q = m.query_projection_size() as f64;
    let kv = (m.query_groups() * m.head_dim()) as f64;
    let fc1_rows = if m.activation.is_gated() { 2.0 } else { 1.0 };
    let mut out = Vec::new();
    let per_stage = m.num_layers / cfg.pp;
    for l in stage * per_stage..(stage + 1) * per_stage {
        if split_qkv {
            out.push(Matrix {
                rows: q,
                cols: h,
                count: 1.0,
                split: t,
                expert: false,
            });
            out.push(Matrix {
                rows: kv,
                cols: h,
                count: 2.0,
                split: t,
                expert: false,
            });
        } else {
            out.push(Matrix {
                rows: q + 2.0 * kv,
                cols: h,
                count: 1.0,
                split: t,
                expert: false,
            });
        }
        out.push(Matrix {
            rows: h,
            cols: q,
            count: 1.0,
            split: t,
            expert: false,
        });
        let mlp = |f: f64, count: f64, split: f64, expert: bool, out: &mut Vec<Matrix>| {
            let rows = fc1_rows * f;
            out.push(Matrix {
                rows,
                cols: h,
                count,
                split,
                expert,
            });
            out.push(Matrix {
                rows: h,
                cols: f,
                count,
                split,
                expert,
            });
        };
        match m.moe.as_ref().filter(|_| m.is_moe_layer(l)) {
            Some(x) => {
                let local = x.num_experts as f64 / cfg.ep as f64;
                mlp(x.ffn_hidden_size as f64, local, etp, true, &mut out);
                if let Some(f) = x.shared_expert_ffn {
                    mlp(f as f64, 1.0, t, false, &mut out);
                }
                out.push(Matrix {
                    rows: x.num_experts as f64,
                    cols: h,
                    count: 1.0,
                    split: 1.0,
                    expert: false,
                });
            }
            None => mlp(m.ffn_hidden_size as f64, 1.0, t, false, &mut out),
        }
    }
    if stage == 0 && m.position_embedding_type == PositionEmbeddingType::LearnedAbsolute {
        let rows = m.max_position_embeddings as f64;
        out.push(Matrix {
            rows,
            cols: h,
            count: 1.0,
            split: 1.0,
            expert: false,
        });
    }
    out
}

/// Bytes of state per element of a Muon matrix (zero without Muon).
pub fn muon_moment_bytes(cfg: &TrainConfig) -> f64 {
    cfg.muon.map_or(0.0, |m| 4.0 * m.moments().len() as f64)
}

/// Muon on pipeline stage `stage` of `cfg` (zero without Muon).
pub fn muon_share(cfg: &TrainConfig, stage: usize) -> MuonShare {
    let Some(muon) = cfg.muon else {
        return MuonShare::default();
    };
    let steps = muon.num_ns_steps as f64;
    // The layer-wise distributed optimizer: each matrix orthogonalized on one DP rank (an
    // expert's on one rank of its expert-data-parallel group: the world over PP, EP and ETP).
    let (dense_d, expert_d) = match cfg.optimizer {
        OptimizerKind::Distributed => (
            (cfg.dp * cfg.cp) as f64,
            (cfg.dp * cfg.cp * cfg.tp) as f64 / (cfg.ep * cfg.etp) as f64,
        ),
        OptimizerKind::Replicated => (1.0, 1.0),
    };
    let mut s = MuonShare::default();
    for x in matrices_of_stage(cfg, stage, muon.qkv_split.is_some()) {
        let d = if x.expert { expert_d } else { dense_d };
        let local = x.rows * x.cols / x.split;
        s.params += x.count * local;
        let flops = match muon.tp_mode {
            _ if x.split <= 1.0 => ns_flops(x.rows, x.cols, steps, 1.0),
            MuonTpMode::Duplicated => {
                s.tp_gather_bytes += x.count * 4.0 * local * (x.split - 1.0) / d;
                ns_flops(x.rows, x.cols, steps, 1.0)
            }
            MuonTpMode::Distributed => ns_flops(x.rows, x.cols, steps, x.split),
            // Each shard alone (rows or columns split: the same FLOPs either way up to the
            // orientation, taken here as the rows).
            MuonTpMode::Blockwise => ns_flops(x.rows / x.split, x.cols, steps, 1.0),
        };
        s.ns_flops += x.count * flops / d;
    }
    s
}
