//! Per-iteration log lines, the JSON metrics file and peak memory.

use crate::TrainError;
use serde::Serialize;
use std::io::{IsTerminal, Write};

#[derive(Serialize, Clone, Debug)]
pub struct IterationMetrics {
    pub iteration: u64,
    pub consumed_samples: u64,
    pub lm_loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub ms_per_iter: f64,
    pub tokens_per_sec: f64,
    /// Under `--rampup-batch-size`: the last iteration's global batch size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global_batch_size: Option<usize>,
    pub tflops: f64,
    pub mfu: f64,
    pub peak_mem_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decoupled_lr: Option<f64>,
    /// A BERT's sentence-order loss over the interval (`lm_loss` is then the masked-LM part
    /// alone), Megatron's `sop loss`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sop_loss: Option<f64>,
    /// Loss scale (fp16 / `--loss-scale`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    /// Iterations of this log interval skipped for overflowing gradients, and those of them
    /// whose loss was not finite: per interval, as Megatron's `training_log` counts them (the
    /// run's total is `TrainSummary::skipped_iterations`).
    pub skipped_iterations: u64,
    pub nan_iterations: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_zeros: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub params_norm: Option<f64>,
    /// Mixture of experts: auxiliary losses and expert load.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<crate::moe_logging::MoELogMetrics>,
    /// Multi-token prediction: each depth's mean loss over the interval (`mtp_1 loss`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtp_losses: Option<Vec<f64>>,
    /// `--log-straggler`: compute time per iteration across ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank_step_times: Option<crate::straggler::RankStepTimes>,
    /// `--log-memory`: this rank's memory by kind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::MemoryBreakdown>,
}

#[derive(Serialize, Clone, Debug)]
pub struct EvalMetrics {
    pub iteration: u64,
    /// The set of `--multiple-validation-sets` (its name, or its position).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_set: Option<String>,
    /// Megatron's `lm loss value` (a BERT's without its sentence-order part).
    pub val_loss: f64,
    /// A BERT's sentence-order loss (`sop loss value`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_sop_loss: Option<f64>,
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
        if let Some(l) = self.sop_loss {
            s += &format!(" | sop loss: {l:.6E}");
        }
        if let Some(lr) = self.decoupled_lr {
            s += &format!(" | decoupled learning rate: {lr:.6E}");
        }
        if let Some(b) = self.global_batch_size {
            s += &format!(" | global batch size: {b}");
        }
        if let Some(x) = self.loss_scale {
            s += &format!(
                " | loss scale: {x:.1} | number of skipped iterations: {} | number of nan iterations: {}",
                self.skipped_iterations, self.nan_iterations
            );
        }
        if let Some(z) = self.num_zeros {
            s += &format!(" | num zeros: {z}");
        }
        if let Some(p) = self.params_norm {
            s += &format!(" | params norm: {p:.3}");
        }
        if let Some(m) = &self.moe {
            s += &m.line();
        }
        for (k, l) in self.mtp_losses.iter().flatten().enumerate() {
            s += &format!(" | mtp_{} loss: {l:.6E}", k + 1);
        }
        if let Some(m) = &self.memory {
            s += &m.line();
        }
        if let Some(r) = &self.rank_step_times {
            s += &r.line();
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

/// Where log lines go: through the progress bar on a terminal, else plain stdout.
pub(crate) struct Reporter {
    bar: Option<indicatif::ProgressBar>,
    /// Ranks other than 0 stay quiet.
    silent: bool,
}

impl Reporter {
    pub(crate) fn new(total: u64, start: u64, plain: bool, silent: bool) -> Self {
        let bar = if !silent && !plain && std::io::stderr().is_terminal() {
            let pb = indicatif::ProgressBar::new(total);
            pb.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} iters [{elapsed_precise}<{eta_precise}] {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            pb.set_position(start);
            Some(pb)
        } else {
            None
        };
        Reporter { bar, silent }
    }
    pub(crate) fn line(&self, s: &str) {
        if self.silent {
            return;
        }
        match &self.bar {
            Some(pb) => pb.println(s),
            None => println!("{s}"),
        }
    }
    pub(crate) fn tick(&self, iteration: u64, loss: f64) {
        if let Some(pb) = &self.bar {
            pb.set_position(iteration);
            pb.set_message(format!("lm loss {loss:.4}"));
        }
    }
    pub(crate) fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
        }
    }
}

