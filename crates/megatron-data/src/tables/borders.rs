//! Borders of the regression head's bins, from the prior itself (TabPFN's "bar distribution":
//! Müller et al. 2022, "Transformers Can Do Bayesian Inference", borders at quantiles of targets
//! the prior produces): the targets of sampled regression tables, each standardised with its
//! own context rows' mean and standard deviation (as the model sees them), pooled, and cut at
//! `bins` equal-probability quantiles.

use super::prior::{sample_table, PriorConfig, Target};

/// `bins - 1` increasing borders from regression tables among `tables` tables of the prior
/// `(cfg, seed)` (tables `u64::MAX - tables ..`, apart from the ones training starts with).
pub fn regression_borders(cfg: &PriorConfig, seed: u64, tables: u64, bins: usize) -> Vec<f32> {
    let mut z: Vec<f32> = Vec::new();
    for i in 0..tables {
        let t = sample_table(cfg, seed, u64::MAX - i);
        let Target::Values(y) = &t.target else {
            continue;
        };
        let ctx = &y[..t.context_rows];
        let n = ctx.len() as f64;
        let mean = ctx.iter().map(|&v| v as f64).sum::<f64>() / n;
        let sd = (ctx.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        let sd = if sd > 1e-6 { sd } else { 1.0 };
        z.extend(y.iter().map(|&v| ((v as f64 - mean) / sd) as f32));
    }
    z.sort_by(f32::total_cmp);
    if z.is_empty() {
        return Vec::new();
    }
    let mut borders: Vec<f32> = (1..bins).map(|k| z[(k * (z.len() - 1)) / bins]).collect();
    // Ties (quantised targets) would make empty bins: nudge to strictly increasing.
    for k in 1..borders.len() {
        if borders[k] <= borders[k - 1] {
            borders[k] = borders[k - 1] + 1e-4;
        }
    }
    borders
}
