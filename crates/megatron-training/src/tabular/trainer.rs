//! `megatron train --model tabular`: tables from the synthetic prior (drawn on worker threads
//! ahead of the step), micro-batches under the cell budget, tensor parallelism inside the model
//! and data parallelism over rank threads (each data-parallel rank runs every `dp`-th
//! micro-batch of the step's plan, so the plan and the loss do not depend on the layout), Adam
//! with Megatron's schedule and clipping, real-table evaluation and atomic checkpoints.

use super::arguments::{ResumeSchedule, TabularTrainConfig};
use super::batch::{step_micro_batches, StepBatching};
use super::checkpoint::{self, gather_whole, scatter_whole, TabularCheckpointMeta, TABULAR_FORMAT};
use super::evaluate::{evaluate_frame, TableMetrics};
use super::frame::{frame, Frame, TaskArg};
use super::inference::Predictor;
use super::tail_bins::split_bins;
use crate::logging::MetricsFile;
use crate::TrainError;
use megatron_comm::{Communicator, ReduceOp};
use megatron_core::context_parallel::{CpCommType, CpLayout};
use megatron_core::models::tabular::{TabularBatch, TabularModel, BINS};
use megatron_core::optimizer::{clip_grads_by_norm, Adam};
use megatron_core::tensor_parallel::finalize::{grad_norm_tp, sum_f64};
use megatron_core::tensor_parallel::{serial_group, Tp};
use megatron_core::transformer::step::StepContext;
use megatron_core::Grads;
use megatron_data::tables::batching::TableBatch;
use megatron_data::tables::borders::{bin_shares, regression_borders, with_tails};
use megatron_data::tables::{CsvTable, PriorConfig, PriorLoader};
use megatron_tensor::RngKey;
use serde::Serialize;
use std::borrow::Cow;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Prior tables the regression bin borders are estimated from.
const BORDER_TABLES: u64 = 64;

#[derive(Clone, Debug, Default)]
pub struct TabularSummary {
    pub start_iteration: u64,
    /// `(iteration, loss)` of every iteration run.
    pub losses: Vec<(u64, f64)>,
    pub evals: Vec<(u64, Vec<TableMetrics>)>,
    pub last_checkpoint: Option<PathBuf>,
    /// The trained model's whole tensors by name (rank 0).
    pub params: Vec<(String, Vec<f32>)>,
    /// Seconds the step waited for prior tables, over the run.
    pub data_wait: f64,
}

#[derive(Serialize)]
struct IterationLine {
    iteration: u64,
    consumed_tables: u64,
    lr: f64,
    loss: f64,
    grad_norm: f64,
    tables_per_second: f64,
    cells_per_second: f64,
    data_wait_seconds: f64,
}

/// Trains as the config says: on rank threads when the layout has more than one rank.
pub fn pretrain_tabular(cfg: TabularTrainConfig) -> Result<TabularSummary, TrainError> {
    let threads = cfg.threads;
    let n = cfg.world();
    if n == 1 {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| TrainError::Args(format!("--num-threads {threads}: {e}")))?;
        return pool.install(|| {
            megatron_tensor::threads::set_gemm_threads(threads);
            let (mut tp, mut cp, mut dp) = (serial_group(), serial_group(), serial_group());
            train_rank(&cfg, 0, &mut tp, &mut cp, &mut dp)
        });
    }
    let per_rank = (threads / n).max(1);
    let cfg = std::sync::Arc::new(cfg);
    let grace = Duration::from_secs(610);
    let results = megatron_comm::run_ranks_until_failure(
        n,
        grace,
        move |rank, comm| -> Result<TabularSummary, TrainError> {
            megatron_tensor::alloc::set_rank(rank);
            // Megatron's order: tensor-parallel ranks adjacent, then context, then data.
            let (t, c) = (cfg.tp, cfg.cp);
            let mut tp = comm.split_named(rank / t, rank % t, "tp")?;
            let mut cp = comm.split_named(rank % t + t * (rank / (t * c)), (rank / t) % c, "cp")?;
            let mut dp = comm.split_named(rank % (t * c), rank / (t * c), "dp")?;
            crate::launch::rank_thread_pool(rank, per_rank)?.install(|| {
                megatron_tensor::threads::set_gemm_threads(per_rank);
                train_rank(&cfg, rank, tp.as_mut(), cp.as_mut(), dp.as_mut())
            })
        },
    );
    let mut lead = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            megatron_comm::RankOutcome::Finished(Ok(s)) => {
                if rank == 0 {
                    lead = Some(s);
                }
            }
            megatron_comm::RankOutcome::Finished(Err(e)) => return Err(e),
            megatron_comm::RankOutcome::Panicked(msg) => {
                return Err(TrainError::Rank { rank, msg })
            }
            megatron_comm::RankOutcome::Stuck => {
                return Err(TrainError::Rank {
                    rank,
                    msg: "stopped arriving (no result)".into(),
                })
            }
        }
    }
    lead.ok_or_else(|| TrainError::Rank {
        rank: 0,
        msg: "finished without a result".into(),
    })
}

