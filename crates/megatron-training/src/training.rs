//! `pretrain`'s loop on one rank (Megatron's `train`): set up, then per iteration one training
//! step, logging, evaluation and checkpointing, each in its own file (`setup`, `train_step`,
//! `logging`, `evaluate`, `checkpointing`; ranks are launched by `launch`).

use crate::arguments::TrainConfig;
use crate::family::TrainFamily;
use crate::flops::peak_flops;
use crate::logging::{peak_rss_bytes, IterationMetrics, MetricsFile, Reporter};
use crate::setup::{
    resumed_grad_scaler, resumed_scheduler, scheduler, set_precision, setup_model_and_optimizer,
    RankComms,
};
use crate::TrainError;
use megatron_comm::{Communicator, ThreadCommunicator};
use megatron_core::models::LossPhase;
use megatron_core::optimizer::{GradScaler, MegatronOptimizer, OptimizerParamScheduler};
use megatron_core::params::ParamId;
use megatron_core::pipeline_parallel::timers::Timers;
use megatron_core::tensor_parallel::{serial_group, sum_f64, Tp};
use megatron_core::{Grads, Params};
use megatron_data::Split;
use megatron_data::Tokenizer;
use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

pub use crate::data::inspect_data;
pub use crate::launch::pretrain;

#[derive(Clone, Debug, Default)]
pub struct TrainSummary {
    pub start_iteration: u64,
    pub final_iteration: u64,
    /// `(iteration, lm loss)` of every iteration run.
    pub losses: Vec<(u64, f64)>,
    /// `(iteration, validation loss)` of every evaluation.
    pub val_losses: Vec<(u64, f64)>,
    /// `--skip-train`: the loss on the test split.
    pub test_loss: Option<f64>,
    pub last_checkpoint: Option<PathBuf>,
    pub peak_activation_bytes: usize,
    /// Most micro-batches (per model chunk) whose activations one pipeline stage held at once.
    pub peak_in_flight: usize,
    /// This stage's bubble over the last timed interval (`--timing-log-level`).
    pub bubble_fraction: f64,
    /// World rank and its trace events (`--profile-trace`).
    pub world_rank: usize,
    pub trace: Vec<megatron_core::pipeline_parallel::timers::TraceEvent>,
    /// Iterations skipped because the gradients overflowed (loss scaling).
    pub skipped_iterations: u64,
    /// Loss scale at the end (loss scaling).
    pub loss_scale: Option<f32>,
    /// Gradient norm of every iteration that stepped.
    pub grad_norms: Vec<(u64, f64)>,
    /// Mixture of experts: each log interval's auxiliary losses and expert load.
    pub moe: Vec<(u64, crate::moe_logging::MoELogMetrics)>,
    /// Weights + gradients + optimizer state per parameter on rank 0 (bytes).
    pub bytes_per_param: f64,
}

/// What the MFU denominator covers.
#[derive(Clone, Copy)]
pub(crate) enum PeakOf {
    /// This many threads of this process (rank threads share them).
    Threads(usize),
    /// This many processes, each with the per-rank thread count.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Processes(usize),
}

/// Everything one rank trains with, shared by the step, evaluation, logging and checkpoints.
pub(crate) struct Trainer<'a, F: TrainFamily> {
    pub cfg: &'a TrainConfig,
    pub comms: RankComms<'a>,
    /// Stands in for the data-parallel group on a single data-parallel rank.
    pub serial_dp: ThreadCommunicator,
    pub params: Params,
    pub grads: Grads,
    pub chunks: Vec<F::Chunk>,
    pub chunk_params: Vec<Range<usize>>,
    pub optimizer: Box<dyn MegatronOptimizer>,
    pub scaler: Option<GradScaler>,
    pub sched: OptimizerParamScheduler,
    pub timers: Timers,
    /// This rank's compute time since the last log interval, and who has been slow
    /// (`--log-straggler`).
    pub busy: std::time::Duration,
    pub straggler: Option<crate::straggler::StragglerWatch>,
    pub data: F::Data,
    /// Buffers of the step's micro-batches.
    pub mbs: Vec<F::MicroBatch>,
    /// `--overlap-param-gather`: the last step's all-gather still runs (in the next forward).
    pub pending_gather: bool,
    pub consumed: u64,
    /// Validation samples the evaluations have read (Megatron's `consumed_valid_samples`).
    pub consumed_valid: u64,
    /// `--full-validation`: micro-batches this rank has drawn from its cyclic list of each
    /// validation set (not saved: Megatron's iterators start afresh on resume).
    pub full_valid_cursors: Vec<u64>,
    /// Which samples of each split this rank reads at a consumed count.
    pub samplers: crate::sample_order::RankSamplers,
    /// `--async-save`: the save a background thread is writing.
    pub pending_save: Option<crate::checkpoint_save::PendingSave>,
    /// The newest checkpoint this run completed (rank 0).
    pub last_checkpoint: Option<PathBuf>,
    /// `--async-save`: staging buffers, kept from one save to the next.
    pub staging: Vec<Vec<f32>>,
    /// The model's buffers (router expert biases) as of the save being written, on the rank
    /// that writes them (the first tensor- and data-parallel rank of each stage).
    pub buffer_snapshot: Vec<(String, Vec<f32>)>,
}

