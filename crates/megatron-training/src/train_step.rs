//! One training step (Megatron's `train_step`): the schedule's forwards and backwards over the
//! step's micro-batches (through the pipeline executor, whatever the pipeline size), gradients
//! finalized (sequence-parallel and tied-embedding all-reduces, data-parallel reduction, with
//! the overlapped reduction and parameter all-gather on a communication thread), then loss
//! scaling, the gradient norm, clipping and the optimizer step behind `MegatronOptimizer`.

use crate::family::{LossAveraging, TrainFamily};
use crate::training::Trainer;
use crate::TrainError;
use megatron_comm::{Communicator, ReduceOp};
use megatron_core::distributed::overlap::{reduce_buckets, GradsPtr, OverlapGradReduce};
use megatron_core::distributed::overlap_param_gather::{gather_params, ParamGate, ParamsPtr};
use megatron_core::distributed::GradBuffer;
use megatron_core::models::ModelChunk;
use megatron_core::optimizer::{ParamGather, StepLr};
use megatron_core::pipeline_parallel::executor::Stage;
use megatron_core::pipeline_parallel::schedule;
use megatron_core::tensor_parallel::{allreduce_sequence_parallel_grads, sum_f64};
use megatron_core::transformer::step::{LossReduction, StepContext};
use megatron_data::Split;
use std::time::Instant;

/// What one step reports.
pub(crate) struct StepOutcome {
    /// Mean loss over the global batch.
    pub loss: f64,
    pub lr: f64,
    /// `--decoupled-lr`'s rate for the embedding and output layer.
    pub decoupled_lr: Option<f64>,
    /// NaN when the step was skipped.
    pub grad_norm: f64,
    pub num_zeros: Option<u64>,
    /// Gradients overflowed under loss scaling: no optimizer step.
    pub skipped: bool,
    pub loss_scale: f32,
    pub peak_activation_bytes: usize,
    pub peak_in_flight: usize,
}

/// What the forward/backward pass of a step left.
struct Pass {
    /// The loss of this rank's micro-batches, summed over the pipeline: the sum of their means
    /// and 0 ([`LossAveraging::MicroBatches`]), or their summed loss and counted tokens
    /// ([`LossAveraging::Tokens`]).
    loss_sum: (f64, f64),
    /// Buckets the overlapped reduction did not reduce (`None`: not overlapped).
    remaining: Option<Vec<usize>>,
    peak_activation_bytes: usize,
    peak_in_flight: usize,
}

