//! Borders of the regression head's bins, from the prior itself (TabPFN's "bar distribution":
//! Müller et al. 2022, "Transformers Can Do Bayesian Inference", borders at quantiles of targets
//! the prior produces): the targets of sampled regression tables, each standardised with its
//! own context rows' mean and standard deviation (as the model sees them), pooled, and cut at
//! `bins` equal-probability quantiles. Equal-probability bins leave the last 1/`bins` of each
//! side in one open bin, whose mean is all a prediction there can be; fixed tail borders
//! beyond the quantiles ([`with_tails`]) let a prediction reach values several standard
//! deviations out, as real columns with skewed or heavy-tailed values need (the PFN bar
//! distribution gives its outer bins half-normal tails for the same reason).

use super::prior::{sample_table, PriorConfig, Target};

/// The standardised targets of regression tables among `tables` tables of the prior
/// `(cfg, seed)` (tables `u64::MAX - tables ..`, apart from the ones training starts with),
/// sorted.
fn standardised_targets(cfg: &PriorConfig, seed: u64, tables: u64) -> Vec<f32> {
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
    z
}

/// `bins - 1` increasing borders at equal-probability quantiles of the standardised targets of
/// regression tables among `tables` tables of the prior `(cfg, seed)`.
pub fn regression_borders(cfg: &PriorConfig, seed: u64, tables: u64, bins: usize) -> Vec<f32> {
    let z = standardised_targets(cfg, seed, tables);
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

/// `body` (increasing borders) with `-t` and `t` added for each of `tails` (positive
/// standardised values) that lies beyond the body's outermost border on that side. Borders the
/// body already reaches are left out, so extending twice with the same tails changes nothing.
pub fn with_tails(body: &[f32], tails: &[f32]) -> Vec<f32> {
    let (Some(&lo), Some(&hi)) = (body.first(), body.last()) else {
        return body.to_vec();
    };
    let mut out: Vec<f32> = tails.iter().map(|&t| -t).filter(|&t| t < lo).collect();
    out.extend_from_slice(body);
    out.extend(tails.iter().copied().filter(|&t| t > hi));
    out.sort_by(f32::total_cmp);
    out.dedup();
    out
}

/// The share of the standardised regression targets of `tables` prior tables (as in
/// [`regression_borders`]) in each of the `borders.len() + 1` bins, each bin counted with half
/// a target more so that no share is zero.
pub fn bin_shares(cfg: &PriorConfig, seed: u64, tables: u64, borders: &[f32]) -> Vec<f64> {
    let z = standardised_targets(cfg, seed, tables);
    let mut counts = vec![0.5f64; borders.len() + 1];
    for v in z {
        counts[borders.partition_point(|&b| b < v)] += 1.0;
    }
    let total: f64 = counts.iter().sum();
    counts.into_iter().map(|c| c / total).collect()
}
