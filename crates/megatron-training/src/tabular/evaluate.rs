//! Evaluation on real tables, logged like validation loss: a seeded 70/30 split of each table,
//! the 70 % as context and the 30 % as queries (accuracy and log loss, or RMSE and R^2), with
//! 10 % of the observed numeric feature cells hidden and reconstructed (RMSE in units of each
//! column's standard deviation).

use super::frame::{Frame, FrameTarget};
use super::inference::{CellQuery, InferenceTable, Predictor};
use megatron_comm::CommError;
use megatron_data::tables::stream::Stream;
use megatron_tensor::RngKey;
use serde::Serialize;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TableMetrics {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rmse: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub r2: Option<f64>,
    pub reconstruction_rmse: f64,
}

impl TableMetrics {
    pub fn line(&self) -> String {
        let mut s = format!(" validation on {}", self.name);
        for (k, v) in [
            ("accuracy", self.accuracy),
            ("log loss", self.log_loss),
            ("rmse", self.rmse),
            ("r2", self.r2),
        ] {
            if let Some(v) = v {
                s += &format!(" | {k} {v:.4}");
            }
        }
        s + &format!(" | reconstruction rmse {:.4}", self.reconstruction_rmse)
    }
}

/// A seeded split of `rows` row indices: (context, queries), 70 / 30.
pub fn split_rows(rows: usize, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut idx: Vec<usize> = (0..rows).collect();
    Stream::new(RngKey::new(seed).fold(0x7370_6c69)).shuffle(&mut idx);
    let ctx = (rows * 7).div_ceil(10).min(rows - 1);
    let queries = idx.split_off(ctx);
    (idx, queries)
}

/// Metrics of the model on `frame` (which must have a target).
pub fn evaluate_frame(
    p: &Predictor,
    name: &str,
    frame: &Frame,
    seed: u64,
    max_context: usize,
) -> Result<TableMetrics, CommError> {
    let target = frame
        .target
        .as_ref()
        .expect("evaluation tables have a target");
    let y = match target {
        FrameTarget::Classes { codes, .. } => codes,
        FrameTarget::Values(v) => v,
    };
    let labelled: Vec<usize> = (0..frame.rows).filter(|&r| !y[r].is_nan()).collect();
    let (ctx, queries) = split_rows(labelled.len(), seed);
    let mut ctx: Vec<usize> = ctx.into_iter().map(|i| labelled[i]).collect();
    ctx.truncate(max_context);
    let queries: Vec<usize> = queries.into_iter().map(|i| labelled[i]).collect();
    let order: Vec<usize> = ctx.iter().chain(&queries).copied().collect();
    let cols = frame.cols;
    let mut values: Vec<f32> = order
        .iter()
        .flat_map(|&r| frame.values[r * cols..(r + 1) * cols].iter().copied())
        .collect();
    // Hide 10 % of the observed numeric cells (keeping two per column in the context).
    let mut rng = Stream::new(RngKey::new(seed).fold(0x6869_6465));
    let mut cells = Vec::new();
    for c in (0..cols).filter(|&c| frame.levels[c].is_none()) {
        let mut kept = 0;
        for (r, _) in order.iter().enumerate() {
            let v = values[r * cols + c];
            if v.is_nan() {
                continue;
            }
            if (r >= ctx.len() || kept >= 2) && rng.chance(0.1) {
                cells.push(CellQuery {
                    row: r,
                    col: c,
                    observed: v,
                });
            } else if r < ctx.len() {
                kept += 1;
            }
        }
    }
    for q in &cells {
        values[q.row * cols + q.col] = f32::NAN;
    }
    let classes = match target {
        FrameTarget::Classes { labels, .. } => labels.len() as u32,
        FrameTarget::Values(_) => 0,
    };
    let table = InferenceTable {
        rows: order.len(),
        cols,
        context_rows: ctx.len(),
        values,
        targets: order
            .iter()
            .enumerate()
            .map(|(i, &r)| if i < ctx.len() { y[r] } else { 0.0 })
            .collect(),
        classes,
    };
    let reading = p.read(&table, &cells, 1, seed)?;
    // Reconstruction error in units of each column's context standard deviation.
    let col_sd: Vec<f64> = (0..cols)
        .map(|c| {
            let v: Vec<f64> = ctx
                .iter()
                .map(|&r| frame.values[r * cols + c] as f64)
                .filter(|v| !v.is_nan())
                .collect();
            let m = v.iter().sum::<f64>() / v.len().max(1) as f64;
            let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len().max(1) as f64;
            var.sqrt().max(1e-6)
        })
        .collect();
    let recon = if cells.is_empty() {
        0.0
    } else {
        (cells
            .iter()
            .zip(&reading.cells)
            .map(|(q, &m)| ((m - q.observed) as f64 / col_sd[q.col]).powi(2))
            .sum::<f64>()
            / cells.len() as f64)
            .sqrt()
    };
    let truth: Vec<f32> = queries.iter().map(|&r| y[r]).collect();
    let mut m = TableMetrics {
        name: name.to_string(),
        accuracy: None,
        log_loss: None,
        rmse: None,
        r2: None,
        reconstruction_rmse: recon,
    };
    if classes > 0 {
        let n = truth.len().max(1) as f64;
        let correct = reading
            .queries
            .iter()
            .zip(&truth)
            .filter(|(p, &t)| argmax(p) == t as usize)
            .count();
        let ll: f64 = reading
            .queries
            .iter()
            .zip(&truth)
            .map(|(p, &t)| -(p[t as usize].max(1e-15) as f64).ln())
            .sum();
        m.accuracy = Some(correct as f64 / n);
        m.log_loss = Some(ll / n);
    } else {
        let n = truth.len().max(1) as f64;
        let mean = truth.iter().map(|&t| t as f64).sum::<f64>() / n;
        let sse: f64 = reading
            .queries
            .iter()
            .zip(&truth)
            .map(|(p, &t)| (p[0] as f64 - t as f64).powi(2))
            .sum();
        let sst: f64 = truth.iter().map(|&t| (t as f64 - mean).powi(2)).sum();
        m.rmse = Some((sse / n).sqrt());
        m.r2 = Some(1.0 - sse / sst.max(1e-12));
    }
    Ok(m)
}

pub fn argmax(p: &[f32]) -> usize {
    p.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}