impl<F: TrainFamily> Trainer<'_, F> {
    /// A split's length as the samplers see it.
    pub fn split_samples(&self, split: Split) -> u64 {
        crate::sample_order::split_length(self.cfg, F::num_samples(&self.data, split), split)
    }

    /// Evaluation, checkpoints, the parameter norm and the end of training need every
    /// parameter: an all-gather still pending from `--overlap-param-gather` runs first.
    pub fn finish_param_gather(&mut self) -> Result<(), TrainError> {
        if std::mem::take(&mut self.pending_gather) {
            if let Some(c) = self.comms.dp.as_deref_mut() {
                self.optimizer.gather_params(&mut self.params, c)?;
            }
        }
        Ok(())
    }

    /// Weights + gradients + optimizer state this rank holds per parameter of its shard, from
    /// the buffers' allocations (Megatron's table: fp32 16, distributed 8 + 8/d).
    fn bytes_per_param(&self) -> f64 {
        (self.params.data.capacity() * 4
            + self.params.half.size_in_bytes()
            + self.grads.data.capacity() * 4
            + self.optimizer.state_bytes()) as f64
            / self.params.numel() as f64
    }
}

/// What can end a run early (Megatron's `--exit-signal-handler`, `--exit-duration-in-mins`,
/// `--exit-interval`): the signal flag is set by SIGTERM/SIGINT handlers registered for the
/// run and removed after it.
pub(crate) struct ExitWatch {
    signal: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handlers: Vec<signal_hook::SigId>,
    started: Instant,
}

impl ExitWatch {
    fn new(cfg: &TrainConfig) -> Result<Self, TrainError> {
        let signal = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut handlers = Vec::new();
        if cfg.args.exit_signal_handler {
            for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
                let id = signal_hook::flag::register(sig, signal.clone()).map_err(|e| {
                    TrainError::Args(format!(
                        "--exit-signal-handler: cannot install a handler: {e}"
                    ))
                })?;
                handlers.push(id);
            }
        }
        Ok(ExitWatch {
            signal,
            handlers,
            started: Instant::now(),
        })
    }
}

impl Drop for ExitWatch {
    fn drop(&mut self) {
        for id in self.handlers.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

impl<F: TrainFamily> Trainer<'_, F> {
    /// Whether to save and stop after `iteration`, agreed over the world (a signal may reach
    /// one rank only, clocks differ).
    fn exit_requested(
        &mut self,
        iteration: u64,
        w: &ExitWatch,
    ) -> Result<Option<&'static str>, TrainError> {
        let a = &self.cfg.args;
        if !(a.exit_signal_handler
            || a.exit_interval.is_some()
            || a.exit_duration_in_mins.is_some())
        {
            return Ok(None);
        }
        let mut code = 0.0f32;
        if a.exit_interval.is_some_and(|n| iteration.is_multiple_of(n)) {
            code = 1.0;
        }
        if a.exit_duration_in_mins
            .is_some_and(|m| w.started.elapsed().as_secs_f64() >= m * 60.0)
        {
            code = 2.0;
        }
        if w.signal.load(std::sync::atomic::Ordering::SeqCst) {
            code = 3.0;
        }
        Ok(match self.comms.world_max(code)? {
            c if c >= 3.0 => Some("a termination signal arrived (--exit-signal-handler)"),
            c if c >= 2.0 => Some("--exit-duration-in-mins reached"),
            c if c >= 1.0 => Some("--exit-interval reached"),
            _ => None,
        })
    }
}

