//! T5's attention block (megatron-core's `SelfAttention` / `CrossAttention` of its T5 layer
//! spec, with Hugging Face T5's scores): self-attention with a fused `linear_qkv` (per head
//! `[q_h, k_h, v_h]`), or cross-attention with `linear_q` on the decoder's states and
//! `linear_kv` (per head `[k_h, v_h]`) on the encoder's output; heads split over tensor
//! parallelism (column-parallel projections, row-parallel `linear_proj`); an optional additive
//! position bias `[local heads, tq, tk]` (T5's relative bias, computed once per stack); the
//! scores scaled by `scale` (1 in T5, whose init absorbs `1/sqrt(d)`). Keys beyond each
//! sequence's length are padding; the decoder's self-attention is causal.

use crate::params::{Grads, Init, Params};
use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, Tp};
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::attention_bias::{
    biased_attention_backward, biased_attention_forward, fuse_heads, unfuse_heads,
    BiasedAttentionDims,
};
use megatron_tensor::Tensor;

/// Which attention: the encoder's (bidirectional), the decoder's self-attention (causal), or
/// the decoder's attention to the encoder output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum T5AttentionKind {
    EncoderSelf,
    DecoderSelf,
    Cross,
}

enum Projections {
    Fused(ColumnParallelLinear),
    Split {
        q: ColumnParallelLinear,
        kv: ColumnParallelLinear,
    },
}

pub struct T5Attention {
    pub kind: T5AttentionKind,
    proj: Projections,
    pub linear_proj: RowParallelLinear,
    /// This rank's heads and the first of them (for the dropout stream).
    heads: usize,
    head0: usize,
    total_heads: usize,
    head_dim: usize,
    scale: f32,
    dropout: f32,
    layer: usize,
}

/// What backward needs: this rank's queries, keys, values, probabilities and the attention
/// output (the row-parallel projection's input).
pub struct T5AttentionSaved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Vec<f32>,
    context: Tensor,
}

impl T5AttentionSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.q.size_in_bytes()
            + self.k.size_in_bytes()
            + self.v.size_in_bytes()
            + self.probs.len() * 4
            + self.context.size_in_bytes()
    }
}

/// Shapes of one call: sequences, query and key lengths.
#[derive(Clone, Copy, Debug)]
pub struct T5AttentionShape {
    pub b: usize,
    pub tq: usize,
    pub tk: usize,
}

