//! The experts this rank holds: each is the model's MLP (GELU, or SwiGLU on a fused
//! `[gate; up]` fc1), run on a contiguous block of one buffer of token rows sorted by local
//! expert (no per-expert gather or copy). The activation runs once over the whole buffer; the
//! GEMMs of the blocks run one after the other, each on every thread (megatron-core's
//! `SequentialMLP`), or with `--moe-grouped-gemm` all at once, one block per thread
//! (`GroupedMLP`): the same bits either way.

use super::super::config::TransformerConfig;
use super::super::saved::linear_input_dtype;
use crate::params::{Grads, Init, ParamId, ParamOperand, Params, Sharding};
use megatron_tensor::cpu::reduce::add_inplace;
use megatron_tensor::cpu::{
    bias_backward, bias_rows_forward, grouped_matmul, matmul_operands, mlp_activation_backward,
    mlp_activation_forward, GemmProblem, MatmulDims, MlpActivation, Operand,
};
use megatron_tensor::{DType, Tensor};
use std::ops::Range;

pub struct Expert {
    pub fc1: ParamId,
    pub fc2: ParamId,
    /// The biases (megatron-core's experts have them unless `--disable-bias-linear`; gpt-oss's
    /// do). fc2's joins the expert's output before the router's probability scales it.
    pub fc1_bias: Option<ParamId>,
    pub fc2_bias: Option<ParamId>,
}

pub struct GroupedMLP {
    /// This rank's experts, in global order.
    pub experts: Vec<Expert>,
    /// Global index of the first.
    pub first: usize,
    activation: MlpActivation,
    hidden: usize,
    /// This rank's slice of each expert's FFN width.
    ffn: usize,
    grouped: bool,
    /// This rank's place among the expert-tensor-parallel ranks, which split fc2's bias.
    etp_rank: usize,
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

/// Elements of rows `r` of a buffer with `c` columns.
fn rows(r: &Range<usize>, c: usize) -> Range<usize> {
    r.start * c..r.end * c
}

/// One product per block: `outs[i] = a(block) · b(block)` with `dims(rows of the block)`.
fn products<'a>(
    outs: Vec<&'a mut [f32]>,
    blocks: &[(usize, Range<usize>)],
    a: impl Fn(usize, &Range<usize>) -> Operand<'a>,
    b: impl Fn(usize, &Range<usize>) -> Operand<'a>,
    dims: impl Fn(usize) -> MatmulDims,
) -> Vec<GemmProblem<'a>> {
    outs.into_iter()
        .zip(blocks)
        .map(|(out, (l, r))| GemmProblem {
            out,
            a: a(*l, r),
            b: b(*l, r),
            dims: dims(r.len()),
        })
        .collect()
}

