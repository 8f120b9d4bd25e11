//! `TransformerLayer`: attention and MLP blocks with fused bias-dropout-add residuals, the
//! LayerNorms before each block (pre-LN: GPT, Llama, Megatron's BERT) or after each residual
//! sum (post-LN: the original BERT, Hugging Face's `BertModel`). Saves its input, the
//! residual-stream tensors the norms read, their statistics and what the sub-blocks save;
//! LayerNorm outputs are recomputed in backward (cheap, memory-bound).
//!
//! Under sequence parallelism the residual stream, LayerNorms and dropout hold this rank's block
//! of token rows; dropout masks are numbered by global element index (the block's first row is
//! an offset into the stream), so every TP size and either mode draws the TP = 1 masks.

use super::attention::{LayerKVCache, SelfAttention, SelfAttentionSaved};
use super::config::{LayerNormPlacement, TransformerConfig};
use super::mlp::{MLPSaved, MLP};
use super::moe::{MoELayer, MoESaved, TokenRows};
pub use super::norm::{LayerNorm, LayerNormSaved, Norm, RMSNorm};
use super::saved::{linear_input_dtype, readable};
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params};
use crate::tensor_parallel::Tp;
use megatron_comm::CommError;
use megatron_tensor::cpu::{
    bias_dropout_add_backward, bias_dropout_add_forward, dropout_add_forward, dropout_backward,
    AttentionMask, Operand, OperandMut, RopeStyle, RopeTable,
};
use megatron_tensor::{DType, RngKey, Tensor};
use std::sync::Arc;

pub struct TransformerLayer {
    pub layer: usize,
    /// The attention block's norm: before it (pre-LN, `input_layernorm`), or after its
    /// residual sum (post-LN, `post_self_attn_layernorm`). Registered first of the layer's
    /// parameters either way.
    pub input_layernorm: Norm,
    pub self_attention: SelfAttention,
    /// The MLP block's norm: `pre_mlp_layernorm`, or post-LN `post_mlp_layernorm`.
    pub pre_mlp_layernorm: Norm,
    pub mlp: FeedForward,
    pub(super) hidden_dropout: f32,
    placement: LayerNormPlacement,
    /// The storage of the layer's residual sums and output (the residual stream).
    pub(super) residual: DType,
}

/// The residual-stream tensors (input, sums) are kept as the stream stores them, never rounded
/// to 16 bits when the stream is f32 (`--fp16`, `--fp32-residual-connection`, T5): backward's
/// recomputed norms, and a recomputed forward, then read the values the forward read.
pub struct TransformerLayerSaved {
    pub input: Tensor,
    pub ln1: LayerNormSaved,
    pub attn: SelfAttentionSaved,
    /// The attention block's residual sum (pre-LN: the MLP block's input; post-LN: the first
    /// norm's input).
    pub mid: Tensor,
    pub ln2: LayerNormSaved,
    pub mlp: FeedForwardSaved,
    /// Post-LN: the MLP block's residual sum, the second norm's input.
    pub post: Option<Tensor>,
}

impl TransformerLayerSaved {
    /// Bytes this layer keeps in flight for one micro-batch.
    pub fn size_in_bytes(&self) -> usize {
        self.input.size_in_bytes()
            + self.ln1.size_in_bytes()
            + self.attn.size_in_bytes()
            + self.mid.size_in_bytes()
            + self.ln2.size_in_bytes()
            + self.mlp.size_in_bytes()
            + self.post.as_ref().map_or(0, |t| t.size_in_bytes())
    }
}

pub(super) const SITE_ATTN_RESIDUAL: u64 = 2;
pub(super) const SITE_MLP_RESIDUAL: u64 = 3;

