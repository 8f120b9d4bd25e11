//! A linear base under the model's regression (`--regression-base linear`): a ridge regression
//! of the target on the features is fitted to the context rows, the model reads the table with
//! the context targets replaced by their leave-one-out residuals, and a query's prediction is
//! the ridge's plus the model's predicted residual.
//!
//! Why: the in-context model reads a query much as a kernel regression reads its neighbours, so
//! it does not extrapolate. A cell beyond the context's range (breast_cancer's skewed columns
//! reach 11 sd; their largest values are near-linear in other columns) came back near the edge
//! of what the context holds: 1.9 sd for a true 9-11 sd, where a linear fit gives 8-9. The
//! ridge carries the linear trend, extrapolating as IterativeImputer's does; the model reads
//! what is left, which stays within the context's range. Leave-one-out residuals (from the hat
//! matrix, as in Allen 1974's PRESS) rather than in-sample ones, so that the model reads the
//! residuals a new row will have. The ridge penalty is the one of a log grid with the least
//! leave-one-out error (PRESS, Allen 1974, as scikit-learn's `RidgeCV` chooses): a fixed penalty
//! under-regularised the small, collinear tables (wine: 178 rows, 13 columns), where an
//! adaptive one (IterativeImputer's `BayesianRidge`) does better. A positive target may be
//! fitted as its logarithm on the logarithms of the positive features (see [`LinearBase::fit`]):
//! breast_cancer's sizes are powers of one another. The model's correction is added with a
//! weight fitted on held-out context rows ([`correction_weight`]). The p+1 system (p <= the
//! model's features + 1, a hundred or so) is solved by a Cholesky factorisation written here
//! rather than a linear-algebra crate for a few small solves per column.

use super::inference::{InferenceTable, Predictor};
use megatron_comm::CommError;

/// What a regression's prediction is built on.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RegressionBase {
    /// A ridge regression on the context, plus the model's reading of its residuals.
    #[default]
    Linear,
    /// The model's reading of the target itself.
    None,
}

/// Ridge penalties on the standardised features tried by [`LinearBase::fit`]: 10^-2 .. 10^3 in
/// half decades (`RidgeCV`'s default grid is 0.1, 1, 10; wider here because a context's rows
/// range from tens to a thousand).
pub const PENALTIES: [f64; 11] = [
    0.01, 0.0316, 0.1, 0.316, 1.0, 3.16, 10.0, 31.6, 100.0, 316.0, 1000.0,
];

/// A ridge regression of the target on `InferenceTable` features: missing features read as
/// the context's mean, features standardised by the context's statistics, intercept free.
pub struct LinearBase {
    standard: Standardisation,
    beta: Vec<f64>,
    penalty: f64,
    target: TargetScale,
}

/// The scale the base fits the target on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TargetScale {
    /// The target as it is.
    Identity,
    /// `ln y` on the logarithms of the table's positive feature columns; a prediction is
    /// `smear * exp(fit)`, the fit clamped to `low..=high` (the context's range of `ln y`
    /// widened by its width on each side, so that a query far outside the context cannot
    /// overflow).
    Log { smear: f64, low: f64, high: f64 },
}

/// The context's per-feature mean and standard deviation, on the scale each feature is read
/// on (`logged`: its logarithm).
#[derive(Clone)]
struct Standardisation {
    logged: Vec<bool>,
    mean: Vec<f64>,
    scale: Vec<f64>,
}

impl Standardisation {
    fn of_context(t: &InferenceTable, logged: Vec<bool>) -> Self {
        let mut mean = vec![0.0; t.cols];
        let mut scale = vec![1.0; t.cols];
        for c in 0..t.cols {
            let seen: Vec<f64> = (0..t.context_rows)
                .map(|r| read(t.values[r * t.cols + c], logged[c]))
                .filter(|v| !v.is_nan())
                .collect();
            if seen.is_empty() {
                continue;
            }
            let m = seen.iter().sum::<f64>() / seen.len() as f64;
            let var = seen.iter().map(|v| (v - m).powi(2)).sum::<f64>() / seen.len() as f64;
            mean[c] = m;
            scale[c] = if var > 1e-18 { var.sqrt() } else { 1.0 };
        }
        Standardisation {
            logged,
            mean,
            scale,
        }
    }

