//! Evaluation (Megatron's `evaluate`): the validation loss over `--eval-iters` global
//! batches, forward only, through the same pipeline executor as training (one stage runs the
//! same way, with nothing to send).

use crate::arguments::ValidationScope;
use crate::family::{LossAveraging, TrainFamily};
use crate::train_step::{loss_sums, sum_loss_sums};
use crate::training::Trainer;
use crate::TrainError;
use megatron_core::models::LossPhase;
use megatron_core::pipeline_parallel::executor::Stage;
use megatron_core::pipeline_parallel::Op;
use megatron_core::transformer::step::StepContext;
use megatron_data::Split;

/// An evaluation's score: the loss trained on, and a BERT's sentence-order part of it, which
/// Megatron's log shows apart (`lm loss value` is then the masked-LM part alone).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct EvalLoss {
    pub loss: f64,
    pub sop: Option<f64>,
}

impl EvalLoss {
    /// Megatron's `lm loss`: the loss without its sentence-order part.
    pub fn lm(&self) -> f64 {
        self.loss - self.sop.unwrap_or(0.0)
    }

    /// The values of Megatron's validation line: `lm loss value: ... | lm loss PPL: ...`, and
    /// `sop loss value` / `sop loss PPL` where there is one.
    pub fn values(&self) -> String {
        let lm = self.lm();
        let mut s = format!("lm loss value: {lm:.6E} | lm loss PPL: {:.3E}", lm.exp());
        if let Some(l) = self.sop {
            s += &format!(" | sop loss value: {l:.6E} | sop loss PPL: {:.3E}", l.exp());
        }
        s
    }
}

