//! T5's layer (megatron-core's T5 encoder and decoder layer specs, Hugging Face's `T5Block`):
//! pre-norm blocks with residual dropout — self-attention (with the stack's relative bias),
//! in the decoder cross-attention to the encoder output, then the MLP. Saves the residual
//! stream before each norm and the norms' statistics; the norms' outputs are recomputed in
//! backward, as `TransformerLayer` does. Under sequence parallelism the residual stream,
//! norms and dropout hold this rank's block of rows; the attention and MLP linears gather
//! and reduce-scatter them.

use super::attention::{SelfKV, T5Attention, T5AttentionKind, T5AttentionSaved, T5AttentionShape};
use crate::params::{Grads, Init, Params};
use crate::tensor_parallel::Tp;
use crate::transformer::config::TransformerConfig;
use crate::transformer::layer::{add_inplace, DropoutRows, LayerNormSaved, Norm};
use crate::transformer::mlp::{MLPSaved, MLP};
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::{dropout_add_forward, dropout_backward};
use megatron_tensor::Tensor;

/// Which stack a layer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum T5Stack {
    Encoder,
    Decoder,
}

pub struct T5Layer {
    /// Number in the dropout streams (encoder layers first, then the decoder's).
    pub stream: usize,
    pub input_layernorm: Norm,
    pub self_attention: T5Attention,
    /// Decoder: `pre_cross_attn_layernorm` and `cross_attention`.
    pub cross: Option<(Norm, T5Attention)>,
    pub pre_mlp_layernorm: Norm,
    pub mlp: MLP,
    hidden_dropout: f32,
}

pub struct T5LayerSaved {
    input: Tensor,
    ln1: LayerNormSaved,
    attn: T5AttentionSaved,
    /// After the self-attention residual.
    mid: Tensor,
    cross: Option<(LayerNormSaved, T5AttentionSaved, Tensor)>,
    ln3: LayerNormSaved,
    mlp: MLPSaved,
}

impl T5LayerSaved {
    pub fn size_in_bytes(&self) -> usize {
        self.input.size_in_bytes()
            + self.ln1.size_in_bytes()
            + self.attn.size_in_bytes()
            + self.mid.size_in_bytes()
            + self.cross.as_ref().map_or(0, |(l, a, t)| {
                l.size_in_bytes() + a.size_in_bytes() + t.size_in_bytes()
            })
            + self.ln3.size_in_bytes()
            + self.mlp.size_in_bytes()
    }
}

const SITE_SELF: u64 = 20;
const SITE_CROSS: u64 = 21;
const SITE_MLP: u64 = 22;

/// The residual stream's inputs of one call: the layer's states and, in the decoder, the
/// encoder output with its lengths.
pub struct T5LayerInputs<'a> {
    pub shape: T5AttentionShape,
    /// This rank's heads' self-attention bias `[heads, t, t]`.
    pub bias: &'a [f32],
    /// Lengths of the layer's own sequences (self-attention keys).
    pub self_lens: &'a [usize],
    /// Decoder: the encoder output `[b * t_enc, hidden]`, its lengths and `t_enc`.
    pub memory: Option<(&'a Tensor, &'a [usize], usize)>,
}

/// Gradients of one layer's inputs.
pub struct T5LayerGrads {
    pub dx: Tensor,
    pub dmemory: Option<Tensor>,
    pub dbias: Vec<f32>,
}

impl T5Layer {
    /// `cfg` gives the sizes (`kv_channels` the head size), norms, activation and inits;
    /// `scale` the attention scores' factor.
    pub fn new(
        cfg: &TransformerConfig,
        stack: T5Stack,
        layer: usize,
        stream: usize,
        scale: f32,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let h = cfg.hidden_size;
        let p = match stack {
            T5Stack::Encoder => format!("encoder.layers.{layer}"),
            T5Stack::Decoder => format!("decoder.layers.{layer}"),
        };
        let norm = |name: &str, params: &mut Params, inits: &mut Vec<Init>| {
            Norm::new(
                cfg.normalization,
                &format!("{p}.{name}"),
                h,
                cfg.layernorm_epsilon,
                params,
                inits,
            )
        };
        let heads = (cfg.num_attention_heads, cfg.head_dim());
        let stds = (cfg.init_method_std, cfg.output_layer_init_std());
        let attn = |kind, name: &str, params: &mut Params, inits: &mut Vec<Init>| {
            T5Attention::new(
                kind,
                &format!("{p}.{name}"),
                h,
                heads,
                stds,
                scale,
                cfg.attention_dropout,
                stream,
                params,
                inits,
            )
        };
        let input_layernorm = norm("input_layernorm", params, inits);
        let self_kind = match stack {
            T5Stack::Encoder => T5AttentionKind::EncoderSelf,
            T5Stack::Decoder => T5AttentionKind::DecoderSelf,
        };
        let self_attention = attn(self_kind, "self_attention", params, inits);
        let cross = (stack == T5Stack::Decoder).then(|| {
            let n = norm("pre_cross_attn_layernorm", params, inits);
            (
                n,
                attn(T5AttentionKind::Cross, "cross_attention", params, inits),
            )
        });
        let pre_mlp_layernorm = norm("pre_mlp_layernorm", params, inits);
        let mlp = MLP::new_named(
            cfg,
            &format!("{p}.mlp"),
            cfg.ffn_hidden_size,
            cfg.add_bias_linear,
            params,
            inits,
        );
        T5Layer {
            stream,
            input_layernorm,
            self_attention,
            cross,
            pre_mlp_layernorm,
            mlp,
            hidden_dropout: cfg.hidden_dropout,
        }
    }