    /// The standardised design row of row `r` of `t`: 1 then the features.
    fn design(&self, t: &InferenceTable, r: usize) -> Vec<f64> {
        std::iter::once(1.0)
            .chain((0..t.cols).map(|c| {
                let v = read(t.values[r * t.cols + c], self.logged[c]);
                if v.is_nan() {
                    0.0
                } else {
                    (v - self.mean[c]) / self.scale[c]
                }
            }))
            .collect()
    }
}

/// A cell as the base reads it: its value, or its logarithm (NaN stays NaN).
fn read(v: f32, logged: bool) -> f64 {
    if logged {
        (v as f64).ln()
    } else {
        v as f64
    }
}

impl LinearBase {
    pub fn predict(&self, t: &InferenceTable, r: usize) -> f64 {
        let fit = dot(&self.beta, &self.standard.design(t, r));
        match self.target {
            TargetScale::Identity => fit,
            TargetScale::Log { smear, low, high } => smear * fit.clamp(low, high).exp(),
        }
    }

    /// The ridge penalty of the fit.
    pub fn penalty(&self) -> f64 {
        self.penalty
    }

    /// The scale the fit reads the target on.
    pub fn target_scale(&self) -> TargetScale {
        self.target
    }

    /// Fits the context rows of `t` (targets `t.targets[..context_rows]`) at the penalty of
    /// [`PENALTIES`] with the least sum of squared leave-one-out residuals (PRESS) in the
    /// target's units, on the target's own scale or, where its PRESS is less by more than one
    /// standard error, the log scale; returns the fit and each context row's leave-one-out
    /// residual.
    ///
    /// Why a log scale: measurements of size (breast_cancer's radius, perimeter and area) are
    /// related by powers, which are linear between logarithms; a ridge on the raw values
    /// misses them and the model, reading residuals in context, does not extrapolate. The log
    /// scale is tried where every context target is positive, on the logarithms of the feature
    /// columns positive in every row (TabPFN v2 likewise reads features through power
    /// transforms: Hollmann et al. 2025), and is back-transformed with Duan's (1983) smearing
    /// estimate, the mean of `exp` of the leave-one-out residuals, since `exp` of a mean log is
    /// the median, below the mean a squared error wants.
    pub fn fit(t: &InferenceTable) -> (Self, Vec<f64>) {
        let identity = Self::fit_identity(t);
        let Some(log) = Self::fit_log(t) else {
            return identity;
        };
        // The one-standard-error rule (Breiman et al. 1984; Hastie et al., ESL 7.10): the log
        // scale only where it beats the target's own by more than the standard error of the
        // difference, so that a near tie stays on the simpler scale.
        let d: Vec<f64> = identity
            .1
            .iter()
            .zip(&log.1)
            .map(|(a, b)| a * a - b * b)
            .collect();
        let n = d.len() as f64;
        let mean = d.iter().sum::<f64>() / n;
        let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        if mean * n > (n * var).sqrt() {
            log
        } else {
            identity
        }
    }

    /// The fit on the target's own scale at the penalty with the least leave-one-out error.
    pub fn fit_identity(t: &InferenceTable) -> (Self, Vec<f64>) {
        least_press(&Problem::new(t, Scale::Target))
    }

    /// The fit on the log scale at the penalty with the least leave-one-out error (residuals
    /// in the target's units), or `None` where a context target is not positive.
    pub fn fit_log(t: &InferenceTable) -> Option<(Self, Vec<f64>)> {
        let positive = |v: &f32| v.is_finite() && *v > 0.0;
        t.targets[..t.context_rows]
            .iter()
            .all(positive)
            .then(|| least_press(&Problem::new(t, Scale::Log)))
    }

    /// Fits the context rows of `t` at ridge penalty `penalty` on the target's own scale;
    /// returns the fit and each context row's leave-one-out residual.
    pub fn fit_penalised(t: &InferenceTable, penalty: f64) -> (Self, Vec<f64>) {
        Problem::new(t, Scale::Target).solve(penalty)
    }
}

/// The fit of `problem` at the penalty of [`PENALTIES`] with the least sum of squared
/// leave-one-out residuals (the first on a tie), and those residuals.
fn least_press(problem: &Problem) -> (LinearBase, Vec<f64>) {
    let mut best: Option<(f64, LinearBase, Vec<f64>)> = None;
    for &penalty in &PENALTIES {
        let (fit, loo) = problem.solve(penalty);
        let press = loo.iter().map(|e| e * e).sum::<f64>();
        if best.as_ref().is_none_or(|(b, _, _)| press < *b) {
            best = Some((press, fit, loo));
        }
    }
    let (_, fit, loo) = best.expect("PENALTIES is not empty");
    (fit, loo)
}

