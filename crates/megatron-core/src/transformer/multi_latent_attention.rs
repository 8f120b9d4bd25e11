//! Multi-latent attention's projections (megatron-core's `MLASelfAttention`, DeepSeek-V2/V3):
//! queries from a low-rank latent (`linear_q_down_proj`, `q_layernorm`, `linear_q_up_proj`) or,
//! without `--q-lora-rank`, straight from the hidden state (`linear_q_proj`); keys and values
//! from one latent (`linear_kv_down_proj`, `kv_layernorm`, `linear_kv_up_proj`) whose last
//! `qk_pos_emb_head_dim` features are the rotary key every head shares. The latents' norms exist
//! under `--qk-layernorm`, as in megatron-core's layer spec (identity otherwise).
//!
//! Tensor parallelism as megatron-core: the down projections are duplicated on every rank and
//! run on its rows (its token block under sequence parallelism; their gradients then partial and
//! all-reduced with the LayerNorms'), the up projections are column-parallel over the heads, and
//! the shared rotary key is all-gathered over the sequence (sequence parallelism) or passed as
//! is, its gradient summed over the ranks' heads either way. The result is the attention
//! kernel's fused QKV (`cpu::mla` packs it), so rotary embeddings, context parallelism, windows,
//! recomputation and decoding run as for the other attention.

use super::config::TransformerConfig;
use super::norm::Norm;
use super::saved::{keep, readable};
use crate::params::{Grads, Init, Params};
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region_backward, gather_from_sequence_parallel_region_backward,
    gather_from_sequence_parallel_region_forward,
};
use crate::tensor_parallel::{ColumnParallelLinear, DuplicatedLinear, Tp};
use megatron_comm::CommError;
use megatron_tensor::cpu::reduce::add_inplace;
use megatron_tensor::cpu::{
    mla_kv_split_backward, mla_kv_split_forward, mla_qkv_backward, mla_qkv_forward, MlaDims,
};
use megatron_tensor::Tensor;

/// How the queries are made.
pub enum QueryProjection {
    /// `linear_q_proj` (no `--q-lora-rank`).
    Direct(ColumnParallelLinear),
    /// `linear_q_down_proj`, `q_layernorm` (under `--qk-layernorm`), `linear_q_up_proj`.
    LowRank {
        down: DuplicatedLinear,
        norm: Option<Norm>,
        up: ColumnParallelLinear,
    },
}

pub struct MLAProjection {
    pub query: QueryProjection,
    pub kv_down: DuplicatedLinear,
    pub kv_norm: Option<Norm>,
    pub kv_up: ColumnParallelLinear,
    /// This rank's heads and the widths (rows filled in per call).
    dims: MlaDims,
    q_scale: f32,
}

/// What backward needs besides the layer's normed input: the latents before their norms.
pub struct MLASaved {
    q_latent: Option<Tensor>,
    kv_latent: Tensor,
}

impl MLASaved {
    pub fn size_in_bytes(&self) -> usize {
        self.q_latent.as_ref().map_or(0, |t| t.size_in_bytes()) + self.kv_latent.size_in_bytes()
    }
}

/// A latent's norm output (the latent itself without a norm).
fn normed(norm: &Option<Norm>, params: &Params, x: &Tensor) -> Option<Tensor> {
    norm.as_ref().map(|n| n.forward(params, x).0)
}

impl MLAProjection {
    /// Registers the projections under `{p}` (`...self_attention`), megatron-core's names.
    pub fn new(
        cfg: &TransformerConfig,
        p: &str,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let m = cfg.mla.expect("an MLA config");
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let t = params.tp.1.max(1);
        let std = cfg.init_method_std;
        let q_head = m.qk_head_dim + m.qk_pos_emb_head_dim;
        let latent_norm = |params: &mut Params, inits: &mut Vec<Init>, name: &str, w: usize| {
            cfg.qk_layernorm.then(|| {
                Norm::new(
                    cfg.normalization,
                    &format!("{p}.{name}"),
                    w,
                    cfg.layernorm_epsilon,
                    params,
                    inits,
                )
            })
        };
        let column =
            |params: &mut Params, inits: &mut Vec<Init>, name: &str, i: usize, o: usize| {
                ColumnParallelLinear::new(
                    params,
                    inits,
                    &format!("{p}.{name}"),
                    i,
                    o,
                    false,
                    std,
                    false,
                    false,
                )
            };
        let query = match m.q_lora_rank {
            None => {
                QueryProjection::Direct(column(params, inits, "linear_q_proj", h, heads * q_head))
            }
            Some(r) => {
                let down = DuplicatedLinear::new(
                    params,
                    inits,
                    &format!("{p}.linear_q_down_proj"),
                    h,
                    r,
                    std,
                );
                let norm = latent_norm(params, inits, "q_layernorm", r);
                let up = column(params, inits, "linear_q_up_proj", r, heads * q_head);
                QueryProjection::LowRank { down, norm, up }
            }
        };
        let kv_down = DuplicatedLinear::new(
            params,
            inits,
            &format!("{p}.linear_kv_down_proj"),
            h,
            m.kv_lora_rank + m.qk_pos_emb_head_dim,
            std,
        );
        let kv_norm = latent_norm(params, inits, "kv_layernorm", m.kv_lora_rank);
        let kv_up = column(
            params,
            inits,
            "linear_kv_up_proj",
            m.kv_lora_rank,
            heads * (m.qk_head_dim + m.v_head_dim),
        );
        MLAProjection {
            query,
            kv_down,
            kv_norm,
            kv_up,
            dims: MlaDims {
                rows: 0,
                heads: heads / t,
                qk: m.qk_head_dim,
                pe: m.qk_pos_emb_head_dim,
                v: m.v_head_dim,
                kv_lora: m.kv_lora_rank,
            },
            q_scale: cfg.mla_query_scale(),
        }
    }