    /// `residual + dropout(branch)` over this rank's rows `at`.
    fn residual(
        &self,
        branch: &Tensor,
        residual: &Tensor,
        ctx: &StepContext,
        at: &DropoutRows,
        site: u64,
    ) -> Tensor {
        let mut out = Tensor::for_overwrite(residual.shape());
        let p = ctx.p(self.hidden_dropout);
        let key = at.key(ctx, self.stream, site);
        at.each(|r, k| {
            dropout_add_forward(
                &mut out.data_mut()[r.clone()],
                &branch.data()[r.clone()],
                &residual.data()[r],
                p,
                key.offset(k),
            )
        });
        out
    }

    fn branch_grad(&self, dout: &Tensor, ctx: &StepContext, at: &DropoutRows, site: u64) -> Tensor {
        let mut d = Tensor::for_overwrite(dout.shape());
        let p = ctx.p(self.hidden_dropout);
        let key = at.key(ctx, self.stream, site);
        at.each(|r, k| {
            dropout_backward(
                &mut d.data_mut()[r.clone()],
                &dout.data()[r],
                p,
                key.offset(k),
            )
        });
        d
    }

    fn cross_shape(s: T5AttentionShape, t_enc: usize) -> T5AttentionShape {
        T5AttentionShape { tk: t_enc, ..s }
    }

    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: Tensor,
        inp: &T5LayerInputs,
        ctx: &StepContext,
    ) -> Result<(Tensor, T5LayerSaved), CommError> {
        let s = inp.shape;
        let at = &DropoutRows::of_block(tp, s.b, s.tq, x.shape()[0], x.shape()[1]);
        let (n1, ln1) = self.input_layernorm.forward(params, &x);
        let (a, attn) = self.self_attention.forward(
            params,
            tp,
            &n1,
            None,
            Some(inp.bias),
            Some(inp.self_lens),
            s,
            ctx,
        )?;
        drop(n1);
        let mid = self.residual(&a, &x, ctx, at, SITE_SELF);
        drop(a);
        let (h2, cross) = match (&self.cross, inp.memory) {
            (Some((norm, attn)), Some((mem, lens, t_enc))) => {
                let (n2, ln2) = norm.forward(params, &mid);
                let cs = Self::cross_shape(s, t_enc);
                let (c, saved) =
                    attn.forward(params, tp, &n2, Some(mem), None, Some(lens), cs, ctx)?;
                let h2 = self.residual(&c, &mid, ctx, at, SITE_CROSS);
                (h2, Some((ln2, saved, Tensor::for_overwrite(&[0]))))
            }
            (None, None) => (Tensor::for_overwrite(&[0]), None),
            _ => panic!("a decoder layer reads the encoder output, an encoder layer does not"),
        };
        // The MLP block's input: after the cross-attention residual (decoder) or `mid`.
        let before_mlp = if cross.is_some() { &h2 } else { &mid };
        let (n3, ln3) = self.pre_mlp_layernorm.forward(params, before_mlp);
        let (f, mlp) = self.mlp.forward(params, tp, &n3, ctx)?;
        drop(n3);
        let out = self.residual(&f, before_mlp, ctx, at, SITE_MLP);
        let cross = cross.map(|(l, a, _)| (l, a, h2));
        Ok((
            out,
            T5LayerSaved {
                input: x,
                ln1,
                attn,
                mid,
                cross,
                ln3,
                mlp,
            },
        ))
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: T5LayerSaved,
        dout: Tensor,
        inp: &T5LayerInputs,
        ctx: &StepContext,
    ) -> Result<T5LayerGrads, CommError> {
        let s = inp.shape;
        let at = &DropoutRows::of_block(tp, s.b, s.tq, dout.shape()[0], dout.shape()[1]);
        let before_mlp = saved.cross.as_ref().map_or(&saved.mid, |c| &c.2);
        let df = self.branch_grad(&dout, ctx, at, SITE_MLP);
        let (n3, _) = self.pre_mlp_layernorm.forward(params, before_mlp);
        let dn3 = self.mlp.backward(params, grads, tp, &saved.mlp, &n3, df)?;
        drop(n3);
        let mut dh = self
            .pre_mlp_layernorm
            .backward(params, grads, &saved.ln3, before_mlp, &dn3);
        add_inplace(&mut dh, &dout);
        drop(dout);
        let mut dmemory = None;
        if let (Some((norm, attn)), Some((ln2, csaved, _)), Some((mem, _, t_enc))) =
            (&self.cross, saved.cross, inp.memory)
        {
            let dc = self.branch_grad(&dh, ctx, at, SITE_CROSS);
            let (n2, _) = norm.forward(params, &saved.mid);
            let cs = Self::cross_shape(s, t_enc);
            let (dn2, dmem, _) = attn.backward(
                params,
                grads,
                tp,
                csaved,
                &n2,
                Some(mem),
                dc,
                false,
                cs,
                ctx,
            )?;
            drop(n2);
            let mut dmid = norm.backward(params, grads, &ln2, &saved.mid, &dn2);
            add_inplace(&mut dmid, &dh);
            dh = dmid;
            dmemory = dmem;
        }
        let da = self.branch_grad(&dh, ctx, at, SITE_SELF);
        let (n1, _) = self.input_layernorm.forward(params, &saved.input);
        let (dn1, _, dbias) = self
            .self_attention
            .backward(params, grads, tp, saved.attn, &n1, None, da, true, s, ctx)?;
        drop(n1);
        let mut dx = self
            .input_layernorm
            .backward(params, grads, &saved.ln1, &saved.input, &dn1);
        add_inplace(&mut dx, &dh);
        Ok(T5LayerGrads {
            dx,
            dmemory,
            dbias: dbias.expect("self-attention returns its bias gradient"),
        })
    }

    /// Generation: one decoder position per sequence (`x`: `[b, hidden]`) at `pos`, without
    /// dropout; the self-attention's keys and values join `cache`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_step(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: Tensor,
        cache: &mut T5LayerCache,
        pos: usize,
        bias: &[f32],
        enc_lens: &[usize],
    ) -> Result<Tensor, CommError> {
        let (n1, _) = self.input_layernorm.forward(params, &x);
        let a = self
            .self_attention
            .decode_self(params, tp, &n1, &mut cache.self_kv, pos, bias)?;
        let mut h = x;
        add_inplace(&mut h, &a);
        if let Some((norm, attn)) = &self.cross {
            let (n2, _) = norm.forward(params, &h);
            let c = attn.decode_cross(
                params,
                tp,
                &n2,
                (&cache.cross.0, &cache.cross.1),
                enc_lens,
                cache.te,
            )?;
            add_inplace(&mut h, &c);
        }
        let (n3, _) = self.pre_mlp_layernorm.forward(params, &h);
        let (f, _) = self.mlp.forward(params, tp, &n3, &StepContext::eval())?;
        add_inplace(&mut h, &f);
        Ok(h)
    }

    /// A decoder layer's cache for `b` sequences of up to `max_t` positions, with the
    /// cross-attention's keys and values of the encoder output `memory` (`te` rows each).
    pub fn decode_cache(
        &self,
        params: &Params,
        tp: &mut Tp,
        memory: &Tensor,
        b: usize,
        te: usize,
        max_t: usize,
    ) -> Result<T5LayerCache, CommError> {
        let (_, attn) = self.cross.as_ref().expect("a decoder layer decodes");
        Ok(T5LayerCache {
            self_kv: self.self_attention.self_kv(b, max_t),
            cross: attn.cross_kv(params, tp, memory)?,
            te,
        })
    }
}

/// What a decoder layer keeps between decoding steps: its self-attention's keys and values
/// and the cross-attention's of the encoder output.
pub struct T5LayerCache {
    self_kv: SelfKV,
    cross: (Tensor, Tensor),
    te: usize,
}
