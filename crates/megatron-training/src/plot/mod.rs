//! `megatron plot METRICS.jsonl [more runs...] --out curves.png`: training and validation loss
//! against tokens (tables for the tabular model), throughput, peak memory and learning rate
//! against iterations, several runs overlaid with a legend, from `--metrics-file` lines.

pub mod canvas;
pub mod chart;

use crate::TrainError;
use canvas::{Canvas, Rgb, BLACK};
use chart::{Panel, Series};
use std::path::{Path, PathBuf};

const COLORS: [Rgb; 8] = [
    Rgb(31, 119, 180),
    Rgb(214, 39, 40),
    Rgb(44, 160, 44),
    Rgb(255, 127, 14),
    Rgb(148, 103, 189),
    Rgb(140, 86, 75),
    Rgb(227, 119, 194),
    Rgb(23, 190, 207),
];

/// One run's curves.
#[derive(Debug, Default)]
pub struct Run {
    pub name: String,
    /// (tokens or tables consumed, loss)
    pub loss: Vec<(f64, f64)>,
    pub val_loss: Vec<(f64, f64)>,
    /// (iteration, value)
    pub throughput: Vec<(f64, f64)>,
    pub memory_mib: Vec<(f64, f64)>,
    pub lr: Vec<(f64, f64)>,
    /// Tabular runs count tables, GPT runs tokens.
    pub tables: bool,
}

/// A run's name in the legend: its file's directory and stem.
fn run_name(p: &Path) -> String {
    let stem = p
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into());
    match p.parent().and_then(|d| d.file_name()) {
        Some(d) => format!("{}/{stem}", d.to_string_lossy()),
        None => stem,
    }
}

/// Reads a metrics file (JSON lines of `megatron train --metrics-file`).
pub fn read_run(path: &Path) -> Result<Run, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Io {
        path: path.display().to_string(),
        source: e,
    })?;
    let mut run = Run {
        name: run_name(path),
        ..Run::default()
    };
    let mut per_iteration = None;
    let mut pending_val = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            TrainError::Args(format!("{}: line {}: not JSON: {e}", path.display(), i + 1))
        })?;
        let Some(it) = v.get("iteration").and_then(|x| x.as_f64()) else {
            return Err(TrainError::Args(format!(
                "{}: line {}: no \"iteration\": not a --metrics-file",
                path.display(),
                i + 1
            )));
        };
        let f = |k: &str| v.get(k).and_then(|x| x.as_f64());
        if let Some(val) = f("val_loss") {
            pending_val.push((it, val));
            continue;
        }
        let (loss, amount, speed) = match (f("lm_loss"), f("loss")) {
            (Some(l), _) => {
                // Tokens per iteration from the interval's rate and time.
                let per =
                    f("tokens_per_sec").unwrap_or(0.0) * f("ms_per_iter").unwrap_or(0.0) / 1e3;
                per_iteration = Some(per);
                (l, it * per, f("tokens_per_sec"))
            }
            (None, Some(l)) => {
                run.tables = true;
                (
                    l,
                    f("consumed_tables").unwrap_or(it),
                    f("tables_per_second"),
                )
            }
            (None, None) => continue,
        };
        run.loss.push((amount, loss));
        if let Some(s) = speed {
            run.throughput.push((it, s));
        }
        if let Some(m) = f("peak_mem_bytes") {
            run.memory_mib.push((it, m / (1 << 20) as f64));
        }
        if let Some(lr) = f("lr") {
            run.lr.push((it, lr));
        }
    }
    let per = per_iteration.unwrap_or(1.0);
    run.val_loss = pending_val
        .into_iter()
        .map(|(it, l)| (it * per, l))
        .collect();
    if run.loss.is_empty() {
        return Err(TrainError::Args(format!(
            "{}: no training lines (lm_loss or loss) to plot",
            path.display()
        )));
    }
    Ok(run)
}

/// Draws the runs into a PNG at `out`.
pub fn plot(files: &[PathBuf], out: &Path) -> Result<Vec<Run>, TrainError> {
    if files.is_empty() {
        return Err(TrainError::Args(
            "megatron plot: give at least one metrics file".into(),
        ));
    }
    let runs: Vec<Run> = files
        .iter()
        .map(|f| read_run(f))
        .collect::<Result<_, _>>()?;
    let amount = if runs.iter().all(|r| r.tables) {
        "tables"
    } else {
        "tokens"
    };
    let series = |pick: &dyn Fn(&Run) -> &Vec<(f64, f64)>, markers: bool, suffix: &str| {
        runs.iter()
            .enumerate()
            .filter(|(_, r)| !pick(r).is_empty())
            .map(|(i, r)| Series {
                name: format!("{}{suffix}", r.name),
                color: COLORS[i % COLORS.len()],
                points: pick(r).clone(),
                markers,
            })
            .collect::<Vec<_>>()
    };
    let mut loss = series(&|r| &r.loss, false, "");
    loss.extend(series(&|r| &r.val_loss, true, " (validation)"));
    let panels = [
        Panel {
            title: "loss (dots: validation)".into(),
            x_label: amount.into(),
            y_label: "loss".into(),
            series: loss,
        },
        Panel {
            title: "throughput".into(),
            x_label: "iteration".into(),
            y_label: format!("{amount} / s"),
            series: series(&|r| &r.throughput, false, ""),
        },
        Panel {
            title: "peak memory (resident)".into(),
            x_label: "iteration".into(),
            y_label: "MiB".into(),
            series: series(&|r| &r.memory_mib, false, ""),
        },
        Panel {
            title: "learning rate".into(),
            x_label: "iteration".into(),
            y_label: "lr".into(),
            series: series(&|r| &r.lr, false, ""),
        },
    ];
    let (w, h) = (1400usize, 1000usize);
    let legend_h = 24.0 * runs.len() as f64 + 16.0;
    let mut c = Canvas::new(w, h + legend_h as usize);
    for (i, r) in runs.iter().enumerate() {
        let y = 8.0 + 24.0 * i as f64;
        let color = COLORS[i % COLORS.len()];
        c.line((20.0, y + 10.0), (60.0, y + 10.0), 3.0, color);
        c.text(&r.name, 70.0, y, 16.0, BLACK);
    }
    let (pw, ph) = (w as f64 / 2.0, h as f64 / 2.0);
    for (i, p) in panels.iter().enumerate() {
        let (col, row) = ((i % 2) as f64, (i / 2) as f64);
        p.draw(&mut c, col * pw, legend_h + row * ph, pw, ph);
    }
    if let Some(d) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).map_err(|e| TrainError::Io {
            path: d.display().to_string(),
            source: e,
        })?;
    }
    c.save_png(out).map_err(|e| TrainError::Io {
        path: out.display().to_string(),
        source: e,
    })?;
    Ok(runs)
}