/// The scale a [`Problem`] is posed on (its fit's [`TargetScale`] follows from the solve).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scale {
    Target,
    Log,
}

/// The normal equations of a context on one scale, shared by the penalties tried.
struct Problem {
    standard: Standardisation,
    scale: Scale,
    rows: Vec<Vec<f64>>,
    /// The context targets in their units.
    y: Vec<f64>,
    /// The context targets on the fit's scale.
    fitted: Vec<f64>,
    gram: Vec<f64>,
    rhs: Vec<f64>,
}

impl Problem {
    /// The problem on `scale`; on the log scale, every feature column positive in all of `t`'s
    /// rows is read as its log.
    fn new(t: &InferenceTable, scale: Scale) -> Self {
        let n = t.context_rows;
        let logged = (0..t.cols)
            .map(|c| {
                scale == Scale::Log
                    && (0..t.rows).all(|r| {
                        let v = t.values[r * t.cols + c];
                        v.is_nan() || (v.is_finite() && v > 0.0)
                    })
            })
            .collect();
        let standard = Standardisation::of_context(t, logged);
        let rows: Vec<Vec<f64>> = (0..n).map(|r| standard.design(t, r)).collect();
        let y: Vec<f64> = t.targets[..n].iter().map(|&v| v as f64).collect();
        let fitted: Vec<f64> = match scale {
            Scale::Target => y.clone(),
            Scale::Log => y.iter().map(|v| v.ln()).collect(),
        };
        let k = t.cols + 1;
        let mut gram = vec![0.0; k * k];
        let mut rhs = vec![0.0; k];
        for (z, &yi) in rows.iter().zip(&fitted) {
            for i in 0..k {
                rhs[i] += z[i] * yi;
                for j in 0..k {
                    gram[i * k + j] += z[i] * z[j];
                }
            }
        }
        Problem {
            standard,
            scale,
            rows,
            y,
            fitted,
            gram,
            rhs,
        }
    }

