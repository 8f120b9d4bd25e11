//! `megatron tabular predict | impute | score-anomalies`: a trained checkpoint read on the
//! user's CSV tables. The training rows are the model's context (no gradient step: the model
//! learns the table in context), so one forward pass per ensemble member answers.

use super::checkpoint::{self, scatter_whole, TabularCheckpointMeta};
use super::evaluate::argmax;
use super::frame::{frame, Frame, FrameTarget, TaskArg};
use super::inference::{CellQuery, InferenceTable, Predictor, Reading};
use super::linear_base::{read_regression, RegressionBase};
use crate::TrainError;
use clap::{Args, Subcommand};
use megatron_core::models::tabular::TabularModel;
use megatron_core::Params;
use megatron_data::tables::{CsvError, CsvTable};
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum TabularCommand {
    /// Class probabilities or values of the target column for the rows of --test, with the
    /// rows of --train as context.
    Predict(PredictArgs),
    /// Fills the missing cells of a table (numeric feature cells predicted from the other
    /// columns, or reconstructed: --impute-method; a missing target from the prediction).
    Impute(ImputeArgs),
    /// One score per numeric cell: the negative log-density of its value given the rest of the
    /// table (higher = more unusual).
    ScoreAnomalies(TableArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A tabular checkpoint: a save directory or an iter_NNNNNNN directory.
    #[arg(long)]
    pub load: PathBuf,
    /// Columns holding categories rather than numbers (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    pub categorical: Vec<String>,
    #[arg(long, value_enum, default_value = "auto")]
    pub task: TaskArg,
    /// Members of the ensemble over column orders and class relabellings.
    #[arg(long, default_value_t = 4)]
    pub ensemble: usize,
    /// Most context rows read at once: each ensemble member reads a different random subset of
    /// a larger context (the cost of the attention down a column grows with the square of the
    /// rows).
    #[arg(long, default_value_t = 1024)]
    pub max_context_rows: usize,
    /// What a regression (and a conditionally imputed cell) is predicted on: `linear`, a
    /// ridge fit on the context plus the model's reading of its residuals (extrapolates
    /// beyond the context's range); `none`, the model alone.
    #[arg(long, value_enum, default_value = "linear")]
    pub regression_base: RegressionBase,
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    #[arg(long)]
    pub num_threads: Option<usize>,
}

#[derive(Args, Debug, Clone)]
pub struct PredictArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Rows with known targets (the context).
    #[arg(long)]
    pub train: PathBuf,
    /// Rows to predict (the target column may be absent or empty).
    #[arg(long)]
    pub test: PathBuf,
    #[arg(long)]
    pub target: String,
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args, Debug, Clone)]
pub struct TableArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long)]
    pub table: PathBuf,
    /// The target column (default: the last one).
    #[arg(long)]
    pub target: Option<String>,
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args, Debug, Clone)]
pub struct ImputeArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// `conditional`: each numeric column predicted from the others by the regression head;
    /// `reconstruction`: the masked-cell head (categorical cells always use it).
    #[arg(long, value_enum, default_value = "conditional")]
    pub impute_method: super::impute::ImputeMethod,
    /// Rounds of conditional imputation: after the first, each column is predicted again from
    /// the others as the last round filled them (chained equations; each round costs a pass).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub impute_rounds: u64,
}

/// A trained model ready to read tables.
pub struct LoadedModel {
    pub model: TabularModel,
    pub params: Params,
    pub meta: TabularCheckpointMeta,
}

impl LoadedModel {
    pub fn load(path: &Path) -> Result<Self, TrainError> {
        let ck = checkpoint::load(path)?;
        let bins = ck.meta.borders.len() + 1;
        let (model, mut params) = TabularModel::new(ck.meta.model, bins, 0, 0, 1);
        let mut local = params.data.clone();
        scatter_whole(&params, &ck.tensors, "", &mut local, &ck.dir)?;
        params.data = local;
        Ok(LoadedModel {
            model,
            params,
            meta: ck.meta,
        })
    }