    /// The kernel's widths on `rows` rows.
    pub fn dims(&self, rows: usize) -> MlaDims {
        MlaDims { rows, ..self.dims }
    }

    /// `x` is the layer-normed input (this rank's token block under sequence parallelism);
    /// returns the fused QKV of every row of the sequence (unrotated) and what backward keeps.
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
    ) -> Result<(Tensor, MLASaved), CommError> {
        let rows = x.shape()[0];
        let (q, q_latent) = match &self.query {
            QueryProjection::Direct(l) => (l.forward(params, tp, x)?, None),
            QueryProjection::LowRank { down, norm, up } => {
                let c = down.forward(params, x);
                let q = match normed(norm, params, &c) {
                    Some(n) => up.forward(params, tp, &n)?,
                    None => up.forward(params, tp, &c)?,
                };
                (q, Some(c))
            }
        };
        let d = self.dims(rows);
        let kv_comb = self.kv_down.forward(params, x);
        let mut kv_latent = Tensor::for_overwrite(&[rows, d.kv_lora]);
        let mut k_pe = Tensor::for_overwrite(&[rows, d.pe]);
        mla_kv_split_forward(kv_latent.data_mut(), k_pe.data_mut(), kv_comb.data(), d);
        drop(kv_comb);
        let kv = match normed(&self.kv_norm, params, &kv_latent) {
            Some(n) => self.kv_up.forward(params, tp, &n)?,
            None => self.kv_up.forward(params, tp, &kv_latent)?,
        };
        let k_pe = if tp.sequence_parallel {
            gather_from_sequence_parallel_region_forward(tp, &k_pe)?
        } else {
            k_pe
        };
        let d = self.dims(q.shape()[0]);
        let mut qkv = Tensor::for_overwrite(&[d.rows, d.heads * 3 * d.head_dim()]);
        mla_qkv_forward(
            qkv.data_mut(),
            q.data(),
            kv.data(),
            k_pe.data(),
            self.q_scale,
            d,
        );
        Ok((
            qkv,
            MLASaved {
                q_latent: q_latent.map(keep),
                kv_latent: keep(kv_latent),
            },
        ))
    }

    /// From the gradient of the (unrotated) fused QKV of every row; `x` is the forward's input.
    /// Returns `dx` for this rank's rows.
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: &MLASaved,
        x: &Tensor,
        dqkv: Tensor,
    ) -> Result<Tensor, CommError> {
        let d = self.dims(dqkv.shape()[0]);
        let mut dq = Tensor::for_overwrite(&[d.rows, d.heads * d.head_dim()]);
        let mut dkv = Tensor::for_overwrite(&[d.rows, d.heads * (d.qk + d.v)]);
        let mut dk_pe = Tensor::for_overwrite(&[d.rows, d.pe]);
        mla_qkv_backward(
            dq.data_mut(),
            dkv.data_mut(),
            dk_pe.data_mut(),
            dqkv.data(),
            self.q_scale,
            d,
        );
        drop(dqkv);
        // Each rank's heads gave part of the shared rotary key's gradient.
        let dk_pe = if tp.sequence_parallel {
            gather_from_sequence_parallel_region_backward(tp, &dk_pe)?
        } else {
            copy_to_tensor_model_parallel_region_backward(tp, dk_pe)?
        };
        let kv_latent = readable(&saved.kv_latent);
        let dkv_latent = self.latent_backward(
            params,
            grads,
            tp,
            (&self.kv_norm, &self.kv_up),
            &kv_latent,
            dkv,
        )?;
        let rows = x.shape()[0];
        let d = self.dims(rows);
        let mut dkv_comb = Tensor::for_overwrite(&[rows, d.kv_lora + d.pe]);
        mla_kv_split_backward(dkv_comb.data_mut(), dkv_latent.data(), dk_pe.data(), d);
        let mut dx = self.kv_down.backward(params, grads, x, &dkv_comb);
        drop(dkv_comb);
        let dxq = match (&self.query, &saved.q_latent) {
            (QueryProjection::Direct(l), _) => l.backward(params, grads, tp, x, dq)?,
            (QueryProjection::LowRank { down, norm, up }, Some(c)) => {
                let c = readable(c);
                let dc = self.latent_backward(params, grads, tp, (norm, up), &c, dq)?;
                down.backward(params, grads, x, &dc)
            }
            (QueryProjection::LowRank { .. }, None) => {
                unreachable!("a low-rank query projection saves its latent")
            }
        };
        add_inplace(dx.data_mut(), dxq.data());
        Ok(dx)
    }

    /// Through an up projection and the latent's norm (recomputed from the latent): the
    /// latent's gradient.
    fn latent_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        (norm, up): (&Option<Norm>, &ColumnParallelLinear),
        latent: &Tensor,
        dout: Tensor,
    ) -> Result<Tensor, CommError> {
        match norm {
            Some(n) => {
                let (normed, stats) = n.forward(params, latent);
                let dn = up.backward(params, grads, tp, &normed, dout)?;
                drop(normed);
                Ok(n.backward(params, grads, &stats, latent, &dn))
            }
            None => up.backward(params, grads, tp, latent, dout),
        }
    }
}
