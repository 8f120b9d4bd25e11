//! Mixture-of-experts statistics for the log line and the metrics file (megatron-core's
//! `track_moe_metrics`): the load-balancing and z-loss values without their coefficients, and
//! per MoE layer the expert load (rows per expert, its max over its mean) and the share of
//! routed rows dropped over capacity, summed over every rank for the log interval.

use crate::setup::RankComms;
use crate::TrainError;
use megatron_comm::ReduceOp;
use megatron_core::models::ModelChunk;
use serde::Serialize;

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct MoELayerLoad {
    pub layer: usize,
    /// Rows routed to each expert over the interval (every rank's tokens).
    pub tokens_per_expert: Vec<f64>,
    /// Max over mean of `tokens_per_expert` (1 is perfect balance).
    pub max_over_mean: f64,
    /// Routed rows dropped over capacity, as a fraction.
    pub dropped_fraction: f64,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct MoELogMetrics {
    /// Mean over MoE layers and micro-batches, without `--moe-aux-loss-coeff`.
    pub load_balancing_loss: f64,
    /// The same for the z-loss.
    pub z_loss: f64,
    pub layers: Vec<MoELayerLoad>,
}

impl MoELogMetrics {
    pub fn line(&self) -> String {
        let loads: Vec<String> = self
            .layers
            .iter()
            .map(|l| format!("{:.2}", l.max_over_mean))
            .collect();
        let dropped: f64 = self.layers.iter().map(|l| l.dropped_fraction).sum::<f64>()
            / self.layers.len().max(1) as f64;
        format!(
            " | load_balancing_loss: {:.6E} | z_loss: {:.6E} | expert load max/mean: [{}] | dropped: {:.2}%",
            self.load_balancing_loss,
            self.z_loss,
            loads.join(", "),
            100.0 * dropped
        )
    }
}

/// Takes every chunk's statistics since the last call and sums them over the world (all
/// ranks call it); `None` for a model without experts.
pub(crate) fn gather_moe_metrics(
    chunks: &[impl ModelChunk],
    comms: &mut RankComms,
    num_layers: usize,
    num_experts: Option<usize>,
) -> Result<Option<MoELogMetrics>, TrainError> {
    let Some(e) = num_experts else {
        return Ok(None);
    };
    // Per layer: tokens per expert, dropped, routed, load-balancing, z-loss, micro-batches.
    let w = e + 5;
    let mut v = vec![0.0f32; num_layers * w];
    for c in chunks {
        for (l, m) in c.take_moe_metrics() {
            let row = &mut v[l * w..(l + 1) * w];
            for (r, t) in row.iter_mut().zip(&m.tokens_per_expert) {
                *r = *t as f32;
            }
            row[e] = m.dropped as f32;
            row[e + 1] = m.routed as f32;
            row[e + 2] = m.load_balancing_loss as f32;
            row[e + 3] = m.z_loss as f32;
            row[e + 4] = m.micro_batches as f32;
        }
    }
    comms.world_reduce(&mut v, ReduceOp::Sum)?;
    // Every TP and CP rank counts each micro-batch (its share of the losses).
    let tp = (comms.tp.size() * comms.tp.cp_layout().size) as f64;
    let (mut lb, mut z, mut n) = (0.0f64, 0.0f64, 0usize);
    let mut layers = Vec::new();
    for l in 0..num_layers {
        let row = &v[l * w..(l + 1) * w];
        let mbs = row[e + 4] as f64 / tp;
        if mbs == 0.0 {
            continue;
        }
        let tokens: Vec<f64> = row[..e].iter().map(|&x| x as f64).collect();
        let mean = tokens.iter().sum::<f64>() / e as f64;
        let max = tokens.iter().cloned().fold(0.0, f64::max);
        layers.push(MoELayerLoad {
            layer: l,
            max_over_mean: if mean > 0.0 { max / mean } else { 0.0 },
            dropped_fraction: if row[e + 1] > 0.0 {
                row[e] as f64 / row[e + 1] as f64
            } else {
                0.0
            },
            tokens_per_expert: tokens,
        });
        lb += row[e + 2] as f64 / mbs;
        z += row[e + 3] as f64 / mbs;
        n += 1;
    }
    Ok(Some(MoELogMetrics {
        load_balancing_loss: lb / n.max(1) as f64,
        z_loss: z / n.max(1) as f64,
        layers,
    }))
}
