//! Reading a trained tabular model: class probabilities or a regression value for query rows
//! (averaged over an ensemble of column orders and class relabellings, as TabPFN does:
//! Hollmann et al. 2023, section 4), and the binned distribution of hidden feature cells
//! (imputation: its mean; anomaly score: the negative log-density of the observed value).

use megatron_comm::CommError;
use megatron_core::models::tabular::{TabularBatch, TabularModel, Task};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_core::Params;
use megatron_data::tables::batching::collate;
use megatron_data::tables::stream::Stream;
use megatron_data::tables::{Table, Target};
use megatron_tensor::cpu::table_features::MAX_CLASSES;
use megatron_tensor::RngKey;

/// A table to read the model on: `rows` x `cols` feature values (row-major, NaN = missing), the
/// first `context_rows` rows with their `targets` known (class index, or value), the rest
/// queries; `classes` 0 for regression.
#[derive(Clone, Debug)]
pub struct InferenceTable {
    pub rows: usize,
    pub cols: usize,
    pub context_rows: usize,
    pub values: Vec<f32>,
    pub targets: Vec<f32>,
    pub classes: u32,
}

impl InferenceTable {
    /// The rows `order` of a row-major table of `cols` columns with `targets` per row, the
    /// first `context` of them context (their targets kept), the rest queries (targets 0).
    pub fn of_rows(
        values: &[f32],
        cols: usize,
        targets: &[f32],
        order: &[usize],
        context: usize,
        classes: u32,
    ) -> Self {
        InferenceTable {
            rows: order.len(),
            cols,
            context_rows: context,
            values: order
                .iter()
                .flat_map(|&r| values[r * cols..(r + 1) * cols].iter().copied())
                .collect(),
            targets: order
                .iter()
                .enumerate()
                .map(|(i, &r)| if i < context { targets[r] } else { 0.0 })
                .collect(),
            classes,
        }
    }
}

/// What the model says about a table.
#[derive(Clone, Debug, Default)]
pub struct Reading {
    /// Per query row: class probabilities (`classes` of them), or one value (the mean of the
    /// binned distribution) for regression.
    pub queries: Vec<Vec<f32>>,
    /// Per query row (regression): the distribution over bins (for the density of a value).
    pub query_bins: Vec<Vec<f32>>,
    /// Per requested cell: the mean of its binned distribution, in the column's units.
    pub cells: Vec<f32>,
    /// Per requested cell: negative log-density of its `observed` value.
    pub cell_nll: Vec<f32>,
    /// The target's context mean and standard deviation (regression).
    pub target_stats: (f32, f32),
}

pub struct Predictor<'a> {
    pub model: &'a TabularModel,
    pub params: &'a Params,
    pub borders: &'a [f32],
    /// Most context rows to read at once: a larger context is subsampled to this many rows
    /// per ensemble member (a different subset each), as TabPFN does for large tables, when no
    /// cells are read; the column attention's cost grows with the square of the rows.
    pub max_context: usize,
}

/// Bin centres and widths of the standardised value; the two open outer bins take their
/// neighbour's width.
pub fn bin_geometry(borders: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let n = borders.len();
    let inner = |k: usize| borders[k] - borders[k - 1];
    let mut centres = Vec::with_capacity(n + 1);
    let mut widths = Vec::with_capacity(n + 1);
    for k in 0..=n {
        let w = match k {
            0 => inner(1),
            k if k == n => inner(n - 1),
            k => inner(k),
        }
        .max(1e-6);
        let c = match k {
            0 => borders[0] - w / 2.0,
            k if k == n => borders[n - 1] + w / 2.0,
            k => (borders[k - 1] + borders[k]) / 2.0,
        };
        centres.push(c);
        widths.push(w);
    }
    (centres, widths)
}

fn softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f32 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// A cell to read: row, feature column, and the observed value to score (NaN: none).
#[derive(Clone, Copy, Debug)]
pub struct CellQuery {
    pub row: usize,
    pub col: usize,
    pub observed: f32,
}

