//! `--qk-layernorm`: each head's queries and keys normalized (megatron-core's `q_layernorm` /
//! `k_layernorm`, Qwen3 and OLMo 2) inside the fused QKV, before rotary embeddings. One weight
//! of `head_dim` per norm, shared by all heads; every tensor-parallel rank applies it to its own
//! heads, so its gradient is all-reduced over TP (`Sharding::ReplicatedPartialGrad`).

use super::config::TransformerConfig;
use super::norm::{LayerNormSaved, Norm};
use super::saved::{keep, readable};
use crate::params::{Grads, Init, Params, Sharding};
use megatron_tensor::cpu::{gather_group_blocks, scatter_group_blocks, GroupBlocks};
use megatron_tensor::Tensor;

pub struct QKNorm {
    pub q_layernorm: Norm,
    pub k_layernorm: Norm,
    /// Query groups and query heads per group on this rank, and the head dimension.
    groups: usize,
    q_per_group: usize,
    head_dim: usize,
}

/// The norms' inputs (as `[rows * heads, head_dim]` and `[rows * groups, head_dim]`) and
/// statistics.
pub struct QKNormSaved {
    q_in: Tensor,
    q_stats: LayerNormSaved,
    k_in: Tensor,
    k_stats: LayerNormSaved,
}

impl QKNormSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.q_in.size_in_bytes()
            + self.q_stats.size_in_bytes()
            + self.k_in.size_in_bytes()
            + self.k_stats.size_in_bytes()
    }
}

impl QKNorm {
    pub fn new(
        cfg: &TransformerConfig,
        prefix: &str,
        groups: usize,
        q_per_group: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let (hd, eps) = (cfg.head_dim(), cfg.layernorm_epsilon);
        let sharding = Sharding::ReplicatedPartialGrad;
        let mut norm = |name: &str| {
            let name = format!("{prefix}.{name}");
            Norm::new_sharded(cfg.normalization, &name, hd, eps, sharding, params, inits)
        };
        QKNorm {
            q_layernorm: norm("q_layernorm"),
            k_layernorm: norm("k_layernorm"),
            groups,
            q_per_group,
            head_dim: hd,
        }
    }

    /// The query heads (`q = true`) or the keys of each group in a fused QKV row.
    fn blocks(&self, q: bool) -> GroupBlocks {
        let qpg = self.q_per_group;
        let (lo, hi) = if q { (0, qpg) } else { (qpg, qpg + 1) };
        GroupBlocks {
            groups: self.groups,
            blocks_per_group: qpg + 2,
            width: self.head_dim,
            lo,
            hi,
        }
    }

    /// Normalizes the queries and keys of `qkv` (`[rows, qkv width]`) in place.
    pub fn forward(&self, params: &Params, qkv: &mut Tensor) -> QKNormSaved {
        let (q_in, q_stats) = self.forward_one(params, qkv, true);
        let (k_in, k_stats) = self.forward_one(params, qkv, false);
        QKNormSaved {
            q_in,
            q_stats,
            k_in,
            k_stats,
        }
    }

    fn forward_one(&self, params: &Params, qkv: &mut Tensor, q: bool) -> (Tensor, LayerNormSaved) {
        let rows = qkv.shape()[0];
        let d = self.blocks(q);
        let n = rows * self.groups * (d.hi - d.lo);
        let mut x = Tensor::for_overwrite(&[n, self.head_dim]);
        gather_group_blocks(x.data_mut(), qkv.data(), rows, d);
        let norm = if q {
            &self.q_layernorm
        } else {
            &self.k_layernorm
        };
        let (y, stats) = norm.forward(params, &x);
        scatter_group_blocks(qkv.data_mut(), y.data(), rows, d);
        (keep(x), stats)
    }

    /// Turns the query and key gradients of `dqkv` (with respect to the normalized values) into
    /// gradients of the projection's output, in place; accumulates the norms' weight gradients.
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &QKNormSaved,
        dqkv: &mut Tensor,
    ) {
        self.backward_one(params, grads, &saved.q_in, &saved.q_stats, dqkv, true);
        self.backward_one(params, grads, &saved.k_in, &saved.k_stats, dqkv, false);
    }

    fn backward_one(
        &self,
        params: &Params,
        grads: &mut Grads,
        x: &Tensor,
        stats: &LayerNormSaved,
        dqkv: &mut Tensor,
        q: bool,
    ) {
        let rows = dqkv.shape()[0];
        let d = self.blocks(q);
        let x = readable(x);
        let mut dy = Tensor::for_overwrite(x.shape());
        gather_group_blocks(dy.data_mut(), dqkv.data(), rows, d);
        let norm = if q {
            &self.q_layernorm
        } else {
            &self.k_layernorm
        };
        let dx = norm.backward(params, grads, stats, &x, &dy);
        scatter_group_blocks(dqkv.data_mut(), dx.data(), rows, d);
    }
}
