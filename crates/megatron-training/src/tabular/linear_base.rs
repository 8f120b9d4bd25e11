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
//! adaptive one (IterativeImputer's `BayesianRidge`) does better. The p+1 system (p <= the
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
}

/// The context's per-feature mean and standard deviation.
#[derive(Clone)]
struct Standardisation {
    mean: Vec<f64>,
    scale: Vec<f64>,
}

impl Standardisation {
    fn of_context(t: &InferenceTable) -> Self {
        let mut mean = vec![0.0; t.cols];
        let mut scale = vec![1.0; t.cols];
        for c in 0..t.cols {
            let seen: Vec<f64> = (0..t.context_rows)
                .map(|r| t.values[r * t.cols + c] as f64)
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
        Standardisation { mean, scale }
    }

    /// The standardised design row of row `r` of `t`: 1 then the features.
    fn design(&self, t: &InferenceTable, r: usize) -> Vec<f64> {
        std::iter::once(1.0)
            .chain((0..t.cols).map(|c| {
                let v = t.values[r * t.cols + c] as f64;
                if v.is_nan() {
                    0.0
                } else {
                    (v - self.mean[c]) / self.scale[c]
                }
            }))
            .collect()
    }
}

impl LinearBase {
    pub fn predict(&self, t: &InferenceTable, r: usize) -> f64 {
        dot(&self.beta, &self.standard.design(t, r))
    }

    /// The ridge penalty of the fit.
    pub fn penalty(&self) -> f64 {
        self.penalty
    }

    /// Fits the context rows of `t` (targets `t.targets[..context_rows]`) at the penalty of
    /// [`PENALTIES`] with the least sum of squared leave-one-out residuals (the first on a tie);
    /// returns the fit and each context row's leave-one-out residual.
    pub fn fit(t: &InferenceTable) -> (Self, Vec<f64>) {
        let problem = Problem::new(t);
        let mut best: Option<(f64, Self, Vec<f64>)> = None;
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

    /// Fits the context rows of `t` at ridge penalty `penalty`; returns the fit and each context
    /// row's leave-one-out residual.
    pub fn fit_penalised(t: &InferenceTable, penalty: f64) -> (Self, Vec<f64>) {
        Problem::new(t).solve(penalty)
    }
}

/// The normal equations of a context, shared by the penalties tried.
struct Problem {
    standard: Standardisation,
    rows: Vec<Vec<f64>>,
    y: Vec<f64>,
    gram: Vec<f64>,
    rhs: Vec<f64>,
}

impl Problem {
    fn new(t: &InferenceTable) -> Self {
        let n = t.context_rows;
        let standard = Standardisation::of_context(t);
        let rows: Vec<Vec<f64>> = (0..n).map(|r| standard.design(t, r)).collect();
        let y: Vec<f64> = t.targets[..n].iter().map(|&v| v as f64).collect();
        let k = t.cols + 1;
        let mut gram = vec![0.0; k * k];
        let mut rhs = vec![0.0; k];
        for (z, &yi) in rows.iter().zip(&y) {
            for i in 0..k {
                rhs[i] += z[i] * yi;
                for j in 0..k {
                    gram[i * k + j] += z[i] * z[j];
                }
            }
        }
        Problem {
            standard,
            rows,
            y,
            gram,
            rhs,
        }
    }

    fn solve(&self, penalty: f64) -> (LinearBase, Vec<f64>) {
        let k = self.rhs.len();
        let mut base = LinearBase {
            standard: self.standard.clone(),
            beta: vec![0.0; k],
            penalty,
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
        let loo = self
            .rows
            .iter()
            .zip(&self.y)
            .map(|(z, &yi)| {
                let leverage = dot(z, &solve(&chol, k, z));
                (yi - dot(&base.beta, z)) / (1.0 - leverage).max(1e-6)
            })
            .collect();
        (base, loo)
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
            let (fit, loo) = LinearBase::fit(t);
            let mut residual = t.clone();
            for (slot, e) in residual.targets.iter_mut().zip(&loo) {
                *slot = *e as f32;
            }
            let r = p.read(&residual, &[], ensemble, seed)?;
            Ok((t.context_rows..t.rows)
                .zip(&r.queries)
                .map(|(row, q)| (fit.predict(t, row) + q[0] as f64) as f32)
                .collect())
        }
    }
}