/// Real tables to evaluate on, read once (their errors stop the run before training).
fn eval_frames(cfg: &TabularTrainConfig) -> Result<Vec<(String, Frame)>, TrainError> {
    cfg.eval_data
        .iter()
        .map(|p| {
            let csv = CsvTable::read(p).map_err(|e| TrainError::Args(e.to_string()))?;
            let target = csv.header.len() - 1;
            let f = frame(
                &csv,
                Some(target),
                &[],
                TaskArg::Auto,
                cfg.prior.max_features,
            )
            .map_err(|e| TrainError::Args(e.to_string()))?;
            let name = p
                .file_name()
                .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into());
            Ok((name, f))
        })
        .collect()
}

fn train_rank(
    cfg: &TabularTrainConfig,
    world_rank: usize,
    tp_comm: &mut dyn Communicator,
    cp_comm: &mut dyn Communicator,
    dp: &mut dyn Communicator,
) -> Result<TabularSummary, TrainError> {
    let lead = world_rank == 0;
    let (tp_rank, dp_rank) = (tp_comm.rank(), dp.rank());
    // The bins also carry reconstructed feature cells, so they exist whatever share of the
    // prior's tables is regression: estimated from regression tables only.
    let all_regression = PriorConfig {
        regression_share: 1.0,
        ..cfg.prior.clone()
    };
    let mut ck = cfg.load.as_deref().map(checkpoint::load).transpose()?;
    let borders = match &mut ck {
        Some(ck) => {
            let old = ck.meta.borders.clone();
            let borders = with_tails(&old, &cfg.tail_borders);
            if borders != old {
                let shares = bin_shares(&all_regression, cfg.seed, BORDER_TABLES, &borders);
                let (m, v) = checkpoint::moment_names();
                split_bins(&mut ck.tensors, &old, &borders, &shares, &[m, v], &ck.dir)?;
                if lead {
                    println!(
                        " split the checkpoint's {} bins into {} at --tabular-tail-borders",
                        old.len() + 1,
                        borders.len() + 1
                    );
                }
            }
            borders
        }
        None => with_tails(
            &regression_borders(&all_regression, cfg.seed, BORDER_TABLES, BINS),
            &cfg.tail_borders,
        ),
    };
    let (model, mut params) =
        TabularModel::new(cfg.model, borders.len() + 1, cfg.seed, tp_rank, cfg.tp);
    let (b1, b2, eps) = cfg.adam;
    let mut adam = Adam::new(&params, b1, b2, eps);
    let mut scheduler = cfg.scheduler.clone();
    let mut iteration = 0u64;
    if let Some(ck) = &ck {
        if ck.meta.model != cfg.model {
            return Err(crate::checkpointing::ckpt_err(
                &ck.dir,
                format!(
                    "was trained with model sizes {:?}; the flags give {:?}",
                    ck.meta.model, cfg.model
                ),
            ));
        }
        let mut local = params.data.clone();
        scatter_whole(&params, &ck.tensors, "", &mut local, &ck.dir)?;
        params.data = local;
        if ck.has_optimizer_state() {
            let (m, v) = checkpoint::moment_names();
            scatter_whole(&params, &ck.tensors, m, &mut adam.exp_avg, &ck.dir)?;
            scatter_whole(&params, &ck.tensors, v, &mut adam.exp_avg_sq, &ck.dir)?;
            adam.step = ck.meta.optimizer_step;
        }
        match cfg.resume_schedule {
            ResumeSchedule::Flags => scheduler.num_steps = ck.meta.scheduler.num_steps,
            ResumeSchedule::Checkpoint => scheduler = ck.meta.scheduler.clone(),
        }
        iteration = ck.meta.iteration;
        if lead {
            println!(
                " loaded tabular checkpoint {} (iteration {iteration})",
                ck.dir.display()
            );
        }
    }
    drop(ck);
    let evals = eval_frames(cfg)?;
    let per = cfg.tables_per_step as u64;
    let mut loader = PriorLoader::new(
        cfg.prior.clone(),
        cfg.seed,
        iteration * per,
        cfg.prior_workers,
        cfg.tables_per_step * 2,
    );
    let mut metrics = MetricsFile::open(if lead {
        cfg.metrics_file.as_deref()
    } else {
        None
    })
    .map_err(|e| TrainError::Args(format!("--metrics-file: {e}")))?;
    let mut summary = TabularSummary {
        start_iteration: iteration,
        ..Default::default()
    };
    let how = StepBatching {
        seed: cfg.seed,
        max_context: cfg.max_context,
        cell_budget: cfg.cell_budget,
        hidden_share: cfg.hidden_share,
    };
    let mut grads = Grads::zeros_like(&params);
    let (mut window_tables, mut window_cells, mut window_wait) = (0u64, 0u64, Duration::ZERO);
    let mut window_start = Instant::now();
    let mut last_save = None;
    while iteration < cfg.train_iters {
        iteration += 1;
        let waited_before = loader.waited();
        let tables: Vec<_> = (0..cfg.tables_per_step)
            .map(|_| loader.next_table())
            .collect();
        window_wait += loader.waited() - waited_before;
        let first = (iteration - 1) * per;
        let micro = step_micro_batches(&tables, first, how).map_err(|e| {
            TrainError::Args(format!("--tabular-cell-budget: iteration {iteration}: {e}"))
        })?;
        window_tables += per;
        window_cells += micro.iter().map(|m| m.cells() as u64).sum::<u64>();
        grads.data.fill(0.0);
        let mut loss = 0.0f64;
        let ctx = StepContext {
            recompute: cfg.recompute,
            ..StepContext::train(cfg.seed, iteration, first)
        };
        let cp = CpLayout {
            rank: cp_comm.rank(),
            size: cp_comm.size(),
        };
        for m in micro.iter().skip(dp_rank).step_by(cfg.dp) {
            let b = rows_on_this_rank(&m.batch, cp);
            let batch = TabularBatch {
                inputs: b.inputs(),
                real_rows: &m.real_rows,
                real_cols: &m.real_cols,
                ids: RngKey::new(cfg.seed)
                    .fold(0x0069_6473)
                    .fold(iteration)
                    .fold(m.index as u64),
                borders: &borders,
                step_tables: cfg.tables_per_step,
                hidden: &m.hidden,
                reconstruction_weight: cfg.reconstruction_weight,
            };
            let mut tp = Tp::new(tp_comm, false).with_context_parallel(cp_comm, CpCommType::A2a);
            loss += model.forward_backward(&params, Some(&mut grads), &mut tp, &batch, &ctx)?;
        }
        // Context-parallel ranks hold parts of the same tables: their shares add up.
        if cfg.cp > 1 {
            cp_comm.all_reduce(&mut grads.data, ReduceOp::Sum)?;
            loss = sum_f64(cp_comm, loss)?;
        }
        // Each rank's loss and gradients are its share of a mean over the step's tables.
        if cfg.dp > 1 {
            dp.all_reduce(&mut grads.data, ReduceOp::Sum)?;
            loss = sum_f64(dp, loss)?;
        }
        let grad_norm = {
            let mut tp = Tp::new(tp_comm, false);
            grad_norm_tp(&params, &grads, &mut tp)?
        };
        if !loss.is_finite() || !grad_norm.is_finite() {
            return Err(TrainError::NonFinite {
                iteration,
                what: if loss.is_finite() {
                    "grad norm"
                } else {
                    "loss"
                },
                value: if loss.is_finite() { grad_norm } else { loss },
            });
        }
        clip_grads_by_norm(&mut grads, grad_norm, cfg.clip_grad);
        let lr = scheduler.get_lr();
        adam.step(&mut params, &grads, lr as f32, cfg.weight_decay);
        scheduler.step(per);
        summary.losses.push((iteration, loss));
        if iteration.is_multiple_of(cfg.log_interval) || iteration == cfg.train_iters {
            let secs = window_start.elapsed().as_secs_f64().max(1e-9);
            let line = IterationLine {
                iteration,
                consumed_tables: iteration * per,
                lr,
                loss,
                grad_norm,
                tables_per_second: window_tables as f64 / secs,
                cells_per_second: window_cells as f64 / secs,
                data_wait_seconds: window_wait.as_secs_f64(),
            };
            if lead {
                println!(
                    " iteration {iteration:>8}/{:>8} | consumed tables: {:>10} | learning rate: {lr:.6E} | loss: {loss:.6E} | grad norm: {grad_norm:.3} | tables/s: {:.2} | cells/s: {:.0} | data wait: {:.3} s",
                    cfg.train_iters,
                    iteration * per,
                    line.tables_per_second,
                    line.cells_per_second,
                    line.data_wait_seconds
                );
                metrics
                    .write(&line)
                    .map_err(|e| TrainError::Args(format!("--metrics-file: {e}")))?;
            }
            (window_tables, window_cells, window_wait) = (0, 0, Duration::ZERO);
            window_start = Instant::now();
        }
        let eval_now = cfg.eval_interval > 0
            && !evals.is_empty()
            && (iteration.is_multiple_of(cfg.eval_interval) || iteration == cfg.train_iters);
        if eval_now {
            let whole = whole_model(&params, tp_comm)?;
            if lead {
                let m = evaluate_whole(cfg, &whole, &borders, &evals)?;
                for t in &m {
                    println!("{}", t.line());
                    metrics
                        .write(&serde_json::json!({ "iteration": iteration, "validation": t }))
                        .map_err(|e| TrainError::Args(format!("--metrics-file: {e}")))?;
                }
                summary.evals.push((iteration, m));
            }
        }
        let save_now = cfg.save.is_some()
            && (iteration == cfg.train_iters
                || cfg
                    .save_interval
                    .is_some_and(|s| s > 0 && iteration.is_multiple_of(s)));
        if save_now {
            let dir = cfg.save.as_ref().expect("checked");
            let meta = TabularCheckpointMeta {
                format: TABULAR_FORMAT.into(),
                iteration,
                consumed_tables: iteration * per,
                model: cfg.model,
                borders: borders.clone(),
                max_features: cfg.prior.max_features,
                max_context: cfg.max_context,
                seed: cfg.seed,
                scheduler: scheduler.clone(),
                optimizer_step: adam.step,
                adam: cfg.adam,
                files: Vec::new(),
            };
            let tensors = checkpoint_tensors(&params, &adam, tp_comm)?;
            if lead {
                let started = Instant::now();
                let path = checkpoint::save(dir, meta, &tensors)?;
                println!(
                    " saved checkpoint at iteration {iteration} to {} ({:.2} s)",
                    path.display(),
                    started.elapsed().as_secs_f64()
                );
                last_save = Some(path);
            }
            // Nobody runs ahead of a checkpoint that is not yet in place.
            dp.barrier()?;
            cp_comm.barrier()?;
            tp_comm.barrier()?;
        }
    }
    summary.last_checkpoint = last_save;
    summary.data_wait = loader.waited().as_secs_f64();
    let whole = whole_model(&params, tp_comm)?;
    if lead {
        summary.params = params
            .metas
            .iter()
            .map(|m| m.name.clone())
            .zip(whole)
            .collect();
    }
    Ok(summary)
}

