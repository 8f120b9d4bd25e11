//! What `megatron train --tensorboard-dir` writes each log interval, with Megatron's tag
//! names (`training_log` in megatron/training/training.py): each scalar against the
//! iteration, and the main ones also against consumed samples (`<tag> vs samples`).

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

    /// One log interval's scalars, flushed.
    pub fn iteration(
        &mut self,
        m: &IterationMetrics,
        batch_size: usize,
        world_size: usize,
        timers: Option<&StageTimes>,
    ) -> std::io::Result<()> {
        let (it, samples) = (m.iteration, m.consumed_samples);
        if self.on.learning_rate {
            self.both("learning-rate", m.lr, it, samples)?;
        }
        self.both("batch-size", batch_size as f64, it, samples)?;
        self.both("lm loss", m.lm_loss, it, samples)?;
        for (k, l) in m.mtp_losses.iter().flatten().enumerate() {
            // megatron-core's `track_mtp_metrics` tags.
            self.writer
                .add_scalar(&format!("mtp_{} loss", k + 1), *l, it)?;
        }
        if let (true, Some(s)) = (self.on.loss_scale, m.loss_scale) {
            self.both("loss-scale", s as f64, it, samples)?;
        }
        if self.on.world_size {
            self.both("world-size", world_size as f64, it, samples)?;
        }
        self.both("grad-norm", m.grad_norm, it, samples)?;
        if let Some(z) = m.num_zeros {
            self.both("num-zeros", z as f64, it, samples)?;
        }
        if let Some(p) = m.params_norm {
            self.both("params-norm", p, it, samples)?;
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
    pub fn validation(&mut self, iteration: u64, samples: u64, loss: f64) -> std::io::Result<()> {
        self.both("lm loss validation", loss, iteration, samples)?;
        if self.on.validation_ppl {
            self.both("lm loss validation ppl", loss.exp(), iteration, samples)?;
        }
        self.writer.flush()
    }
}
