//! Per-rank memory accounting (`--log-memory`): what this rank holds, by kind, each log
//! interval, and at start-up the prediction beside Korthikanti et al.'s activation formula
//! (2022, Table 2: `sbh(34 + 5as/h)` per layer and its TP / SP / recomputation variants).

use crate::arguments::TrainConfig;
use megatron_core::models::gpt::activation_bytes_formula_with;
use megatron_core::transformer::step::Recompute;
use serde::Serialize;

/// Bytes this rank holds, by kind.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct MemoryBreakdown {
    /// Parameters: fp32 values (or fp32 mains) and the 16-bit copy the model reads.
    pub parameters: u64,
    pub gradients: u64,
    /// Adam moments and, with the distributed optimizer under 16-bit parameters, fp32 mains.
    pub optimizer_state: u64,
    /// Saved activations at the step's peak, and how many micro-batches were in flight then.
    pub activations: u64,
    pub micro_batches_in_flight: usize,
    /// Buffers the tensor pool keeps for reuse on this rank's thread.
    pub pooled: u64,
    /// The process's resident high-water mark (every rank thread of the process together).
    pub process_peak: u64,
}

impl MemoryBreakdown {
    pub fn line(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        format!(
            " | memory (MiB) params: {:.1} grads: {:.1} optimizer: {:.1} activations: {:.1} ({} in flight) pool: {:.1} process peak: {:.0}",
            mib(self.parameters),
            mib(self.gradients),
            mib(self.optimizer_state),
            mib(self.activations),
            self.micro_batches_in_flight,
            mib(self.pooled),
            mib(self.process_peak)
        )
    }
}

/// Korthikanti et al.'s activation bytes per layer (16-bit activations): `sbh(34 + 5as/h)`
/// without parallelism, `sbh(10 + 24/t + 5as/(ht))` with TP, `/t` of the whole with TP + SP;
/// selective recomputation drops the `5as/h` term, full recomputation keeps `2sbh`.
pub fn korthikanti_layer_bytes(cfg: &TrainConfig) -> f64 {
    let m = &cfg.model;
    let (s, b) = (
        (cfg.args.seq_length / cfg.cp) as f64,
        cfg.args.micro_batch_size as f64,
    );
    let (h, a, t) = (
        m.hidden_size as f64,
        m.num_attention_heads as f64,
        cfg.tp as f64,
    );
    let sbh = s * b * h;
    let sp = cfg.args.sequence_parallel && cfg.tp > 1;
    let attn = 5.0 * a * s / h;
    match cfg.recompute {
        Recompute::Full { .. } => 2.0 * sbh / if sp { t } else { 1.0 },
        Recompute::Selective(m) if m.core_attn => {
            if sp {
                34.0 * sbh / t
            } else {
                sbh * (10.0 + 24.0 / t)
            }
        }
        _ => {
            if sp {
                sbh * (34.0 + attn) / t
            } else {
                sbh * (10.0 + 24.0 / t + attn / t)
            }
        }
    }
}

/// The start-up lines: this rank's parameters, gradients and optimizer state (known once the
/// optimizer exists), and the activations of one micro-batch by the engine's formula beside
/// Korthikanti's, with the micro-batches a first pipeline stage keeps in flight.
pub fn predicted(cfg: &TrainConfig, params: u64, grads: u64, optimizer: u64) -> String {
    let a = &cfg.args;
    let mib = |b: f64| b / (1 << 20) as f64;
    let ours = activation_bytes_formula_with(
        &cfg.model,
        a.micro_batch_size,
        a.seq_length / cfg.cp,
        cfg.tp,
        a.sequence_parallel && cfg.tp > 1,
        cfg.precision.half().is_some(),
        cfg.recompute,
    ) as f64
        / cfg.pp as f64;
    let layers = cfg.model.num_layers as f64 / cfg.pp as f64;
    let theirs = korthikanti_layer_bytes(cfg) * layers;
    let in_flight = cfg.pp.min(cfg.num_microbatches);
    format!(
        "memory per rank (predicted): params {:.1} MiB, grads {:.1} MiB, optimizer {:.1} MiB; activations per micro-batch {:.1} MiB (engine; Korthikanti et al. with 16-bit activations: {:.1} MiB), up to {in_flight} in flight on the first pipeline stage",
        mib(params as f64),
        mib(grads as f64),
        mib(optimizer as f64),
        mib(ours),
        mib(theirs)
    )
}