impl<F: TrainFamily> Trainer<'_, F> {
    pub(crate) fn train_step(&mut self, iteration: u64) -> Result<StepOutcome, TrainError> {
        self.grads.zero();
        // fp16 loss scaling: the loss gradient is multiplied by the scale, the gradients divided
        // by it before the optimizer.
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale());
        // Under context parallelism each rank's gradients cover its part of the sequence and
        // are averaged over data x context ranks: scaled by the context-parallel size they sum
        // over the sequence (Megatron multiplies the loss by it).
        // This rank's own work in the step (for --log-straggler): the forward/backward pass
        // less the time it waited for pipeline neighbours.
        let (busy_start, waited) = (Instant::now(), self.timers.p2p_wait);
        if self.cfg.args.inject_slow_rank == Some(self.comms.world_rank) {
            std::thread::sleep(std::time::Duration::from_millis(
                self.cfg.args.inject_slow_ms,
            ));
        }
        self.fill_micro_batches()?;
        let grad_scale = self.grad_scale(loss_scale)?;
        let pass = self.forward_backward(iteration, grad_scale)?;
        self.busy += busy_start
            .elapsed()
            .saturating_sub(self.timers.p2p_wait.saturating_sub(waited));
        let opt_start = Instant::now();
        let loss = self.finalize_gradients(iteration, &pass)?;
        let mut out = self.optimizer_step(iteration, loss)?;
        self.timers.optimizer += opt_start.elapsed();
        self.timers.record(|| "optimizer".into(), opt_start);
        out.loss_scale = loss_scale;
        out.peak_activation_bytes = pass.peak_activation_bytes;
        out.peak_in_flight = pass.peak_in_flight;
        Ok(out)
    }

    /// The factor of the loss gradient. Each micro-batch's mean: 1 / micro-batches.
    /// `--calculate-per-token-loss`: the data-and-context-parallel size over the global batch's
    /// counted tokens, since the reduction averages over that group and each rank's gradient
    /// is of its tokens' summed loss (so every token weighs 1 / tokens, as Megatron's
    /// `finalize_model_grads` scales), counted on the step's filled micro-batches.
    fn grad_scale(&mut self, loss_scale: f32) -> Result<f32, TrainError> {
        let m = self.cfg.batches.num_microbatches(self.consumed);
        if self.cfg.loss_reduction == LossReduction::MicroBatchMean {
            return Ok(loss_scale * self.cfg.cp as f32 / m as f32);
        }
        let local: f64 = self.mbs[..m].iter().map(F::counted_tokens).sum();
        let (_, group) = self.comms.dp_rank_size();
        let tokens = match self.comms.dp.as_deref_mut() {
            Some(c) => sum_f64(c, local)?,
            None => local,
        };
        Ok(loss_scale * group as f32 / tokens.max(1.0) as f32)
    }

    /// This rank's micro-batches of the step, from the data, in the sampler's order: the
    /// `m`-th of the step is the one Megatron's sampler hands this rank once the step's first
    /// `m` data-parallel micro-batches are consumed.
    fn fill_micro_batches(&mut self) -> Result<(), TrainError> {
        let (_, dp) = self.comms.data_rank_size();
        let step = (self.cfg.args.micro_batch_size * dp) as u64;
        let total = self.split_samples(Split::Train);
        let m = self.cfg.batches.num_microbatches(self.consumed);
        for (k, mb) in self.mbs[..m].iter_mut().enumerate() {
            let consumed = self.consumed + k as u64 * step;
            let samples = self.samplers.micro_batch(Split::Train, total, consumed)?;
            F::fill(self.cfg, &self.data, mb, Split::Train, &samples)?;
        }
        Ok(())
    }

    /// Where each of this rank's micro-batches of the step starts in the order the data-
    /// parallel ranks consume samples together (under `single`, its first sample). Dropout
    /// draws are keyed by it, so they do not depend on the layout, nor repeat between rows.
    fn micro_batch_positions(&self) -> Vec<u64> {
        let (dp_rank, dp) = self.comms.data_rank_size();
        let b = self.cfg.args.micro_batch_size as u64;
        (0..self.cfg.batches.num_microbatches(self.consumed) as u64)
            .map(|k| self.consumed + k * b * dp as u64 + dp_rank as u64 * b)
            .collect()
    }

    /// Runs the schedule on the micro-batches [`Trainer::fill_micro_batches`] filled.
    /// `--overlap-grad-reduce`: a communication thread reduces each bucket
    /// over DP as soon as the last micro-batch's backward has finished it.
    /// `--overlap-param-gather`: the same thread first all-gathers the parameters the last
    /// optimizer step updated, while forward waits bucket by bucket (`Params::get`).
    fn forward_backward(&mut self, iteration: u64, grad_scale: f32) -> Result<Pass, TrainError> {
        let cfg = self.cfg;
        let a = &cfg.args;
        let starts = self.micro_batch_positions();
        // Under batch-size ramp-up the buffers (sized for the final batch) are used in part.
        let batches: Vec<_> = self.mbs[..starts.len()]
            .iter()
            .map(|x| F::batch(cfg, x))
            .collect();
        let ctxs: Vec<StepContext> = starts
            .iter()
            .map(|&s| {
                StepContext::train(a.seed, iteration, s)
                    .with_grad_scale(grad_scale)
                    .with_recompute(cfg.recompute)
                    .with_loss_reduction(cfg.loss_reduction)
            })
            .collect();
        let (pp_rank, pp_size) = (self.comms.pp.rank(), self.comms.pp.size());
        let m = starts.len();
        let ops = schedule(pp_size, pp_rank, m, cfg.partition.v).map_err(TrainError::Args)?;
        let (_, dp) = self.comms.dp_rank_size();
        let overlap_grad = a.overlap_grad_reduce && dp > 1;
        let gather = std::mem::take(&mut self.pending_gather).then(|| {
            let gate = std::sync::Arc::new(ParamGate::new());
            self.params.gate = Some(gate.clone());
            (ParamsPtr::new(&mut self.params), gate)
        });
        let overlap_dp = if overlap_grad || gather.is_some() {
            self.comms.dp.as_deref_mut()
        } else {
            None
        };
        let active: &GradBuffer = self.optimizer.grad_buffer();
        let world_rank = self.comms.world_rank;
        let tied_pp = pp_size > 1 && !cfg.model.untie_embeddings_and_output_weights;
        let (params, grads) = (&self.params, &mut self.grads);
        let (tp, pp, timers) = (&mut self.comms.tp, &mut *self.comms.pp, &mut self.timers);
        let (chunks, chunk_params) = (&self.chunks, &self.chunk_params);
        let pass = std::thread::scope(|sc| -> Result<Pass, TrainError> {
            let mut overlap = None;
            let mut comm_thread = None;
            if let Some(dpc) = overlap_dp {
                let (tx, rx) = std::sync::mpsc::channel();
                let ptr = GradsPtr::new(grads);
                let slot = megatron_tensor::alloc::current_slot();
                comm_thread = Some(sc.spawn(move || -> Result<(), megatron_comm::CommError> {
                    megatron_tensor::alloc::set_slot(slot);
                    if let Some((p, gate)) = gather {
                        gather_params(active, p, &mut *dpc, &gate)?;
                    }
                    reduce_buckets(rx, active, ptr, dpc)
                }));
                if overlap_grad {
                    // The tied embedding is all-reduced over the embedding group first: its
                    // bucket waits for the end of the step.
                    let metas = &params.metas;
                    overlap = Some(OverlapGradReduce::new(
                        active,
                        params,
                        |p| tied_pp && metas[p].name == "embedding.word_embeddings.weight",
                        tx,
                    ));
                }
            }
            let r = Stage {
                chunks,
                partition: cfg.partition.clone(),
                rank: pp_rank,
                pp: &mut *pp,
                tp,
            }
            .run_overlapped(
                params,
                Some(grads),
                &ops,
                &batches,
                &ctxs,
                grad_scale,
                timers,
                overlap.as_mut().map(|ov| (ov, &chunk_params[..])),
            )?;
            let local = loss_sums::<F>(&r.losses);
            // The loss is known on the last stage: summed over the pipeline group.
            let loss_sum = if pp_size > 1 {
                let last = pp_rank == pp_size - 1;
                sum_loss_sums::<F>(pp, if last { local } else { (0.0, 0.0) })?
            } else {
                local
            };
            let remaining = overlap.map(|ov| ov.remaining());
            if let Some(h) = comm_thread {
                // Without `--overlap-grad-reduce` the channel's sender is gone: the thread ends
                // once the parameters are gathered.
                h.join().map_err(|_| TrainError::Rank {
                    rank: world_rank,
                    msg: "the data-parallel communication thread panicked".into(),
                })??;
            }
            Ok(Pass {
                loss_sum,
                remaining,
                peak_activation_bytes: r.peak_activation_bytes,
                peak_in_flight: r.peak_in_flight,
            })
        })?;
        self.params.gate = None;
        Ok(pass)
    }

    /// Sequence-parallel and tied-embedding all-reduces, then the mean gradient and loss over
    /// data-parallel ranks. Returns the step's mean loss.
    fn finalize_gradients(&mut self, iteration: u64, pass: &Pass) -> Result<f64, TrainError> {
        let cfg = self.cfg;
        let (sum, tokens) = pass.loss_sum;
        allreduce_sequence_parallel_grads(&self.params, &mut self.grads, &mut self.comms.tp)?;
        for c in &self.chunks {
            c.finalize_step(
                &mut self.comms.tp,
                megatron_comm::reborrow(&mut self.comms.dp),
            )?;
        }
        if let (Some(e), true) = (
            self.comms.embedding.as_deref_mut(),
            self.comms.pp.size() > 1,
        ) {
            // The first stage's word embedding and the last stage's copy: one gradient.
            if let Some(id) = self.chunks.iter().find_map(|c| c.shared_embedding()) {
                e.all_reduce(self.grads.get_mut(id), ReduceOp::Sum)?;
            }
        }
        if self.comms.pp.size() > 1 {
            // Copies on several stages (a T5's embedding and relative biases): one gradient.
            let tied = self
                .chunks
                .first()
                .map_or(Vec::new(), |c| c.pipeline_tied());
            for t in tied {
                match t.id {
                    Some(id) => self
                        .comms
                        .pp
                        .all_reduce(self.grads.get_mut(id), ReduceOp::Sum)?,
                    None => self
                        .comms
                        .pp
                        .all_reduce(&mut vec![0.0f32; t.numel], ReduceOp::Sum)?,
                }
            }
        }
        if cfg.args.inject_grad_overflow.contains(&iteration) {
            self.grads.data[0] = f32::INFINITY;
        }
        if cfg.args.inject_nan_grad == Some(iteration)
            && cfg.args.inject_nan_grad_rank == self.comms.world_rank
        {
            self.grads.data[0] = f32::NAN;
        }
        if cfg.check_for_nan_in_loss_and_grad {
            self.check_local_loss_and_grads(iteration, sum)?;
        }
        let m = cfg.batches.num_microbatches(self.consumed) as f64;
        let mut loss = match F::loss_averaging() {
            LossAveraging::MicroBatches => sum / m,
            LossAveraging::Tokens => sum / tokens.max(1.0),
        };
        if let Some(c) = self.comms.dp.as_deref_mut() {
            // The mean gradient (all-reduced, or reduce-scattered to the distributed optimizer's
            // shards) and loss over all ranks' micro-batches.
            let rest = pass.remaining.as_deref();
            self.optimizer
                .reduce_gradients(&mut self.grads, rest, &mut *c)?;
            loss = match F::loss_averaging() {
                LossAveraging::MicroBatches => {
                    let mut l = [loss as f32];
                    c.all_reduce(&mut l, ReduceOp::Avg)?;
                    l[0] as f64
                }
                LossAveraging::Tokens => {
                    let (sum, tokens) = sum_loss_sums::<F>(c, (sum, tokens))?;
                    sum / tokens.max(1.0)
                }
            };
        }
        Ok(loss)
    }

    /// Megatron's `check_for_nan_in_loss_and_grad`: this rank's loss and gradients, before the
    /// data-parallel reduction would spread a bad value to every replica, so the error names
    /// the rank (a faulty device, a bad sample) and the first tensor holding it. Under
    /// `--overlap-grad-reduce` buckets were reduced during the backward pass: the message says
    /// so, since the source may then be any data-parallel peer.
    fn check_local_loss_and_grads(&mut self, iteration: u64, loss: f64) -> Result<(), TrainError> {
        let overlapped = self.cfg.args.overlap_grad_reduce && self.comms.dp_rank_size().1 > 1;
        let err = |what: String, when: &'static str| TrainError::LocalNonFinite {
            iteration,
            rank: self.comms.world_rank,
            coords: format!(
                "tp {}, pp {}, dp {}",
                self.comms.tp.rank(),
                self.comms.pp.rank(),
                self.comms.dp_rank_size().0
            ),
            what,
            when,
        };
        if !loss.is_finite() {
            return Err(err(
                format!("{loss} in its local forward loss"),
                "before data-parallel communication",
            ));
        }
        if let Some(i) = megatron_tensor::cpu::first_non_finite(&self.grads.data) {
            let m = self.params.metas.iter().find(|m| i < m.offset + m.numel);
            let name = m.map_or("an unnamed buffer", |m| m.name.as_str());
            let when = if overlapped {
                "after its overlapped data-parallel reduction (any data-parallel peer may be the source)"
            } else {
                "before data-parallel communication"
            };
            return Err(err(
                format!("{} in the gradient of {name}", self.grads.data[i]),
                when,
            ));
        }
        Ok(())
    }

    /// Unscales and checks for overflow (loss scaling), takes the global gradient norm, clips
    /// and steps; a skipped step leaves the learning-rate schedule where it was (as Megatron).
    fn optimizer_step(&mut self, iteration: u64, loss: f64) -> Result<StepOutcome, TrainError> {
        let a = &self.cfg.args;
        let skip = self.grads_overflowed()?;
        if !loss.is_finite() && self.scaler.is_none() {
            return Err(TrainError::NonFinite {
                iteration,
                what: "lm loss",
                value: loss,
            });
        }
        let lr = self.sched.get_lr();
        // Megatron's decoupled group: its own peak (and floor, else --min-lr) on the schedule.
        let decoupled_lr = a.decoupled_lr.map(|max| {
            self.sched
                .get_lr_in(max, a.decoupled_min_lr.unwrap_or(self.sched.min_lr))
        });
        let mut out = StepOutcome {
            loss,
            lr,
            decoupled_lr,
            grad_norm: f64::NAN,
            num_zeros: None,
            skipped: skip,
            loss_scale: 1.0,
            peak_activation_bytes: 0,
            peak_in_flight: 0,
        };
        if let Some(sc) = self.scaler.as_mut() {
            sc.update(skip);
        }
        if skip {
            return Ok(out);
        }
        let (params, grads, opt) = (&mut self.params, &mut self.grads, &mut self.optimizer);
        let (tp, pp) = (&mut self.comms.tp, &mut *self.comms.pp);
        let dp = self
            .comms
            .dp
            .as_deref_mut()
            .map(|c| c as &mut dyn Communicator);
        let norm2 = opt.grad_norm_squared(params, grads, tp, pp, dp)?;
        out.grad_norm = norm2.sqrt();
        if !out.grad_norm.is_finite() {
            return Err(TrainError::NonFinite {
                iteration,
                what: "grad norm",
                value: out.grad_norm,
            });
        }
        if a.log_num_zeros_in_grad {
            let dp = self
                .comms
                .dp
                .as_deref_mut()
                .map(|c| c as &mut dyn Communicator);
            out.num_zeros = Some(opt.count_zeros(params, grads, tp, pp, dp)?);
        }
        if a.clip_grad > 0.0 {
            let coeff = a.clip_grad as f64 / (out.grad_norm + 1e-6);
            if coeff < 1.0 {
                opt.scale_grads(grads, coeff as f32);
            }
        }
        let (_, dp_size) = self.comms.dp_rank_size();
        // `--overlap-param-gather` (validated to come with the distributed optimizer): the
        // all-gather runs during the next step's forward.
        let gather = if a.overlap_param_gather && dp_size > 1 {
            ParamGather::Deferred
        } else {
            ParamGather::Now
        };
        let dp: &mut dyn Communicator = match self.comms.dp.as_deref_mut() {
            Some(c) => c,
            None => &mut self.serial_dp,
        };
        let rates = StepLr {
            base: lr as f32,
            decoupled: decoupled_lr.map(|x| x as f32),
        };
        opt.step(params, grads, rates, a.weight_decay, dp, gather)?;
        self.pending_gather = gather == ParamGather::Deferred;
        self.sched
            .step(self.cfg.batches.global_batch_size(self.consumed));
        Ok(out)
    }

    /// Under loss scaling: unscales the gradients; whether any overflowed anywhere (then every
    /// rank skips the step).
    fn grads_overflowed(&mut self) -> Result<bool, TrainError> {
        let Some(sc) = &self.scaler else {
            return Ok(false);
        };
        let inv = 1.0 / sc.scale();
        self.optimizer.scale_grads(&mut self.grads, inv);
        let sum_sq = self
            .optimizer
            .local_grad_norm_squared(&self.params, &self.grads);
        let mut flag = [if sum_sq.is_finite() { 0.0f32 } else { 1.0 }];
        self.comms.tp.comm.all_reduce(&mut flag, ReduceOp::Max)?;
        self.comms.pp.all_reduce(&mut flag, ReduceOp::Max)?;
        if let Some(c) = self.comms.dp.as_deref_mut() {
            c.all_reduce(&mut flag, ReduceOp::Max)?;
        }
        Ok(flag[0] > 0.0)
    }
}

/// A stage's micro-batch losses `(mean, counted tokens)` as [`Pass::loss_sum`] holds them.
pub(crate) fn loss_sums<F: TrainFamily>(losses: &[(f32, f32)]) -> (f64, f64) {
    match F::loss_averaging() {
        LossAveraging::MicroBatches => (losses.iter().map(|l| l.0 as f64).sum(), 0.0),
        LossAveraging::Tokens => losses.iter().fold((0.0, 0.0), |(s, n), &(mean, tokens)| {
            (s + mean as f64 * tokens as f64, n + tokens as f64)
        }),
    }
}

/// [`loss_sums`] summed over `comm`; the token count only where the averaging uses it.
pub(crate) fn sum_loss_sums<F: TrainFamily>(
    comm: &mut dyn Communicator,
    (sum, tokens): (f64, f64),
) -> Result<(f64, f64), megatron_comm::CommError> {
    let sum = sum_f64(comm, sum)?;
    let tokens = match F::loss_averaging() {
        LossAveraging::MicroBatches => tokens,
        LossAveraging::Tokens => sum_f64(comm, tokens)?,
    };
    Ok((sum, tokens))
}