/// Running sums over a logging interval.
#[derive(Default)]
pub(crate) struct Interval {
    /// The losses of the iterations that stepped (Megatron's "advanced" iterations: a step
    /// skipped for overflowing gradients leaves the logged mean, as in `training_log`).
    pub loss: f64,
    pub advanced: u64,
    /// The losses of skipped iterations, the mean only where every iteration was skipped.
    pub skipped_loss: f64,
    /// Steps skipped for overflowing gradients, and those of them whose loss was not finite
    /// (Megatron's per-interval `number of skipped/nan iterations`).
    pub skipped: u64,
    pub nan: u64,
    /// A BERT's sentence-order losses of this rank over the steps taken (sum of micro-batch
    /// means, micro-batches), logged apart as Megatron does.
    pub sop: (f64, f64),
    pub iters: u64,
    pub secs: f64,
    /// Samples trained (the global batch sizes, which ramp-up varies).
    pub samples: u64,
    /// The last iteration's global batch size.
    pub last_batch: u64,
}

pub(crate) fn run(
    cfg: &TrainConfig,
    tok: &dyn Tokenizer,
    threads: usize,
    groups: Option<&mut megatron_comm::ProcessGroups>,
    world_peak: PeakOf,
) -> Result<TrainSummary, TrainError> {
    match cfg.args.model {
        crate::arguments::ModelArg::Bert => {
            run_family::<crate::family_bert::Bert>(cfg, tok, threads, groups, world_peak)
        }
        crate::arguments::ModelArg::T5 => {
            run_family::<crate::family_t5::T5>(cfg, tok, threads, groups, world_peak)
        }
        _ => run_family::<crate::family_gpt::Gpt>(cfg, tok, threads, groups, world_peak),
    }
}

