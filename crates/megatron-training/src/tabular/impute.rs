//! Imputation by conditional prediction (TabPFN's unsupervised imputation, Hollmann et al.
//! 2025, and `tabpfn-extensions`' `TabPFNUnsupervisedModel.impute`): each numeric feature
//! column with missing cells becomes the regression target of a table whose features are the
//! other columns and the table's own target (where known); the rows that observe the column
//! are the context, the rows missing it the queries, and the prediction (the mean of the binned
//! distribution) fills the cell. The supervised regression head is what pre-training trains
//! most, so it reads dependencies between columns better than the masked-cell head.

use super::frame::Frame;
use super::inference::{InferenceTable, Predictor};
use megatron_comm::CommError;

/// How `megatron tabular impute` fills feature cells.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ImputeMethod {
    /// Each numeric column predicted from the others by the regression head.
    #[default]
    Conditional,
    /// The masked-cell reconstruction head, all cells in one pass.
    Reconstruction,
}

/// Fills: (row, feature column, value) for each missing numeric feature cell of `f` whose
/// column is observed in at least 2 rows; `y` is the target per row (NaN where unknown).
pub fn conditional_fill(
    p: &Predictor<'_>,
    f: &Frame,
    y: &[f32],
    ensemble: usize,
    seed: u64,
) -> Result<Vec<(usize, usize, f32)>, CommError> {
    let cols = f.cols;
    let mut out = Vec::new();
    for c in 0..cols {
        if matches!(&f.levels[c], Some(l) if !l.is_empty()) {
            continue;
        }
        let at = |r: usize| f.values[r * cols + c];
        let observed: Vec<usize> = (0..f.rows).filter(|&r| !at(r).is_nan()).collect();
        let missing: Vec<usize> = (0..f.rows).filter(|&r| at(r).is_nan()).collect();
        if missing.is_empty() || observed.len() < 2 {
            continue;
        }
        let order: Vec<usize> = observed.iter().chain(&missing).copied().collect();
        // Features: every other column, then the table's target.
        let values: Vec<f32> = order
            .iter()
            .flat_map(|&r| {
                (0..cols)
                    .filter(move |&k| k != c)
                    .map(move |k| f.values[r * cols + k])
                    .chain(std::iter::once(y[r]))
            })
            .collect();
        let table = InferenceTable {
            rows: order.len(),
            cols,
            context_rows: observed.len(),
            values,
            targets: order
                .iter()
                .enumerate()
                .map(|(i, &r)| if i < observed.len() { at(r) } else { 0.0 })
                .collect(),
            classes: 0,
        };
        let reading = p.read(&table, &[], ensemble, seed.wrapping_add(c as u64))?;
        for (i, &r) in missing.iter().enumerate() {
            out.push((r, c, reading.queries[i][0]));
        }
    }
    Ok(out)
}
