//! A BERT's sentence-order loss in the log, apart from the masked-LM loss, as Megatron's
//! `pretrain_bert.py` reports them (`lm loss` and `sop loss`, in training and evaluation):
//! the model records each micro-batch's sentence-order mean, and the log takes the mean over
//! the micro-batches of every rank.

use crate::setup::RankComms;
use crate::TrainError;
use megatron_comm::ReduceOp;
use megatron_core::models::{LossPhase, ModelChunk};

/// This rank's sentence-order losses of `phase` since the last call: the sum of the
/// micro-batches' means and their number (zeros on stages without the head).
pub(crate) fn take_local(chunks: &[impl ModelChunk], phase: LossPhase) -> (f64, f64) {
    chunks
        .iter()
        .filter_map(|c| c.take_sop_losses(phase))
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// The mean over every rank's recorded micro-batches (all ranks call it; each tensor-parallel
/// rank records the same micro-batches, which the mean does not mind).
pub(crate) fn mean_over_ranks(
    comms: &mut RankComms,
    (sum, n): (f64, f64),
) -> Result<f64, TrainError> {
    let mut v = [sum as f32, n as f32];
    comms.world_reduce(&mut v, ReduceOp::Sum)?;
    Ok(if v[1] > 0.0 {
        f64::from(v[0]) / f64::from(v[1])
    } else {
        0.0
    })
}
