//! What `megatron train --tensorboard-dir` writes, with Megatron's tag names and cadence
//! (`training_log` in megatron/training/training.py): the iteration's own loss, learning rate,
//! batch size, loss scale, world size, grad norm, zeros and parameter norm every
//! `--tensorboard-log-interval` iterations (Megatron's default 1, whatever `--log-interval`),
//! each against the iteration and consumed samples (`<tag> vs samples`); throughput, MFU,
//! memory and timers, which Megatron measures over a log interval, every log interval.

use super::SummaryWriter;
use crate::arguments::TrainArgs;
use crate::logging::IterationMetrics;
use crate::TrainError;
use std::path::Path;

/// Per-iteration stage timers of the interval (milliseconds), for `--log-timers-to-tensorboard`.
#[derive(Clone, Copy, Debug, Default)]
pub struct StageTimes {
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub p2p_wait_ms: f64,
    pub optimizer_ms: f64,
    pub pipeline_ms: f64,
}

/// One iteration's figures, as Megatron's `training_log` writes them each
/// `--tensorboard-log-interval`.
#[derive(Clone, Copy, Debug)]
pub struct StepScalars {
    pub iteration: u64,
    pub consumed_samples: u64,
    pub lr: f64,
    pub decoupled_lr: Option<f64>,
    pub batch_size: u64,
    /// The iteration's loss (the global batch's), not the interval's mean; a BERT's without
    /// its sentence-order part, which is `sop_loss`.
    pub loss: f64,
    pub sop_loss: Option<f64>,
    pub loss_scale: Option<f32>,
    pub world_size: usize,
    /// `None` for a skipped step.
    pub grad_norm: Option<f64>,
    pub num_zeros: Option<u64>,
    pub params_norm: Option<f64>,
}

/// Which optional scalars to write (Megatron's `--log-*-to-tensorboard` switches).
#[derive(Clone, Copy, Debug)]
struct Switches {
    timers: bool,
    memory: bool,
    validation_ppl: bool,
    world_size: bool,
    loss_scale: bool,
    learning_rate: bool,
}

pub struct TensorboardLog {
    writer: SummaryWriter,
    on: Switches,
}

fn io_err(dir: &str) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::Io {
        path: dir.to_string(),
        source: e,
    }
}

impl TensorboardLog {
    /// The writer of `--tensorboard-dir` on the rank that writes (`lead`), else `None`.
    pub fn open(a: &TrainArgs, lead: bool) -> Result<Option<Self>, TrainError> {
        let Some(dir) = a.tensorboard_dir.as_deref().filter(|_| lead) else {
            return Ok(None);
        };
        let writer = SummaryWriter::create(Path::new(dir)).map_err(io_err(dir))?;
        Ok(Some(TensorboardLog {
            writer,
            on: Switches {
                timers: a.log_timers_to_tensorboard,
                memory: a.log_memory_to_tensorboard,
                validation_ppl: a.log_validation_ppl_to_tensorboard,
                world_size: a.log_world_size_to_tensorboard,
                loss_scale: !a.no_log_loss_scale_to_tensorboard,
                learning_rate: !a.no_log_learning_rate_to_tensorboard,
            },
        }))
    }

    pub fn path(&self) -> &Path {
        self.writer.path()
    }

    fn both(&mut self, tag: &str, v: f64, iteration: u64, samples: u64) -> std::io::Result<()> {
        self.writer.add_scalar(tag, v, iteration)?;
        self.writer
            .add_scalar(&format!("{tag} vs samples"), v, samples)
    }

    /// One iteration's scalars (every `--tensorboard-log-interval` iterations), flushed.
    pub fn step(&mut self, x: &StepScalars) -> std::io::Result<()> {
        let (it, samples) = (x.iteration, x.consumed_samples);
        if self.on.learning_rate {
            self.both("learning-rate", x.lr, it, samples)?;
            if let Some(d) = x.decoupled_lr {
                self.writer.add_scalar("decoupled-learning-rate", d, it)?;
            }
        }
        self.both("batch-size", x.batch_size as f64, it, samples)?;
        self.both("lm loss", x.loss, it, samples)?;
        if let Some(l) = x.sop_loss {
            self.both("sop loss", l, it, samples)?;
        }
        if let (true, Some(s)) = (self.on.loss_scale, x.loss_scale) {
            self.both("loss-scale", s as f64, it, samples)?;
        }
        if self.on.world_size {
            self.both("world-size", x.world_size as f64, it, samples)?;
        }
        // A skipped step has no norm (Megatron's optimizer returns none).
        if let Some(g) = x.grad_norm {
            self.both("grad-norm", g, it, samples)?;
        }
        if let Some(z) = x.num_zeros {
            self.both("num-zeros", z as f64, it, samples)?;
        }
        if let Some(p) = x.params_norm {
            self.both("params-norm", p, it, samples)?;
        }
        self.writer.flush()
    }

    /// One log interval's measured scalars (throughput, MFU, memory, timers, MTP losses),
    /// flushed.
    pub fn interval(
        &mut self,
        m: &IterationMetrics,
        timers: Option<&StageTimes>,
    ) -> std::io::Result<()> {
        let it = m.iteration;
        for (k, l) in m.mtp_losses.iter().flatten().enumerate() {
            // megatron-core's `track_mtp_metrics` tags.
            self.writer
                .add_scalar(&format!("mtp_{} loss", k + 1), *l, it)?;
        }
        self.writer.add_scalar("throughput", m.tflops, it)?;
        self.writer
            .add_scalar("tokens-per-sec", m.tokens_per_sec, it)?;
        self.writer.add_scalar("mfu", m.mfu, it)?;
        if self.on.memory {
            self.writer
                .add_scalar("mem-peak-rss-bytes", m.peak_mem_bytes as f64, it)?;
            if let Some(mem) = &m.memory {
                if let Some(a) = mem.allocated_peak {
                    self.writer
                        .add_scalar("mem-max-allocated-bytes", a as f64, it)?;
                }
                if let Some(r) = mem.reserved_peak {
                    self.writer
                        .add_scalar("mem-max-reserved-bytes", r as f64, it)?;
                }
            }
        }
        if self.on.timers {
            self.writer
                .add_scalar("iteration-time", m.ms_per_iter / 1e3, it)?;
            if let Some(t) = timers {
                for (tag, ms) in [
                    ("forward-compute-time", t.forward_ms),
                    ("backward-compute-time", t.backward_ms),
                    ("forward-backward-time", t.pipeline_ms),
                    ("p2p-wait-time", t.p2p_wait_ms),
                    ("optimizer-time", t.optimizer_ms),
                ] {
                    self.writer.add_scalar(tag, ms / 1e3, it)?;
                }
            }
        }
        self.writer.flush()
    }

    /// A validation loss (and perplexity with `--log-validation-ppl-to-tensorboard`), flushed.
    pub fn validation(
        &mut self,
        (suffix, iteration, samples): (&str, u64, u64),
        loss: f64,
        sop: Option<f64>,
    ) -> std::io::Result<()> {
        // `lm loss validation-<set>` for a set of --multiple-validation-sets, as Megatron.
        let lm = format!("lm loss validation{suffix}");
        self.both(&lm, loss, iteration, samples)?;
        if self.on.validation_ppl {
            self.both(&format!("{lm} ppl"), loss.exp(), iteration, samples)?;
        }
        if let Some(l) = sop {
            self.both("sop loss validation", l, iteration, samples)?;
            if self.on.validation_ppl {
                self.both("sop loss validation ppl", l.exp(), iteration, samples)?;
            }
        }
        self.writer.flush()
    }
}
