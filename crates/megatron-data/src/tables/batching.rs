//! Batches of whole tables. Every training example is a table of its own shape, so a step's
//! tables are sorted by size and packed into micro-batches under a cell budget (padded rows x
//! padded columns x tables), with masks for the padding: similar shapes share a micro-batch,
//! little compute goes to padding, and micro-batches cost about the same (which keeps pipeline
//! stages balanced). Before batching each table gets a view: a random subset of its context rows
//! and a random column order, drawn from (seed, table index) so every layout sees the same
//! examples in the same order.

use super::prior::{Table, Target};
use super::stream::Stream;
use megatron_tensor::RngKey;

/// Rows are padded to a multiple of this, columns to [`COL_MULTIPLE`]: fewer distinct shapes.
pub const ROW_MULTIPLE: usize = 16;
pub const COL_MULTIPLE: usize = 4;

/// Table `index`'s training view: at most `max_context` of its context rows (a random subset,
/// in their original order) followed by its query rows, columns in a random order.
pub fn table_view(t: &Table, seed: u64, index: u64, max_context: usize) -> Table {
    let mut rng = Stream::new(RngKey::new(seed).fold(0x7669_6577).fold(index));
    let mut keep: Vec<usize> = (0..t.context_rows).collect();
    if t.context_rows > max_context {
        rng.shuffle(&mut keep);
        keep.truncate(max_context);
        keep.sort_unstable();
    }
    let context_rows = keep.len();
    keep.extend(t.context_rows..t.rows);
    let mut order: Vec<usize> = (0..t.cols).collect();
    rng.shuffle(&mut order);
    let values = keep
        .iter()
        .flat_map(|&r| order.iter().map(move |&c| t.values[r * t.cols + c]))
        .collect();
    let target = match &t.target {
        Target::Values(v) => Target::Values(keep.iter().map(|&r| v[r]).collect()),
        Target::Classes { k, labels } => Target::Classes {
            k: *k,
            labels: keep.iter().map(|&r| labels[r]).collect(),
        },
    };
    Table {
        rows: keep.len(),
        cols: t.cols,
        context_rows,
        values,
        categories: order.iter().map(|&c| t.categories[c]).collect(),
        target,
    }
}

fn padded(rows: usize, cols: usize) -> (usize, usize) {
    (
        rows.next_multiple_of(ROW_MULTIPLE),
        cols.next_multiple_of(COL_MULTIPLE),
    )
}

/// The size class of a table: padded rows and columns rounded up to powers of two. Only tables
/// of one class share a micro-batch, so no table is padded to more than twice its rows or
/// columns.
fn bucket(rows: usize, cols: usize) -> (usize, usize) {
    let (r, c) = padded(rows, cols);
    (r.next_power_of_two(), c.next_power_of_two())
}

/// Packs tables of shapes `(rows, cols)` into micro-batches of at most `cell_budget` padded
/// cells: tables are bucketed by size class (largest class first), and within a class each
/// micro-batch takes the next tables while tables x padded rows x padded columns (the largest
/// of each) fits. Returns indices into `shapes`, or an error naming a table that alone exceeds
/// the budget.
pub fn plan_micro_batches(
    shapes: &[(usize, usize)],
    cell_budget: usize,
) -> Result<Vec<Vec<usize>>, String> {
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        let (r, c) = padded(rows, cols);
        if r * c > cell_budget {
            return Err(format!(
                "table {i} ({rows} rows x {cols} columns, padded {r} x {c} = {} cells) exceeds the cell budget of {cell_budget} per micro-batch",
                r * c
            ));
        }
    }
    let mut order: Vec<usize> = (0..shapes.len()).collect();
    // Largest class first; within a class by padded size, largest first; ties by index.
    order.sort_by_key(|&i| {
        let (rows, cols) = shapes[i];
        let (br, bc) = bucket(rows, cols);
        let (r, c) = padded(rows, cols);
        (
            std::cmp::Reverse(br * bc),
            std::cmp::Reverse(br),
            std::cmp::Reverse(r * c),
            i,
        )
    });
    let mut out: Vec<Vec<usize>> = Vec::new();
    let (mut cur, mut class, mut max_r, mut max_c) = (Vec::new(), (0, 0), 0, 0);
    for i in order {
        let (rows, cols) = shapes[i];
        let (r, c) = padded(rows, cols);
        let b = bucket(rows, cols);
        let (nr, nc) = (max_r.max(r), max_c.max(c));
        if !cur.is_empty() && (b != class || (cur.len() + 1) * nr * nc > cell_budget) {
            out.push(std::mem::take(&mut cur));
            (max_r, max_c) = (r, c);
        } else {
            (max_r, max_c) = (nr, nc);
        }
        class = b;
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    Ok(out)
}