impl T5Attention {
    /// Registers `{prefix}.linear_qkv` (self) or `{prefix}.linear_q` and `.linear_kv` (cross),
    /// and `{prefix}.linear_proj`, without biases (T5's), for `heads` heads of `head_dim`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: T5AttentionKind,
        prefix: &str,
        hidden: usize,
        (heads, head_dim): (usize, usize),
        (init_std, out_std): (f32, f32),
        scale: f32,
        dropout: f32,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let width = heads * head_dim;
        let column = |params: &mut Params, inits: &mut Vec<Init>, name: &str, out: usize| {
            ColumnParallelLinear::new(
                params,
                inits,
                &format!("{prefix}.{name}"),
                hidden,
                out,
                false,
                init_std,
                false,
                false,
            )
        };
        let proj = match kind {
            T5AttentionKind::Cross => Projections::Split {
                q: column(params, inits, "linear_q", width),
                kv: column(params, inits, "linear_kv", 2 * width),
            },
            _ => Projections::Fused(column(params, inits, "linear_qkv", 3 * width)),
        };
        let linear_proj = RowParallelLinear::new(
            params,
            inits,
            &format!("{prefix}.linear_proj"),
            width,
            hidden,
            false,
            out_std,
            true,
        );
        let (rank, t) = (params.tp.0, params.tp.1.max(1));
        let local = heads / t;
        T5Attention {
            kind,
            proj,
            linear_proj,
            heads: local,
            head0: rank * local,
            total_heads: heads,
            head_dim,
            scale,
            dropout,
            layer,
        }
    }

    fn dims(&self, s: T5AttentionShape, ctx: &StepContext) -> BiasedAttentionDims {
        BiasedAttentionDims {
            b: s.b,
            tq: s.tq,
            tk: s.tk,
            heads: self.heads,
            head_dim: self.head_dim,
            causal: self.kind == T5AttentionKind::DecoderSelf,
            scale: self.scale,
            dropout: ctx.p(self.dropout),
            rng_heads: (self.head0, self.total_heads),
        }
    }

    /// The probabilities' dropout masks, numbered among all of the step's samples.
    fn key(&self, ctx: &StepContext, s: T5AttentionShape) -> megatron_tensor::RngKey {
        const SITE: u64 = 7;
        let site = match self.kind {
            T5AttentionKind::Cross => SITE + 1,
            _ => SITE,
        };
        ctx.site_for(self.layer, site, self.total_heads * s.tq * s.tk)
    }

    /// `x` is the queries' states `[b * tq, hidden]`; `memory` the encoder output
    /// `[b * tk, hidden]` for cross-attention (`None` otherwise); `bias` this rank's heads'
    /// `[heads, tq, tk]`; `key_lens` the keys' lengths per sequence. Collective over `tp`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        memory: Option<&Tensor>,
        bias: Option<&[f32]>,
        key_lens: Option<&[usize]>,
        s: T5AttentionShape,
        ctx: &StepContext,
    ) -> Result<(Tensor, T5AttentionSaved), CommError> {
        let (nh, hd) = (self.heads, self.head_dim);
        let mut q = Tensor::for_overwrite(&[s.b * s.tq, nh * hd]);
        let mut k = Tensor::for_overwrite(&[s.b * s.tk, nh * hd]);
        let mut v = Tensor::for_overwrite(&[s.b * s.tk, nh * hd]);
        match &self.proj {
            Projections::Fused(qkv) => {
                let fused = qkv.forward(params, tp, x)?;
                let mut outs = [q.data_mut(), k.data_mut(), v.data_mut()];
                unfuse_heads(&mut outs, fused.data(), nh, hd);
            }
            Projections::Split { q: lq, kv } => {
                let mem = memory.expect("cross-attention reads the encoder output");
                q = lq.forward(params, tp, x)?;
                let fused = kv.forward(params, tp, mem)?;
                let mut outs = [k.data_mut(), v.data_mut()];
                unfuse_heads(&mut outs, fused.data(), nh, hd);
            }
        }
        let d = self.dims(s, ctx);
        let mut context = Tensor::for_overwrite(&[s.b * s.tq, nh * hd]);
        let mut probs = vec![0.0f32; s.b * nh * s.tq * s.tk];
        biased_attention_forward(
            context.data_mut(),
            &mut probs,
            q.data(),
            k.data(),
            v.data(),
            bias,
            key_lens,
            d,
            self.key(ctx, s),
        );
        let y = self.linear_proj.forward(params, tp, &context)?;
        Ok((
            y,
            T5AttentionSaved {
                q,
                k,
                v,
                probs,
                context,
            },
        ))
    }

    /// Gradients of the states `x`, of the encoder output (cross-attention) and of the bias
    /// (this rank's heads, summed over sequences); parameter gradients accumulate.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: T5AttentionSaved,
        x: &Tensor,
        memory: Option<&Tensor>,
        dy: Tensor,
        with_bias: bool,
        s: T5AttentionShape,
        ctx: &StepContext,
    ) -> Result<(Tensor, Option<Tensor>, Option<Vec<f32>>), CommError> {
        let (nh, hd) = (self.heads, self.head_dim);
        let dcontext = self
            .linear_proj
            .backward(params, grads, tp, &saved.context, dy)?;
        drop(saved.context);
        let d = self.dims(s, ctx);
        let mut dq = Tensor::for_overwrite(saved.q.shape());
        let mut dk = Tensor::for_overwrite(saved.k.shape());
        let mut dv = Tensor::for_overwrite(saved.v.shape());
        let mut dbias = with_bias.then(|| vec![0.0f32; nh * s.tq * s.tk]);
        biased_attention_backward(
            dq.data_mut(),
            dk.data_mut(),
            dv.data_mut(),
            dbias.as_deref_mut(),
            dcontext.data(),
            &saved.probs,
            saved.q.data(),
            saved.k.data(),
            saved.v.data(),
            d,
            self.key(ctx, s),
        );
        match &self.proj {
            Projections::Fused(qkv) => {
                let mut dfused = Tensor::for_overwrite(&[s.b * s.tq, 3 * nh * hd]);
                fuse_heads(
                    dfused.data_mut(),
                    &[dq.data(), dk.data(), dv.data()],
                    nh,
                    hd,
                );
                let dx = qkv.backward(params, grads, tp, x, dfused)?;
                Ok((dx, None, dbias))
            }
            Projections::Split { q, kv } => {
                let mem = memory.expect("cross-attention reads the encoder output");
                let mut dfused = Tensor::for_overwrite(&[s.b * s.tk, 2 * nh * hd]);
                fuse_heads(dfused.data_mut(), &[dk.data(), dv.data()], nh, hd);
                let dmem = kv.backward(params, grads, tp, mem, dfused)?;
                let dx = q.backward(params, grads, tp, x, dq)?;
                Ok((dx, Some(dmem), dbias))
            }
        }
    }

    /// Decoding: one position per sequence.
    fn decode_dims(&self, tk: usize) -> BiasedAttentionDims {
        BiasedAttentionDims {
            b: 1,
            tq: 1,
            tk,
            heads: self.heads,
            head_dim: self.head_dim,
            causal: false,
            scale: self.scale,
            dropout: 0.0,
            rng_heads: (self.head0, self.total_heads),
        }
    }

    /// Generation, the decoder's self-attention: `x` holds one new position per sequence
    /// (`[b, hidden]`) at `pos`; its key and value join `cache` and it attends to positions
    /// `0..=pos` with `bias` (`[heads, pos + 1]`, the query's row of the relative bias).
    pub fn decode_self(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        cache: &mut SelfKV,
        pos: usize,
        bias: &[f32],
    ) -> Result<Tensor, CommError> {
        let Projections::Fused(qkv) = &self.proj else {
            panic!("decode_self runs a self-attention");
        };
        let (b, row) = (x.shape()[0], self.heads * self.head_dim);
        let fused = qkv.forward(params, tp, x)?;
        let mut q = Tensor::for_overwrite(&[b, row]);
        let mut k = Tensor::for_overwrite(&[b, row]);
        let mut v = Tensor::for_overwrite(&[b, row]);
        let mut outs = [q.data_mut(), k.data_mut(), v.data_mut()];
        unfuse_heads(&mut outs, fused.data(), self.heads, self.head_dim);
        let mut context = Tensor::for_overwrite(&[b, row]);
        let mut probs = vec![0.0f32; self.heads * (pos + 1)];
        let at = pos * row..(pos + 1) * row;
        for s in 0..b {
            let here = s * row..(s + 1) * row;
            cache.k[s][at.clone()].copy_from_slice(&k.data()[here.clone()]);
            cache.v[s][at.clone()].copy_from_slice(&v.data()[here.clone()]);
            biased_attention_forward(
                &mut context.data_mut()[here.clone()],
                &mut probs,
                &q.data()[here],
                &cache.k[s][..at.end],
                &cache.v[s][..at.end],
                Some(bias),
                None,
                self.decode_dims(pos + 1),
                megatron_tensor::RngKey::new(0),
            );
        }
        self.linear_proj.forward(params, tp, &context)
    }

    /// Generation, cross-attention: the keys and values of the encoder output `memory`
    /// (`[b * te, hidden]`), computed once.
    pub fn cross_kv(
        &self,
        params: &Params,
        tp: &mut Tp,
        memory: &Tensor,
    ) -> Result<(Tensor, Tensor), CommError> {
        let Projections::Split { kv, .. } = &self.proj else {
            panic!("cross_kv runs a cross-attention");
        };
        let n = memory.shape()[0];
        let mut k = Tensor::for_overwrite(&[n, self.heads * self.head_dim]);
        let mut v = Tensor::for_overwrite(&[n, self.heads * self.head_dim]);
        let fused = kv.forward(params, tp, memory)?;
        let mut outs = [k.data_mut(), v.data_mut()];
        unfuse_heads(&mut outs, fused.data(), self.heads, self.head_dim);
        Ok((k, v))
    }

    /// Generation, cross-attention of one position per sequence (`x`: `[b, hidden]`) to the
    /// encoder output's keys and values of [`T5Attention::cross_kv`] (`te` rows per sequence,
    /// `enc_lens` of them real).
    pub fn decode_cross(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        (k, v): (&Tensor, &Tensor),
        enc_lens: &[usize],
        te: usize,
    ) -> Result<Tensor, CommError> {
        let Projections::Split { q: lq, .. } = &self.proj else {
            panic!("decode_cross runs a cross-attention");
        };
        let (b, row) = (x.shape()[0], self.heads * self.head_dim);
        let q = lq.forward(params, tp, x)?;
        let mut context = Tensor::for_overwrite(&[b, row]);
        let mut probs = vec![0.0f32; self.heads * te];
        for s in 0..b {
            let here = s * row..(s + 1) * row;
            let keys = s * te * row..(s + 1) * te * row;
            biased_attention_forward(
                &mut context.data_mut()[here.clone()],
                &mut probs,
                &q.data()[here],
                &k.data()[keys.clone()],
                &v.data()[keys],
                None,
                Some(&enc_lens[s..s + 1]),
                self.decode_dims(te),
                megatron_tensor::RngKey::new(0),
            );
        }
        self.linear_proj.forward(params, tp, &context)
    }

    /// An empty self-attention cache for `b` sequences of up to `max_t` positions.
    pub fn self_kv(&self, b: usize, max_t: usize) -> SelfKV {
        let n = max_t * self.heads * self.head_dim;
        SelfKV {
            k: vec![vec![0.0; n]; b],
            v: vec![vec![0.0; n]; b],
        }
    }
}

/// The decoder self-attention's keys and values so far, per sequence `[max_t, heads * head_dim]`.
pub struct SelfKV {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}
