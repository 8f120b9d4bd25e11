//! One layer of the tabular model (TabPFN v2's layer: Hollmann et al. 2025, Nature, Methods):
//! pre-norm attention across the cells of each row (features talk to each other), pre-norm
//! attention down each column in which every row attends only to the context rows (queries
//! learn from labelled rows, never from each other), and a per-cell MLP, each with a residual.
//! Cells are `[b, rows, cols, e]` row-major throughout; LayerNorm, the projections and the MLP
//! work per cell, so only the column attention's fused QKV and output are swapped to
//! column-major (`swap_rows_cols`) around the attention kernel.
//!
//! The projections are Megatron's column- and row-parallel linears: heads split over tensor
//! parallelism as in a GPT layer.

use crate::context_parallel::{heads_to_sequence, sequence_to_heads, CpLayout};
use crate::params::Sharding;
use crate::params::{Grads, Init, Params};
use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear, Tp};
use crate::transformer::config::{Activation, TransformerConfig};
use crate::transformer::mlp::{MLPSaved, MLP};
use crate::transformer::norm::{LayerNorm, LayerNormSaved};
use crate::transformer::step::StepContext;
use megatron_comm::CommError;
use megatron_tensor::cpu::{
    attention_backward, attention_forward, swap_rows_cols, AttentionDims, AttentionMask, TableDims,
};
use megatron_tensor::{RngKey, Tensor};
use std::borrow::Cow;

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TabularConfig {
    /// Width of a cell's embedding.
    pub emb: usize,
    pub heads: usize,
    pub ffn: usize,
    pub layers: usize,
    pub init_std: f32,
    pub eps: f32,
}

/// The batch's shape and which keys each sequence may see.
#[derive(Clone, Copy, Debug)]
pub struct TableShape<'a> {
    pub b: usize,
    /// Padded rows and columns (the target column included).
    pub rows: usize,
    pub cols: usize,
    /// Per table: real columns (target included; keys of row attention) and context rows
    /// (keys of column attention).
    pub valid_cols: &'a [usize],
    pub context_rows: &'a [usize],
}

pub struct TabularLayer {
    pub row_attention: AttentionBranch,
    pub column_attention: AttentionBranch,
    pub mlp_norm: LayerNorm,
    pub mlp: MLP,
}

/// One pre-norm attention branch: LayerNorm, fused QKV (column-parallel), attention along
/// `axis`, output projection (row-parallel).
pub struct AttentionBranch {
    pub norm: LayerNorm,
    pub linear_qkv: ColumnParallelLinear,
    pub linear_proj: RowParallelLinear,
    axis: Axis,
    heads_local: usize,
    head_dim: usize,
}

/// What backward needs of one attention branch.
pub struct AttentionSaved {
    norm: LayerNormSaved,
    normed: Tensor,
    /// Fused QKV and output in the branch's sequence layout, and the log-sum-exp (QKV and the
    /// log-sum-exp as the kernel saw them: whole columns of a share of the heads under
    /// context parallelism, whose output is then `out_heads`).
    qkv: Tensor,
    out: Tensor,
    out_heads: Option<Tensor>,
    lse: Tensor,
}

pub struct TabularLayerSaved {
    input: Tensor,
    row: AttentionSaved,
    mid: Tensor,
    col: AttentionSaved,
    after_attention: Tensor,
    mlp_norm: LayerNormSaved,
    mlp_in: Tensor,
    mlp: MLPSaved,
}

/// Which way a branch's sequences run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Axis {
    /// Sequences are rows: keys are a table's real columns.
    Row,
    /// Sequences are columns: keys are a table's context rows.
    Column,
}

impl AttentionBranch {
    fn new(
        cfg: &TabularConfig,
        prefix: &str,
        axis: Axis,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let e = cfg.emb;
        let norm = LayerNorm::new(
            &format!("{prefix}.norm"),
            e,
            cfg.eps,
            Sharding::Replicated,
            params,
            inits,
        );
        let (std, name) = (cfg.init_std, |n: &str| format!("{prefix}.{n}"));
        let linear_qkv = ColumnParallelLinear::new(
            params,
            inits,
            &name("linear_qkv"),
            e,
            3 * e,
            false,
            std,
            false,
            true,
        );
        let out_std = std / (2.0 * cfg.layers as f32).sqrt();
        let linear_proj = RowParallelLinear::new(
            params,
            inits,
            &name("linear_proj"),
            e,
            e,
            false,
            out_std,
            true,
        );
        AttentionBranch {
            norm,
            linear_qkv,
            linear_proj,
            axis,
            heads_local: cfg.heads / params.tp.1.max(1),
            head_dim: e / cfg.heads,
        }
    }

