//! A CSV table as the model reads it: numeric feature columns as they are, categorical ones
//! (`--categorical`) as codes into their sorted levels, and the target as class indices or
//! values. Refuses what the model cannot read, naming the column.

use megatron_data::tables::{CsvError, CsvTable};
use megatron_tensor::cpu::table_features::MAX_CLASSES;

/// `--task`: what the target column holds.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TaskArg {
    /// Classes when the target holds text or at most 10 distinct integers; else regression.
    #[default]
    Auto,
    Classification,
    Regression,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FrameTarget {
    /// Class index per row (NaN where missing) and the class labels, sorted.
    Classes {
        labels: Vec<String>,
        codes: Vec<f32>,
    },
    Values(Vec<f32>),
}

#[derive(Clone, Debug)]
pub struct Frame {
    pub rows: usize,
    pub cols: usize,
    pub names: Vec<String>,
    /// Row-major, NaN = missing.
    pub values: Vec<f32>,
    /// Per feature column: its levels when categorical.
    pub levels: Vec<Option<Vec<String>>>,
    pub target: Option<FrameTarget>,
    pub target_name: Option<String>,
}

fn err(csv: &CsvTable, msg: String) -> CsvError {
    CsvError {
        path: csv.path.clone(),
        line: None,
        msg,
    }
}

/// Reads `csv` with column `target` (if any) as the target and every other column as a
/// feature; `max_features` is what the model was trained for.
pub fn frame(
    csv: &CsvTable,
    target: Option<usize>,
    categorical: &[String],
    task: TaskArg,
    max_features: usize,
) -> Result<Frame, CsvError> {
    for c in categorical {
        csv.column(c)?;
    }
    let features: Vec<usize> = (0..csv.header.len())
        .filter(|&c| Some(c) != target)
        .collect();
    if features.is_empty() {
        return Err(err(csv, "no feature columns besides the target".into()));
    }
    if features.len() > max_features {
        return Err(err(
            csv,
            format!(
                "{} feature columns; the model supports at most {max_features}",
                features.len()
            ),
        ));
    }
    let rows = csv.records.len();
    let cols = features.len();
    let mut values = vec![0.0f32; rows * cols];
    let mut levels = Vec::with_capacity(cols);
    for (j, &c) in features.iter().enumerate() {
        let (column, lv) = if categorical.contains(&csv.header[c]) {
            let lv = csv.levels(c);
            (csv.codes(c, &lv), Some(lv))
        } else {
            (csv.numeric(c)?, None)
        };
        for (r, v) in column.into_iter().enumerate() {
            values[r * cols + j] = v;
        }
        levels.push(lv);
    }
    let target_frame = match target {
        None => None,
        Some(t) => Some(target_column(csv, t, task)?),
    };
    Ok(Frame {
        rows,
        cols,
        names: features.iter().map(|&c| csv.header[c].clone()).collect(),
        values,
        levels,
        target: target_frame,
        target_name: target.map(|t| csv.header[t].clone()),
    })
}

fn target_column(csv: &CsvTable, t: usize, task: TaskArg) -> Result<FrameTarget, CsvError> {
    let levels = csv.levels(t);
    let numeric = csv.numeric(t).ok();
    let integral = numeric
        .as_ref()
        .is_some_and(|v| v.iter().all(|x| x.is_nan() || x.fract() == 0.0));
    let classes = match task {
        TaskArg::Classification => true,
        TaskArg::Regression => false,
        TaskArg::Auto => numeric.is_none() || (integral && levels.len() <= MAX_CLASSES),
    };
    if !classes {
        return match numeric {
            Some(v) => Ok(FrameTarget::Values(v)),
            None => csv.numeric(t).map(FrameTarget::Values),
        };
    }
    if levels.len() > MAX_CLASSES {
        return Err(err(
            csv,
            format!(
                "target column {:?} has {} classes; the model supports at most {MAX_CLASSES} (use --task regression for a numeric target)",
                csv.header[t],
                levels.len()
            ),
        ));
    }
    if levels.len() < 2 {
        return Err(err(
            csv,
            format!(
                "target column {:?} has {} class; classification needs at least 2",
                csv.header[t],
                levels.len()
            ),
        ));
    }
    Ok(FrameTarget::Classes {
        codes: csv.codes(t, &levels),
        labels: levels,
    })
}
