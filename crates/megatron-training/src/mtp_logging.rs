//! Multi-token prediction's losses for the log line and the metrics file (megatron-core's
//! `MTPLossLoggingHelper`: `mtp_1 loss`, ...), averaged over the log interval and every
//! data-parallel rank.

use crate::setup::RankComms;
use crate::TrainError;
use megatron_comm::ReduceOp;
use megatron_core::models::ModelChunk;

/// Multi-token prediction's losses since the last call, each depth's mean over the interval's
/// micro-batches and data-parallel ranks (all ranks call it); `None` without it.
pub(crate) fn gather_mtp_losses(
    chunks: &[impl ModelChunk],
    comms: &mut RankComms,
    depths: Option<usize>,
) -> Result<Option<Vec<f64>>, TrainError> {
    let Some(d) = depths else {
        return Ok(None);
    };
    // Per depth: summed micro-batch means, micro-batches (every TP rank counts each).
    let mut v = vec![0.0f32; 2 * d];
    for c in chunks {
        for (k, (sum, n)) in c.take_mtp_losses().into_iter().enumerate() {
            v[2 * k] += sum as f32;
            v[2 * k + 1] += n as f32;
        }
    }
    comms.world_reduce(&mut v, ReduceOp::Sum)?;
    Ok(Some(
        v.chunks(2)
            .map(|p| {
                if p[1] > 0.0 {
                    (p[0] / p[1]) as f64
                } else {
                    0.0
                }
            })
            .collect(),
    ))
}