    /// The fit at `penalty` and its leave-one-out residuals in the target's units.
    fn solve(&self, penalty: f64) -> (LinearBase, Vec<f64>) {
        let k = self.rhs.len();
        let mut base = LinearBase {
            standard: self.standard.clone(),
            beta: vec![0.0; k],
            penalty,
            target: TargetScale::Identity,
        };
        let mut gram = self.gram.clone();
        for i in 1..k {
            gram[i * k + i] += penalty;
        }
        let Some(chol) = cholesky(&gram, k) else {
            // Not positive definite (fewer rows than one): the context mean alone.
            base.beta[0] = self.y.iter().sum::<f64>() / self.y.len().max(1) as f64;
            let loo = self.y.iter().map(|v| v - base.beta[0]).collect();
            return (base, loo);
        };
        base.beta = solve(&chol, k, &self.rhs);
        let loo: Vec<f64> = self
            .rows
            .iter()
            .zip(&self.fitted)
            .map(|(z, &yi)| {
                let leverage = dot(z, &solve(&chol, k, z));
                (yi - dot(&base.beta, z)) / (1.0 - leverage).max(1e-6)
            })
            .collect();
        match self.scale {
            Scale::Target => (base, loo),
            Scale::Log => {
                let smear = loo.iter().map(|e| e.exp()).sum::<f64>() / loo.len() as f64;
                let (lo, hi) = self
                    .fitted
                    .iter()
                    .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &v| {
                        (l.min(v), h.max(v))
                    });
                base.target = TargetScale::Log {
                    smear,
                    low: lo - (hi - lo),
                    high: hi + (hi - lo),
                };
                // The held-out fit of row i is ln y_i - e_i on the log scale.
                let units = self
                    .y
                    .iter()
                    .zip(&self.fitted)
                    .zip(&loo)
                    .map(|((&yi, &li), &e)| yi - smear * (li - e).exp())
                    .collect();
                (base, units)
            }
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Lower-triangular `l` with `l l^T = a` (`k` x `k`, row-major), or `None` when `a` is not
/// positive definite.
fn cholesky(a: &[f64], k: usize) -> Option<Vec<f64>> {
    let mut l = vec![0.0; k * k];
    for i in 0..k {
        for j in 0..=i {
            let s = a[i * k + j] - (0..j).map(|m| l[i * k + m] * l[j * k + m]).sum::<f64>();
            if i == j {
                if s <= 1e-12 {
                    return None;
                }
                l[i * k + i] = s.sqrt();
            } else {
                l[i * k + j] = s / l[j * k + j];
            }
        }
    }
    Some(l)
}

/// `x` with `l l^T x = b`.
fn solve(l: &[f64], k: usize, b: &[f64]) -> Vec<f64> {
    let mut z = vec![0.0; k];
    for i in 0..k {
        z[i] = (b[i] - (0..i).map(|m| l[i * k + m] * z[m]).sum::<f64>()) / l[i * k + i];
    }
    let mut x = vec![0.0; k];
    for i in (0..k).rev() {
        x[i] = (z[i] - (i + 1..k).map(|m| l[m * k + i] * x[m]).sum::<f64>()) / l[i * k + i];
    }
    x
}

/// The regression prediction for every query row of `t` (`t.classes` 0) on `base`.
pub fn read_regression(
    p: &Predictor<'_>,
    t: &InferenceTable,
    base: RegressionBase,
    ensemble: usize,
    seed: u64,
) -> Result<Vec<f32>, CommError> {
    match base {
        RegressionBase::None => Ok(p
            .read(t, &[], ensemble, seed)?
            .queries
            .into_iter()
            .map(|q| q[0])
            .collect()),
        RegressionBase::Linear => {
            let weight = correction_weight(p, t, ensemble, seed)?;
            let (fit, correction) = read_residuals(p, t, ensemble, seed)?;
            Ok((t.context_rows..t.rows)
                .zip(correction)
                .map(|(row, m)| (fit.predict(t, row) + weight * m) as f32)
                .collect())
        }
    }
}

/// The base fitted to the context of `t`, and the model's reading of its leave-one-out
/// residuals at each query row.
fn read_residuals(
    p: &Predictor<'_>,
    t: &InferenceTable,
    ensemble: usize,
    seed: u64,
) -> Result<(LinearBase, Vec<f64>), CommError> {
    let (fit, loo) = LinearBase::fit(t);
    let mut residual = t.clone();
    for (slot, e) in residual.targets.iter_mut().zip(&loo) {
        *slot = *e as f32;
    }
    let r = p.read(&residual, &[], ensemble, seed)?;
    Ok((fit, r.queries.iter().map(|q| q[0] as f64).collect()))
}

/// Context rows below which the weight is not estimated (the model's correction taken whole).
pub const MIN_STACKING_ROWS: usize = 20;

/// How much of the model's correction to add to the base: the least-squares weight in 0..=1
/// of the correction against the base's residual on held-out context rows, cross-fitted on two
/// halves of the context (each half read with the other as context: stacked regression,
/// Wolpert 1992, Breiman 1996).
///
/// Why: on some tables the model reads nothing in what the ridge leaves (breast_cancer and
/// diabetes imputation, where a checkpoint's correction added 0.2-1 % to the ridge's error), and
/// then its correction is noise; on others it carries much (wine_alcohol). The weight lets the
/// context say which, at the cost of two more reads of the context rows (each with half of
/// them as context).
pub fn correction_weight(
    p: &Predictor<'_>,
    t: &InferenceTable,
    ensemble: usize,
    seed: u64,
) -> Result<f64, CommError> {
    if t.context_rows < MIN_STACKING_ROWS {
        return Ok(1.0);
    }
    let (mut num, mut den) = (0.0, 0.0);
    for half in 0..2 {
        let (held, kept): (Vec<usize>, Vec<usize>) =
            (0..t.context_rows).partition(|r| r % 2 == half);
        let order: Vec<usize> = kept.iter().chain(&held).copied().collect();
        let fold =
            InferenceTable::of_rows(&t.values, t.cols, &t.targets, &order, kept.len(), t.classes);
        let (fit, correction) = read_residuals(p, &fold, ensemble, seed)?;
        for (i, (m, &r)) in correction.into_iter().zip(&held).enumerate() {
            let residual = t.targets[r] as f64 - fit.predict(&fold, kept.len() + i);
            num += residual * m;
            den += m * m;
        }
    }
    Ok(if den > 0.0 {
        (num / den).clamp(0.0, 1.0)
    } else {
        1.0
    })
}
