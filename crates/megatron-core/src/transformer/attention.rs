//! `SelfAttention`: fused QKV projection (column-parallel: each TP rank owns a contiguous block
//! of heads, since the fused layout is per head), causal core attention on the local heads,
//! output projection (row-parallel). The output projection's bias is left to the layer's fused
//! bias-dropout-add.

use super::config::TransformerConfig;
use super::saved::{keep, restore};
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params};
use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, Tp};
use megatron_comm::CommError;
use megatron_tensor::cpu::{attention_backward, attention_forward, AttentionDims, AttentionMask};
use megatron_tensor::Tensor;

pub struct SelfAttention {
    pub layer: usize,
    pub linear_qkv: ColumnParallelLinear,
    pub linear_proj: RowParallelLinear,
    pub qkv_weight: ParamId,
    pub qkv_bias: ParamId,
    pub proj_weight: ParamId,
    pub proj_bias: ParamId,
    hidden: usize,
    /// Heads on this TP rank, the first of them in global numbering, and all heads.
    heads: usize,
    head_offset: usize,
    total_heads: usize,
    attention_dropout: f32,
}

/// What backward needs: the QKV activations, the attention output and its log-sum-exp.
pub struct SelfAttentionSaved {
    pub qkv: Tensor,
    pub attn: Tensor,
    pub lse: Tensor,
}

impl SelfAttentionSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.qkv.size_in_bytes() + self.attn.size_in_bytes() + self.lse.size_in_bytes()
    }
}

const SITE_ATTN_DROPOUT: u64 = 1;

impl SelfAttention {
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let (tp_rank, t) = (params.tp.0, params.tp.1.max(1));
        let p = format!("decoder.layers.{layer}.self_attention");
        let linear_qkv = ColumnParallelLinear::new(
            params,
            inits,
            &format!("{p}.linear_qkv"),
            h,
            3 * h,
            true,
            cfg.init_method_std,
            false,
            false,
        );
        let linear_proj = RowParallelLinear::new(
            params,
            inits,
            &format!("{p}.linear_proj"),
            h,
            h,
            cfg.output_layer_init_std(),
            true,
        );
        let heads = cfg.num_attention_heads / t;
        SelfAttention {
            layer,
            qkv_weight: linear_qkv.weight,
            qkv_bias: linear_qkv.bias.expect("qkv has a bias"),
            proj_weight: linear_proj.weight,
            proj_bias: linear_proj.bias,
            linear_qkv,
            linear_proj,
            hidden: h,
            heads,
            head_offset: tp_rank * heads,
            total_heads: cfg.num_attention_heads,
            attention_dropout: cfg.attention_dropout,
        }
    }

    fn dims(&self, b: usize, t: usize, ctx: &StepContext) -> AttentionDims {
        AttentionDims {
            b,
            t,
            heads: self.heads,
            head_dim: self.hidden / self.total_heads,
            causal: true,
            dropout: ctx.p(self.attention_dropout),
            rng_heads: (self.head_offset, self.total_heads),
        }
    }

    /// `x` is the layer-normed input (`[b*t, h]`, or this rank's token block under sequence
    /// parallelism); returns the output projection without its bias, in the same layout.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<(Tensor, SelfAttentionSaved), CommError> {
        let n = b * t;
        let local = self.heads * (self.hidden / self.total_heads);
        let qkv = self.linear_qkv.forward(params, tp, x)?;
        let mut attn = Tensor::for_overwrite(&[n, local]);
        let mut lse = Tensor::for_overwrite(&[b, self.heads, t]);
        let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.total_heads * t * t);
        attention_forward(
            attn.data_mut(),
            lse.data_mut(),
            qkv.data(),
            mask,
            self.dims(b, t, ctx),
            key,
        );
        let out = self.linear_proj.forward(params, tp, &attn)?;
        Ok((
            out,
            SelfAttentionSaved {
                qkv: keep(qkv),
                attn: keep(attn),
                lse,
            },
        ))
    }

    /// `dout` is the gradient of the projection output (after the layer's dropout backward);
    /// `x` the recomputed layer-normed input. Returns `dx`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: &SelfAttentionSaved,
        x: &Tensor,
        dout: Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<Tensor, CommError> {
        let n = b * t;
        let attn = restore(&saved.attn);
        let qkv = restore(&saved.qkv);
        let dattn = self.linear_proj.backward(params, grads, tp, &attn, dout)?;
        let mut dqkv = Tensor::for_overwrite(&[n, qkv.shape()[1]]);
        let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.total_heads * t * t);
        attention_backward(
            dqkv.data_mut(),
            dattn.data(),
            attn.data(),
            saved.lse.data(),
            qkv.data(),
            mask,
            self.dims(b, t, ctx),
            key,
        );
        drop(dattn);
        self.linear_qkv.backward(params, grads, tp, x, dqkv)
    }
}
