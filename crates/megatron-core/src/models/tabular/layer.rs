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

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
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

impl TableShape<'_> {
    fn cells(&self) -> usize {
        self.b * self.rows * self.cols
    }
}

pub struct TabularLayer {
    pub row_norm: LayerNorm,
    pub row_qkv: ColumnParallelLinear,
    pub row_proj: RowParallelLinear,
    pub col_norm: LayerNorm,
    pub col_qkv: ColumnParallelLinear,
    pub col_proj: RowParallelLinear,
    pub mlp_norm: LayerNorm,
    pub mlp: MLP,
    heads_local: usize,
    head_dim: usize,
}

/// What backward needs of one attention branch.
pub struct AttentionSaved {
    norm: LayerNormSaved,
    normed: Tensor,
    /// Fused QKV and output in the branch's sequence layout, and the log-sum-exp.
    qkv: Tensor,
    out: Tensor,
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

impl TabularLayer {
    pub fn new(
        cfg: &TabularConfig,
        layer: usize,
        params: &mut Params,
        inits: &mut Vec<Init>,
    ) -> Self {
        let e = cfg.emb;
        let p = format!("tabular.layers.{layer}");
        let std = cfg.init_std;
        let out_std = std / (2.0 * cfg.layers as f32).sqrt();
        let norm = |name: &str, params: &mut Params, inits: &mut Vec<Init>| {
            LayerNorm::new(
                &format!("{p}.{name}"),
                e,
                cfg.eps,
                Sharding::Replicated,
                params,
                inits,
            )
        };
        let row_norm = norm("row_attention.norm", params, inits);
        let row_qkv = ColumnParallelLinear::new(
            params,
            inits,
            &format!("{p}.row_attention.linear_qkv"),
            e,
            3 * e,
            false,
            std,
            false,
            true,
        );
        let row_proj = RowParallelLinear::new(
            params,
            inits,
            &format!("{p}.row_attention.linear_proj"),
            e,
            e,
            false,
            out_std,
            true,
        );
        let col_norm = norm("column_attention.norm", params, inits);
        let col_qkv = ColumnParallelLinear::new(
            params,
            inits,
            &format!("{p}.column_attention.linear_qkv"),
            e,
            3 * e,
            false,
            std,
            false,
            true,
        );
        let col_proj = RowParallelLinear::new(
            params,
            inits,
            &format!("{p}.column_attention.linear_proj"),
            e,
            e,
            false,
            out_std,
            true,
        );
        let mlp_norm = norm("mlp.norm", params, inits);
        let tcfg = TransformerConfig {
            hidden_size: e,
            ffn_hidden_size: cfg.ffn,
            num_attention_heads: cfg.heads,
            num_layers: cfg.layers,
            activation: Activation::Gelu,
            add_bias_linear: false,
            init_method_std: std,
            ..Default::default()
        };
        let mlp = MLP::new_named(&tcfg, &format!("{p}.mlp"), cfg.ffn, false, params, inits);
        let tp = params.tp.1.max(1);
        TabularLayer {
            row_norm,
            row_qkv,
            row_proj,
            col_norm,
            col_qkv,
            col_proj,
            mlp_norm,
            mlp,
            heads_local: cfg.heads / tp,
            head_dim: e / cfg.heads,
        }
    }

    fn dims(&self, seqs: usize, t: usize) -> AttentionDims {
        AttentionDims {
            b: seqs,
            t,
            heads: self.heads_local,
            groups: self.heads_local,
            head_dim: self.head_dim,
            causal: false,
            dropout: 0.0,
            rng_heads: (0, self.heads_local),
            rng_block: None,
        }
    }