/// Writes a Chrome trace (`chrome://tracing`, Perfetto): one row (thread) per world rank, one
/// complete event per forward, backward, receive wait and optimizer step.
pub(crate) fn write_trace(
    path: &str,
    ranks: &[(
        usize,
        Vec<megatron_core::pipeline_parallel::timers::TraceEvent>,
    )],
) -> Result<(), TrainError> {
    let mut events = Vec::new();
    for (rank, evs) in ranks {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
            "args": { "name": format!("rank {rank}") }
        }));
        for e in evs {
            events.push(serde_json::json!({
                "name": e.name, "ph": "X", "pid": 0, "tid": rank,
                "ts": e.start_us, "dur": e.dur_us
            }));
        }
    }
    let text = serde_json::json!({ "traceEvents": events }).to_string();
    std::fs::write(path, text).map_err(|e| TrainError::Io {
        path: path.to_string(),
        source: e,
    })
}

/// The activation memory of the run against the engine's formula and Korthikanti et al.'s
/// (`sbh(34 + 5as/h)` per layer, for 16-bit activations; doubled for f32).
pub(crate) fn print_activations(
    cfg: &crate::arguments::TrainConfig,
    tp: &megatron_core::tensor_parallel::Tp,
    summary: &crate::training::TrainSummary,
    formulas: Option<(f64, f64)>,
) {
    let mib = |x: f64| x / (1 << 20) as f64;
    if cfg.pp > 1 {
        println!(
            "saved activations on pipeline stage 0 at the peak: {:.2} MiB ({} micro-batch chunks in flight)",
            mib(summary.peak_activation_bytes as f64),
            summary.peak_in_flight
        );
        return;
    }
    let measured = mib(summary.peak_activation_bytes as f64);
    match formulas {
        Some((engine, megatron)) => println!(
            "activations held per micro-batch and rank: {measured:.2} MiB measured, engine formula {:.2} MiB; Megatron's sbh(34 + 5as/h){} per layer would be {:.2} MiB in f32",
            mib(engine),
            if tp.sequence_parallel { "/t" } else { "" },
            mib(megatron)
        ),
        None => println!("activations held per micro-batch and rank: {measured:.2} MiB measured"),
    }
}

/// The decoder's activation formulas for this run (the engine's and Megatron's
/// `sbh(34 + 5as/h)` per layer, divided by t under sequence parallelism), in bytes.
pub(crate) fn decoder_activation_formulas(
    cfg: &crate::arguments::TrainConfig,
    tp: &megatron_core::tensor_parallel::Tp,
) -> (f64, f64) {
    let (b, t) = (cfg.args.micro_batch_size, cfg.args.seq_length);
    let (s_, b_, h_, a_) = (
        t as f64,
        b as f64,
        cfg.model.hidden_size as f64,
        cfg.model.num_attention_heads as f64,
    );
    let sp = if tp.sequence_parallel {
        tp.size() as f64
    } else {
        1.0
    };
    let megatron =
        2.0 * s_ * b_ * h_ * (34.0 + 5.0 * a_ * s_ / h_) * cfg.model.num_layers as f64 / sp;
    let engine = megatron_core::models::gpt::activation_bytes_formula(
        &cfg.model,
        b,
        t,
        tp.size(),
        tp.sequence_parallel,
        cfg.precision.half().is_some(),
    );
    (engine as f64, megatron)
}
