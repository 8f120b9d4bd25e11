//! Imputation by conditional prediction (TabPFN's unsupervised imputation, Hollmann et al.
//! 2025, and `tabpfn-extensions`' `TabPFNUnsupervisedModel.impute`): each numeric feature
//! column with missing cells becomes the regression target of a table whose features are the
//! other columns and the table's own target (where known); the rows that observe the column
//! are the context, the rows missing it the queries, and the prediction (the mean of the binned
//! distribution) fills the cell. The supervised regression head is what pre-training trains
//! most, so it reads dependencies between columns better than the masked-cell head.

use super::frame::Frame;
use super::inference::{InferenceTable, Predictor};
use super::linear_base::{read_regression, RegressionBase};
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
/// After the first of `rounds`, each column is predicted again from the others as the last
/// round filled them (chained equations, as IterativeImputer does: van Buuren and
/// Groothuis-Oudshoorn 2011), so that a row missing several cells reads its other gaps as
/// estimates rather than as missing.
pub fn conditional_fill(
    p: &Predictor<'_>,
    f: &Frame,
    y: &[f32],
    base: RegressionBase,
    ensemble: usize,
    seed: u64,
    rounds: usize,
) -> Result<Vec<(usize, usize, f32)>, CommError> {
    let mut current = f.values.clone();
    let mut out = Vec::new();
    for _ in 0..rounds.max(1) {
        out = fill_round(p, f, &current, y, base, ensemble, seed)?;
        for &(r, c, v) in &out {
            current[r * f.cols + c] = v;
        }
    }
    Ok(out)
}

/// One round: each column's missing cells of `f` predicted from `current` (`f`'s values, or
/// with the last round's fills) of the other columns.
fn fill_round(
    p: &Predictor<'_>,
    f: &Frame,
    current: &[f32],
    y: &[f32],
    base: RegressionBase,
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
                    .map(move |k| current[r * cols + k])
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
        let filled = read_regression(p, &table, base, ensemble, seed.wrapping_add(c as u64))?;
        for (&r, v) in missing.iter().zip(filled) {
            out.push((r, c, v));
        }
    }
    Ok(out)
}
