//! The experts this rank holds: each is the model's MLP (GELU, or SwiGLU on a fused
//! `[gate; up]` fc1), run on a contiguous block of one buffer of token rows sorted by local
//! expert (no per-expert gather or copy). The activation runs once over the whole buffer; the
//! GEMMs of the blocks run one after the other, each on every thread (megatron-core's
//! `SequentialMLP`), or with `--moe-grouped-gemm` all at once, one block per thread
//! (`GroupedMLP`): the same bits either way.

use super::super::config::{Activation, TransformerConfig};
use crate::params::{Grads, Init, ParamId, ParamRef, Params, Sharding};
use megatron_tensor::cpu::{
    gelu_backward, gelu_forward, grouped_matmul, matmul, swiglu_backward, swiglu_forward,
    GemmProblem, MatmulDims,
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
    grouped: bool,
}

/// Splits `buf` (rows of `cols`) into the non-empty blocks' slices.
fn row_blocks<'a>(
    mut buf: &'a mut [f32],
    blocks: &[(usize, Range<usize>)],
    cols: usize,
) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut at = 0;
    for (_, r) in blocks {
        let (_, tail) = std::mem::take(&mut buf).split_at_mut((r.start - at) * cols);
        let (mine, tail) = tail.split_at_mut(r.len() * cols);
        out.push(mine);
        buf = tail;
        at = r.end;
    }
    out
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
            grouped: m.grouped_gemm,
        }
    }

    fn fc1_width(&self) -> usize {
        match self.activation {
            Activation::Gelu => self.ffn,
            Activation::SwiGLU => 2 * self.ffn,
        }
    }

    /// Non-empty row blocks of each local expert in a buffer of `counts[l]` rows per expert.
    fn blocks(counts: &[usize]) -> Vec<(usize, Range<usize>)> {
        let mut at = 0;
        let mut out = Vec::new();
        for (l, &m) in counts.iter().enumerate() {
            if m > 0 {
                out.push((l, at..at + m));
            }
            at += m;
        }
        out
    }

    /// Runs the blocks' products: one at a time on every thread, or grouped.
    fn run(&self, problems: &mut [GemmProblem<'_>]) {
        if self.grouped {
            grouped_matmul(problems);
        } else {
            for p in problems.iter_mut() {
                matmul(p.out, p.a, p.b, p.dims);
            }
        }
    }

    fn activate(&self, act: &mut [f32], h1: &[f32]) {
        match self.activation {
            Activation::Gelu => gelu_forward(act, h1),
            Activation::SwiGLU => swiglu_forward(act, h1, self.ffn),
        }
    }

    fn weights<'p>(
        &self,
        params: &'p Params,
        which: impl Fn(&Expert) -> ParamId,
    ) -> Vec<ParamRef<'p>> {
        self.experts.iter().map(|e| params.get(which(e))).collect()
    }

    /// `x` holds `counts[l]` rows for local expert `l`, in order; returns the experts' outputs
    /// (same rows) and their fc1 outputs (what backward needs).
    pub fn forward(&self, params: &Params, x: &Tensor, counts: &[usize]) -> (Tensor, Tensor) {
        let (h, f, f1) = (self.hidden, self.ffn, self.fc1_width());
        let n = x.shape()[0];
        let blocks = Self::blocks(counts);
        let (w1, w2) = (
            self.weights(params, |e| e.fc1),
            self.weights(params, |e| e.fc2),
        );
        let mut h1 = Tensor::for_overwrite(&[n, f1]);
        let mut problems: Vec<GemmProblem> = row_blocks(h1.data_mut(), &blocks, f1)
            .into_iter()
            .zip(&blocks)
            .map(|(out, (l, r))| GemmProblem {
                out,
                a: &x.data()[r.start * h..r.end * h],
                b: &w1[*l],
                dims: MatmulDims::new(r.len(), f1, h).tb(),
            })
            .collect();
        self.run(&mut problems);
        drop(problems);
        let mut act = Tensor::for_overwrite(&[n, f]);
        self.activate(act.data_mut(), h1.data());
        let mut y = Tensor::for_overwrite(&[n, h]);
        let mut problems: Vec<GemmProblem> = row_blocks(y.data_mut(), &blocks, h)
            .into_iter()
            .zip(&blocks)
            .map(|(out, (l, r))| GemmProblem {
                out,
                a: &act.data()[r.start * f..r.end * f],
                b: &w2[*l],
                dims: MatmulDims::new(r.len(), h, f).tb(),
            })
            .collect();
        self.run(&mut problems);
        drop(problems);
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
        let blocks = Self::blocks(counts);
        let (w1, w2) = (
            self.weights(params, |e| e.fc1),
            self.weights(params, |e| e.fc2),
        );
        let mut act = Tensor::for_overwrite(&[n, f]);
        self.activate(act.data_mut(), h1.data());
        let rows = |r: &Range<usize>, c: usize| r.start * c..r.end * c;
        // fc2: dW2 += dy^T act (each block its expert's gradient), dact = dy W2.
        {
            let ids: Vec<ParamId> = blocks.iter().map(|(l, _)| self.experts[*l].fc2).collect();
            let mut problems: Vec<GemmProblem> = grads
                .disjoint_mut(&ids)
                .into_iter()
                .zip(&blocks)
                .map(|(out, (_, r))| GemmProblem {
                    out,
                    a: &dy.data()[rows(r, h)],
                    b: &act.data()[rows(r, f)],
                    dims: MatmulDims::new(h, f, r.len()).ta().acc(),
                })
                .collect();
            self.run(&mut problems);
        }
        let mut dact = act;
        let mut problems: Vec<GemmProblem> = row_blocks(dact.data_mut(), &blocks, f)
            .into_iter()
            .zip(&blocks)
            .map(|(out, (l, r))| GemmProblem {
                out,
                a: &dy.data()[rows(r, h)],
                b: &w2[*l],
                dims: MatmulDims::new(r.len(), f, h),
            })
            .collect();
        self.run(&mut problems);
        drop(problems);
        let mut dh1 = Tensor::for_overwrite(&[n, f1]);
        match self.activation {
            Activation::Gelu => gelu_backward(dh1.data_mut(), dact.data(), h1.data()),
            Activation::SwiGLU => swiglu_backward(dh1.data_mut(), dact.data(), h1.data(), f),
        }
        drop(dact);
        // fc1: dW1 += dh1^T x, dx = dh1 W1.
        {
            let ids: Vec<ParamId> = blocks.iter().map(|(l, _)| self.experts[*l].fc1).collect();
            let mut problems: Vec<GemmProblem> = grads
                .disjoint_mut(&ids)
                .into_iter()
                .zip(&blocks)
                .map(|(out, (_, r))| GemmProblem {
                    out,
                    a: &dh1.data()[rows(r, f1)],
                    b: &x.data()[rows(r, h)],
                    dims: MatmulDims::new(f1, h, r.len()).ta().acc(),
                })
                .collect();
            self.run(&mut problems);
        }
        let mut dx = Tensor::for_overwrite(&[n, h]);
        let mut problems: Vec<GemmProblem> = row_blocks(dx.data_mut(), &blocks, h)
            .into_iter()
            .zip(&blocks)
            .map(|(out, (l, r))| GemmProblem {
                out,
                a: &dh1.data()[rows(r, f1)],
                b: &w1[*l],
                dims: MatmulDims::new(r.len(), h, f1),
            })
            .collect();
        self.run(&mut problems);
        drop(problems);
        dx
    }
}
