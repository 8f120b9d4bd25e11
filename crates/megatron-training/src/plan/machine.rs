//! `--cluster this-machine`: one node whose devices are rank threads, with its numbers
//! measured here (a few seconds): the FMA peak the MFU uses, memory bandwidth by a parallel
//! copy, the thread communicator's all-reduce bus bandwidth, and the engine's compute
//! efficiency and optimizer cost on this model: every rank runs a few steps of one and of three
//! micro-batches (data parallel, so the cores are as loaded as in the layouts: two busy cores
//! clock and share memory differently from one), and the efficiency and the optimizer's bytes
//! per parameter are what make the cost model's times of those runs the measured ones (a GEMM
//! probe alone misses the backward GEMMs' layouts, the attention kernel and the element-wise
//! passes, which on a CPU are not bandwidth-bound). The layouts'
//! predictions then come from the cost model. Memory per rank is the machine's memory shared
//! by the ranks.

use super::cluster::{AttentionKernel, Cluster, Engine};
use crate::arguments::TrainArgs;
use crate::TrainError;

fn mem_total_bytes() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// The thread communicator's all-reduce bus bandwidth over `ranks` rank threads (4 MiB).
fn all_reduce_bandwidth(ranks: usize) -> Result<f64, TrainError> {
    if ranks < 2 {
        return Ok(f64::INFINITY);
    }
    let bytes = 4 << 20;
    let t = crate::machine_probes::thread_all_reduce_seconds(ranks, bytes, 6)
        .map_err(|e| TrainError::Args(format!("measuring all-reduce: {e}")))?;
    Ok(2.0 * (ranks - 1) as f64 / ranks as f64 * bytes as f64 / t)
}

/// The flags of a calibration run: one micro-batch per step of the model on `ranks` ranks of
/// `threads` threads each, tensor parallel over `tp` of them and context parallel over `cp`.
fn calibration_args(
    a: &TrainArgs,
    ranks: usize,
    threads: usize,
    (tp, cp): (usize, usize),
) -> TrainArgs {
    let choice = super::layout::Choice {
        tp,
        pp: 1,
        vp_layers: None,
        cp,
        ep: 1,
        micro_batch_size: 1,
        recompute: super::layout::RecomputeChoice::None,
        distributed_optimizer: false,
    };
    let mut one = super::layout::layout_args(a, ranks, &choice);
    one.num_threads = Some(threads * ranks);
    one.global_batch_size = Some(ranks / (tp * cp));
    one
}

/// The cost model's time of `cfg` on `cluster` with one of its figures changed by `set`.
fn time_with(
    cfg: &crate::arguments::TrainConfig,
    cluster: &Cluster,
    set: impl FnOnce(&mut Cluster),
) -> Result<super::cost::TimeCost, TrainError> {
    let mut c = cluster.clone();
    set(&mut c);
    Ok(super::cost::predict(cfg, &c)
        .map_err(TrainError::Args)?
        .time)
}

/// The GEMM efficiency and the optimizer's bytes per parameter that make the cost model's
/// times the measured ones: every rank (data parallel, so the cores are as loaded as in the
/// layouts) runs steps of one and of three micro-batches; their difference is one micro-batch's
/// compute, what remains of the one-micro-batch step is the gradient reduction and the
/// optimizer.
fn calibrate(
    a: &TrainArgs,
    cluster: &Cluster,
    ranks: usize,
    threads: usize,
) -> Result<(f64, f64), TrainError> {
    let vocab = a.tokenizer.vocab_size.unwrap_or(0);
    let one = calibration_args(a, ranks, threads, (1, 1));
    let mut three = one.clone();
    three.global_batch_size = Some(3 * ranks);
    let t1 = super::measure::run_layout(&one, 6)?.step_seconds;
    let t3 = super::measure::run_layout(&three, 6)?.step_seconds;
    let per_micro_batch = ((t3 - t1) / 2.0).max(t1 * 0.05);
    let step_rest = (t1 - per_micro_batch).max(0.0);
    let cfg = one.validate(vocab)?;
    let full = time_with(&cfg, cluster, |c| c.gemm_efficiency = 1.0)?;
    let half = time_with(&cfg, cluster, |c| c.gemm_efficiency = 0.5)?;
    // compute(eff) = gemm / eff + memory-bound.
    let gemm = half.compute - full.compute;
    let memory_bound = full.compute - gemm;
    let eff = (gemm / (per_micro_batch - memory_bound).max(gemm * 1e-3)).clamp(0.01, 1.0);
    let params = super::cost::parameters_per_rank(&cfg).0;
    let optimizer_seconds = (step_rest - full.data_parallel).max(0.0);
    let bytes = optimizer_seconds * cluster.memory_bandwidth * cluster.memory_efficiency / params;
    Ok((eff, bytes.max(1.0)))
}

