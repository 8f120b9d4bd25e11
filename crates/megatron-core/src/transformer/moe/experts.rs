//! The experts this rank holds (megatron-core's `GroupedMLP`): each is the model's MLP (GELU,
//! or SwiGLU on a fused `[gate; up]` fc1), run on a contiguous block of one buffer of token rows
//! sorted by local expert — one pass over the blocks, no per-expert gather or copy.

use super::super::config::{Activation, TransformerConfig};
use crate::params::{Grads, Init, ParamId, Params, Sharding};
use megatron_tensor::cpu::{
    gelu_backward, gelu_forward, matmul, matmul_forward, swiglu_backward, swiglu_forward,
    MatmulDims,
};
use megatron_tensor::Tensor;
use std::ops::Range;

pub struct Expert {
    pub fc1: ParamId,
    pub fc2: ParamId,
}

pub struct GroupedMLP {
    /// This rank's experts, in global order.
    pub experts: Vec<Expert>,
    /// Global index of the first.
    pub first: usize,
    activation: Activation,
    hidden: usize,
    /// This rank's slice of each expert's FFN width.
    ffn: usize,
}

impl GroupedMLP {
    /// Registers the weights of global experts `which` of layer `layer` under megatron-core's
    /// names with global expert numbers, so checkpoints do not depend on the expert layout.
    pub fn new(
        cfg: &TransformerConfig,
        layer: usize,
        which: Range<usize>,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let m = cfg.moe.as_ref().expect("an MoE layer needs --num-experts");
        let (h, f) = (cfg.hidden_size, m.ffn_hidden_size);
        // Under expert tensor parallelism fc1 is column-parallel (SwiGLU's [gate; up] split
        // blockwise) and fc2 row-parallel, as in the dense MLP.
        let (fc1_rows, fc1_split) = match cfg.activation {
            Activation::Gelu => (f, Sharding::ExpertSplit(0)),
            Activation::SwiGLU => (2 * f, Sharding::ExpertSplitChunks(2)),
        };
        let etp = params.experts.etp.max(1);
        let first = which.start;
        let experts = which
            .map(|e| {
                let q = format!("decoder.layers.{layer}.mlp.experts.local_experts.{e}");
                Expert {
                    fc1: params.add_sharded(
                        inits,
                        format!("{q}.linear_fc1.weight"),
                        &[fc1_rows, h],
                        true,
                        Init::Normal(cfg.init_method_std),
                        fc1_split,
                    ),
                    fc2: params.add_sharded(
                        inits,
                        format!("{q}.linear_fc2.weight"),
                        &[h, f],
                        true,
                        Init::Normal(cfg.output_layer_init_std()),
                        Sharding::ExpertSplit(1),
                    ),
                }
            })
            .collect();
        GroupedMLP {
            experts,
            first,
            activation: cfg.activation,
            hidden: h,
            ffn: f / etp,
        }
    }

    fn fc1_width(&self) -> usize {
        match self.activation {
            Activation::Gelu => self.ffn,
            Activation::SwiGLU => 2 * self.ffn,
        }
    }

    /// Row blocks of each local expert in a buffer of `counts[l]` rows per expert.
    fn blocks(counts: &[usize]) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        counts.iter().enumerate().scan(0, |at, (l, &m)| {
            let r = *at..*at + m;
            *at += m;
            Some((l, r))
        })
    }

    fn activate(&self, act: &mut [f32], h1: &[f32]) {
        match self.activation {
            Activation::Gelu => gelu_forward(act, h1),
            Activation::SwiGLU => swiglu_forward(act, h1, self.ffn),
        }
    }

    /// `x` holds `counts[l]` rows for local expert `l`, in order; returns the experts' outputs
    /// (same rows) and their fc1 outputs (what backward needs).
    pub fn forward(&self, params: &Params, x: &Tensor, counts: &[usize]) -> (Tensor, Tensor) {
        let (h, f, f1) = (self.hidden, self.ffn, self.fc1_width());
        let n = x.shape()[0];
        let mut h1 = Tensor::for_overwrite(&[n, f1]);
        let mut act = Tensor::for_overwrite(&[n, f]);
        let mut y = Tensor::for_overwrite(&[n, h]);
        for (l, r) in Self::blocks(counts) {
            if r.is_empty() {
                continue;
            }
            let (m, ex) = (r.len(), &self.experts[l]);
            let h1b = &mut h1.data_mut()[r.start * f1..r.end * f1];
            let xb = &x.data()[r.start * h..r.end * h];
            matmul_forward(h1b, xb, &params.get(ex.fc1), None, m, h, f1);
            let ab = &mut act.data_mut()[r.start * f..r.end * f];
            self.activate(ab, &h1.data()[r.start * f1..r.end * f1]);
            let yb = &mut y.data_mut()[r.start * h..r.end * h];
            matmul_forward(
                yb,
                &act.data()[r.start * f..r.end * f],
                &params.get(ex.fc2),
                None,
                m,
                f,
                h,
            );
        }
        (y, h1)
    }

    /// Gradients of the experts' weights from `dy` (rows as in forward); returns `dx`.
    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        x: &Tensor,
        h1: &Tensor,
        dy: &Tensor,
        counts: &[usize],
    ) -> Tensor {
        let (h, f, f1) = (self.hidden, self.ffn, self.fc1_width());
        let n = x.shape()[0];
        let mut dx = Tensor::for_overwrite(&[n, h]);
        let mut act = vec![0.0f32; 0];
        let mut dact = vec![0.0f32; 0];
        let mut dh1 = vec![0.0f32; 0];
        for (l, r) in Self::blocks(counts) {
            if r.is_empty() {
                continue;
            }
            let (m, ex) = (r.len(), &self.experts[l]);
            let h1b = &h1.data()[r.start * f1..r.end * f1];
            let dyb = &dy.data()[r.start * h..r.end * h];
            let xb = &x.data()[r.start * h..r.end * h];
            act.resize(m * f, 0.0);
            self.activate(&mut act, h1b);
            // fc2: dW2 += dy^T act, dact = dy W2.
            matmul(
                grads.get_mut(ex.fc2),
                dyb,
                &act,
                MatmulDims::new(h, f, m).ta().acc(),
            );
            dact.resize(m * f, 0.0);
            matmul(
                &mut dact,
                dyb,
                &params.get(ex.fc2),
                MatmulDims::new(m, f, h),
            );
            dh1.resize(m * f1, 0.0);
            match self.activation {
                Activation::Gelu => gelu_backward(&mut dh1, &dact, h1b),
                Activation::SwiGLU => swiglu_backward(&mut dh1, &dact, h1b, f),
            }
            // fc1: dW1 += dh1^T x, dx = dh1 W1.
            matmul(
                grads.get_mut(ex.fc1),
                &dh1,
                xb,
                MatmulDims::new(f1, h, m).ta().acc(),
            );
            matmul(
                &mut dx.data_mut()[r.start * h..r.end * h],
                &dh1,
                &params.get(ex.fc1),
                MatmulDims::new(m, h, f1),
            );
        }
        dx
    }
}