impl Predictor<'_> {
    /// The model's reading of `t`, averaged over `ensemble` members (member 0 keeps the
    /// table as it is; the others permute its columns and, for classes, its labels). `cells`
    /// must be missing in `t.values` (the model reconstructs them from the rest).
    pub fn read(
        &self,
        t: &InferenceTable,
        cells: &[CellQuery],
        ensemble: usize,
        seed: u64,
    ) -> Result<Reading, CommError> {
        let k = t.classes as usize;
        let queries = t.rows - t.context_rows;
        let (centres, widths) = bin_geometry(self.borders);
        let bins = self.model.head.bins();
        let mut out = Reading {
            queries: vec![vec![0.0; if k == 0 { 1 } else { k }]; queries],
            query_bins: vec![vec![0.0; bins]; if k == 0 { queries } else { 0 }],
            cells: vec![0.0; cells.len()],
            cell_nll: vec![0.0; cells.len()],
            target_stats: (0.0, 1.0),
        };
        let members = ensemble.max(1);
        let mut cell_density = vec![0.0f32; cells.len()];
        let mut g = serial_group();
        let mut tp = Tp::new(&mut g, false);
        for m in 0..members {
            let mut rng = Stream::new(RngKey::new(seed).fold(0x656e_7365).fold(m as u64));
            // This member's rows: a subset of the context when it is larger than training's,
            // then every query row, in order.
            let rows: Vec<usize> = if cells.is_empty() && t.context_rows > self.max_context {
                let mut ctx: Vec<usize> = (0..t.context_rows).collect();
                rng.shuffle(&mut ctx);
                ctx.truncate(self.max_context);
                ctx.sort_unstable();
                ctx.into_iter().chain(t.context_rows..t.rows).collect()
            } else {
                (0..t.rows).collect()
            };
            let context_rows = rows.len() - queries;
            let mut order: Vec<usize> = (0..t.cols).collect();
            let mut relabel: Vec<usize> = (0..k).collect();
            if m > 0 {
                rng.shuffle(&mut order);
                rng.shuffle(&mut relabel);
            }
            let position: Vec<usize> = {
                let mut p = vec![0; t.cols];
                for (i, &c) in order.iter().enumerate() {
                    p[c] = i;
                }
                p
            };
            let values: Vec<f32> = rows
                .iter()
                .flat_map(|&r| order.iter().map(move |&c| t.values[r * t.cols + c]))
                .collect();
            let target = if k == 0 {
                Target::Values(rows.iter().map(|&r| t.targets[r]).collect())
            } else {
                Target::Classes {
                    k: t.classes,
                    labels: rows
                        .iter()
                        .map(|&r| {
                            if r < t.context_rows {
                                relabel[t.targets[r] as usize] as u32
                            } else {
                                0
                            }
                        })
                        .collect(),
                }
            };
            let table = Table {
                rows: rows.len(),
                cols: t.cols,
                context_rows,
                values,
                categories: vec![0; t.cols],
                target,
            };
            let b = collate(&[&table]);
            let width = b.cols + 1;
            let batch = TabularBatch {
                inputs: b.inputs(),
                real_rows: &[rows.len()],
                real_cols: &[t.cols],
                ids: RngKey::new(seed).fold(m as u64),
                borders: self.borders,
                step_tables: 1,
                hidden: &[],
                reconstruction_weight: 0.0,
            };
            let enc = self
                .model
                .encode(self.params, &mut tp, &batch, &StepContext::eval())?;
            let head = &self.model.head;
            let qcells: Vec<u32> = (context_rows..rows.len())
                .map(|r| (r * width) as u32)
                .collect();
            if !qcells.is_empty() {
                let task = if k == 0 {
                    Task::Regression
                } else {
                    Task::Classification
                };
                let logits = head.logits(self.params, &enc.output, &qcells, task);
                let w = if k == 0 { bins } else { MAX_CLASSES };
                for (q, row) in logits.data().chunks_exact(w).enumerate() {
                    if k == 0 {
                        let p = softmax(row);
                        let (mean, sd) = enc.target_stats[0];
                        let z: f32 = p.iter().zip(&centres).map(|(p, c)| p * c).sum();
                        out.queries[q][0] += (mean + sd * z) / members as f32;
                        for (d, v) in out.query_bins[q].iter_mut().zip(&p) {
                            *d += v / members as f32;
                        }
                        out.target_stats = (mean, sd);
                    } else {
                        let p = softmax(&row[..k]);
                        for (class, slot) in out.queries[q].iter_mut().enumerate() {
                            *slot += p[relabel[class]] / members as f32;
                        }
                    }
                }
            }
            if !cells.is_empty() {
                let ccells: Vec<u32> = cells
                    .iter()
                    .map(|c| (c.row * width + 1 + position[c.col]) as u32)
                    .collect();
                let logits = head.logits(self.params, &enc.output, &ccells, Task::Reconstruction);
                for (i, row) in logits.data().chunks_exact(bins).enumerate() {
                    let p = softmax(row);
                    let (mean, sd) = enc.column_stats[position[cells[i].col]];
                    let z: f32 = p.iter().zip(&centres).map(|(p, c)| p * c).sum();
                    out.cells[i] += (mean + sd * z) / members as f32;
                    let obs = cells[i].observed;
                    if !obs.is_nan() {
                        let zb =
                            megatron_core::models::tabular::bin_of((obs - mean) / sd, self.borders)
                                as usize;
                        cell_density[i] += p[zb] / (widths[zb] * sd) / members as f32;
                    }
                }
            }
        }
        for (nll, d) in out.cell_nll.iter_mut().zip(&cell_density) {
            *nll = -(d.max(1e-30)).ln();
        }
        Ok(out)
    }
}