/// One micro-batch of tables, padded to `[b, rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TableBatch {
    pub b: usize,
    pub rows: usize,
    pub cols: usize,
    /// `[b, rows, cols]`; missing and padding cells hold 0.
    pub values: Vec<f32>,
    /// `[b, rows, cols]`: 1 where a cell was missing in the table (not padding).
    pub missing: Vec<f32>,
    /// `[b, rows]` / `[b, cols]`: 1 for real rows / columns, 0 for padding.
    pub row_valid: Vec<f32>,
    pub col_valid: Vec<f32>,
    /// Per table: context rows (queries follow), classes (0 for regression), levels per column.
    pub context_rows: Vec<usize>,
    pub classes: Vec<u32>,
    pub categories: Vec<u32>,
    /// `[b, rows]`: class index or value of each row's target (0 on padding).
    pub targets: Vec<f32>,
}

impl TableBatch {
    /// The batch as the model's feature kernel reads it.
    pub fn inputs(&self) -> megatron_tensor::cpu::TableInputs<'_> {
        megatron_tensor::cpu::TableInputs {
            b: self.b,
            rows: self.rows,
            cols: self.cols,
            values: &self.values,
            missing: &self.missing,
            row_valid: &self.row_valid,
            col_valid: &self.col_valid,
            targets: &self.targets,
            context_rows: &self.context_rows,
            classes: &self.classes,
        }
    }
}

/// Pads `tables` into one [`TableBatch`].
pub fn collate(tables: &[&Table]) -> TableBatch {
    let b = tables.len();
    let rows = tables.iter().map(|t| t.rows).max().unwrap_or(0);
    let cols = tables.iter().map(|t| t.cols).max().unwrap_or(0);
    let (rows, cols) = padded(rows, cols);
    let mut out = TableBatch {
        b,
        rows,
        cols,
        values: vec![0.0; b * rows * cols],
        missing: vec![0.0; b * rows * cols],
        row_valid: vec![0.0; b * rows],
        col_valid: vec![0.0; b * cols],
        context_rows: Vec::with_capacity(b),
        classes: Vec::with_capacity(b),
        categories: vec![0; b * cols],
        targets: vec![0.0; b * rows],
    };
    for (i, t) in tables.iter().enumerate() {
        for r in 0..t.rows {
            out.row_valid[i * rows + r] = 1.0;
            for c in 0..t.cols {
                let v = t.values[r * t.cols + c];
                let at = (i * rows + r) * cols + c;
                if v.is_nan() {
                    out.missing[at] = 1.0;
                } else {
                    out.values[at] = v;
                }
            }
        }
        for c in 0..t.cols {
            out.col_valid[i * cols + c] = 1.0;
            out.categories[i * cols + c] = t.categories[c];
        }
        out.context_rows.push(t.context_rows);
        match &t.target {
            Target::Values(v) => {
                out.classes.push(0);
                out.targets[i * rows..i * rows + t.rows].copy_from_slice(v);
            }
            Target::Classes { k, labels } => {
                out.classes.push(*k);
                for (d, &l) in out.targets[i * rows..].iter_mut().zip(labels) {
                    *d = l as f32;
                }
            }
        }
    }
    out
}

/// The micro-batches data-parallel rank `rank` of `size` runs: every `size`-th, so the step's
/// tables are split the same way on every layout of the same data-parallel size, and the
/// loss, a sum over all tables divided by their number, does not depend on the split.
pub fn data_parallel_share<T: Clone>(micro_batches: &[T], rank: usize, size: usize) -> Vec<T> {
    micro_batches
        .iter()
        .skip(rank)
        .step_by(size.max(1))
        .cloned()
        .collect()
}