/// What one wait of a kind costs beyond the cost model's time: a two-rank calibration run of
/// layout `(tp, cp)` (one micro-batch per step) measured against the prediction without the
/// wait, `set` putting a latency into the cluster. 0 where the model does not split that way.
fn latency(
    a: &TrainArgs,
    cluster: &Cluster,
    threads: usize,
    layout: (usize, usize),
    set: impl Fn(&mut Cluster, f64),
) -> Result<f64, TrainError> {
    let two = calibration_args(a, 2, threads, layout);
    let Ok(cfg) = two.validate(a.tokenizer.vocab_size.unwrap_or(0)) else {
        return Ok(0.0);
    };
    let measured = super::measure::run_layout(&two, 6)?.step_seconds;
    let time = |latency: f64| -> Result<f64, TrainError> {
        Ok(time_with(&cfg, cluster, |c| set(c, latency))?.total())
    };
    // time(latency) = base + waits x latency.
    let base = time(0.0)?;
    let per = time(1.0)? - base;
    Ok(((measured - base) / per).max(0.0))
}

/// Seconds each context-parallel ring exchange waits beyond the cost model's time (context
/// parallelism 2; 0 with fewer than two ranks, or a sequence that does not split in 4).
fn ring_latency(
    a: &TrainArgs,
    cluster: &Cluster,
    ranks: usize,
    threads: usize,
) -> Result<f64, TrainError> {
    if ranks < 2 || !a.seq_length.is_multiple_of(4) {
        return Ok(0.0);
    }
    latency(a, cluster, threads, (1, 2), |c, l| {
        c.ring_exchange_latency = l
    })
}

/// Seconds each tensor-parallel collective waits beyond the cost model's time (tensor
/// parallelism 2; 0 with fewer than two ranks or where the heads or widths do not split in 2).
/// Why measured: rank threads meet in every collective, and where they share cores with each
/// other's GEMM threads a late one costs a scheduler slice (2.2 ms each here, 15 % of a
/// hidden-256 model's TP 2 step; BENCHMARKS.md).
fn tp_latency(
    a: &TrainArgs,
    cluster: &Cluster,
    ranks: usize,
    threads: usize,
) -> Result<f64, TrainError> {
    if ranks < 2 {
        return Ok(0.0);
    }
    latency(a, cluster, threads, (2, 1), |c, l| {
        c.tp_collective_latency = l
    })
}

/// This machine as a cluster of `--nproc-per-node` rank threads.
pub fn this_machine(a: &TrainArgs) -> Result<Cluster, TrainError> {
    let ranks = a.nproc_per_node.max(1);
    let threads = a
        .num_threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let per_rank = (threads / ranks).max(1);
    let unit = crate::flops::PeakUnit::Fma;
    // Rank threads share the process's cores: each gets its share of the whole peak.
    let peak = crate::flops::peak_flops(None, threads, unit) / ranks as f64;
    let memory = mem_total_bytes().ok_or_else(|| {
        TrainError::Args("this-machine: cannot read MemTotal from /proc/meminfo".into())
    })?;
    let bandwidth = crate::machine_probes::memcpy_bandwidth_threads(threads, 5) / ranks as f64;
    let all_reduce = all_reduce_bandwidth(ranks)?;
    let half = a.bf16 || a.fp16;
    let mut c = Cluster {
        gpus_per_node: ranks,
        num_nodes: 1,
        memory_per_gpu: memory / ranks as f64,
        reserved_memory: 0.0,
        peak_flops: peak,
        intra_node_bandwidth: all_reduce.min(bandwidth * 4.0),
        inter_node_bandwidth: all_reduce.min(bandwidth * 4.0),
        memory_bandwidth: bandwidth,
        gemm_efficiency: 1.0,
        memory_efficiency: 1.0,
        attention: AttentionKernel::Flash,
        activation_bytes: if half { 2.0 } else { 4.0 },
        engine: Engine::ThisEngine,
        ring_exchange_latency: 0.0,
        tp_collective_latency: 0.0,
        optimizer_bytes_per_parameter: 36.0,
    };
    (c.gemm_efficiency, c.optimizer_bytes_per_parameter) = calibrate(a, &c, ranks, per_rank)?;
    c.ring_exchange_latency = ring_latency(a, &c, ranks, per_rank)?;
    c.tp_collective_latency = tp_latency(a, &c, ranks, per_rank)?;
    Ok(c)
}
