//! A training step's tables as micro-batches: each table's view (context subset, column order),
//! the feature cells hidden for reconstruction, all drawn from (seed, table index) so that every
//! layout sees the same examples; then bucketing under the cell budget and padding.

use megatron_core::models::tabular::HiddenCell;
use megatron_data::tables::batching::{collate, plan_micro_batches, table_view, TableBatch};
use megatron_data::tables::stream::Stream;
use megatron_data::tables::Table;
use megatron_tensor::RngKey;

/// One micro-batch: the padded tables, their real sizes and the cells hidden from the input.
pub struct MicroBatch {
    pub batch: TableBatch,
    pub real_rows: Vec<usize>,
    pub real_cols: Vec<usize>,
    pub hidden: Vec<HiddenCell>,
    /// Its index in the step's plan (keys the random column identities).
    pub index: usize,
}

impl MicroBatch {
    pub fn cells(&self) -> usize {
        self.batch.b * self.batch.rows * self.batch.cols
    }
}

/// How a step's tables become micro-batches.
#[derive(Clone, Copy, Debug)]
pub struct StepBatching {
    pub seed: u64,
    pub max_context: usize,
    pub cell_budget: usize,
    pub hidden_share: f64,
}

/// The feature cells of `view` (table `index`) hidden for reconstruction: each observed cell
/// with probability `share`, never all of a column's context cells (its statistics need some).
pub fn hidden_cells(view: &Table, seed: u64, index: u64, share: f64) -> Vec<(usize, usize)> {
    let mut rng = Stream::new(RngKey::new(seed).fold(0x6869_6465).fold(index));
    let mut out = Vec::new();
    for c in 0..view.cols {
        let mut kept_context = 0;
        let mut col = Vec::new();
        for r in 0..view.rows {
            if view.values[r * view.cols + c].is_nan() {
                continue;
            }
            if rng.chance(share) {
                col.push((r, c));
            } else if r < view.context_rows {
                kept_context += 1;
            }
        }
        if kept_context >= 2 {
            out.extend(col);
        }
    }
    out
}

/// The step's micro-batches from its `tables`, the first of which is global table `first`.
pub fn step_micro_batches(
    tables: &[Table],
    first: u64,
    how: StepBatching,
) -> Result<Vec<MicroBatch>, String> {
    let views: Vec<(Table, Vec<(usize, usize)>)> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let index = first + i as u64;
            let v = table_view(t, how.seed, index, how.max_context);
            let h = hidden_cells(&v, how.seed, index, how.hidden_share);
            (v, h)
        })
        .collect();
    let shapes: Vec<(usize, usize)> = views.iter().map(|(v, _)| (v.rows, v.cols)).collect();
    let plan = plan_micro_batches(&shapes, how.cell_budget)?;
    Ok(plan
        .into_iter()
        .enumerate()
        .map(|(index, members)| {
            let refs: Vec<&Table> = members.iter().map(|&i| &views[i].0).collect();
            let mut batch = collate(&refs);
            let mut hidden = Vec::new();
            for (tb, &i) in members.iter().enumerate() {
                let v = &views[i].0;
                for &(r, c) in &views[i].1 {
                    let at = (tb * batch.rows + r) * batch.cols + c;
                    batch.missing[at] = 1.0;
                    batch.values[at] = 0.0;
                    hidden.push(HiddenCell {
                        table: tb,
                        row: r,
                        col: c,
                        value: v.values[r * v.cols + c],
                    });
                }
            }
            MicroBatch {
                real_rows: refs.iter().map(|t| t.rows).collect(),
                real_cols: refs.iter().map(|t| t.cols).collect(),
                batch,
                hidden,
                index,
            }
        })
        .collect())
}