/// [`run`] for one model family.
fn run_family<F: TrainFamily>(
    cfg: &TrainConfig,
    tok: &dyn Tokenizer,
    threads: usize,
    groups: Option<&mut megatron_comm::ProcessGroups>,
    world_peak: PeakOf,
) -> Result<TrainSummary, TrainError> {
    let a = &cfg.args;
    let (mut serial_tp, mut serial_pp) = (serial_group(), serial_group());
    let mut comms = RankComms::new(
        groups,
        &mut serial_tp,
        &mut serial_pp,
        a.sequence_parallel,
        cfg.cp_comm_type,
    );
    set_precision(cfg, &mut comms)?;
    let lead = comms.lead();
    // `--log-memory` counts this rank's allocations from here.
    megatron_tensor::alloc::start_epoch();
    let setup = setup_model_and_optimizer(cfg, &F::config(cfg), &mut comms, lead)?;
    if a.log_memory && lead {
        let (state, peak) =
            crate::memory::rank_memory(cfg, &setup.params, setup.optimizer.as_ref(), 0)
                .map_err(TrainError::Args)?;
        println!("{}", crate::memory::predicted(cfg, &state, &peak));
    }
    let data = F::build_data(cfg, tok, lead)?;
    // One origin for every rank thread of the process, so trace rows line up.
    static TRACE_ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let (sched, mut iteration, consumed, consumed_valid) = match &setup.restored {
        Some(r) => (
            resumed_scheduler(cfg, r)?,
            r.iteration,
            r.consumed_samples,
            r.consumed_valid_samples,
        ),
        None => (scheduler(cfg), 0, 0, 0),
    };
    let cp = comms.cp_layout();
    let comms_dp = comms.data_rank_size();
    let mut tr = Trainer::<F> {
        cfg,
        comms,
        serial_dp: serial_group(),
        grads: Grads::zeros_like(&setup.params),
        params: setup.params,
        chunks: setup.chunks,
        chunk_params: setup.chunk_params,
        optimizer: setup.optimizer,
        scaler: resumed_grad_scaler(cfg, setup.restored.as_ref(), lead),
        sched,
        busy: std::time::Duration::ZERO,
        straggler: a.log_straggler.then(|| {
            crate::straggler::StragglerWatch::new(a.straggler_margin, a.straggler_patience)
        }),
        timers: Timers::new(
            *TRACE_ORIGIN.get_or_init(Instant::now),
            a.profile_trace.is_some(),
        ),
        data,
        mbs: (0..cfg.num_microbatches())
            .map(|_| F::micro_batch(cfg, cp))
            .collect(),
        pending_gather: false,
        consumed,
        consumed_valid,
        full_valid_cursors: Vec::new(),
        samplers: {
            let (dp_rank, dp) = comms_dp;
            crate::sample_order::RankSamplers::new(
                cfg.sample_order,
                (a.micro_batch_size, cfg.eval_micro_batch_size),
                dp_rank,
                dp,
            )
        },
        pending_save: None,
        last_checkpoint: None,
        staging: Vec::new(),
        buffer_snapshot: Vec::new(),
    };
    if a.async_save && a.save.is_some() {
        tr.prepare_async_staging();
    }
    // MFU is against the whole job's peak: the process's thread budget for rank threads (they
    // share its cores), the per-process peak times the world under MPI.
    let unit = crate::flops::PeakUnit::of_this_thread();
    let peak = match world_peak {
        PeakOf::Threads(n) => peak_flops(a.peak_tflops, n, unit),
        PeakOf::Processes(n) => peak_flops(a.peak_tflops, threads, unit) * n as f64,
    };
    let metrics_err = |e| TrainError::Io {
        path: a.metrics_file.clone().unwrap_or_default(),
        source: e,
    };
    let mut metrics =
        MetricsFile::open(a.metrics_file.as_deref().filter(|_| lead)).map_err(metrics_err)?;
    let per_param = tr.bytes_per_param();
    if lead {
        print_setup(
            cfg,
            &F::describe_layers(cfg),
            &tr.params,
            (threads, peak),
            per_param,
        );
    }
    let mut tensorboard = crate::tensorboard::training_log::TensorboardLog::open(a, lead)?;
    let tb_err = |e| TrainError::Io {
        path: a.tensorboard_dir.clone().unwrap_or_default(),
        source: e,
    };
    let rep = Reporter::new(cfg.train_iters, iteration, a.no_progress_bar, !lead);
    let mut summary = TrainSummary {
        bytes_per_param: per_param,
        start_iteration: iteration,
        ..Default::default()
    };
    let mut interval = Interval::default();
    let exits = ExitWatch::new(cfg)?;
    let save = cfg.checkpoints.save.as_ref().filter(|_| !a.skip_train);
    for dir in save.iter().flat_map(|s| s.dirs()) {
        tr.check_save_dir(dir)?;
    }
    if a.skip_train {
        // Megatron's --skip-train: evaluate the loaded model on validation and test, train
        // nothing.
        tr.finish_param_gather()?;
        let (val, test) = (tr.validate()?, tr.evaluate(Split::Test)?);
        if lead {
            if val.is_empty() {
                rep.line(" no validation samples (or --eval-iters 0)");
            }
            for (suffix, l) in &val {
                rep.line(&end_of_training_line(iteration, (suffix, "validation"), l));
            }
            match &test {
                Some(l) => rep.line(&end_of_training_line(iteration, ("", "test"), l)),
                None => rep.line(" no test samples (or --eval-iters 0)"),
            }
            summary
                .val_losses
                .extend(val.iter().map(|(_, v)| (iteration, v.loss)));
            summary.test_loss = test.map(|t| t.loss);
        }
    }
    // An exit condition (--exit-interval, --exit-duration-in-mins, a signal) ends the run right
    // after its checkpoint, as Megatron's does: no end-of-training evaluation (a preempted job
    // has seconds to go).
    let mut exited = false;
    while iteration < cfg.train_iters && !a.skip_train {
        let started = Instant::now();
        iteration += 1;
        if iteration == 2 && a.inject_rank_stall == Some(tr.comms.world_rank) {
            loop {
                std::thread::park();
            }
        }
        // A stepped batch size must split into micro-batches once it is reached.
        cfg.batches
            .check(tr.consumed)
            .inspect_err(|_| rep.finish())?;
        let step = tr.train_step(iteration).inspect_err(|_| rep.finish())?;
        if step.skipped {
            rep.line(&format!(
                " iteration {iteration}: gradients overflowed at loss scale {}; step skipped",
                step.loss_scale
            ));
        } else {
            summary.grad_norms.push((iteration, step.grad_norm));
        }
        summary.peak_activation_bytes = summary
            .peak_activation_bytes
            .max(step.peak_activation_bytes);
        summary.peak_in_flight = summary.peak_in_flight.max(step.peak_in_flight);
        summary.skipped_iterations += u64::from(step.skipped);
        summary.loss_scale = tr.scaler.as_ref().map(|s| s.scale());
        let step_samples = cfg.batches.global_batch_size(tr.consumed);
        tr.consumed += step_samples;
        interval.samples += step_samples;
        interval.last_batch = step_samples;
        summary.losses.push((iteration, step.loss));
        if step.skipped {
            interval.skipped += 1;
            interval.nan += u64::from(!step.loss.is_finite());
            interval.skipped_loss += step.loss;
        } else {
            interval.advanced += 1;
            interval.loss += step.loss;
        }
        interval.iters += 1;
        interval.secs += started.elapsed().as_secs_f64();
        rep.tick(iteration, step.loss);
        let sop_apart = F::logs_sop_apart(cfg);
        let step_sop = crate::bert_logging::take_local(&tr.chunks, LossPhase::Training);
        if !step.skipped {
            interval.sop.0 += step_sop.0;
            interval.sop.1 += step_sop.1;
        }
        let log_due = iteration.is_multiple_of(a.log_interval) || iteration == cfg.train_iters;
        // Every rank decides alike (the parameter norm is a collective); only the lead writes.
        let tb_due =
            a.tensorboard_dir.is_some() && iteration.is_multiple_of(a.tensorboard_log_interval);
        let params_norm = match a.log_params_norm && (log_due || tb_due) {
            true => Some(tr.params_norm()?),
            false => None,
        };
        let sop_loss = match sop_apart && tb_due {
            true => Some(crate::bert_logging::mean_over_ranks(
                &mut tr.comms,
                step_sop,
            )?),
            false => None,
        };
        if let (true, Some(tb)) = (tb_due, &mut tensorboard) {
            let x = crate::tensorboard::training_log::StepScalars {
                iteration,
                consumed_samples: tr.consumed,
                lr: step.lr,
                decoupled_lr: step.decoupled_lr,
                batch_size: step_samples,
                loss: step.loss - sop_loss.unwrap_or(0.0),
                sop_loss,
                loss_scale: tr.scaler.as_ref().map(|s| s.scale()),
                world_size: cfg.world(),
                grad_norm: (!step.skipped).then_some(step.grad_norm),
                num_zeros: step.num_zeros,
                params_norm,
            };
            tb.step(&x).map_err(tb_err)?;
        }
        if log_due {
            let m = tr.log_metrics(iteration, &step, &interval, peak, params_norm)?;
            rep.line(&m.line(cfg.train_iters));
            let times = tr.log_timers(&rep, interval.iters);
            if let Some((bubble, _)) = times {
                summary.bubble_fraction = bubble;
            }
            metrics.write(&m).map_err(metrics_err)?;
            if let Some(tb) = &mut tensorboard {
                tb.interval(&m, times.as_ref().map(|t| &t.1))
                    .map_err(tb_err)?;
            }
            if let Some(moe) = &m.moe {
                summary.moe.push((iteration, moe.clone()));
            }
            interval = Interval::default();
        }
        if cfg.validates_after(iteration) {
            tr.finish_param_gather()?;
            let val = tr.validate()?;
            for (suffix, val) in val.iter().filter(|_| lead) {
                rep.line(&format!(
                    " validation{suffix} loss at iteration {iteration} | {}",
                    val.values()
                ));
                record_validation(
                    a,
                    (iteration, tr.consumed),
                    (suffix, val),
                    &mut metrics,
                    &mut tensorboard,
                )?;
                summary.val_losses.push((iteration, val.loss));
            }
        }
        let exit = tr.exit_requested(iteration, &exits)?;
        let forced = iteration == cfg.train_iters || exit.is_some();
        if let Some(target) = save.and_then(|s| s.target(iteration, forced)) {
            tr.finish_param_gather()?;
            for line in tr.save_checkpoint(target, iteration, tok)? {
                rep.line(&line);
            }
        } else if tr.pending_save.is_some() {
            for line in tr.finish_pending_save(false)? {
                rep.line(&line);
            }
        }
        if let Some(why) = exit {
            rep.line(&format!(" exiting after iteration {iteration}: {why}"));
            exited = true;
            break;
        }
    }
    tr.finish_param_gather()?;
    if !a.skip_train && !exited {
        // Megatron's end of training scores validation (on the next validation samples, as
        // its iterator goes on), then test, with its own lines.
        let val = tr.validate()?;
        for (suffix, val) in val.iter().filter(|_| lead) {
            rep.line(&end_of_training_line(
                iteration,
                (suffix, "validation"),
                val,
            ));
            record_validation(
                a,
                (iteration, tr.consumed),
                (suffix, val),
                &mut metrics,
                &mut tensorboard,
            )?;
            summary.val_losses.push((iteration, val.loss));
        }
        if let (Some(test), true) = (tr.evaluate(Split::Test)?, lead) {
            rep.line(&end_of_training_line(iteration, ("", "test"), &test));
            summary.test_loss = Some(test.loss);
        }
    }
    for line in tr.finish_pending_save(true)? {
        rep.line(&line);
    }
    summary.last_checkpoint = tr.last_checkpoint.take();
    rep.finish();
    summary.final_iteration = iteration;
    summary.world_rank = tr.comms.world_rank;
    if let Some(ev) = tr.timers.events.take() {
        summary.trace = ev;
    }
    if lead && summary.peak_activation_bytes > 0 {
        let formulas = F::activation_formulas(cfg, &tr.comms.tp);
        crate::logging::print_activations(cfg, &tr.comms.tp, &summary, formulas);
    }
    Ok(summary)
}