impl TransformerLayer {
    /// Layer `layer` of the `stack` (`"decoder"`, or `"encoder"` in an encoder: megatron-core
    /// names its parameters `{stack}.layers.{layer}.*`).
    pub fn new(
        cfg: &TransformerConfig,
        stack: &str,
        layer: usize,
        rope: Option<(Arc<RopeTable>, RopeStyle)>,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let p = format!("{stack}.layers.{layer}");
        Self::new_named(cfg, &p, layer, rope, params, inits)
    }

    /// A layer whose parameters are named under `p` (a multi-token-prediction layer's
    /// `mtp.layers.{k}.mtp_model_layer`); `layer` numbers it for dropout masks and picks its
    /// per-layer settings.
    pub fn new_named(
        cfg: &TransformerConfig,
        p: &str,
        layer: usize,
        rope: Option<(Arc<RopeTable>, RopeStyle)>,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let (norm1, norm2) = match cfg.layernorm_placement {
            LayerNormPlacement::PreLn => ("input_layernorm", "pre_mlp_layernorm"),
            LayerNormPlacement::PostLn => ("post_self_attn_layernorm", "post_mlp_layernorm"),
        };
        let input_layernorm = Norm::new(
            cfg.normalization,
            &format!("{p}.{norm1}"),
            h,
            cfg.layernorm_epsilon,
            params,
            inits,
        );
        let self_attention = SelfAttention::new(cfg, layer, p, rope, params, inits);
        let pre_mlp_layernorm = Norm::new(
            cfg.normalization,
            &format!("{p}.{norm2}"),
            h,
            cfg.layernorm_epsilon,
            params,
            inits,
        );
        let mlp = if cfg.is_moe_layer(layer) {
            FeedForward::MoE(Box::new(MoELayer::new(cfg, layer, p, params, inits)))
        } else {
            FeedForward::Dense(MLP::new_named(
                cfg,
                &format!("{p}.mlp"),
                cfg.ffn_hidden_size,
                cfg.add_bias_linear,
                params,
                inits,
            ))
        };
        TransformerLayer {
            layer,
            input_layernorm,
            self_attention,
            pre_mlp_layernorm,
            mlp,
            hidden_dropout: cfg.hidden_dropout,
            placement: cfg.layernorm_placement,
            residual: cfg.residual.dtype(),
        }
    }

