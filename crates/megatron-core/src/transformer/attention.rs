//! `SelfAttention`: fused QKV projection, causal core attention, output projection.
//! The output projection's bias is left to the layer's fused bias-dropout-add.

use super::config::TransformerConfig;
use super::step::StepContext;
use crate::params::{Grads, Init, ParamId, Params};
use megatron_tensor::cpu::{
    attention_backward, attention_forward, matmul_backward, matmul_forward, AttentionDims,
    AttentionMask,
};
use megatron_tensor::Tensor;

pub struct SelfAttention {
    pub layer: usize,
    pub qkv_weight: ParamId,
    pub qkv_bias: ParamId,
    pub proj_weight: ParamId,
    pub proj_bias: ParamId,
    hidden: usize,
    heads: usize,
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
        let p = format!("decoder.layers.{layer}.self_attention");
        let out_std = cfg.output_layer_init_std();
        let mut reg = |name: &str, shape: &[usize], wd: bool, init: Init| {
            params.add(inits, format!("{p}.{name}"), shape, wd, init)
        };
        SelfAttention {
            layer,
            qkv_weight: reg(
                "linear_qkv.weight",
                &[3 * h, h],
                true,
                Init::Normal(cfg.init_method_std),
            ),
            qkv_bias: reg("linear_qkv.bias", &[3 * h], false, Init::Const(0.0)),
            proj_weight: reg("linear_proj.weight", &[h, h], true, Init::Normal(out_std)),
            proj_bias: reg("linear_proj.bias", &[h], false, Init::Const(0.0)),
            hidden: h,
            heads: cfg.num_attention_heads,
            attention_dropout: cfg.attention_dropout,
        }
    }

    fn dims(&self, b: usize, t: usize, ctx: &StepContext) -> AttentionDims {
        AttentionDims {
            b,
            t,
            heads: self.heads,
            head_dim: self.hidden / self.heads,
            causal: true,
            dropout: ctx.p(self.attention_dropout),
        }
    }

    /// `x` is the layer-normed input `[b*t, h]`; returns the output projection without its bias.
    pub fn forward(
        &self,
        params: &Params,
        x: &Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> (Tensor, SelfAttentionSaved) {
        let (n, h) = (b * t, self.hidden);
        let mut qkv = Tensor::for_overwrite(&[n, 3 * h]);
        matmul_forward(
            qkv.data_mut(),
            x.data(),
            params.get(self.qkv_weight),
            Some(params.get(self.qkv_bias)),
            n,
            h,
            3 * h,
        );
        let mut attn = Tensor::for_overwrite(&[n, h]);
        let mut lse = Tensor::for_overwrite(&[b, self.heads, t]);
        let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.heads * t * t);
        attention_forward(
            attn.data_mut(),
            lse.data_mut(),
            qkv.data(),
            mask,
            self.dims(b, t, ctx),
            key,
        );
        let mut out = Tensor::for_overwrite(&[n, h]);
        matmul_forward(
            out.data_mut(),
            attn.data(),
            params.get(self.proj_weight),
            None,
            n,
            h,
            h,
        );
        (out, SelfAttentionSaved { qkv, attn, lse })
    }

    /// `dout` is the gradient of the projection output (after the layer's dropout backward);
    /// `x` the recomputed layer-normed input. Returns `dx`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        saved: &SelfAttentionSaved,
        x: &Tensor,
        dout: &Tensor,
        b: usize,
        t: usize,
        ctx: &StepContext,
        mask: AttentionMask,
    ) -> Tensor {
        let (n, h) = (b * t, self.hidden);
        let mut dattn = Tensor::for_overwrite(&[n, h]);
        matmul_backward(
            Some(dattn.data_mut()),
            grads.get_mut(self.proj_weight),
            None,
            dout.data(),
            saved.attn.data(),
            params.get(self.proj_weight),
            n,
            h,
            h,
        );
        let mut dqkv = Tensor::for_overwrite(&[n, 3 * h]);
        let key = ctx.site_for(self.layer, SITE_ATTN_DROPOUT, self.heads * t * t);
        attention_backward(
            dqkv.data_mut(),
            dattn.data(),
            saved.attn.data(),
            saved.lse.data(),
            saved.qkv.data(),
            mask,
            self.dims(b, t, ctx),
            key,
        );
        drop(dattn);
        let mut dx = Tensor::for_overwrite(&[n, h]);
        let [dw, db] = grads.many_mut([self.qkv_weight, self.qkv_bias]);
        matmul_backward(
            Some(dx.data_mut()),
            dw,
            Some(db),
            dqkv.data(),
            x.data(),
            params.get(self.qkv_weight),
            n,
            h,
            3 * h,
        );
        dx
    }
}
