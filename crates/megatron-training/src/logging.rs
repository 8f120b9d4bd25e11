//! Per-iteration log lines, the JSON metrics file and peak memory.

use serde::Serialize;
use std::io::Write;

#[derive(Serialize, Clone, Debug)]
pub struct IterationMetrics {
    pub iteration: u64,
    pub consumed_samples: u64,
    pub lm_loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub ms_per_iter: f64,
    pub tokens_per_sec: f64,
    pub tflops: f64,
    pub mfu: f64,
    pub peak_mem_bytes: u64,
    /// Loss scale (fp16 / `--loss-scale`), iterations skipped on overflow so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    pub skipped_iterations: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_zeros: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub params_norm: Option<f64>,
}

#[derive(Serialize, Clone, Debug)]
pub struct EvalMetrics {
    pub iteration: u64,
    pub val_loss: f64,
}

impl IterationMetrics {
    pub fn line(&self, train_iters: u64) -> String {
        format!(
            " iteration {:>8}/{:>8} | consumed samples: {:>10} | elapsed time per iteration (ms): {:.1} | tokens/s: {:.0} | throughput (TFLOP/s): {:.3} | MFU: {:.1}% | learning rate: {:.6E} | lm loss: {:.6E} | grad norm: {:.3} | peak mem (MiB): {:.0}",
            self.iteration,
            train_iters,
            self.consumed_samples,
            self.ms_per_iter,
            self.tokens_per_sec,
            self.tflops,
            self.mfu * 100.0,
            self.lr,
            self.lm_loss,
            self.grad_norm,
            self.peak_mem_bytes as f64 / (1 << 20) as f64
        ) + &self.extras()
    }

    fn extras(&self) -> String {
        let mut s = String::new();
        if let Some(x) = self.loss_scale {
            s += &format!(
                " | loss scale: {x:.1} | number of skipped iterations: {}",
                self.skipped_iterations
            );
        }
        if let Some(z) = self.num_zeros {
            s += &format!(" | num zeros: {z}");
        }
        if let Some(p) = self.params_norm {
            s += &format!(" | params norm: {p:.3}");
        }
        s
    }
}

/// Appends one JSON object per line.
pub struct MetricsFile(Option<std::fs::File>);

impl MetricsFile {
    pub fn open(path: Option<&str>) -> std::io::Result<Self> {
        Ok(MetricsFile(match path {
            Some(p) => Some({
                if let Some(parent) = std::path::Path::new(p)
                    .parent()
                    .filter(|d| !d.as_os_str().is_empty())
                {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?
            }),
            None => None,
        }))
    }

    pub fn write<T: Serialize>(&mut self, v: &T) -> std::io::Result<()> {
        if let Some(f) = &mut self.0 {
            let s = serde_json::to_string(v).map_err(std::io::Error::other)?;
            writeln!(f, "{s}")?;
            f.flush()?;
        }
        Ok(())
    }
}

/// Peak resident set size of this process (`VmHWM`), in bytes; 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}