    /// Sequences, their length, each one's visible keys, and the attention's sizes.
    fn sequences(&self, s: &TableShape) -> (Vec<usize>, AttentionDims) {
        let (seqs, t, keys) = match self.axis {
            Axis::Row => (
                s.b * s.rows,
                s.cols,
                (0..s.b * s.rows)
                    .map(|i| s.valid_cols[i / s.rows])
                    .collect(),
            ),
            Axis::Column => (
                s.b * s.cols,
                s.rows,
                (0..s.b * s.cols)
                    .map(|i| s.context_rows[i / s.cols])
                    .collect(),
            ),
        };
        let d = AttentionDims {
            b: seqs,
            t,
            heads: self.heads_local,
            groups: self.heads_local,
            head_dim: self.head_dim,
            causal: false,
            dropout: 0.0,
            rng_heads: (0, self.heads_local),
            rng_block: None,
        };
        (keys, d)
    }

    /// Row-major cells `[cells, w]` in the branch's sequence layout (a copy only for columns).
    fn to_sequences(&self, t: Tensor, s: &TableShape) -> Tensor {
        match self.axis {
            Axis::Row => t,
            Axis::Column => swapped(&t, s, Axis::Row),
        }
    }

    /// The inverse of [`Self::to_sequences`], borrowing when nothing moves.
    fn to_cells<'t>(&self, t: &'t Tensor, s: &TableShape) -> Cow<'t, Tensor> {
        match self.axis {
            Axis::Row => Cow::Borrowed(t),
            Axis::Column => Cow::Owned(swapped(t, s, Axis::Column)),
        }
    }

    /// Whether this branch runs on whole columns of a share of the heads: column attention
    /// with the rows split over context-parallel ranks (each rank holds two of the `2C` row
    /// chunks, as for a GPT's tokens). Rows attend to the context rows of the whole column, so
    /// an all-to-all turns this rank's rows of every head into every row of its heads and back
    /// (Ulysses); row attention and the MLP never look past their own row.
    fn splits_heads(&self, tp: &Tp) -> Option<CpLayout> {
        let cp = tp.cp_layout();
        (self.axis == Axis::Column && cp.size > 1).then_some(cp)
    }

    /// `x` (this rank's rows of every sequence, all its heads) to whole sequences of its share
    /// of the heads, when [`Self::splits_heads`]; else as it is.
    fn rows_to_heads(&self, tp: &mut Tp, x: Tensor, seqs: usize) -> Result<Tensor, CommError> {
        match (self.splits_heads(tp), tp.cp()) {
            (Some(cp), Some(c)) => sequence_to_heads(&x, seqs, cp, c),
            _ => Ok(x),
        }
    }

    /// The inverse of [`Self::rows_to_heads`].
    fn heads_to_rows(&self, tp: &mut Tp, x: Tensor, seqs: usize) -> Result<Tensor, CommError> {
        match (self.splits_heads(tp), tp.cp()) {
            (Some(cp), Some(c)) => heads_to_sequence(&x, seqs, cp, c),
            _ => Ok(x),
        }
    }

    /// [`Self::sequences`] as the attention kernel sees them (whole columns, a share of the
    /// heads, under [`Self::splits_heads`]).
    fn kernel_sequences(&self, tp: &Tp, s: &TableShape) -> (Vec<usize>, AttentionDims) {
        let (keys, mut d) = self.sequences(s);
        if let Some(cp) = self.splits_heads(tp) {
            d.t *= cp.size;
            d.heads /= cp.size;
            d.groups /= cp.size;
            d.rng_heads = (0, d.heads);
        }
        (keys, d)
    }

    fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: &Tensor,
        s: &TableShape,
    ) -> Result<(Tensor, AttentionSaved), CommError> {
        let (normed, norm) = self.norm.forward(params, x);
        let qkv = self.to_sequences(self.linear_qkv.forward(params, tp, &normed)?, s);
        let (keys, d) = self.kernel_sequences(tp, s);
        let qkv = self.rows_to_heads(tp, qkv, d.b)?;
        let mut out = Tensor::for_overwrite(&[d.b * d.t, d.heads * d.head_dim]);
        let mut lse = Tensor::for_overwrite(&[d.b * d.heads * d.t]);
        attention_forward(
            out.data_mut(),
            lse.data_mut(),
            qkv.data(),
            AttentionMask::key_lens(&keys),
            d,
            RngKey::new(0),
        );
        let (out, out_heads) = match self.splits_heads(tp) {
            Some(_) => (self.heads_to_rows(tp, out.clone(), d.b)?, Some(out)),
            None => (out, None),
        };
        let y = self
            .linear_proj
            .forward(params, tp, &self.to_cells(&out, s))?;
        Ok((
            y,
            AttentionSaved {
                norm,
                normed,
                qkv,
                out,
                out_heads,
                lse,
            },
        ))
    }

    fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: AttentionSaved,
        x: &Tensor,
        dy: Tensor,
        s: &TableShape,
    ) -> Result<Tensor, CommError> {
        let out_cells = self.to_cells(&saved.out, s);
        let dout = self
            .linear_proj
            .backward(params, grads, tp, &out_cells, dy)?;
        drop(out_cells);
        let (keys, d) = self.kernel_sequences(tp, s);
        let dout = self.rows_to_heads(tp, self.to_sequences(dout, s), d.b)?;
        let mut dqkv = Tensor::zeros(saved.qkv.shape());
        attention_backward(
            dqkv.data_mut(),
            dout.data(),
            saved.out_heads.as_ref().unwrap_or(&saved.out).data(),
            saved.lse.data(),
            saved.qkv.data(),
            AttentionMask::key_lens(&keys),
            d,
            RngKey::new(0),
        );
        let dqkv = self.heads_to_rows(tp, dqkv, d.b)?;
        let dqkv = match self.to_cells(&dqkv, s) {
            Cow::Borrowed(_) => dqkv,
            Cow::Owned(t) => t,
        };
        let dnormed = self
            .linear_qkv
            .backward(params, grads, tp, &saved.normed, dqkv)?;
        Ok(self.norm.backward(params, grads, &saved.norm, x, &dnormed))
    }
}

