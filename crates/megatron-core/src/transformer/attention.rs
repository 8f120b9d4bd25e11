//! `SelfAttention`: fused QKV projection (column-parallel: each TP rank owns a contiguous block
//! of query groups, since megatron-core's fused layout is per group: the group's query heads,
//! its key, its value), rotary embeddings on the queries and keys (`--position-embedding-type
//! rope`), causal core attention on the local heads (grouped-query attention shares each
//! group's K and V inside the kernel), output projection (row-parallel). The output projection's
//! bias is left to the layer's fused bias-dropout-add. Under `--multi-latent-attention` the
//! fused QKV comes from MLA's low-rank projections instead (`multi_latent_attention.rs`) and
//! the output projection reads each head's first `v_head_dim` features.

use super::config::{AttnMaskType, SoftmaxType, TransformerConfig};
use super::multi_latent_attention::{MLAProjection, MLASaved};
use super::qk_norm::{QKNorm, QKNormSaved};
use super::saved::{as_kept, keep, readable, restore};
use super::step::StepContext;
use crate::context_parallel::{
    heads_to_sequence, ring_attention_backward, ring_attention_forward, sequence_to_heads,
    CpCommType, CpLayout,
};
use crate::params::{Grads, Init, ParamId, Params};
use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, Tp};
use megatron_comm::CommError;
use megatron_tensor::cpu::{
    attention_backward, attention_decode_forward, attention_forward, attention_sink_backward,
    attention_sink_forward, kv_cache_append, mla_attn_narrow_backward, mla_attn_narrow_forward,
    rope_backward, rope_forward, sliding_window_starts, AttentionDims, AttentionMask, DecodeDims,
    RopeDims, RopeStyle, RopeTable, SinkDims,
};
use megatron_tensor::Tensor;
use std::sync::Arc;

/// Where the fused QKV comes from.
pub enum QkvProjection {
    /// megatron-core's `linear_qkv`, with `--qk-layernorm`'s per-head norms.
    Fused {
        linear_qkv: ColumnParallelLinear,
        qk_norm: Option<QKNorm>,
    },
    /// Multi-latent attention's projections.
    Latent(Box<MLAProjection>),
}

pub struct SelfAttention {
    pub layer: usize,
    pub qkv: QkvProjection,
    pub linear_proj: RowParallelLinear,
    pub proj_weight: ParamId,
    pub proj_bias: Option<ParamId>,
    /// Query heads and key/value groups on this TP rank, the first head in global numbering,
    /// and all heads.
    pub heads: usize,
    pub groups: usize,
    head_offset: usize,
    total_heads: usize,
    pub head_dim: usize,
    attention_dropout: f32,
    /// Rotary embeddings' cos/sin table and pairing, shared by the layers.
    pub rope: Option<(Arc<RopeTable>, RopeStyle)>,
    /// Causal (decoders) or bidirectional over the real keys (encoders).
    causal: bool,
    /// `--window-size`: the keys before each query this layer sees, if windowed.
    pub window: Option<usize>,
    /// `--softmax-type`: the extra logit in each head's softmax denominator, if any.
    pub sink: Option<AttentionSink>,
}

/// The sink logit of `--softmax-type`: zero (`off-by-one`) or megatron-core's learned
/// `core_attention.softmax_offset` (`learnable`, one per head, split over TP by heads).
#[derive(Clone, Copy, Debug)]
pub enum AttentionSink {
    OffByOne,
    Learnable(ParamId),
}

/// What the QKV projection keeps for backward.
pub enum QkvSaved {
    /// The query/key norms' inputs (`--qk-layernorm`).
    Fused(Option<Box<QKNormSaved>>),
    Latent(MLASaved),
}

impl QkvSaved {
    pub fn size_in_bytes(&self) -> usize {
        match self {
            QkvSaved::Fused(q) => q.as_ref().map_or(0, |q| q.size_in_bytes()),
            QkvSaved::Latent(m) => m.size_in_bytes(),
        }
    }
}

