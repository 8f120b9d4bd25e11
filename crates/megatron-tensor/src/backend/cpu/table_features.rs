//! The per-cell input features of the tabular model, before its learned embedding (a linear
//! layer). TabPFN v2 (Hollmann et al. 2025, Methods) standardises each feature with statistics of
//! the training (context) rows, marks missing values, and tells columns apart with a random
//! vector per column rather than a learned position (so the model stays indifferent to column
//! order); the target is one more column, known on context rows and unknown on query rows.
//!
//! Layout: cells `[b, rows, 1 + cols, FEATURES]`, the target column first. A cell's features:
//! `[z, missing, id_0..id_{ID}, target_z, class one-hot (MAX_CLASSES), target_unknown]`.

use crate::rng::RngKey;

/// Width of a column's random identity vector.
pub const ID: usize = 8;
/// Most classes a classification target may have.
pub const MAX_CLASSES: usize = 10;
pub const FEATURES: usize = 2 + ID + 1 + MAX_CLASSES + 1;
/// Standardised values are clipped to this magnitude (outliers in a tiny context).
pub const CLIP: f32 = 10.0;

const Z: usize = 0;
const MISSING: usize = 1;
const IDS: usize = 2;
const TARGET_Z: usize = IDS + ID;
const CLASSES: usize = TARGET_Z + 1;
const UNKNOWN: usize = CLASSES + MAX_CLASSES;

/// A padded batch of tables as [`table_features`] reads it (`megatron_data::tables` collates
/// it): `values`/`missing` `[b, rows, cols]`, `row_valid` `[b, rows]`, `col_valid` `[b, cols]`,
/// `targets` `[b, rows]` (class index or value), per table `context_rows` and `classes` (0:
/// regression).
#[derive(Clone, Copy)]
pub struct TableInputs<'a> {
    pub b: usize,
    pub rows: usize,
    pub cols: usize,
    pub values: &'a [f32],
    pub missing: &'a [f32],
    pub row_valid: &'a [f32],
    pub col_valid: &'a [f32],
    pub targets: &'a [f32],
    pub context_rows: &'a [usize],
    pub classes: &'a [u32],
}

/// Mean and standard deviation over the context rows of `x(r)` where `keep(r)`; (0, 1) when
/// fewer than two values or no spread.
fn context_stats(n: usize, x: impl Fn(usize) -> f32, keep: impl Fn(usize) -> bool) -> (f32, f32) {
    let (mut s, mut k) = (0.0f64, 0usize);
    for r in (0..n).filter(|&r| keep(r)) {
        s += x(r) as f64;
        k += 1;
    }
    if k < 2 {
        return (0.0, 1.0);
    }
    let mean = s / k as f64;
    let var = (0..n)
        .filter(|&r| keep(r))
        .map(|r| (x(r) as f64 - mean).powi(2))
        .sum::<f64>()
        / k as f64;
    let sd = var.sqrt();
    (mean as f32, if sd > 1e-6 { sd as f32 } else { 1.0 })
}

/// Context means and standard deviations the features were standardised with.
pub struct TableStats<'a> {
    /// Per table: the regression target's (to turn predictions back into values; (0, 1) for
    /// classification).
    pub target: &'a mut [(f32, f32)],
    /// Per table and column `[b, cols]` ((0, 1) on padding columns).
    pub columns: &'a mut [(f32, f32)],
}

/// Writes `out` (`[b, rows, 1 + cols, FEATURES]`, zero on padding) and the statistics used.
/// `ids` keys the columns' random identities (a fresh key per step in training; any fixed key
/// at inference, or one per ensemble member).
pub fn table_features(out: &mut [f32], stats: TableStats, t: TableInputs, ids: RngKey) {
    let (target_stats, columns) = (stats.target, stats.columns);
    let (rows, cols) = (t.rows, t.cols);
    assert_eq!(target_stats.len(), t.b);
    assert_eq!(columns.len(), t.b * cols);
    columns.fill((0.0, 1.0));
    for (tb, tstat) in target_stats.iter_mut().enumerate() {
        let ctx = t.context_rows[tb].min(rows);
        let cell = |r: usize, c: usize| (tb * rows + r) * cols + c;
        for c in 0..cols {
            if t.col_valid[tb * cols + c] == 0.0 {
                continue;
            }
            let present = |r: usize| t.missing[cell(r, c)] == 0.0;
            columns[tb * cols + c] = context_stats(ctx, |r| t.values[cell(r, c)], present);
        }
        let y = |r: usize| t.targets[tb * rows + r];
        *tstat = if t.classes[tb] == 0 {
            context_stats(ctx, y, |_| true)
        } else {
            (0.0, 1.0)
        };
    }
    let positions: Vec<usize> = (0..rows).collect();
    table_features_with_stats(out, target_stats, columns, t, &positions, ids);
}