    /// Reads contexts of at most `max_context` rows (`--max-context-rows`).
    pub fn predictor(&self, max_context: usize) -> Predictor<'_> {
        Predictor {
            model: &self.model,
            params: &self.params,
            borders: &self.meta.borders,
            max_context,
        }
    }
}

fn csv_err(e: CsvError) -> TrainError {
    TrainError::Args(e.to_string())
}

/// `train` followed by `test`'s rows, `test`'s columns matched to `train`'s by name (a missing
/// target column reads as empty).
fn stack(train: &CsvTable, test: &CsvTable, target: &str) -> Result<CsvTable, CsvError> {
    let map: Vec<Option<usize>> = train
        .header
        .iter()
        .map(|h| match test.header.iter().position(|t| t == h) {
            Some(i) => Ok(Some(i)),
            None if h == target => Ok(None),
            None => Err(CsvError {
                path: test.path.clone(),
                line: Some(1),
                msg: format!("no column named {h:?}, which {} has", train.path),
            }),
        })
        .collect::<Result<_, _>>()?;
    let mut out = train.clone();
    for (rec, &line) in test.records.iter().zip(&test.lines) {
        out.records.push(
            map.iter()
                .map(|m| m.map_or_else(String::new, |i| rec[i].clone()))
                .collect(),
        );
        out.lines.push(line);
    }
    Ok(out)
}

fn targets_of(f: &Frame) -> (&[f32], u32) {
    match f.target.as_ref().expect("a target") {
        FrameTarget::Classes { codes, labels } => (codes, labels.len() as u32),
        FrameTarget::Values(v) => (v, 0),
    }
}

/// The table with rows `order` (the first `context` of them context), cells `hide` set missing.
fn inference_table(
    f: &Frame,
    order: &[usize],
    context: usize,
    hide: &[CellQuery],
) -> InferenceTable {
    let (y, classes) = targets_of(f);
    let mut t = InferenceTable::of_rows(&f.values, f.cols, y, order, context, classes);
    for q in hide {
        t.values[q.row * f.cols + q.col] = f32::NAN;
    }
    t
}

fn thread_pool(n: Option<usize>) -> Result<rayon::ThreadPool, TrainError> {
    let n = n.unwrap_or_else(megatron_tensor::threads::available_cores);
    megatron_tensor::threads::set_gemm_threads(n);
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .map_err(|e| TrainError::Args(format!("--num-threads {n}: {e}")))
}

fn write_csv(path: &Path, header: &[String], rows: &[Vec<String>]) -> Result<(), TrainError> {
    let io = |e: csv::Error| TrainError::Args(format!("{}: {e}", path.display()));
    // Written beside and renamed into place: never a half-written output.
    let tmp = path.with_extension("partial");
    let mut w = csv::Writer::from_path(&tmp).map_err(io)?;
    w.write_record(header).map_err(io)?;
    for r in rows {
        w.write_record(r).map_err(io)?;
    }
    w.flush()
        .map_err(|e| TrainError::Args(format!("{}: {e}", path.display())))?;
    drop(w);
    std::fs::rename(&tmp, path).map_err(crate::io_err(path))
}

fn no_context(path: &str, what: &str) -> TrainError {
    TrainError::Args(format!("{path}: {what}"))
}