impl GroupedMLP {
    /// Registers the weights of global experts `which` of layer `layer` under megatron-core's
    /// names with global expert numbers, so checkpoints do not depend on the expert layout.
    pub fn new(
        cfg: &TransformerConfig,
        prefix: &str,
        which: Range<usize>,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let m = cfg.moe.as_ref().expect("an MoE layer needs --num-experts");
        let (h, f) = (cfg.hidden_size, m.ffn_hidden_size);
        // Under expert tensor parallelism fc1 is column-parallel (SwiGLU's [gate; up] split
        // blockwise) and fc2 row-parallel, as in the dense MLP.
        let (fc1_rows, fc1_split) = if cfg.activation.is_gated() {
            (2 * f, Sharding::ExpertSplitChunks(2))
        } else {
            (f, Sharding::ExpertSplit(0))
        };
        let etp = params.experts.etp.max(1);
        let first = which.start;
        let experts = which
            .map(|e| {
                let q = format!("{prefix}.mlp.experts.local_experts.{e}");
                // megatron-core's registration order: fc1's weight and bias, then fc2's.
                let fc1 = params.add_sharded(
                    inits,
                    format!("{q}.linear_fc1.weight"),
                    &[fc1_rows, h],
                    true,
                    Init::Normal(cfg.init_method_std),
                    fc1_split,
                );
                let fc1_bias = m.biases.then(|| {
                    params.add_sharded(
                        inits,
                        format!("{q}.linear_fc1.bias"),
                        &[fc1_rows],
                        false,
                        Init::Const(0.0),
                        fc1_split,
                    )
                });
                let fc2 = params.add_sharded(
                    inits,
                    format!("{q}.linear_fc2.weight"),
                    &[h, f],
                    true,
                    Init::Normal(cfg.output_layer_init_std()),
                    Sharding::ExpertSplit(1),
                );
                // fc2's output is a partial sum per expert-tensor-parallel rank until the
                // dispatcher reduces it: each rank holds and adds its own block of the bias's
                // features, so the sum has the bias once (megatron-core adds the whole bias on
                // every such rank).
                let fc2_bias = m.biases.then(|| {
                    params.add_sharded(
                        inits,
                        format!("{q}.linear_fc2.bias"),
                        &[h],
                        false,
                        Init::Const(0.0),
                        Sharding::ExpertSplit(0),
                    )
                });
                Expert {
                    fc1,
                    fc2,
                    fc1_bias,
                    fc2_bias,
                }
            })
            .collect();
        GroupedMLP {
            experts,
            first,
            activation: cfg.activation_kernel(),
            hidden: h,
            ffn: f / etp,
            grouped: m.grouped_gemm,
            etp_rank: params.experts.etp_rank,
        }
    }