/// A validation score in the metrics file and TensorBoard (rank 0), at `(iteration, consumed
/// training samples)`.
fn record_validation(
    a: &crate::arguments::TrainArgs,
    (iteration, consumed): (u64, u64),
    (suffix, val): (&str, &crate::evaluate::EvalLoss),
    metrics: &mut MetricsFile,
    tensorboard: &mut Option<crate::tensorboard::training_log::TensorboardLog>,
) -> Result<(), TrainError> {
    let ev = crate::logging::EvalMetrics {
        iteration,
        val_set: suffix.strip_prefix('-').map(String::from),
        val_loss: val.lm(),
        val_sop_loss: val.sop,
    };
    metrics.write(&ev).map_err(|e| TrainError::Io {
        path: a.metrics_file.clone().unwrap_or_default(),
        source: e,
    })?;
    if let Some(tb) = tensorboard {
        tb.validation((suffix, iteration, consumed), val.lm(), val.sop)
            .map_err(|e| TrainError::Io {
                path: a.tensorboard_dir.clone().unwrap_or_default(),
                source: e,
            })?;
    }
    Ok(())
}

/// Megatron's line for a split scored after training (or under `--skip-train`), which log
/// parsers look for: `validation loss at iteration N on test set | ...` (`validation-<set>
/// loss ...` for a set of `--multiple-validation-sets`).
fn end_of_training_line(
    iteration: u64,
    (suffix, split): (&str, &str),
    loss: &crate::evaluate::EvalLoss,
) -> String {
    format!(
        " validation{suffix} loss at iteration {iteration} on {split} set | {}",
        loss.values()
    )
}