/// `megatron tabular predict`: returns the rows written.
pub fn predict(a: &PredictArgs) -> Result<Vec<Vec<f32>>, TrainError> {
    let lm = LoadedModel::load(&a.model.load)?;
    let train = CsvTable::read(&a.train).map_err(csv_err)?;
    let test = CsvTable::read(&a.test).map_err(csv_err)?;
    train.column(&a.target).map_err(csv_err)?;
    let both = stack(&train, &test, &a.target).map_err(csv_err)?;
    let t = both.column(&a.target).map_err(csv_err)?;
    let f = frame(
        &both,
        Some(t),
        &a.model.categorical,
        a.model.task,
        lm.meta.max_features,
    )
    .map_err(csv_err)?;
    let (y, _) = targets_of(&f);
    let context: Vec<usize> = (0..train.records.len())
        .filter(|&r| !y[r].is_nan())
        .collect();
    if context.len() < 2 {
        return Err(no_context(
            &train.path,
            "needs at least 2 rows with a known target",
        ));
    }
    let order: Vec<usize> = context
        .iter()
        .copied()
        .chain(train.records.len()..both.records.len())
        .collect();
    let table = inference_table(&f, &order, context.len(), &[]);
    let pool = thread_pool(a.model.num_threads)?;
    let p = lm.predictor(a.model.max_context_rows);
    let (m, seed) = (a.model.ensemble, a.model.seed);
    let (header, queries): (Vec<String>, Vec<Vec<f32>>) = match f.target.as_ref().expect("a target")
    {
        FrameTarget::Classes { labels, .. } => (
            labels.clone(),
            pool.install(|| p.read(&table, &[], m, seed))?.queries,
        ),
        FrameTarget::Values(_) => (
            vec!["prediction".into()],
            pool.install(|| read_regression(&p, &table, a.model.regression_base, m, seed))?
                .into_iter()
                .map(|v| vec![v])
                .collect(),
        ),
    };
    let rows: Vec<Vec<String>> = queries
        .iter()
        .map(|q| q.iter().map(|v| format!("{v:.6}")).collect())
        .collect();
    write_csv(&a.out, &header, &rows)?;
    Ok(queries)
}

/// The table of `a` read with its target.
fn read_table(a: &TableArgs, lm: &LoadedModel) -> Result<(CsvTable, Frame, usize), TrainError> {
    let csv = CsvTable::read(&a.table).map_err(csv_err)?;
    let t = match &a.target {
        Some(name) => csv.column(name).map_err(csv_err)?,
        None => csv.header.len() - 1,
    };
    let f = frame(
        &csv,
        Some(t),
        &a.model.categorical,
        a.model.task,
        lm.meta.max_features,
    )
    .map_err(csv_err)?;
    Ok((csv, f, t))
}

/// `megatron tabular impute`: returns the filled records.
pub fn impute(args: &ImputeArgs) -> Result<Vec<Vec<String>>, TrainError> {
    let a = &args.table;
    let lm = LoadedModel::load(&a.model.load)?;
    let (csv, f, t) = read_table(a, &lm)?;
    let (y, _) = targets_of(&f);
    let known: Vec<usize> = (0..f.rows).filter(|&r| !y[r].is_nan()).collect();
    let unknown: Vec<usize> = (0..f.rows).filter(|&r| y[r].is_nan()).collect();
    if known.len() < 2 {
        return Err(no_context(
            &csv.path,
            "needs at least 2 rows with a known target",
        ));
    }
    let order: Vec<usize> = known.iter().chain(&unknown).copied().collect();
    let cells: Vec<CellQuery> = order
        .iter()
        .enumerate()
        .flat_map(|(i, &r)| {
            let f = &f;
            (0..f.cols)
                .filter(move |&c| f.values[r * f.cols + c].is_nan())
                .map(move |c| CellQuery {
                    row: i,
                    col: c,
                    observed: f32::NAN,
                })
        })
        .collect();
    let table = inference_table(&f, &order, known.len(), &[]);
    let pool = thread_pool(a.model.num_threads)?;
    let r = pool.install(|| {
        lm.predictor(a.model.max_context_rows)
            .read(&table, &cells, a.model.ensemble, a.model.seed)
    })?;
    let mut records = csv.records.clone();
    let feature_col: Vec<usize> = (0..csv.header.len()).filter(|&c| c != t).collect();
    let conditional = match args.impute_method {
        super::impute::ImputeMethod::Conditional => pool.install(|| {
            super::impute::conditional_fill(
                &lm.predictor(a.model.max_context_rows),
                &f,
                y,
                a.model.regression_base,
                a.model.ensemble,
                a.model.seed,
                args.impute_rounds as usize,
            )
        })?,
        super::impute::ImputeMethod::Reconstruction => Vec::new(),
    };
    for (q, &v) in cells.iter().zip(&r.cells) {
        let row = order[q.row];
        records[row][feature_col[q.col]] = match &f.levels[q.col] {
            Some(levels) if !levels.is_empty() => {
                levels[(v.round().max(0.0) as usize).min(levels.len() - 1)].clone()
            }
            _ => format!("{v:.6}"),
        };
    }
    for &(row, c, v) in &conditional {
        records[row][feature_col[c]] = format!("{v:.6}");
    }
    for (i, &row) in unknown.iter().enumerate() {
        let q = &r.queries[i];
        records[row][t] = match f.target.as_ref().expect("a target") {
            FrameTarget::Classes { labels, .. } => labels[argmax(q)].clone(),
            FrameTarget::Values(_) => format!("{:.6}", q[0]),
        };
    }
    write_csv(&a.out, &csv.header, &records)?;
    Ok(records)
}

