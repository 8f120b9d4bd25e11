//! `TransformerLayer`: pre-LayerNorm attention and MLP blocks with fused bias-dropout-add
//! residuals. Saves its input, the two residual-stream LayerNorm statistics and what the
//! sub-blocks save; LayerNorm outputs are recomputed in backward (cheap, memory-bound).
//!
//! Under sequence parallelism the residual stream, LayerNorms and dropout hold this rank's block
//! of token rows; dropout masks are numbered by global element index (the block's first row is
//! an offset into the stream), so every TP size and either mode draws the TP = 1 masks.

use super::attention::{SelfAttention, SelfAttentionSaved};
use super::config::TransformerConfig;
use super::mlp::{MLPSaved, MLP};
use super::saved::{keep, restore};
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use crate::tensor_parallel::Tp;
use megatron_comm::CommError;
use megatron_tensor::cpu::layernorm::LayerNormDims;
use megatron_tensor::cpu::{
    bias_dropout_add_backward, bias_dropout_add_forward, layernorm_backward, layernorm_forward,
    AttentionMask,
};
use megatron_tensor::Tensor;

/// A LayerNorm's parameters.
#[derive(Clone, Copy)]
pub struct LayerNorm {
    pub weight: ParamId,
    pub bias: ParamId,
    pub eps: f32,
}

/// Saved LayerNorm statistics per row.
pub struct LayerNormSaved {
    pub mean: Tensor,
    pub rstd: Tensor,
}

impl LayerNorm {
    pub fn new(name: &str, h: usize, eps: f32, params: &mut Params, inits: &mut Vec<Init>) -> Self {
        let weight = params.add_sharded(
            inits,
            format!("{name}.weight"),
            &[h],
            false,
            Init::Const(1.0),
            Sharding::ReplicatedSequenceParallel,
        );
        let bias = params.add_sharded(
            inits,
            format!("{name}.bias"),
            &[h],
            false,
            Init::Const(0.0),
            Sharding::ReplicatedSequenceParallel,
        );
        LayerNorm { weight, bias, eps }
    }

    pub fn forward(&self, params: &Params, x: &Tensor) -> (Tensor, LayerNormSaved) {
        let (n, h) = (x.shape()[0], x.shape()[1]);
        let mut out = Tensor::for_overwrite(&[n, h]);
        let mut mean = Tensor::for_overwrite(&[n]);
        let mut rstd = Tensor::for_overwrite(&[n]);
        let d = LayerNormDims {
            rows: n,
            cols: h,
            eps: self.eps,
        };
        layernorm_forward(
            out.data_mut(),
            mean.data_mut(),
            rstd.data_mut(),
            x.data(),
            &params.get(self.weight),
            &params.get(self.bias),
            d,
        );
        (out, LayerNormSaved { mean, rstd })
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &LayerNormSaved,
        x: &Tensor,
        dout: &Tensor,
    ) -> Tensor {
        let (n, h) = (x.shape()[0], x.shape()[1]);
        let mut dx = Tensor::for_overwrite(&[n, h]);
        let [dw, db] = grads.many_mut([self.weight, self.bias]);
        let d = LayerNormDims {
            rows: n,
            cols: h,
            eps: self.eps,
        };
        layernorm_backward(
            dx.data_mut(),
            dw,
            db,
            dout.data(),
            x.data(),
            &params.get(self.weight),
            saved.mean.data(),
            saved.rstd.data(),
            d,
        );
        dx
    }
}

pub struct TransformerLayer {
    pub layer: usize,
    pub input_layernorm: LayerNorm,
    pub self_attention: SelfAttention,
    pub pre_mlp_layernorm: LayerNorm,
    pub mlp: MLP,
    hidden_dropout: f32,
}

pub struct TransformerLayerSaved {
    pub input: Tensor,
    pub ln1: LayerNormSaved,
    pub attn: SelfAttentionSaved,
    pub mid: Tensor,
    pub ln2: LayerNormSaved,
    pub mlp: MLPSaved,
}

impl TransformerLayerSaved {
    /// Bytes this layer keeps in flight for one micro-batch.
    pub fn size_in_bytes(&self) -> usize {
        self.input.size_in_bytes()
            + self.ln1.mean.size_in_bytes() * 2
            + self.attn.size_in_bytes()
            + self.mid.size_in_bytes()
            + self.ln2.mean.size_in_bytes() * 2
            + self.mlp.fc1_pre.size_in_bytes()
    }
}

