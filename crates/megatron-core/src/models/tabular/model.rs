//! The whole tabular model for one step: cell features -> embedding -> layers -> head, with
//! the loss over every table's query rows (each table weighted equally, each of its query rows
//! equally within it) plus, weighted, the reconstruction of feature cells hidden from the input.

use super::embedding::CellEmbedding;
use super::head::{bin_of, HeadRows, TabularHead, Task};
use super::layer::{TableShape, TabularConfig, TabularLayer, TabularLayerSaved};
use crate::params::{Grads, Params};
use crate::tensor_parallel::Tp;
use crate::transformer::step::{Recompute, RecomputeMethod, StepContext};
use megatron_comm::CommError;
use megatron_tensor::cpu::table_features::FEATURES;
use megatron_tensor::cpu::{
    context_mean_sd, context_means, table_context_partials, table_features,
    table_features_with_stats, TableInputs, TableStats,
};
use megatron_tensor::{RngKey, Tensor};
use std::ops::Range;

pub struct TabularModel {
    pub config: TabularConfig,
    pub embedding: CellEmbedding,
    pub layers: Vec<TabularLayer>,
    pub head: TabularHead,
}

/// One micro-batch of tables as the model reads it.
#[derive(Clone, Copy)]
pub struct TabularBatch<'a> {
    pub inputs: TableInputs<'a>,
    /// Per table: real rows (context + queries) and real feature columns.
    pub real_rows: &'a [usize],
    pub real_cols: &'a [usize],
    /// Keys the random column identities (a fresh key per step in training).
    pub ids: RngKey,
    /// Increasing borders of the standardised regression target (the head's bins - 1).
    pub borders: &'a [f32],
    /// Tables in the whole step (the loss is the mean over them).
    pub step_tables: usize,
    /// Feature cells hidden from the input (marked missing in `inputs`) to reconstruct, and
    /// the weight of that loss beside the supervised one.
    pub hidden: &'a [HiddenCell],
    pub reconstruction_weight: f32,
}

/// A feature cell hidden from the model: table, row, column and its true value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HiddenCell {
    pub table: usize,
    pub row: usize,
    pub col: usize,
    pub value: f32,
}

impl TabularModel {
    /// The model as TP rank `tp_rank` of `tp_size` holds it, initialized from `seed`, its
    /// regression and reconstruction heads over `bins` bins.
    pub fn new(
        config: TabularConfig,
        bins: usize,
        seed: u64,
        tp_rank: usize,
        tp_size: usize,
    ) -> (Self, Params) {
        let mut params = Params::for_tp_rank(tp_rank, tp_size);
        let mut inits = Vec::new();
        let embedding = CellEmbedding::new(config.emb, config.init_std, &mut params, &mut inits);
        let layers = (0..config.layers)
            .map(|l| TabularLayer::new(&config, l, &mut params, &mut inits))
            .collect();
        let head = TabularHead::new(
            config.emb,
            bins,
            config.init_std,
            config.eps,
            &mut params,
            &mut inits,
        );
        params.initialize(seed, &inits);
        (
            TabularModel {
                config,
                embedding,
                layers,
                head,
            },
            params,
        )
    }

    /// The model output `[b * rows * (1 + cols), emb]` for a batch (no gradients), with the
    /// context statistics each table was standardised with: what prediction, imputation and
    /// anomaly scores read the head off.
    pub fn encode(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &TabularBatch,
        ctx: &StepContext,
    ) -> Result<Encoded, CommError> {
        let (x, enc) = self.run(params, tp, batch, ctx, None)?;
        Ok(Encoded {
            output: x,
            target_stats: enc.stats,
            column_stats: enc.columns,
        })
    }