    /// Sequences, their length and each one's visible keys for `axis`.
    fn sequences(&self, s: &TableShape, axis: Axis) -> (usize, usize, Vec<usize>) {
        match axis {
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
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_forward(
        &self,
        params: &Params,
        tp: &mut Tp,
        norm: &LayerNorm,
        qkv_linear: &ColumnParallelLinear,
        proj: &RowParallelLinear,
        x: &Tensor,
        s: &TableShape,
        axis: Axis,
    ) -> Result<(Tensor, AttentionSaved), CommError> {
        let (normed, norm_saved) = norm.forward(params, x);
        let qkv_rows = qkv_linear.forward(params, tp, &normed)?;
        let w = qkv_rows.shape()[1];
        let ow = self.heads_local * self.head_dim;
        let cells = TableDims {
            b: s.b,
            rows: s.rows,
            cols: s.cols,
            w,
        };
        let qkv = match axis {
            Axis::Row => qkv_rows,
            Axis::Column => {
                let mut t = Tensor::for_overwrite(&[s.cells(), w]);
                swap_rows_cols(t.data_mut(), qkv_rows.data(), cells);
                t
            }
        };
        let (seqs, len, keys) = self.sequences(s, axis);
        let d = self.dims(seqs, len);
        let mut out = Tensor::for_overwrite(&[s.cells(), ow]);
        let mut lse = Tensor::for_overwrite(&[seqs * self.heads_local * len]);
        attention_forward(
            out.data_mut(),
            lse.data_mut(),
            qkv.data(),
            AttentionMask::key_lens(&keys),
            d,
            RngKey::new(0),
        );
        let out_rows = match axis {
            Axis::Row => None,
            Axis::Column => {
                let mut t = Tensor::for_overwrite(&[s.cells(), ow]);
                let od = TableDims {
                    b: s.b,
                    rows: s.cols,
                    cols: s.rows,
                    w: ow,
                };
                swap_rows_cols(t.data_mut(), out.data(), od);
                Some(t)
            }
        };
        let y = proj.forward(params, tp, out_rows.as_ref().unwrap_or(&out))?;
        Ok((
            y,
            AttentionSaved {
                norm: norm_saved,
                normed,
                qkv,
                out,
                lse,
            },
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        params: &Params,
        grads: &mut Grads,
        tp: &mut Tp,
        norm: &LayerNorm,
        qkv_linear: &ColumnParallelLinear,
        proj: &RowParallelLinear,
        saved: AttentionSaved,
        x: &Tensor,
        dy: Tensor,
        s: &TableShape,
        axis: Axis,
    ) -> Result<Tensor, CommError> {
        let ow = self.heads_local * self.head_dim;
        let w = saved.qkv.shape()[1];
        // The projection's input in row-major cells.
        let out_rows = match axis {
            Axis::Row => None,
            Axis::Column => {
                let mut t = Tensor::for_overwrite(&[s.cells(), ow]);
                let od = TableDims {
                    b: s.b,
                    rows: s.cols,
                    cols: s.rows,
                    w: ow,
                };
                swap_rows_cols(t.data_mut(), saved.out.data(), od);
                Some(t)
            }
        };
        let dout_rows = proj.backward(
            params,
            grads,
            tp,
            out_rows.as_ref().unwrap_or(&saved.out),
            dy,
        )?;
        drop(out_rows);
        let dout = match axis {
            Axis::Row => dout_rows,
            Axis::Column => {
                let mut t = Tensor::for_overwrite(&[s.cells(), ow]);
                let cells = TableDims {
                    b: s.b,
                    rows: s.rows,
                    cols: s.cols,
                    w: ow,
                };
                swap_rows_cols(t.data_mut(), dout_rows.data(), cells);
                t
            }
        };
        let (seqs, len, keys) = self.sequences(s, axis);
        let mut dqkv = Tensor::zeros(&[s.cells(), w]);
        attention_backward(
            dqkv.data_mut(),
            dout.data(),
            saved.out.data(),
            saved.lse.data(),
            saved.qkv.data(),
            AttentionMask::key_lens(&keys),
            self.dims(seqs, len),
            RngKey::new(0),
        );
        let dqkv_rows = match axis {
            Axis::Row => dqkv,
            Axis::Column => {
                let mut t = Tensor::for_overwrite(&[s.cells(), w]);
                let cd = TableDims {
                    b: s.b,
                    rows: s.cols,
                    cols: s.rows,
                    w,
                };
                swap_rows_cols(t.data_mut(), dqkv.data(), cd);
                t
            }
        };
        let dnormed = qkv_linear.backward(params, grads, tp, &saved.normed, dqkv_rows)?;
        Ok(norm.backward(params, grads, &saved.norm, x, &dnormed))
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
        let (ya, row) = self.attention_forward(
            params,
            tp,
            &self.row_norm,
            &self.row_qkv,
            &self.row_proj,
            &x,
            s,
            Axis::Row,
        )?;
        let mid = add(&x, &ya);
        let (yc, col) = self.attention_forward(
            params,
            tp,
            &self.col_norm,
            &self.col_qkv,
            &self.col_proj,
            &mid,
            s,
            Axis::Column,
        )?;
        let after_attention = add(&mid, &yc);
        let (mlp_in, mlp_norm) = self.mlp_norm.forward(params, &after_attention);
        let (ym, mlp) = self.mlp.forward(params, tp, &mlp_in, ctx)?;
        let out = add(&after_attention, &ym);
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
        let d_after = add(
            &dout,
            &self.mlp_norm.backward(
                params,
                grads,
                &saved.mlp_norm,
                &saved.after_attention,
                &dmlp_in,
            ),
        );
        let dcol = self.attention_backward(
            params,
            grads,
            tp,
            &self.col_norm,
            &self.col_qkv,
            &self.col_proj,
            saved.col,
            &saved.mid,
            d_after.clone(),
            s,
            Axis::Column,
        )?;
        let dmid = add(&d_after, &dcol);
        let drow = self.attention_backward(
            params,
            grads,
            tp,
            &self.row_norm,
            &self.row_qkv,
            &self.row_proj,
            saved.row,
            &saved.input,
            dmid.clone(),
            s,
            Axis::Row,
        )?;
        Ok(add(&dmid, &drow))
    }
}

fn add(a: &Tensor, b: &Tensor) -> Tensor {
    let mut out = a.clone();
    megatron_tensor::cpu::reduce::add_inplace(out.data_mut(), b.data());
    out
}
