//! What turns a clean causal sample into a realistic table (TabPFN v1/v2 priors): Kumaraswamy
//! warping of a column's distribution, quantisation to a few levels, and cells missing
//! completely at random.

use super::stream::Stream;

/// Maps a column through the Kumaraswamy CDF `1 - (1 - x^a)^b` after scaling it to [0, 1]:
/// skews and bends the marginal the way real measurements are (TabPFN v1's input warping).
pub fn kumaraswamy_warp(col: &mut [f64], a: f64, b: f64) {
    let (lo, hi) = min_max(col);
    if hi - lo < 1e-12 {
        return;
    }
    for v in col.iter_mut() {
        let x = ((*v - lo) / (hi - lo)).clamp(0.0, 1.0);
        *v = 1.0 - (1.0 - x.powf(a)).powf(b);
    }
}

/// Rounds a column to `levels` equally spaced values between its extremes (an ordinal or
/// coarsely measured feature).
pub fn quantize(col: &mut [f64], levels: usize) {
    let (lo, hi) = min_max(col);
    if hi - lo < 1e-12 || levels < 2 {
        return;
    }
    let step = (hi - lo) / (levels - 1) as f64;
    for v in col.iter_mut() {
        *v = lo + ((*v - lo) / step).round() * step;
    }
}

/// Each cell goes missing (NaN) with probability `p`, independently of everything.
pub fn mcar(rng: &mut Stream, col: &mut [f64], p: f64) {
    for v in col.iter_mut() {
        if rng.chance(p) {
            *v = f64::NAN;
        }
    }
}

fn min_max(col: &[f64]) -> (f64, f64) {
    col.iter()
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}