/// The start-up lines: the model and batch, and the bytes per parameter.
fn print_setup(
    cfg: &TrainConfig,
    layers: &str,
    params: &Params,
    (threads, peak): (usize, f64),
    per_param: f64,
) {
    let m = &cfg.model;
    if let Some(note) = cfg.args.script_compat.note() {
        println!("{note}");
    }
    println!(
        "model: {} parameters, {layers}, hidden {}, heads {}, seq {}, padded vocab {} | global batch {} = {} micro-batches of {} | {} threads | peak {:.1} GFLOP/s",
        params.numel(),
        m.hidden_size,
        m.num_attention_heads,
        cfg.args.seq_length,
        m.padded_vocab_size,
        cfg.global_batch_size,
        cfg.num_microbatches(),
        cfg.args.micro_batch_size,
        threads,
        peak / 1e9
    );
    if cfg.pp > 1 {
        println!("pipeline split: {}", cfg.partition.describe());
    }
    if !cfg.batches.steps.is_empty() {
        let steps: Vec<String> = cfg
            .batches
            .steps
            .iter()
            .map(|(t, b)| format!("{b} from {t} samples"))
            .collect();
        println!(
            "step batch size schedule: global batch {} ({} iterations in all)",
            steps.join(", "),
            cfg.train_iters
        );
    }
    if let Some(r) = cfg.batches.rampup {
        println!(
            "batch size ramp-up: global batch {} growing by {} over the first {} samples to {} ({} iterations in all)",
            r.start, r.increment, r.samples, cfg.global_batch_size, cfg.train_iters
        );
    }
    if cfg.precision == crate::arguments::Precision::BF16 {
        use megatron_core::transformer::config::ResidualPrecision;
        use megatron_tensor::cpu::matmul_packed::BlockKernel;
        println!(
            "bf16 matmuls on {}; residual stream in {}",
            match megatron_tensor::cpu::matmul::bf16_block_kernel() {
                Some(BlockKernel::AmxTiles) => "AMX tiles (MFU against the measured tile peak)",
                Some(BlockKernel::DotProduct) => {
                    "the bf16 dot-product instruction (MFU against its measured peak)"
                }
                None => "the f32 FMA GEMM with rounded operands",
            },
            match cfg.model.residual {
                ResidualPrecision::BF16 =>
                    "bf16 (Megatron's default; --fp32-residual-connection: f32)",
                ResidualPrecision::F32 if cfg.args.fp32_residual_connection => {
                    "f32 (--fp32-residual-connection)"
                }
                ResidualPrecision::F32 => "f32 (this model's layers keep it in f32)",
            }
        );
    }
    println!(
        "weights + gradients + optimizer state: {per_param:.2} bytes per parameter on this rank ({:.1} MiB)",
        per_param * params.numel() as f64 / (1 << 20) as f64
    );
}