/// What backward needs: the QKV activations (as attention read them), the attention output
/// (the output projection's input) and its log-sum-exp, and what the QKV projection keeps.
pub struct SelfAttentionSaved {
    pub qkv: Tensor,
    /// The attention output and its log-sum-exp; `None` under selective recomputation of
    /// `core_attn` (backward reruns the attention kernel on `qkv`, same dropout masks).
    pub attn: Option<(Tensor, Tensor)>,
    pub projection: QkvSaved,
}

impl SelfAttentionSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.qkv.size_in_bytes()
            + self
                .attn
                .as_ref()
                .map_or(0, |(a, l)| a.size_in_bytes() + l.size_in_bytes())
            + self.projection.size_in_bytes()
    }
}

const SITE_ATTN_DROPOUT: u64 = 1;

/// Which way [`SelfAttention::rotate`] turns.
#[derive(Clone, Copy)]
enum Rotation {
    Forward,
    Backward,
}

/// Whether attention passes keys and values around the context-parallel ring.
fn ring(tp: &Tp) -> bool {
    tp.cp.is_some() && tp.cp_comm_type == CpCommType::P2p
}

impl SelfAttention {
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        prefix: &str,
        rope: Option<(Arc<RopeTable>, RopeStyle)>,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let (tp_rank, t) = (params.tp.0, params.tp.1.max(1));
        let p = format!("{prefix}.self_attention");
        let heads = cfg.num_attention_heads / t;
        let groups = cfg.query_groups() / t;
        let qkv = match cfg.mla {
            Some(_) => QkvProjection::Latent(Box::new(MLAProjection::new(cfg, &p, params, inits))),
            None => {
                let linear_qkv = ColumnParallelLinear::new(
                    params,
                    inits,
                    &format!("{p}.linear_qkv"),
                    h,
                    cfg.qkv_size(),
                    cfg.add_qkv_bias,
                    cfg.init_method_std,
                    false,
                    false,
                );
                let qk_norm = cfg
                    .qk_layernorm
                    .then(|| QKNorm::new(cfg, &p, groups, heads / groups, params, inits));
                QkvProjection::Fused {
                    linear_qkv,
                    qk_norm,
                }
            }
        };
        let sink = match cfg.softmax_type {
            SoftmaxType::Vanilla => None,
            SoftmaxType::OffByOne => Some(AttentionSink::OffByOne),
            SoftmaxType::Learnable => Some(AttentionSink::Learnable(params.add_sharded(
                inits,
                format!("{p}.core_attention.softmax_offset"),
                &[cfg.num_attention_heads],
                false,
                Init::Normal(cfg.init_method_std),
                crate::params::Sharding::Split(0),
            ))),
        };
        let linear_proj = RowParallelLinear::new(
            params,
            inits,
            &format!("{p}.linear_proj"),
            cfg.query_projection_size(),
            h,
            cfg.add_bias_linear,
            cfg.output_layer_init_std(),
            true,
        );
        SelfAttention {
            layer,
            qkv,
            proj_weight: linear_proj.weight,
            proj_bias: linear_proj.bias,
            linear_proj,
            heads,
            groups,
            head_offset: tp_rank * heads,
            total_heads: cfg.num_attention_heads,
            head_dim: cfg.head_dim(),
            attention_dropout: cfg.attention_dropout,
            rope,
            causal: cfg.attn_mask_type == AttnMaskType::Causal,
            window: cfg.attention_window(layer),
            sink,
        }
    }

    /// The sink logits of `heads` of this rank's heads, from the `first`.
    fn sink_logits(&self, params: &Params, first: usize, heads: usize) -> Option<Vec<f32>> {
        Some(match self.sink? {
            AttentionSink::OffByOne => vec![0.0; heads],
            AttentionSink::Learnable(id) => params.get(id)[first..first + heads].to_vec(),
        })
    }

    /// Moves a finished attention output (`[b * t, heads * head_dim]`, heads from this rank's
    /// `first`) and its log-sum-exp to the sink's softmax.
    #[allow(clippy::too_many_arguments)]
    fn apply_sink(
        &self,
        params: &Params,
        attn: &mut Tensor,
        lse: &mut Tensor,
        b: usize,
        t: usize,
        first: usize,
        heads: usize,
    ) {
        if let Some(s) = self.sink_logits(params, first, heads) {
            let d = SinkDims {
                b,
                t,
                heads,
                head_dim: self.head_dim,
            };
            attention_sink_forward(attn.data_mut(), lse.data_mut(), &s, d);
        }
    }

    /// The learned sink's gradient from the sink output, its log-sum-exp and the output's
    /// gradient (heads from this rank's `first`).
    #[allow(clippy::too_many_arguments)]
    fn sink_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        dattn: &Tensor,
        attn: &Tensor,
        lse: &Tensor,
        b: usize,
        t: usize,
        first: usize,
        heads: usize,
    ) {
        let Some(AttentionSink::Learnable(id)) = self.sink else {
            return;
        };
        let s = self
            .sink_logits(params, first, heads)
            .expect("a learned sink has logits");
        let d = SinkDims {
            b,
            t,
            heads,
            head_dim: self.head_dim,
        };
        let g = &mut grads.get_mut(id)[first..first + heads];
        attention_sink_backward(g, dattn.data(), attn.data(), lse.data(), &s, d);
    }

    /// `mask` with this layer's sliding window folded into each query's first visible key
    /// (`t` tokens per sequence: the whole sequence, as every attention kernel indexes
    /// `doc_start`); unchanged for a layer without a window.
    fn windowed<'a>(
        &self,
        mask: AttentionMask<'a>,
        b: usize,
        t: usize,
        starts: &'a mut Vec<u32>,
    ) -> AttentionMask<'a> {
        match self.window {
            None => mask,
            Some(left) => {
                sliding_window_starts(starts, mask.doc_start, b, t, left);
                AttentionMask {
                    key_lens: mask.key_lens,
                    doc_start: Some(starts),
                }
            }
        }
    }

    /// The kernel's dimensions for this rank's share of the heads under context parallelism
    /// (the whole sequence of `t` tokens, heads and groups split over the group).
    fn dims_of(&self, b: usize, t: usize, ctx: &StepContext, cp: CpLayout) -> AttentionDims {
        let heads = self.heads / cp.size;
        AttentionDims {
            b,
            t,
            heads,
            groups: self.groups / cp.size,
            head_dim: self.head_dim,
            causal: self.causal,
            dropout: ctx.p(self.attention_dropout),
            rng_heads: (self.head_offset + cp.rank * heads, self.total_heads),
            rng_block: None,
        }
    }

    /// Rotates (or with `Rotation::Backward` rotates back) the queries and keys of `qkv`
    /// (`[b * t, ..]`) at their positions: `first_pos..` per sequence, or under context
    /// parallelism each local chunk at its place in the whole sequence.
    fn rotate(&self, qkv: &mut [f32], t: usize, first_pos: usize, cp: CpLayout, dir: Rotation) {
        let Some((table, style)) = &self.rope else {
            return;
        };
        let apply = |x: &mut [f32], rows: usize, first: usize| {
            let d = self.rope_dims(rows, first, *style);
            match dir {
                Rotation::Forward => rope_forward(x, table, d),
                Rotation::Backward => rope_backward(x, table, d),
            }
        };
        if cp.size == 1 {
            return apply(qkv, t, first_pos);
        }
        let c = t / 2;
        let width = (self.heads + 2 * self.groups) * self.head_dim;
        for (i, chunk) in qkv.chunks_mut(c * width).enumerate() {
            apply(chunk, c, cp.chunk(i % 2) * c);
        }
    }

    /// Where the rotary embeddings act: rows of `t` tokens from position `first_pos`.
    pub fn rope_dims(&self, t: usize, first_pos: usize, style: RopeStyle) -> RopeDims {
        RopeDims {
            t,
            groups: self.groups,
            q_per_group: self.heads / self.groups,
            head_dim: self.head_dim,
            first_pos,
            style,
        }
    }

    /// The fused QKV projection (or MLA's), queries and keys normalized (`--qk-layernorm`)
    /// and rotated (positions `first_pos..`).
    pub fn qkv_forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        t: usize,
        first_pos: usize,
    ) -> Result<(Tensor, QkvSaved), CommError> {
        let (mut qkv, saved) = match &self.qkv {
            QkvProjection::Fused {
                linear_qkv,
                qk_norm,
            } => {
                let mut qkv = linear_qkv.forward(params, tp, x)?;
                let qk = qk_norm
                    .as_ref()
                    .map(|n| Box::new(n.forward(params, &mut qkv)));
                (qkv, QkvSaved::Fused(qk))
            }
            QkvProjection::Latent(m) => {
                let (qkv, saved) = m.forward(params, tp, x)?;
                (qkv, QkvSaved::Latent(saved))
            }
        };
        let cp = tp.cp_layout();
        self.rotate(qkv.data_mut(), t, first_pos, cp, Rotation::Forward);
        Ok((qkv, saved))
    }

    /// Whether the output projection reads fewer features per head than the kernel writes.
    fn narrows(&self) -> bool {
        matches!(&self.qkv, QkvProjection::Latent(m) if m.dims(0).v < self.head_dim)
    }

    /// The attention output as the output projection reads it: MLA keeps each head's first
    /// `v_head_dim` features (the rest are its zero value padding's).
    fn narrow(&self, attn: Tensor) -> Tensor {
        match &self.qkv {
            QkvProjection::Latent(m) if self.narrows() => {
                let d = m.dims(attn.shape()[0]);
                let mut out = Tensor::for_overwrite(&[d.rows, d.heads * d.v]);
                mla_attn_narrow_forward(out.data_mut(), attn.data(), d);
                out
            }
            _ => attn,
        }
    }

    /// [`SelfAttention::narrow`]'s gradient, or its inverse on a kept output: padded back to
    /// the kernel's head width with zeros.
    fn widen(&self, x: Tensor) -> Tensor {
        match &self.qkv {
            QkvProjection::Latent(m) if self.narrows() => {
                let d = m.dims(x.shape()[0]);
                let mut out = Tensor::for_overwrite(&[d.rows, d.heads * d.head_dim()]);
                mla_attn_narrow_backward(out.data_mut(), x.data(), d);
                out
            }
            _ => x,
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
        let (qkv, projection) = self.qkv_forward(params, tp, x, t, 0)?;
        let cp = tp.cp_layout();
        let mut starts = Vec::new();
        let mask = self.windowed(mask, b, t * cp.size, &mut starts);
        // Attention reads QKV as backward keeps it (16-bit under `--bf16` / `--fp16`, as
        // Megatron's QKV is), so an output recomputed in backward equals this one.
        let (qkv, attn, lse) = if ring(tp) {
            let qkv = keep(qkv);
            let (attn, lse) = self.ring_attention(params, tp, &restore(&qkv), b, t, ctx, mask)?;
            (qkv, attn, lse)
        } else {
            // All-to-all (or no context parallelism): attention runs on the whole sequence and
            // this rank's share of the heads; what backward keeps is in that layout.
            let qkv = keep(self.to_heads(tp, qkv, b, cp)?);
            let (attn_h, lse) =
                self.core_attention(params, &readable(&qkv), b, t * cp.size, ctx, mask, cp);
            (qkv, self.to_sequence(tp, attn_h, b, cp)?, lse)
        };
        let attn = self.narrow(attn);
        let out = self.linear_proj.forward(params, tp, &attn)?;
        let attn = (!ctx.drops(|m| m.core_attn)).then(|| (keep(attn), lse));
        Ok((
            out,
            SelfAttentionSaved {
                qkv,
                attn,
                projection,
            },
        ))
    }

    /// The attention kernel on the (normed, rotated) QKV of `t` tokens per sequence and this
    /// rank's heads: output and log-sum-exp.
    #[allow(clippy::too_many_arguments)]
    fn core_attention(
        &self,
        params: &Params,
        qkv: &Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
        cp: CpLayout,
    ) -> (Tensor, Tensor) {
        let d = self.dims_of(b, t, ctx, cp);
        let mut attn = Tensor::for_overwrite(&[b * t, d.heads * self.head_dim]);
        let mut lse = Tensor::for_overwrite(&[b, d.heads, t]);
        let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.total_heads * t * t);
        attention_forward(attn.data_mut(), lse.data_mut(), qkv.operand(), mask, d, key);
        let first = cp.rank * d.heads;
        self.apply_sink(params, &mut attn, &mut lse, b, t, first, d.heads);
        (attn, lse)
    }

    /// This rank's chunks, every head -> the whole sequence, this rank's heads.
    fn to_heads(
        &self,
        tp: &mut Tp,
        x: Tensor,
        b: usize,
        cp: CpLayout,
    ) -> Result<Tensor, CommError> {
        match tp.cp() {
            Some(c) => sequence_to_heads(&x, b, cp, c),
            None => Ok(x),
        }
    }

    /// The inverse of [`SelfAttention::to_heads`].
    fn to_sequence(
        &self,
        tp: &mut Tp,
        x: Tensor,
        b: usize,
        cp: CpLayout,
    ) -> Result<Tensor, CommError> {
        match tp.cp() {
            Some(c) => heads_to_sequence(&x, b, cp, c),
            None => Ok(x),
        }
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
        let cp = tp.cp_layout();
        let mut starts = Vec::new();
        let mask = self.windowed(mask, b, t * cp.size, &mut starts);
        if ring(tp) {
            let qkv = restore(&saved.qkv);
            let (attn, lse) = match &saved.attn {
                Some((a, l)) => (restore(a).into_owned(), std::borrow::Cow::Borrowed(l)),
                None => {
                    let (a, l) = self.ring_attention(params, tp, &qkv, b, t, ctx, mask)?;
                    (self.narrow(as_kept(a)), std::borrow::Cow::Owned(l))
                }
            };
            let dattn = self.linear_proj.backward(params, grads, tp, &attn, dout)?;
            let (dattn, attn) = (self.widen(dattn), self.widen(attn));
            let tw = t * cp.size;
            let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.total_heads * tw * tw);
            let d = self.dims_of(b, t, ctx, CpLayout { rank: 0, size: 1 });
            let comm = tp
                .cp()
                .expect("ring attention runs in a context-parallel group");
            let starts = mask.doc_start;
            let dqkv =
                ring_attention_backward(&dattn, &attn, &lse, &qkv, b, cp, comm, d, starts, key)?;
            self.sink_backward(params, grads, &dattn, &attn, &lse, b, t, 0, self.heads);
            return self.qkv_backward(params, grads, tp, saved, x, dqkv, t, cp);
        }
        let tw = t * cp.size;
        // The kept QKV as stored: the packed kernels read bf16 in place.
        let qkv = readable(&saved.qkv);
        // The attention output in both layouts: this rank's chunks as the projection reads
        // them, and the kernel's output for this rank's heads over the whole sequence (made
        // from the first after the projection's backward when not at hand).
        let (attn, attn_h, lse) = match &saved.attn {
            Some((a, l)) => (restore(a).into_owned(), None, std::borrow::Cow::Borrowed(l)),
            None => {
                let (a_h, l) = self.core_attention(params, &qkv, b, tw, ctx, mask, cp);
                let a_h = as_kept(a_h);
                let l = std::borrow::Cow::Owned(l);
                match tp.cp() {
                    Some(c) => (
                        self.narrow(heads_to_sequence(&a_h, b, cp, c)?),
                        Some(a_h),
                        l,
                    ),
                    None if self.narrows() => (self.narrow(a_h.clone()), Some(a_h), l),
                    None => (a_h, None, l),
                }
            }
        };
        let dattn = self.linear_proj.backward(params, grads, tp, &attn, dout)?;
        let dattn = self.to_heads(tp, self.widen(dattn), b, cp)?;
        let attn_h = match attn_h {
            Some(a) => a,
            None => {
                let a = self.widen(attn);
                match tp.cp() {
                    Some(c) => sequence_to_heads(&a, b, cp, c)?,
                    None => a,
                }
            }
        };
        let mut dqkv = Tensor::for_overwrite(qkv.shape());
        let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.total_heads * tw * tw);
        attention_backward(
            dqkv.data_mut(),
            dattn.data(),
            attn_h.data(),
            lse.data(),
            qkv.operand(),
            mask,
            self.dims_of(b, tw, ctx, cp),
            key,
        );
        let heads = self.heads / cp.size;
        self.sink_backward(
            params,
            grads,
            &dattn,
            &attn_h,
            &lse,
            b,
            tw,
            cp.rank * heads,
            heads,
        );
        drop((dattn, attn_h, qkv));
        let dqkv = self.to_sequence(tp, dqkv, b, cp)?;
        self.qkv_backward(params, grads, tp, saved, x, dqkv, t, cp)
    }

    /// From the gradient of the (normed, rotated) QKV of this rank's tokens: through the
    /// rotation, the query/key norms and the projection. Returns `dx`.
    #[allow(clippy::too_many_arguments)]
    fn qkv_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: &SelfAttentionSaved,
        x: &Tensor,
        mut dqkv: Tensor,
        t: usize,
        cp: CpLayout,
    ) -> Result<Tensor, CommError> {
        self.rotate(dqkv.data_mut(), t, 0, cp, Rotation::Backward);
        match (&self.qkv, &saved.projection) {
            (
                QkvProjection::Fused {
                    linear_qkv,
                    qk_norm,
                },
                QkvSaved::Fused(s),
            ) => {
                if let (Some(n), Some(s)) = (qk_norm, s) {
                    n.backward(params, grads, s, &mut dqkv);
                }
                linear_qkv.backward(params, grads, tp, x, dqkv)
            }
            (QkvProjection::Latent(m), QkvSaved::Latent(s)) => {
                m.backward(params, grads, tp, s, x, dqkv)
            }
            _ => unreachable!("the QKV projection saves its own kind"),
        }
    }

    /// Ring attention over the context-parallel group: this rank's queries against every
    /// rank's keys and values (`t` local rows per sequence).
    #[allow(clippy::too_many_arguments)]
    fn ring_attention(
        &self,
        params: &Params,
        tp: &mut Tp,
        qkv: &Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<(Tensor, Tensor), CommError> {
        let cp = tp.cp_layout();
        let tw = t * cp.size;
        let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.total_heads * tw * tw);
        let d = self.dims_of(b, t, ctx, CpLayout { rank: 0, size: 1 });
        let comm = tp
            .cp()
            .expect("ring attention runs in a context-parallel group");
        let (mut attn, mut lse) = ring_attention_forward(qkv, b, cp, comm, d, mask.doc_start, key)?;
        self.apply_sink(params, &mut attn, &mut lse, b, t, 0, self.heads);
        Ok((attn, lse))
    }

    /// One new token per sequence (`x` is `[b, h]`, normed) at position `pos` against this
    /// layer's cache (`[b, groups, max_t, head_dim]` keys and values): the same projections and
    /// rotary embeddings as training, single-query attention. Returns the output projection
    /// without its bias.
    pub fn decode_forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        cache: &mut LayerKVCache,
        pos: usize,
    ) -> Result<Tensor, CommError> {
        let b = x.shape()[0];
        let (qkv, _) = self.qkv_forward(params, tp, x, 1, pos)?;
        let d = DecodeDims {
            b,
            heads: self.heads,
            groups: self.groups,
            head_dim: self.head_dim,
            max_t: cache.max_t,
        };
        let mut q = Tensor::for_overwrite(&[b, self.heads * self.head_dim]);
        kv_cache_append(&mut cache.k, &mut cache.v, q.data_mut(), qkv.data(), d, pos);
        let mut attn = Tensor::for_overwrite(&[b, self.heads * self.head_dim]);
        let first = self.window.map_or(0, |left| pos.saturating_sub(left));
        let sink = self.sink_logits(params, 0, self.heads);
        attention_decode_forward(
            attn.data_mut(),
            q.data(),
            &cache.k,
            &cache.v,
            d,
            first..pos + 1,
            sink.as_deref(),
        );
        let attn = self.narrow(attn);
        self.linear_proj.forward(params, tp, &attn)
    }
}

/// One layer's key/value cache: `[b, groups, max_t, head_dim]` each (grouped-query attention
/// caches one K and V per group, not per head).
pub struct LayerKVCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub max_t: usize,
}

impl LayerKVCache {
    pub fn new(attention: &SelfAttention, b: usize, max_t: usize) -> Self {
        let n = b * attention.groups * max_t * attention.head_dim;
        LayerKVCache {
            k: vec![0.0; n],
            v: vec![0.0; n],
            max_t,
        }
    }
}