    /// Features, embedding and layers; with `kept`, what backward needs of each layer group
    /// (its layers' activations, or under full recomputation only the group's input).
    fn run(
        &self,
        params: &Params,
        tp: &mut Tp,
        batch: &TabularBatch,
        ctx: &StepContext,
        mut kept: Option<&mut Vec<Kept>>,
    ) -> Result<(Tensor, Inputs), CommError> {
        let t = batch.inputs;
        let width = t.cols + 1;
        let cells = t.b * t.rows * width;
        let mut features = Tensor::for_overwrite(&[cells, FEATURES]);
        let mut stats = vec![(0.0f32, 1.0f32); t.b];
        let mut columns = vec![(0.0f32, 1.0f32); t.b * t.cols];
        let cp = tp.cp_layout();
        let positions = cp.positions(t.rows);
        match tp.cp() {
            None => {
                let s = TableStats {
                    target: &mut stats,
                    columns: &mut columns,
                };
                table_features(features.data_mut(), s, t, batch.ids);
            }
            Some(comm) => {
                // Rows split over ranks: the context statistics are sums over every rank's rows.
                let mut sums = table_context_partials(t, &positions, None);
                sum_f64s(comm, &mut sums)?;
                let means = context_means(&sums);
                let mut squares = table_context_partials(t, &positions, Some(&means));
                sum_f64s(comm, &mut squares)?;
                for (tb, row) in context_mean_sd(&means, &squares)
                    .chunks_exact(width)
                    .enumerate()
                {
                    stats[tb] = row[0];
                    columns[tb * t.cols..(tb + 1) * t.cols].copy_from_slice(&row[1..]);
                }
                table_features_with_stats(
                    features.data_mut(),
                    &stats,
                    &columns,
                    t,
                    &positions,
                    batch.ids,
                );
            }
        }
        let valid_cols: Vec<usize> = batch.real_cols.iter().map(|c| c + 1).collect();
        let shape = TableShape {
            b: t.b,
            rows: t.rows,
            cols: width,
            valid_cols: &valid_cols,
            context_rows: t.context_rows,
        };
        let mut x = self.embedding.forward(params, &features);
        for (range, recompute) in layer_groups(ctx.recompute, self.layers.len()) {
            match kept.as_deref_mut() {
                Some(kept) if recompute => {
                    kept.push(Kept::GroupInput(x.clone()));
                    for layer in &self.layers[range] {
                        x = layer.forward(params, tp, x, &shape, ctx)?.0;
                    }
                }
                Some(kept) => {
                    for layer in &self.layers[range] {
                        let (y, s) = layer.forward(params, tp, x, &shape, ctx)?;
                        kept.push(Kept::Layer(Box::new(s)));
                        x = y;
                    }
                }
                None => {
                    for layer in &self.layers[range] {
                        x = layer.forward(params, tp, x, &shape, ctx)?.0;
                    }
                }
            }
        }
        let inputs = Inputs {
            features,
            stats,
            columns,
            valid_cols,
            positions,
        };
        Ok((x, inputs))
    }

    /// The step's loss share of this micro-batch and, with `grads`, its gradients.
    pub fn forward_backward(
        &self,
        params: &Params,
        grads: Option<&mut Grads>,
        tp: &mut Tp,
        batch: &TabularBatch,
        ctx: &StepContext,
    ) -> Result<f64, CommError> {
        assert_eq!(
            batch.borders.len() + 1,
            self.head.bins(),
            "the batch's bin borders must match the head's bins"
        );
        let mut kept = Vec::new();
        let keep = grads.is_some().then_some(&mut kept);
        let (x, enc) = self.run(params, tp, batch, ctx, keep)?;
        let rows = HeadTargets::of(batch, &enc);
        let Some(grads) = grads else {
            return Ok(rows.loss(&self.head, params, &x, None));
        };
        let t = batch.inputs;
        let shape = TableShape {
            b: t.b,
            rows: t.rows,
            cols: t.cols + 1,
            valid_cols: &enc.valid_cols,
            context_rows: t.context_rows,
        };
        let mut dy = Tensor::zeros(x.shape());
        let loss = rows.loss(&self.head, params, &x, Some((&mut *grads, &mut dy)));
        let again = StepContext {
            recomputing: true,
            ..*ctx
        };
        for (range, recompute) in layer_groups(ctx.recompute, self.layers.len())
            .into_iter()
            .rev()
        {
            let saved: Vec<TabularLayerSaved> = if recompute {
                // The group runs again from its kept input, keeping everything this time.
                let Some(Kept::GroupInput(mut x)) = kept.pop() else {
                    unreachable!("a recomputed group keeps its input")
                };
                let mut saved = Vec::with_capacity(range.len());
                for layer in &self.layers[range.clone()] {
                    let (y, s) = layer.forward(params, tp, x, &shape, &again)?;
                    saved.push(s);
                    x = y;
                }
                saved
            } else {
                let mut saved: Vec<TabularLayerSaved> = (0..range.len())
                    .map(|_| match kept.pop() {
                        Some(Kept::Layer(s)) => *s,
                        _ => unreachable!("a kept group keeps every layer"),
                    })
                    .collect();
                saved.reverse();
                saved
            };
            for (layer, s) in self.layers[range].iter().zip(saved).rev() {
                dy = layer.backward(params, grads, tp, s, dy, &shape)?;
            }
        }
        self.embedding.backward(params, grads, &enc.features, &dy);
        Ok(loss)
    }
}

/// What the forward pass keeps of a layer group for backward.
enum Kept {
    /// One layer's activations.
    Layer(Box<TabularLayerSaved>),
    /// A recomputed group's input: its layers run again in backward.
    GroupInput(Tensor),
}

/// The layers in groups as `--recompute-granularity full` asks, each with whether it is
/// recomputed (Megatron's methods: `uniform` recomputes every group of `num_layers` layers from
/// its input; `block` recomputes the first `num_layers` layers one by one and keeps the rest).
/// Without full recomputation every layer is its own kept group.
pub fn layer_groups(recompute: Recompute, layers: usize) -> Vec<(Range<usize>, bool)> {
    match recompute {
        Recompute::Full {
            method: RecomputeMethod::Uniform,
            num_layers,
        } => (0..layers)
            .step_by(num_layers.max(1))
            .map(|l| (l..(l + num_layers.max(1)).min(layers), true))
            .collect(),
        Recompute::Full {
            method: RecomputeMethod::Block,
            num_layers,
        } => (0..layers).map(|l| (l..l + 1, l < num_layers)).collect(),
        Recompute::None | Recompute::Selective(_) => {
            (0..layers).map(|l| (l..l + 1, false)).collect()
        }
    }
}