impl<F: TrainFamily> Trainer<'_, F> {
    /// `--log-params-norm`: the norm of every parameter, once the parameters are gathered.
    fn params_norm(&mut self) -> Result<f64, TrainError> {
        self.finish_param_gather()?;
        params_norm(&self.params, &mut self.comms.tp, &mut *self.comms.pp)
    }

    /// The log line's figures over the interval just ended.
    fn log_metrics(
        &mut self,
        iteration: u64,
        step: &crate::train_step::StepOutcome,
        interval: &Interval,
        peak: f64,
        params_norm: Option<f64>,
    ) -> Result<IterationMetrics, TrainError> {
        let a = &self.cfg.args;
        let moe = crate::moe_logging::gather_moe_metrics(
            &self.chunks,
            &mut self.comms,
            self.cfg.model.num_layers + self.cfg.model.mtp.map_or(0, |m| m.num_layers),
            self.cfg.model.moe.as_ref().map(|m| m.num_experts),
        )?;
        let sop_loss = match F::logs_sop_apart(self.cfg) {
            true => Some(crate::bert_logging::mean_over_ranks(
                &mut self.comms,
                interval.sop,
            )?),
            false => None,
        };
        let mtp_losses = crate::mtp_logging::gather_mtp_losses(
            &self.chunks,
            &mut self.comms,
            self.cfg.model.mtp.map(|m| m.num_layers),
        )?;
        let busy_ms = std::mem::take(&mut self.busy).as_secs_f64() * 1e3 / interval.iters as f64;
        let rank_step_times = match self.straggler.is_some() {
            true => {
                let times = crate::straggler::gather_world(&mut self.comms, busy_ms)?;
                self.straggler.as_mut().map(|w| w.observe(&times))
            }
            false => None,
        };
        // Per iteration, averaged over the interval (ramp-up varies the batch).
        let per_iter = interval.secs / interval.iters as f64;
        let flops = F::flops(self.cfg, interval.samples as usize) / interval.iters as f64;
        Ok(IterationMetrics {
            iteration,
            consumed_samples: self.consumed,
            // Megatron's `lm loss`: without the sentence-order part, which has its own field.
            lm_loss: match interval.advanced {
                0 => interval.skipped_loss / interval.iters as f64,
                n => interval.loss / n as f64,
            } - sop_loss.unwrap_or(0.0),
            sop_loss,
            lr: step.lr,
            decoupled_lr: step.decoupled_lr,
            grad_norm: step.grad_norm,
            ms_per_iter: per_iter * 1e3,
            tokens_per_sec: (interval.samples as f64 * a.seq_length as f64) / interval.secs,
            global_batch_size: (self.cfg.batches.rampup.is_some()
                || !self.cfg.batches.steps.is_empty())
            .then_some(interval.last_batch as usize),
            tflops: flops / per_iter / 1e12,
            mfu: flops / per_iter / peak,
            peak_mem_bytes: peak_rss_bytes(),
            loss_scale: self.scaler.as_ref().map(|s| s.scale()),
            skipped_iterations: interval.skipped,
            nan_iterations: interval.nan,
            num_zeros: step.num_zeros,
            params_norm,
            moe,
            mtp_losses,
            rank_step_times,
            memory: match a.log_memory {
                true => Some(self.memory_breakdown(step)?),
                false => None,
            },
        })
    }

    /// `--log-memory`: this rank's bytes by kind, its allocator high-water marks beside the
    /// prediction, and the spread of measured / predicted over every rank.
    fn memory_breakdown(
        &mut self,
        step: &crate::train_step::StepOutcome,
    ) -> Result<crate::memory::MemoryBreakdown, TrainError> {
        use megatron_tensor::alloc;
        let (state, peak) = crate::memory::rank_memory(
            self.cfg,
            &self.params,
            self.optimizer.as_ref(),
            self.comms.pp.rank(),
        )
        .map_err(TrainError::Args)?;
        let predicted = peak.total();
        let installed = alloc::installed();
        let allocated_peak = installed.then(|| alloc::peak().in_use.max(0) as u64);
        let reserved_peak = installed.then(|| alloc::peak().reserved.max(0) as u64);
        let peak_over_predicted = match allocated_peak {
            Some(p) => {
                let r = p as f32 / predicted.max(1) as f32;
                let hi = self.comms.world_max(r)?;
                let lo = -self.comms.world_max(-r)?;
                Some((lo as f64, hi as f64))
            }
            None => None,
        };
        Ok(crate::memory::MemoryBreakdown {
            parameters: state.parameters,
            gradients: state.gradients,
            optimizer_state: state.optimizer,
            activations: step.peak_activation_bytes as u64,
            micro_batches_in_flight: step.peak_in_flight,
            pooled: megatron_tensor::pool::pooled_bytes() as u64,
            communication: self.optimizer.comm_buffer_bytes() as u64,
            kv_ring: megatron_core::context_parallel::take_ring_peak_bytes() as u64,
            process_peak: peak_rss_bytes(),
            allocated_peak,
            reserved_peak,
            predicted_peak: predicted,
            peak_over_predicted,
        })
    }

    /// `--timing-log-level`: per-stage timers on the first rank of each stage; returns the
    /// bubble fraction when printed.
    fn log_timers(
        &mut self,
        rep: &Reporter,
        iters: u64,
    ) -> Option<(f64, crate::tensorboard::training_log::StageTimes)> {
        let (dp_rank, _) = self.comms.dp_rank_size();
        if self.cfg.args.timing_log_level == 0 || dp_rank != 0 || self.comms.tp.rank() != 0 {
            return None;
        }
        let tm = &mut self.timers;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / iters as f64;
        rep.line(&format!(
            " stage {}: forward {:.1} ms | backward {:.1} ms | p2p wait {:.1} ms | optimizer {:.1} ms | pipeline {:.1} ms | bubble {:.1} % (per iteration)",
            self.comms.pp.rank(),
            ms(tm.forward),
            ms(tm.backward),
            ms(tm.p2p_wait),
            ms(tm.optimizer),
            ms(tm.pipeline),
            100.0 * tm.bubble_fraction()
        ));
        let bubble = tm.bubble_fraction();
        let times = crate::tensorboard::training_log::StageTimes {
            forward_ms: ms(tm.forward),
            backward_ms: ms(tm.backward),
            p2p_wait_ms: ms(tm.p2p_wait),
            optimizer_ms: ms(tm.optimizer),
            pipeline_ms: ms(tm.pipeline),
        };
        tm.reset();
        Some((bubble, times))
    }
}

/// L2 norm of the whole model's parameters (`--log-params-norm`), each counted once.
fn params_norm(params: &Params, tp: &mut Tp, pp: &mut dyn Communicator) -> Result<f64, TrainError> {
    let tp_rank = tp.rank();
    let local: f64 = params
        .metas
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.shared && (!m.tp_replicated || tp_rank == 0))
        .map(|(i, _)| megatron_tensor::cpu::global_norm_squared(&params.get(ParamId(i))))
        .sum();
    let x = sum_f64(tp.comm, local)?;
    Ok(sum_f64(pp, x)?.sqrt())
}