const SITE_ATTN_RESIDUAL: u64 = 2;
const SITE_MLP_RESIDUAL: u64 = 3;

impl TransformerLayer {
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let p = format!("decoder.layers.{layer}");
        let input_layernorm = LayerNorm::new(
            &format!("{p}.input_layernorm"),
            h,
            cfg.layernorm_epsilon,
            params,
            inits,
        );
        let self_attention = SelfAttention::new(cfg, layer, params, inits);
        let pre_mlp_layernorm = LayerNorm::new(
            &format!("{p}.pre_mlp_layernorm"),
            h,
            cfg.layernorm_epsilon,
            params,
            inits,
        );
        let mlp = MLP::new(cfg, layer, params, inits);
        TransformerLayer {
            layer,
            input_layernorm,
            self_attention,
            pre_mlp_layernorm,
            mlp,
            hidden_dropout: cfg.hidden_dropout,
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
        let (rows, h) = (x.shape()[0], x.shape()[1]);
        let (lo, _) = tp.sequence_shard(b * t);
        let p = ctx.p(self.hidden_dropout);
        let (ln1_out, ln1) = self.input_layernorm.forward(params, &x);
        let (proj, attn) = self
            .self_attention
            .forward(params, tp, &ln1_out, b, t, ctx, mask)?;
        drop(ln1_out);
        let mut mid = Tensor::for_overwrite(&[rows, h]);
        let key = ctx
            .site_for(self.layer, SITE_ATTN_RESIDUAL, t * h)
            .offset((lo * h) as u64);
        bias_dropout_add_forward(
            mid.data_mut(),
            proj.data(),
            &params.get(self.self_attention.proj_bias),
            x.data(),
            p,
            key,
        );
        drop(proj);
        let (ln2_out, ln2) = self.pre_mlp_layernorm.forward(params, &mid);
        let (y, mlp) = self.mlp.forward(params, tp, &ln2_out)?;
        drop(ln2_out);
        let mut out = Tensor::for_overwrite(&[rows, h]);
        let key = ctx
            .site_for(self.layer, SITE_MLP_RESIDUAL, t * h)
            .offset((lo * h) as u64);
        bias_dropout_add_forward(
            out.data_mut(),
            y.data(),
            &params.get(self.mlp.fc2_bias),
            mid.data(),
            p,
            key,
        );
        Ok((
            out,
            TransformerLayerSaved {
                input: keep(x),
                ln1,
                attn,
                mid: keep(mid),
                ln2,
                mlp,
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
        let (rows, h) = (dout.shape()[0], dout.shape()[1]);
        let (lo, _) = tp.sequence_shard(b * t);
        let p = ctx.p(self.hidden_dropout);
        // MLP residual: d(mid) gets dout directly plus the MLP branch.
        let mut dy = Tensor::for_overwrite(&[rows, h]);
        bias_dropout_add_backward(
            dy.data_mut(),
            grads.get_mut(self.mlp.fc2_bias),
            dout.data(),
            p,
            ctx.site_for(self.layer, SITE_MLP_RESIDUAL, t * h)
                .offset((lo * h) as u64),
        );
        let mid = restore(&saved.mid);
        let (ln2_out, _) = self.pre_mlp_layernorm.forward(params, &mid);
        let dln2 = self
            .mlp
            .backward(params, grads, tp, &saved.mlp, &ln2_out, dy)?;
        drop(ln2_out);
        let mut dmid = self
            .pre_mlp_layernorm
            .backward(params, grads, &saved.ln2, &mid, &dln2);
        drop(dln2);
        add_inplace(&mut dmid, &dout);
        drop(dout);
        // Attention residual.
        let mut dproj = Tensor::for_overwrite(&[rows, h]);
        bias_dropout_add_backward(
            dproj.data_mut(),
            grads.get_mut(self.self_attention.proj_bias),
            dmid.data(),
            p,
            ctx.site_for(self.layer, SITE_ATTN_RESIDUAL, t * h)
                .offset((lo * h) as u64),
        );
        drop(mid);
        let input = restore(&saved.input);
        let (ln1_out, _) = self.input_layernorm.forward(params, &input);
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

fn add_inplace(a: &mut Tensor, b: &Tensor) {
    megatron_tensor::cpu::reduce::add_inplace(a.data_mut(), b.data());
}
