//! The post-LayerNorm layer (the original BERT, Hugging Face's `BertLayer`):
//! `mid = LN1(x + dropout(attn(x) + b))`, `out = LN2(mid + dropout(mlp(mid) + b))`. Saves the
//! input, the two residual sums the norms read and their statistics; the first norm's output
//! (the MLP's input) is recomputed in backward, as the pre-LN layer recomputes its norms.
//! The norms write the residual stream (bf16 under `--bf16`): in this layout it is their output.

use super::layer::{
    add_inplace, DropoutRows, TransformerLayer, TransformerLayerSaved, SITE_ATTN_RESIDUAL,
    SITE_MLP_RESIDUAL,
};
use super::moe::TokenRows;
use super::saved::readable;
use super::step::StepContext;
use crate::params::{Grads, Params};
use crate::tensor_parallel::Tp;
use megatron_comm::CommError;
use megatron_tensor::cpu::AttentionMask;
use megatron_tensor::Tensor;

impl TransformerLayer {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_post_ln(
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
        let (proj, attn) = self
            .self_attention
            .forward(params, tp, &x, b, t, ctx, mask)?;
        let at = DropoutRows::new(tp, lo, rows, t, h);
        let bias = self.self_attention.proj_bias;
        let mid_sum = self.residual_add(params, (&proj, bias), &x, &at, ctx, SITE_ATTN_RESIDUAL);
        drop(proj);
        let (mid, ln1) = self
            .input_layernorm
            .forward_as(params, &mid_sum, self.residual);
        let moe_rows = TokenRows {
            first: lo,
            seq_length: t,
        };
        let (y, mlp) = self.mlp.forward(params, tp, &mid, moe_rows, ctx)?;
        let bias = self.mlp.fc2_bias();
        let out_sum = self.residual_add(params, (&y, bias), &mid, &at, ctx, SITE_MLP_RESIDUAL);
        drop((y, mid));
        let (out, ln2) = self
            .pre_mlp_layernorm
            .forward_as(params, &out_sum, self.residual);
        Ok((
            out,
            TransformerLayerSaved {
                input: x,
                ln1,
                attn,
                mid: mid_sum,
                ln2,
                mlp,
                post: Some(out_sum),
            },
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_post_ln(
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
        let out_sum = readable(saved.post.as_ref().expect("a post-LN layer's saved state"));
        let dout_sum = self
            .pre_mlp_layernorm
            .backward(params, grads, &saved.ln2, &out_sum, &dout);
        drop((out_sum, dout));
        // The MLP branch's gradient through its dropout (and its bias gradient).
        let at = DropoutRows::new(tp, lo, rows, t, h);
        let bias = self.mlp.fc2_bias();
        let dy = self.residual_branch_grad(grads, bias, &dout_sum, &at, ctx, SITE_MLP_RESIDUAL);
        let mid_sum = readable(&saved.mid);
        let (mid, _) = self
            .input_layernorm
            .forward_as(params, &mid_sum, self.residual);
        let mut dmid = self
            .mlp
            .backward(params, grads, tp, &saved.mlp, &mid, dy, ctx)?;
        drop(mid);
        add_inplace(&mut dmid, &dout_sum);
        drop(dout_sum);
        let dmid_sum = self
            .input_layernorm
            .backward(params, grads, &saved.ln1, &mid_sum, &dmid);
        drop((mid_sum, dmid));
        let bias = self.self_attention.proj_bias;
        let dproj = self.residual_branch_grad(grads, bias, &dmid_sum, &at, ctx, SITE_ATTN_RESIDUAL);
        let input = readable(&saved.input);
        let mut dx = self.self_attention.backward(
            params,
            grads,
            tp,
            &saved.attn,
            &input,
            dproj,
            b,
            t,
            ctx,
            mask,
        )?;
        add_inplace(&mut dx, &dmid_sum);
        Ok(dx)
    }
}