/// Per table, the target's and then each column's `(sum, count)` over the context rows this
/// rank holds (`positions`: each local row's row in the whole table) or, given `centre` (per
/// table the target's and each column's mean, laid out the same way), `(sum of squared
/// deviations, count)`. With rows split over ranks (context parallelism) the ranks add these
/// up to get the statistics [`table_features`] computes on one rank.
pub fn table_context_partials(
    t: TableInputs,
    positions: &[usize],
    centre: Option<&[f64]>,
) -> Vec<f64> {
    let (rows, cols) = (t.rows, t.cols);
    let width = 1 + cols;
    let mut out = vec![0.0f64; t.b * width * 2];
    for tb in 0..t.b {
        let ctx = t.context_rows[tb];
        let local = (0..rows).filter(|&r| positions[r] < ctx && t.row_valid[tb * rows + r] > 0.0);
        for r in local {
            for c in 0..width {
                let v = if c == 0 {
                    if t.classes[tb] != 0 {
                        continue;
                    }
                    t.targets[tb * rows + r]
                } else {
                    let at = (tb * rows + r) * cols + c - 1;
                    if t.col_valid[tb * cols + c - 1] == 0.0 || t.missing[at] != 0.0 {
                        continue;
                    }
                    t.values[at]
                } as f64;
                let slot = (tb * width + c) * 2;
                out[slot] += match centre {
                    None => v,
                    Some(m) => (v - m[tb * width + c]).powi(2),
                };
                out[slot + 1] += 1.0;
            }
        }
    }
    out
}

/// Means from summed [`table_context_partials`] (0 with fewer than two values).
pub fn context_means(sums: &[f64]) -> Vec<f64> {
    sums.chunks_exact(2)
        .map(|p| if p[1] < 2.0 { 0.0 } else { p[0] / p[1] })
        .collect()
}

/// `(mean, sd)` per entry from the means and summed squared deviations, as [`table_features`]
/// computes them ((0, 1) with fewer than two values or no spread).
pub fn context_mean_sd(means: &[f64], squares: &[f64]) -> Vec<(f32, f32)> {
    means
        .iter()
        .zip(squares.chunks_exact(2))
        .map(|(&m, p)| {
            if p[1] < 2.0 {
                return (0.0, 1.0);
            }
            let sd = (p[0] / p[1]).sqrt();
            (m as f32, if sd > 1e-6 { sd as f32 } else { 1.0 })
        })
        .collect()
}

/// [`table_features`] with the statistics given (`target_stats` per table, `columns`
/// `[b, cols]`) for rows at `positions` of their tables (rows at or past a table's context
/// rows are queries).
pub fn table_features_with_stats(
    out: &mut [f32],
    target_stats: &[(f32, f32)],
    columns: &[(f32, f32)],
    t: TableInputs,
    positions: &[usize],
    ids: RngKey,
) {
    let (rows, cols) = (t.rows, t.cols);
    let width = 1 + cols;
    assert_eq!(out.len(), t.b * rows * width * FEATURES);
    assert_eq!(positions.len(), rows);
    out.fill(0.0);
    for (tb, &(tmean, tsd)) in target_stats.iter().enumerate() {
        let ctx = t.context_rows[tb];
        let cell = |r: usize, c: usize| (tb * rows + r) * cols + c;
        let real_row = |r: usize| t.row_valid[tb * rows + r] > 0.0;
        let base = |r: usize, c: usize| ((tb * rows + r) * width + c) * FEATURES;
        // Feature columns 1..=cols.
        for c in 0..cols {
            if t.col_valid[tb * cols + c] == 0.0 {
                continue;
            }
            let present = |r: usize| t.missing[cell(r, c)] == 0.0;
            let (mean, sd) = columns[tb * cols + c];
            let key = ids.fold(tb as u64).fold(c as u64);
            for r in (0..rows).filter(|&r| real_row(r)) {
                let o = &mut out[base(r, 1 + c)..base(r, 1 + c) + FEATURES];
                if present(r) {
                    o[Z] = ((t.values[cell(r, c)] - mean) / sd).clamp(-CLIP, CLIP);
                } else {
                    o[MISSING] = 1.0;
                }
                for (j, v) in o[IDS..IDS + ID].iter_mut().enumerate() {
                    *v = key.normal(j as u64);
                }
            }
        }
        // The target column.
        let y = |r: usize| t.targets[tb * rows + r];
        let k = t.classes[tb] as usize;
        for r in (0..rows).filter(|&r| real_row(r)) {
            let o = &mut out[base(r, 0)..base(r, 0) + FEATURES];
            if positions[r] >= ctx {
                o[UNKNOWN] = 1.0;
            } else if k == 0 {
                o[TARGET_Z] = ((y(r) - tmean) / tsd).clamp(-CLIP, CLIP);
            } else {
                o[CLASSES + (y(r) as usize).min(MAX_CLASSES - 1)] = 1.0;
            }
        }
    }
}