    fn fc1_width(&self) -> usize {
        self.activation.fc1_factor() * self.ffn
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
                matmul_operands(p.out, p.a, p.b, p.dims);
            }
        }
    }

    /// The activation of fc1's output `h1` (either storage type), in the storage type fc2's
    /// products read ([`linear_input_dtype`]: bf16 under `--bf16`, as the dense MLP's).
    fn activate(&self, h1: &Tensor) -> Tensor {
        let n = h1.shape()[0];
        let mut act = Tensor::for_overwrite_as(&[n, self.ffn], linear_input_dtype());
        mlp_activation_forward(act.operand_mut(), h1.operand(), self.ffn, self.activation);
        act
    }

    /// The local experts' weights as stored: a `--bf16` weight's 16-bit copy is read in place
    /// by the packed kernels (widened per product only by the others), not widened up front.
    fn weights<'p>(
        &self,
        params: &'p Params,
        which: impl Fn(&Expert) -> ParamId,
    ) -> Vec<ParamOperand<'p>> {
        self.experts
            .iter()
            .map(|e| params.operand(which(e)))
            .collect()
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
        let b1 = self.start_at_biases(params, h1.data_mut(), &blocks, f1, |e| e.fc1_bias);
        // `x` as dispatched (bf16 under `--bf16`).
        let xs = x.operand();
        self.run(&mut products(
            row_blocks(h1.data_mut(), &blocks, f1),
            &blocks,
            |_, r| xs.slice(rows(r, h)),
            |l, _| w1[l].operand(),
            |m| MatmulDims::new(m, f1, h).tb().acc_if(b1),
        ));
        let act = self.activate(&h1);
        let acts = act.operand();
        let mut y = Tensor::for_overwrite(&[n, h]);
        let b2 = self.start_at_biases(params, y.data_mut(), &blocks, h, |e| e.fc2_bias);
        self.run(&mut products(
            row_blocks(y.data_mut(), &blocks, h),
            &blocks,
            |_, r| acts.slice(rows(r, f)),
            |l, _| w2[l].operand(),
            |m| MatmulDims::new(m, h, f).tb().acc_if(b2),
        ));
        (y, h1)
    }

    /// Sets each block's rows of `out` (`cols` wide) to its expert's bias, where the experts
    /// have one; returns whether they do (the products then accumulate onto it).
    fn start_at_biases(
        &self,
        params: &Params,
        out: &mut [f32],
        blocks: &[(usize, Range<usize>)],
        cols: usize,
        which: impl Fn(&Expert) -> Option<ParamId>,
    ) -> bool {
        if self.experts.iter().any(|e| which(e).is_none()) {
            return false;
        }
        // This rank's block of fc2's bias, zero elsewhere in the partial sum's row.
        let mut row = Vec::new();
        for (l, r) in blocks {
            let b = which(&self.experts[*l]).expect("every expert has its bias");
            let b = params.get(b);
            if b.len() == cols {
                bias_rows_forward(&mut out[rows(r, cols)], &b);
            } else {
                row.resize(cols, 0.0);
                let at = self.etp_rank * b.len();
                row[at..at + b.len()].copy_from_slice(&b);
                bias_rows_forward(&mut out[rows(r, cols)], &row);
            }
        }
        true
    }

    /// Each block's rows of `dout` (`cols` wide) summed into its expert's bias gradient.
    fn bias_grads(
        &self,
        grads: &mut Grads,
        dout: &[f32],
        blocks: &[(usize, Range<usize>)],
        cols: usize,
        which: impl Fn(&Expert) -> Option<ParamId>,
    ) {
        // fc2's bias block: the column sums of this rank's block of features.
        let mut all = Vec::new();
        for (l, r) in blocks {
            let Some(b) = which(&self.experts[*l]) else {
                continue;
            };
            let g = grads.get_mut(b);
            if g.len() == cols {
                bias_backward(g, &dout[rows(r, cols)], r.len(), cols);
            } else {
                all.clear();
                all.resize(cols, 0.0);
                bias_backward(&mut all, &dout[rows(r, cols)], r.len(), cols);
                let at = self.etp_rank * g.len();
                add_inplace(g, &all[at..at + g.len()]);
            }
        }
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
        let ids = |which: fn(&Expert) -> ParamId| -> Vec<ParamId> {
            blocks
                .iter()
                .map(|(l, _)| which(&self.experts[*l]))
                .collect()
        };
        self.bias_grads(grads, dy.data(), &blocks, h, |e| e.fc2_bias);
        let act = self.activate(h1);
        let acts = act.operand();
        // fc2: dW2 += dy^T act (each block its expert's gradient), dact = dy W2.
        self.run(&mut products(
            grads.disjoint_mut(&ids(|e| e.fc2)),
            &blocks,
            |_, r| Operand::F32(&dy.data()[rows(r, h)]),
            |_, r| acts.slice(rows(r, f)),
            |m| MatmulDims::new(h, f, m).ta().acc(),
        ));
        // The activation's f32 buffer takes its gradient (a bf16 one is freed first).
        let mut dact = if act.dtype() == DType::F32 {
            act
        } else {
            drop(act);
            Tensor::for_overwrite(&[n, f])
        };
        self.run(&mut products(
            row_blocks(dact.data_mut(), &blocks, f),
            &blocks,
            |_, r| Operand::F32(&dy.data()[rows(r, h)]),
            |l, _| w2[l].operand(),
            |m| MatmulDims::new(m, f, h),
        ));
        let mut dh1 = Tensor::for_overwrite(&[n, f1]);
        let (di, dy) = (dh1.data_mut(), dact.data());
        mlp_activation_backward(di, dy, h1.operand(), f, self.activation);
        drop(dact);
        self.bias_grads(grads, dh1.data(), &blocks, f1, |e| e.fc1_bias);
        // fc1: dW1 += dh1^T x, dx = dh1 W1; `x` as kept (bf16 under `--bf16`).
        let xs = x.operand();
        self.run(&mut products(
            grads.disjoint_mut(&ids(|e| e.fc1)),
            &blocks,
            |_, r| Operand::F32(&dh1.data()[rows(r, f1)]),
            |_, r| xs.slice(rows(r, h)),
            |m| MatmulDims::new(f1, h, m).ta().acc(),
        ));
        let mut dx = Tensor::for_overwrite(&[n, h]);
        self.run(&mut products(
            row_blocks(dx.data_mut(), &blocks, h),
            &blocks,
            |_, r| Operand::F32(&dh1.data()[rows(r, f1)]),
            |l, _| w1[l].operand(),
            |m| MatmulDims::new(m, h, f1),
        ));
        dx
    }
}