/// Rounds of the anomaly scoring: each hides a tenth of the cells and of the targets.
const ROUNDS: usize = 10;

/// `megatron tabular score-anomalies`: returns the scores (NaN where a cell has none).
pub fn score_anomalies(a: &TableArgs) -> Result<Vec<Vec<f32>>, TrainError> {
    let lm = LoadedModel::load(&a.model.load)?;
    let (csv, f, t) = read_table(a, &lm)?;
    let (y, classes) = targets_of(&f);
    let feature_col: Vec<usize> = (0..csv.header.len()).filter(|&c| c != t).collect();
    let mut scores = vec![vec![f32::NAN; csv.header.len()]; f.rows];
    let pool = thread_pool(a.model.num_threads)?;
    let p = lm.predictor(a.model.max_context_rows);
    let (_, widths) = super::inference::bin_geometry(&lm.meta.borders);
    for round in 0..ROUNDS {
        let queries: Vec<usize> = (0..f.rows)
            .filter(|&r| r % ROUNDS == round && !y[r].is_nan())
            .collect();
        let context: Vec<usize> = (0..f.rows)
            .filter(|&r| r % ROUNDS != round && !y[r].is_nan())
            .collect();
        if context.len() < 2 {
            return Err(no_context(
                &csv.path,
                "needs more rows with a known target to score",
            ));
        }
        let order: Vec<usize> = context.iter().chain(&queries).copied().collect();
        let cells: Vec<CellQuery> = order
            .iter()
            .enumerate()
            .flat_map(|(i, &r)| {
                let f = &f;
                (0..f.cols)
                    .filter(move |&c| {
                        f.levels[c].is_none()
                            && (r + 3 * c) % ROUNDS == round
                            && !f.values[r * f.cols + c].is_nan()
                    })
                    .map(move |c| CellQuery {
                        row: i,
                        col: c,
                        observed: f.values[r * f.cols + c],
                    })
            })
            .collect();
        let table = inference_table(&f, &order, context.len(), &cells);
        let r: Reading = pool.install(|| p.read(&table, &cells, a.model.ensemble, a.model.seed))?;
        for (q, &nll) in cells.iter().zip(&r.cell_nll) {
            scores[order[q.row]][feature_col[q.col]] = nll;
        }
        for (i, &row) in queries.iter().enumerate() {
            scores[row][t] = if classes > 0 {
                -(r.queries[i][y[row] as usize].max(1e-30)).ln()
            } else {
                let (mean, sd) = r.target_stats;
                let z = (y[row] - mean) / sd;
                let k = megatron_core::models::tabular::bin_of(z, &lm.meta.borders) as usize;
                -(r.query_bins[i][k] / (widths[k] * sd)).max(1e-30).ln()
            };
        }
    }
    let rows: Vec<Vec<String>> = scores
        .iter()
        .map(|s| {
            s.iter()
                .map(|v| {
                    if v.is_nan() {
                        String::new()
                    } else {
                        format!("{v:.4}")
                    }
                })
                .collect()
        })
        .collect();
    write_csv(&a.out, &csv.header, &rows)?;
    Ok(scores)
}