/// Sums f64s over a group whose collectives carry f32: each value travels as two f32 halves.
fn sum_f64s(comm: &mut dyn megatron_comm::Communicator, x: &mut [f64]) -> Result<(), CommError> {
    let mut v: Vec<f32> = x
        .iter()
        .flat_map(|&x| {
            let hi = x as f32;
            [hi, (x - hi as f64) as f32]
        })
        .collect();
    comm.all_reduce(&mut v, megatron_comm::ReduceOp::Sum)?;
    for (x, p) in x.iter_mut().zip(v.chunks_exact(2)) {
        *x = p[0] as f64 + p[1] as f64;
    }
    Ok(())
}

/// What [`TabularModel::encode`] returns.
pub struct Encoded {
    /// `[b * rows * (1 + cols), emb]`, the target column first in each row.
    pub output: Tensor,
    /// Per table: mean and standard deviation of the target over its context rows.
    pub target_stats: Vec<(f32, f32)>,
    /// `[b, cols]`: mean and standard deviation of each feature over the context rows.
    pub column_stats: Vec<(f32, f32)>,
}

/// The model's inputs for one batch, kept for the backward pass and the head.
struct Inputs {
    features: Tensor,
    stats: Vec<(f32, f32)>,
    columns: Vec<(f32, f32)>,
    valid_cols: Vec<usize>,
    /// Each local row's row in its table (rows split over context-parallel ranks).
    positions: Vec<usize>,
}

/// Cells the head reads for one task, with their targets, classes and loss weights.
#[derive(Default)]
struct TaskRows {
    cells: Vec<u32>,
    targets: Vec<u32>,
    valid: Vec<u32>,
    weights: Vec<f32>,
}

impl TaskRows {
    fn push(&mut self, cell: usize, target: u32, valid: u32, weight: f32) {
        self.cells.push(cell as u32);
        self.targets.push(target);
        self.valid.push(valid);
        self.weights.push(weight);
    }

    fn rows(&self) -> HeadRows<'_> {
        HeadRows {
            cells: &self.cells,
            targets: &self.targets,
            valid: &self.valid,
            weights: &self.weights,
        }
    }
}

/// The cells the head reads, by task: query rows' target cells (classification, regression)
/// and hidden feature cells (reconstruction).
struct HeadTargets {
    class: TaskRows,
    reg: TaskRows,
    cells: TaskRows,
}

impl HeadTargets {
    /// `batch.hidden` names rows of the whole tables; those of this rank's rows are read.
    fn of(batch: &TabularBatch, enc: &Inputs) -> Self {
        let (stats, columns) = (&enc.stats, &enc.columns);
        let t = batch.inputs;
        let whole_rows = enc.positions.iter().max().map_or(0, |m| m + 1);
        let mut local_of = vec![None; whole_rows];
        for (q, &r) in enc.positions.iter().enumerate() {
            local_of[r] = Some(q);
        }
        let width = t.cols + 1;
        let mut q = HeadTargets {
            class: TaskRows::default(),
            reg: TaskRows::default(),
            cells: TaskRows::default(),
        };
        let mut hidden_per_table = vec![0usize; t.b];
        for h in batch.hidden {
            hidden_per_table[h.table] += 1;
        }
        for h in batch.hidden {
            let Some(row) = local_of.get(h.row).copied().flatten() else {
                continue;
            };
            let (mean, sd) = columns[h.table * t.cols + h.col];
            q.cells.push(
                (h.table * t.rows + row) * width + 1 + h.col,
                bin_of((h.value - mean) / sd, batch.borders),
                0,
                batch.reconstruction_weight
                    / (hidden_per_table[h.table] * batch.step_tables) as f32,
            );
        }
        for (tb, &(mean, sd)) in stats.iter().enumerate() {
            let (ctx, real) = (t.context_rows[tb], batch.real_rows[tb]);
            let w = 1.0 / ((real - ctx).max(1) * batch.step_tables) as f32;
            let queries = (0..t.rows).filter(|&q| (ctx..real).contains(&enc.positions[q]));
            for r in queries {
                let cell = (tb * t.rows + r) * width;
                let y = t.targets[tb * t.rows + r];
                match t.classes[tb] {
                    0 => q
                        .reg
                        .push(cell, bin_of((y - mean) / sd, batch.borders), 0, w),
                    k => q.class.push(cell, y as u32, k, w),
                }
            }
        }
        q
    }

    fn loss(
        &self,
        head: &TabularHead,
        params: &Params,
        y: &Tensor,
        mut backward: Option<(&mut Grads, &mut Tensor)>,
    ) -> f64 {
        [
            (&self.class, Task::Classification),
            (&self.reg, Task::Regression),
            (&self.cells, Task::Reconstruction),
        ]
        .into_iter()
        .map(|(rows, task)| {
            let b = backward.as_mut().map(|(g, d)| (&mut **g, &mut **d));
            head.loss(params, y, &rows.rows(), task, b)
        })
        .sum()
    }
}
