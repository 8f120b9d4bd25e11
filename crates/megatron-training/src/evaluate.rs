//! Evaluation (Megatron's `evaluate`): the validation loss over `--eval-iters` global
//! batches, forward only, through the same pipeline executor as training (one stage runs the
//! same way, with nothing to send).

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
    /// micro-batches r, r + d, ... of them); the sum is all-reduced over DP. Every rank calls
    /// it; `None` without samples in the split or with `--eval-iters 0`.
    pub(crate) fn evaluate(&mut self, split: Split) -> Result<Option<EvalLoss>, TrainError> {
        if F::num_samples(&self.data, split) == 0 || self.cfg.args.eval_iters == 0 {
            return Ok(None);
        }
        // Micro-batches of --eval-micro-batch-size, --eval-global-batch-size per iteration.
        let eval_cfg = self.cfg.for_evaluation();
        let cfg = &eval_cfg;
        let b = cfg.args.micro_batch_size;
        let (dp_rank, dp_size) = self.comms.data_rank_size();
        let global = cfg.args.eval_iters as usize * cfg.global_batch_size / b;
        let first = match split {
            Split::Valid if !cfg.args.skip_train => {
                let first = self.consumed_valid;
                self.consumed_valid += cfg.eval_samples();
                first
            }
            _ => 0,
        };
        let count = (dp_rank..global).step_by(dp_size).len();
        let cp = self.comms.cp_layout();
        let total = self.split_samples(split);
        let mut mbs: Vec<F::MicroBatch> = (0..count).map(|_| F::micro_batch(cfg, cp)).collect();
        for (k, mb) in mbs.iter_mut().enumerate() {
            let consumed = first + (k * dp_size * b) as u64;
            let samples = self.samplers.micro_batch(split, total, consumed)?;
            F::fill(cfg, &self.data, mb, split, &samples)?;
        }
        let batches: Vec<_> = mbs.iter().map(|x| F::batch(cfg, x)).collect();
        let partition = cfg.partition.clone();
        let chunks = partition.v;
        let ops: Vec<Op> = (0..count)
            .flat_map(|mb| (0..chunks).map(move |chunk| Op::Forward { chunk, mb }))
            .collect();
        let ctxs = vec![StepContext::eval(); count];
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
        // Only the last stage holds losses: the others add zeros.
        let mut total = loss_sums::<F>(&r.losses);
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
}