    /// `x` in the residual stream's storage: under a bf16 stream an f32 input (the
    /// embedding's output, a received activation, a multi-token-prediction projection) is
    /// rounded once, as Megatron's bf16 modules write bf16, so forward, the norms recomputed in
    /// backward and a recomputed forward all read the kept values.
    pub fn into_stream(&self, x: Tensor) -> Tensor {
        if x.dtype() == self.residual {
            x
        } else {
            x.to_dtype(self.residual)
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<(Tensor, TransformerLayerSaved), CommError> {
        match self.placement {
            LayerNormPlacement::PreLn => self.forward_pre_ln(params, tp, x, b, t, ctx, mask),
            LayerNormPlacement::PostLn => self.forward_post_ln(params, tp, x, b, t, ctx, mask),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_pre_ln(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<(Tensor, TransformerLayerSaved), CommError> {
        let (rows, h) = (x.shape()[0], x.shape()[1]);
        let (lo, _) = tp.sequence_shard(b * t);
        let (ln1_out, ln1) = self
            .input_layernorm
            .forward_as(params, &x, linear_input_dtype());
        let (proj, attn) = self
            .self_attention
            .forward(params, tp, &ln1_out, b, t, ctx, mask)?;
        drop(ln1_out);
        let at = DropoutRows::new(tp, lo, rows, t, h);
        let bias = self.self_attention.proj_bias;
        let mid = self.residual_add(params, (&proj, bias), &x, &at, ctx, SITE_ATTN_RESIDUAL);
        drop(proj);
        let ln2_dtype = self.mlp.input_dtype();
        let (ln2_out, ln2) = self.pre_mlp_layernorm.forward_as(params, &mid, ln2_dtype);
        let moe_rows = TokenRows {
            first: lo,
            seq_length: t,
        };
        let (y, mlp) = self.mlp.forward(params, tp, &ln2_out, moe_rows, ctx)?;
        drop(ln2_out);
        let bias = self.mlp.fc2_bias();
        let out = self.residual_add(params, (&y, bias), &mid, &at, ctx, SITE_MLP_RESIDUAL);
        Ok((
            out,
            TransformerLayerSaved {
                input: x,
                ln1,
                attn,
                mid,
                ln2,
                mlp,
                post: None,
            },
        ))
    }

    /// Forward without keeping anything for backward (evaluation).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_no_grad(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<Tensor, CommError> {
        Ok(self.forward(params, tp, x, b, t, ctx, mask)?.0)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: TransformerLayerSaved,
        dout: Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<Tensor, CommError> {
        match self.placement {
            LayerNormPlacement::PreLn => {
                self.backward_pre_ln(params, grads, tp, saved, dout, b, t, ctx, mask)
            }
            LayerNormPlacement::PostLn => {
                self.backward_post_ln(params, grads, tp, saved, dout, b, t, ctx, mask)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_pre_ln(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: TransformerLayerSaved,
        dout: Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Result<Tensor, CommError> {
        let (rows, h) = (dout.shape()[0], dout.shape()[1]);
        let (lo, _) = tp.sequence_shard(b * t);
        // MLP residual: d(mid) gets dout directly plus the MLP branch.
        let at = DropoutRows::new(tp, lo, rows, t, h);
        let bias = self.mlp.fc2_bias();
        let dy = self.residual_branch_grad(grads, bias, &dout, &at, ctx, SITE_MLP_RESIDUAL);
        // The kept residuals are read as stored (bf16 under `--bf16`): the norms widen them
        // row block by row block, in cache.
        let mid = readable(&saved.mid);
        let ln2_dtype = self.mlp.input_dtype();
        let (ln2_out, _) = self.pre_mlp_layernorm.forward_as(params, &mid, ln2_dtype);
        let dln2 = self
            .mlp
            .backward(params, grads, tp, &saved.mlp, &ln2_out, dy, ctx)?;
        drop(ln2_out);
        let mut dmid = self
            .pre_mlp_layernorm
            .backward(params, grads, &saved.ln2, &mid, &dln2);
        drop(dln2);
        add_inplace(&mut dmid, &dout);
        drop(dout);
        // Attention residual.
        let bias = self.self_attention.proj_bias;
        let dproj = self.residual_branch_grad(grads, bias, &dmid, &at, ctx, SITE_ATTN_RESIDUAL);
        drop(mid);
        let input = readable(&saved.input);
        let (ln1_out, _) = self
            .input_layernorm
            .forward_as(params, &input, linear_input_dtype());
        let dln1 = self.self_attention.backward(
            params,
            grads,
            tp,
            &saved.attn,
            &ln1_out,
            dproj,
            b,
            t,
            ctx,
            mask,
        )?;
        drop(ln1_out);
        let mut dx = self
            .input_layernorm
            .backward(params, grads, &saved.ln1, &input, &dln1);
        add_inplace(&mut dx, &dmid);
        Ok(dx)
    }
}

/// `out = residual + dropout(x + bias)`, the bias optional (`--disable-bias-linear`).
pub(super) fn residual_forward<'o, 'r>(
    params: &Params,
    bias: Option<ParamId>,
    out: impl Into<OperandMut<'o>>,
    x: &[f32],
    residual: impl Into<Operand<'r>>,
    p: f32,
    key: RngKey,
) {
    match bias {
        Some(b) => bias_dropout_add_forward(out, x, &params.get(b), residual, p, key),
        None => dropout_add_forward(out, x, residual, p, key),
    }
}

/// Where this rank's rows of the residual stream sit in the micro-batch, for the dropout
/// masks: one run of rows, or under context parallelism one per chunk. Masks are numbered by
/// the element's index among all of the step's samples, so every micro-batch draws its own and
/// every layout draws the one-rank masks (the T5 stacks use it too).
pub(crate) struct DropoutRows {
    /// (element range in this rank's tensor, element offset in the micro-batch).
    runs: Vec<(std::ops::Range<usize>, u64)>,
    /// Elements per sequence of the whole micro-batch.
    per_sample: usize,
}

impl DropoutRows {
    /// This rank's `rows` of `b` sequences of `t` tokens of width `h` (its sequence-parallel
    /// block of them).
    pub(crate) fn of_block(tp: &Tp, b: usize, t: usize, rows: usize, h: usize) -> Self {
        let (lo, _) = tp.sequence_shard(b * t);
        Self::new(tp, lo, rows, t, h)
    }

    pub(super) fn new(tp: &Tp, lo: usize, rows: usize, t: usize, h: usize) -> Self {
        let cp = tp.cp_layout();
        DropoutRows {
            runs: crate::context_parallel::element_runs(lo, lo + rows, t, cp, h),
            per_sample: t * cp.size * h,
        }
    }

    pub(crate) fn key(&self, ctx: &StepContext, layer: usize, site: u64) -> RngKey {
        ctx.site_for(layer, site, self.per_sample)
    }

    pub(crate) fn each(&self, mut f: impl FnMut(std::ops::Range<usize>, u64)) {
        for (r, k) in &self.runs {
            f(r.clone(), *k);
        }
    }
}

impl TransformerLayer {
    /// `residual + dropout(branch + bias)` over this rank's rows `at`, with the dropout masks
    /// of `site`.
    pub(super) fn residual_add(
        &self,
        params: &Params,
        (branch, bias): (&Tensor, Option<ParamId>),
        residual: &Tensor,
        at: &DropoutRows,
        ctx: &StepContext,
        site: u64,
    ) -> Tensor {
        let p = ctx.p(self.hidden_dropout);
        let mut out = Tensor::for_overwrite_as(residual.shape(), self.residual);
        let key = at.key(ctx, self.layer, site);
        at.each(|r, k| {
            residual_forward(
                params,
                bias,
                out.operand_mut().slice(r.clone()),
                &branch.data()[r.clone()],
                residual.operand().slice(r),
                p,
                key.offset(k),
            )
        });
        out
    }

    /// The branch's gradient through [`Self::residual_add`]'s dropout, the bias gradient
    /// accumulated.
    pub(super) fn residual_branch_grad(
        &self,
        grads: &mut Grads,
        bias: Option<ParamId>,
        dout: &Tensor,
        at: &DropoutRows,
        ctx: &StepContext,
        site: u64,
    ) -> Tensor {
        let p = ctx.p(self.hidden_dropout);
        let mut d = Tensor::for_overwrite(dout.shape());
        let key = at.key(ctx, self.layer, site);
        at.each(|r, k| {
            residual_backward(
                grads,
                bias,
                &mut d.data_mut()[r.clone()],
                &dout.data()[r],
                p,
                key.offset(k),
            )
        });
        d
    }
}

/// The branch's gradient through [`residual_forward`]'s dropout (and its bias gradient).
pub(super) fn residual_backward(
    grads: &mut Grads,
    bias: Option<ParamId>,
    dx: &mut [f32],
    dout: &[f32],
    p: f32,
    key: RngKey,
) {
    match bias {
        Some(b) => bias_dropout_add_backward(dx, grads.get_mut(b), dout, p, key),
        None => dropout_backward(dx, dout, p, key),
    }
}

impl TransformerLayer {
    /// Generation: one new token per sequence (`x` is `[b, h]`) at position `pos`, through the
    /// same norms, attention projections and MLP as training, attention against `cache`.
    pub fn decode_forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: Tensor,
        cache: &mut LayerKVCache,
        pos: usize,
    ) -> Result<Tensor, CommError> {
        // Only decoders decode, and they are pre-LN (post-LN is built for BERT's encoder).
        assert_eq!(
            self.placement,
            LayerNormPlacement::PreLn,
            "KV-cache decoding is built for pre-LN decoder layers"
        );
        let no_key = RngKey::new(0);
        let (rows, h) = (x.shape()[0], x.shape()[1]);
        let (ln1, _) = self.input_layernorm.forward(params, &x);
        let proj = self
            .self_attention
            .decode_forward(params, tp, &ln1, cache, pos)?;
        let mut mid = Tensor::for_overwrite(&[rows, h]);
        let bias = self.self_attention.proj_bias;
        residual_forward(
            params,
            bias,
            mid.data_mut(),
            proj.data(),
            x.data(),
            0.0,
            no_key,
        );
        let (ln2, _) = self.pre_mlp_layernorm.forward(params, &mid);
        let at = TokenRows {
            first: 0,
            seq_length: 1,
        };
        let (y, _) = self
            .mlp
            .forward(params, tp, &ln2, at, &StepContext::eval())?;
        let mut out = Tensor::for_overwrite(&[rows, h]);
        let b2 = self.mlp.fc2_bias();
        residual_forward(
            params,
            b2,
            out.data_mut(),
            y.data(),
            mid.data(),
            0.0,
            no_key,
        );
        Ok(out)
    }
}

/// The layer's feed-forward block: the dense MLP, or a mixture of experts.
pub enum FeedForward {
    Dense(MLP),
    MoE(Box<MoELayer>),
}

pub enum FeedForwardSaved {
    Dense(MLPSaved),
    MoE(Box<MoESaved>),
}

impl FeedForwardSaved {
    pub fn size_in_bytes(&self) -> usize {
        match self {
            FeedForwardSaved::Dense(s) => s.size_in_bytes(),
            FeedForwardSaved::MoE(s) => s.size_in_bytes(),
        }
    }
}

impl FeedForward {
    /// The storage type of the normalized input: the dense MLP's fc1 is its only reader
    /// ([`linear_input_dtype`]); an MoE router reads its input in f32.
    pub fn input_dtype(&self) -> DType {
        match self {
            FeedForward::Dense(_) => linear_input_dtype(),
            FeedForward::MoE(_) => DType::F32,
        }
    }

    /// The output bias the residual's bias-dropout-add applies (dense MLP with biases only).
    pub fn fc2_bias(&self) -> Option<ParamId> {
        match self {
            FeedForward::Dense(m) => m.fc2_bias,
            FeedForward::MoE(_) => None,
        }
    }

    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        rows: TokenRows,
        ctx: &StepContext,
    ) -> Result<(Tensor, FeedForwardSaved), CommError> {
        Ok(match self {
            FeedForward::Dense(m) => {
                let (y, s) = m.forward(params, tp, x, ctx)?;
                (y, FeedForwardSaved::Dense(s))
            }
            FeedForward::MoE(m) => {
                let (y, s) = m.forward(params, tp, x, rows, ctx)?;
                (y, FeedForwardSaved::MoE(Box::new(s)))
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: &FeedForwardSaved,
        x: &Tensor,
        dout: Tensor,
        ctx: &StepContext,
    ) -> Result<Tensor, CommError> {
        match (self, saved) {
            (FeedForward::Dense(m), FeedForwardSaved::Dense(s)) => {
                m.backward(params, grads, tp, s, x, dout)
            }
            (FeedForward::MoE(m), FeedForwardSaved::MoE(s)) => {
                m.backward(params, grads, tp, s, x, &dout, ctx)
            }
            _ => panic!("backward of a feed-forward state made by another block"),
        }
    }
}

/// `a += b` on tensors (residual gradients).
pub(crate) fn add_inplace(a: &mut Tensor, b: &Tensor) {
    megatron_tensor::cpu::reduce::add_inplace(a.data_mut(), b.data());
}