impl TabularLayer {
    pub fn new(
        cfg: &TabularConfig,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let p = format!("tabular.layers.{layer}");
        let row_attention =
            AttentionBranch::new(cfg, &format!("{p}.row_attention"), Axis::Row, params, inits);
        let column_attention = AttentionBranch::new(
            cfg,
            &format!("{p}.column_attention"),
            Axis::Column,
            params,
            inits,
        );
        let mlp_norm = LayerNorm::new(
            &format!("{p}.mlp.norm"),
            cfg.emb,
            cfg.eps,
            Sharding::Replicated,
            params,
            inits,
        );
        let tcfg = TransformerConfig {
            hidden_size: cfg.emb,
            ffn_hidden_size: cfg.ffn,
            num_attention_heads: cfg.heads,
            num_layers: cfg.layers,
            activation: Activation::Gelu,
            add_bias_linear: false,
            init_method_std: cfg.init_std,
            ..Default::default()
        };
        let mlp = MLP::new_named(&tcfg, &format!("{p}.mlp"), cfg.ffn, false, params, inits);
        TabularLayer {
            row_attention,
            column_attention,
            mlp_norm,
            mlp,
        }
    }

    /// `x`: `[b * rows * cols, e]` row-major cells.
    pub fn forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        x: Tensor,
        s: &TableShape,
        ctx: &StepContext,
    ) -> Result<(Tensor, TabularLayerSaved), CommError> {
        let (ya, row) = self.row_attention.forward(params, tp, &x, s)?;
        let mid = add(ya, &x);
        let (yc, col) = self.column_attention.forward(params, tp, &mid, s)?;
        let after_attention = add(yc, &mid);
        let (mlp_in, mlp_norm) = self.mlp_norm.forward(params, &after_attention);
        let (ym, mlp) = self.mlp.forward(params, tp, &mlp_in, ctx)?;
        let out = add(ym, &after_attention);
        Ok((
            out,
            TabularLayerSaved {
                input: x,
                row,
                mid,
                col,
                after_attention,
                mlp_norm,
                mlp_in,
                mlp,
            },
        ))
    }

    pub fn backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        saved: TabularLayerSaved,
        dout: Tensor,
        s: &TableShape,
    ) -> Result<Tensor, CommError> {
        let dmlp_in =
            self.mlp
                .backward(params, grads, tp, &saved.mlp, &saved.mlp_in, dout.clone())?;
        let dnorm = self.mlp_norm.backward(
            params,
            grads,
            &saved.mlp_norm,
            &saved.after_attention,
            &dmlp_in,
        );
        let d_after = add(dnorm, &dout);
        let dcol = self.column_attention.backward(
            params,
            grads,
            tp,
            saved.col,
            &saved.mid,
            d_after.clone(),
            s,
        )?;
        let dmid = add(dcol, &d_after);
        let drow = self.row_attention.backward(
            params,
            grads,
            tp,
            saved.row,
            &saved.input,
            dmid.clone(),
            s,
        )?;
        Ok(add(drow, &dmid))
    }
}

/// `a + b`, into `a` (the residual stream's other operand is kept for backward).
fn add(mut a: Tensor, b: &Tensor) -> Tensor {
    crate::transformer::layer::add_inplace(&mut a, b);
    a
}

/// `t` (`[cells, w]`) with rows and columns swapped, read as rows first (`from` = `Row`) or
/// columns first.
fn swapped(t: &Tensor, s: &TableShape, from: Axis) -> Tensor {
    let d = TableDims {
        b: s.b,
        rows: s.rows,
        cols: s.cols,
        w: t.shape()[1],
    };
    let d = if from == Axis::Row { d } else { d.transposed() };
    let mut out = Tensor::for_overwrite(t.shape());
    swap_rows_cols(out.data_mut(), t.data(), d);
    out
}