/// This context-parallel rank's rows of a micro-batch (chunks `r` and `2C-1-r` of each
/// table's padded rows; everything per table or per column as it is).
fn rows_on_this_rank(b: &TableBatch, cp: CpLayout) -> Cow<'_, TableBatch> {
    if cp.size == 1 {
        return Cow::Borrowed(b);
    }
    let cells = |x: &[f32]| cp.batch_on_this_rank(x, b.b, b.rows * b.cols);
    let rows = |x: &[f32]| cp.batch_on_this_rank(x, b.b, b.rows);
    Cow::Owned(TableBatch {
        rows: b.rows / cp.size,
        values: cells(&b.values),
        missing: cells(&b.missing),
        row_valid: rows(&b.row_valid),
        targets: rows(&b.targets),
        ..b.clone()
    })
}

fn whole_model(
    params: &megatron_core::Params,
    tp: &mut dyn Communicator,
) -> Result<Vec<Vec<f32>>, TrainError> {
    gather_whole(params, &params.data, tp)
}

fn checkpoint_tensors(
    params: &megatron_core::Params,
    adam: &Adam,
    tp: &mut dyn Communicator,
) -> Result<checkpoint::Tensors, TrainError> {
    let (m, v) = checkpoint::moment_names();
    let mut out = Vec::new();
    for (prefix, local) in [
        ("", &params.data),
        (m, &adam.exp_avg),
        (v, &adam.exp_avg_sq),
    ] {
        let whole = gather_whole(params, local, tp)?;
        for (meta, w) in params.metas.iter().zip(whole) {
            out.push((format!("{prefix}{}", meta.name), meta.shape.clone(), w));
        }
    }
    Ok(out)
}

/// Evaluates the whole model (rebuilt at TP 1 from gathered tensors) on the real tables.
fn evaluate_whole(
    cfg: &TabularTrainConfig,
    whole: &[Vec<f32>],
    borders: &[f32],
    evals: &[(String, Frame)],
) -> Result<Vec<TableMetrics>, TrainError> {
    let (model, mut params) = TabularModel::new(cfg.model, borders.len() + 1, cfg.seed, 0, 1);
    for (m, w) in params.metas.clone().iter().zip(whole) {
        params.data[m.offset..m.offset + m.numel].copy_from_slice(w);
    }
    let p = Predictor {
        model: &model,
        params: &params,
        borders,
        max_context: cfg.max_context,
    };
    evals
        .iter()
        .map(|(name, f)| {
            evaluate_frame(&p, name, f, cfg.seed, cfg.max_context).map_err(TrainError::from)
        })
        .collect()
}