impl<F: TrainFamily> Trainer<'_, F> {
    /// The mean loss over `--eval-iters` global batches of `split`. As Megatron's iterators:
    /// each validation reads the next global batches of the validation split (from the
    /// `consumed_valid` samples on, which it advances), the test split and `--skip-train`
    /// read from the start. Each rank's micro-batches come from its sampler, as the step's do
    /// (under `single`, the same samples for every layout: data-parallel rank r takes
    /// micro-batches r, r + d, ... of them); the sum is all-reduced over DP (validations go
    /// through [`Self::validate`], which reads whole sets under `--full-validation`). Every
    /// rank calls it; `None` without samples in the split or with `--eval-iters 0`.
    pub(crate) fn evaluate(&mut self, split: Split) -> Result<Option<EvalLoss>, TrainError> {
        self.evaluate_set(split, None)
    }

    /// One validation: each set's loss with the suffix Megatron's log gives it (`-<i>` or
    /// `-<name>` under `--multiple-validation-sets`; none otherwise).
    pub(crate) fn validate(&mut self) -> Result<Vec<(String, EvalLoss)>, TrainError> {
        let n = F::num_samples(&self.data, Split::Valid);
        let names = match &self.cfg.validation {
            ValidationScope::EvalIters => None,
            ValidationScope::Full => Some(None),
            ValidationScope::FullPerDataset { names } => Some(Some(names.clone())),
        };
        let Some(names) = names else {
            let l = self.evaluate_set(Split::Valid, None)?;
            return Ok(l.map(|l| (String::new(), l)).into_iter().collect());
        };
        // Under --full-validation: the whole split, or each dataset's set apart.
        let sets = match &names {
            None => vec![n],
            Some(_) => F::validation_sets(&self.data),
        };
        if let Some(names) = names
            .as_ref()
            .filter(|v| !v.is_empty() && v.len() != sets.len())
        {
            return Err(TrainError::Args(format!(
                "--validation-set-names gives {} names, the validation split has {} datasets",
                names.len(),
                sets.len()
            )));
        }
        let mut out = Vec::with_capacity(sets.len());
        let mut start = 0;
        for (i, &len) in sets.iter().enumerate() {
            let suffix = match &names {
                None => String::new(),
                Some(v) => format!("-{}", v.get(i).cloned().unwrap_or_else(|| i.to_string())),
            };
            if let Some(l) = self.evaluate_set(Split::Valid, Some((start, len, i)))? {
                out.push((suffix, l));
            }
            start += len;
        }
        Ok(out)
    }

    /// [`Self::evaluate`] of `split`, or under `--full-validation` one whole validation set
    /// `(start, len, index)` ([`Self::full_pass`]).
    fn evaluate_set(
        &mut self,
        split: Split,
        full: Option<(u64, u64, usize)>,
    ) -> Result<Option<EvalLoss>, TrainError> {
        if F::num_samples(&self.data, split) == 0
            || (self.cfg.args.eval_iters == 0 && full.is_none())
        {
            return Ok(None);
        }
        let (dp_rank, dp_size) = self.comms.data_rank_size();
        let plan = if let Some(set) = full {
            self.full_pass(dp_rank, dp_size, set)?
        } else {
            // Micro-batches of --eval-micro-batch-size, --eval-global-batch-size per iteration.
            let cfg = self.cfg.for_evaluation();
            let b = cfg.args.micro_batch_size;
            let global = cfg.args.eval_iters as usize * cfg.global_batch_size / b;
            let first = match split {
                Split::Valid if !cfg.args.skip_train => {
                    let first = self.consumed_valid;
                    self.consumed_valid += cfg.eval_samples();
                    first
                }
                _ => 0,
            };
            let total = self.split_samples(split);
            let samples = (0..global / dp_size)
                .map(|k| {
                    let consumed = first + (k * dp_size * b) as u64;
                    self.samplers.micro_batch(split, total, consumed)
                })
                .collect::<Result<_, _>>()?;
            EvalPlan {
                per_iteration: cfg.global_batch_size / (b * dp_size),
                global,
                samples,
                cfg,
            }
        };
        let cfg = &plan.cfg;
        let cp = self.comms.cp_layout();
        let mut losses = Vec::with_capacity(plan.samples.len());
        // One forward-only pass per evaluation iteration, as Megatron's `evaluate` calls its
        // schedule (the micro-batches of one iteration are built at a time).
        for step in plan.samples.chunks(plan.per_iteration.max(1)) {
            let mut mbs: Vec<F::MicroBatch> =
                (0..step.len()).map(|_| F::micro_batch(cfg, cp)).collect();
            for (mb, samples) in mbs.iter_mut().zip(step) {
                F::fill(cfg, &self.data, mb, split, samples)?;
            }
            losses.extend(self.forward_only(cfg, &mbs)?);
        }
        let global = plan.global;
        // Only the last stage holds losses: the others add zeros.
        let mut total = loss_sums::<F>(&losses);
        let pp = &mut *self.comms.pp;
        if pp.size() > 1 {
            total = sum_loss_sums::<F>(pp, total)?;
        }
        if let Some(c) = self.comms.dp.as_deref_mut() {
            total = sum_loss_sums::<F>(c, total)?;
        }
        let loss = match F::loss_averaging() {
            // Every context-parallel rank holds its micro-batches' whole loss.
            LossAveraging::MicroBatches => total.0 / (global * cfg.cp) as f64,
            // Megatron's GPT: the summed loss over the counted tokens (context-parallel
            // copies in both).
            LossAveraging::Tokens => total.0 / total.1.max(1.0),
        };
        let sop = match F::logs_sop_apart(cfg) {
            true => {
                let local = crate::bert_logging::take_local(&self.chunks, LossPhase::Evaluation);
                Some(crate::bert_logging::mean_over_ranks(
                    &mut self.comms,
                    local,
                )?)
            }
            false => None,
        };
        Ok(Some(EvalLoss { loss, sop }))
    }

    /// The losses (per micro-batch: mean, tokens) of a forward-only pass over `mbs`, through
    /// the pipeline executor as training's step (one stage runs the same way).
    fn forward_only(
        &mut self,
        cfg: &crate::arguments::TrainConfig,
        mbs: &[F::MicroBatch],
    ) -> Result<Vec<(f32, f32)>, TrainError> {
        let batches: Vec<_> = mbs.iter().map(|x| F::batch(cfg, x)).collect();
        let partition = cfg.partition.clone();
        let chunks = partition.v;
        let ops: Vec<Op> = (0..mbs.len())
            .flat_map(|mb| (0..chunks).map(move |chunk| Op::Forward { chunk, mb }))
            .collect();
        let ctxs = vec![StepContext::eval(); mbs.len()];
        let pp = &mut *self.comms.pp;
        let r = Stage {
            chunks: &self.chunks,
            partition,
            rank: pp.rank(),
            pp: &mut *pp,
            tp: &mut self.comms.tp,
        }
        .run(
            &self.params,
            None,
            &ops,
            &batches,
            &ctxs,
            1.0,
            &mut self.timers,
        )?;
        Ok(r.losses)
    }

    /// `--full-validation`: the micro-batches of one pass over the whole validation split as
    /// Megatron reads it. Its `MegatronFullValidationSampler` hands data-parallel rank r the
    /// samples r, r + d, ... one per micro-batch, and the run's evaluation iterations become
    /// as many as the longest rank's list, each of `--eval-global-batch-size` /
    /// (`--eval-micro-batch-size` x d) micro-batches drawn from that rank's list under a
    /// cyclic iterator that goes on from one validation to the next. Where d divides the split
    /// and one micro-batch makes an iteration, each pass reads every sample once; otherwise
    /// it reads some twice, as Megatron does (and a resumed run starts its lists afresh, as
    /// Megatron's rebuilt iterator does).
    /// `set`: where the set lies in the split's sample indices (start, length) and its index
    /// (each set has its own iterators).
    fn full_pass(
        &mut self,
        dp_rank: usize,
        dp_size: usize,
        (start, n, set): (u64, u64, usize),
    ) -> Result<EvalPlan, TrainError> {
        let (rank, dp) = (dp_rank as u64, dp_size as u64);
        if n < dp {
            return Err(TrainError::Args(format!(
                "--full-validation: validation set {set} has {n} samples, fewer than the {dp} data-parallel ranks that each read one (Megatron's iterator stops on an empty rank)"
            )));
        }
        let own = (n - rank).div_ceil(dp);
        let iterations = n.div_ceil(dp);
        let c = self.cfg;
        let per_iteration = c.eval_global_batch_size / (c.eval_micro_batch_size * dp_size);
        let count = iterations * per_iteration as u64;
        if self.full_valid_cursors.len() <= set {
            self.full_valid_cursors.resize(set + 1, 0);
        }
        let cursor = self.full_valid_cursors[set];
        let samples = (0..count)
            .map(|k| vec![start + rank + dp * ((cursor + k) % own)])
            .collect();
        self.full_valid_cursors[set] += count;
        // Megatron's count of validation samples read: an evaluation batch per iteration.
        self.consumed_valid += iterations * c.eval_global_batch_size as u64;
        let mut cfg = c.for_evaluation();
        cfg.args.micro_batch_size = 1;
        Ok(EvalPlan {
            per_iteration,
            global: count as usize * dp_size,
            samples,
            cfg,
        })
    }
}

/// What one evaluation reads on this rank.
struct EvalPlan {
    /// Micro-batches per evaluation iteration on this rank.
    per_iteration: usize,
    /// Micro-batches over all data-parallel ranks (a mean of micro-batch losses divides by it).
    global: usize,
    /// This rank's micro-batches, each its sample indices.
    samples: Vec<Vec<u64>>,
    /// The configuration the micro-batches are built with (their size).
    cfg: crate::arguments::TrainConfig,
}
