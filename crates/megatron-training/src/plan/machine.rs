//! `--cluster this-machine`: one node whose devices are rank threads, with its numbers
//! measured here (a second or two): the FMA peak the MFU uses, a GEMM of the model's width
//! against it, memory bandwidth by a parallel copy, and the thread communicator's all-reduce
//! bus bandwidth. Memory per rank is the machine's memory shared by the ranks.

use super::cluster::{AttentionKernel, Cluster, Engine};
use crate::arguments::TrainArgs;
use crate::TrainError;
use megatron_comm::{Communicator, ReduceOp};
use std::time::Instant;

fn mem_total_bytes() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Bytes per second a parallel copy (read + write) reaches on `threads` threads.
fn copy_bandwidth(threads: usize) -> f64 {
    let n = 16 << 20; // 64 MiB of f32 per buffer: well beyond the caches
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let chunk = n.div_ceil(threads);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * (n * 4) as f64 / best
}

/// The thread communicator's all-reduce bus bandwidth over `ranks` rank threads.
fn all_reduce_bandwidth(ranks: usize) -> Result<f64, TrainError> {
    if ranks < 2 {
        return Ok(f64::INFINITY);
    }
    let n = 1 << 20;
    let times = megatron_comm::run_ranks(ranks, move |_, comm| {
        let mut buf = vec![1.0f32; n];
        let mut best = f64::MAX;
        for _ in 0..6 {
            comm.barrier().ok();
            let t0 = Instant::now();
            comm.all_reduce(&mut buf, ReduceOp::Sum).ok();
            best = best.min(t0.elapsed().as_secs_f64());
        }
        best
    });
    let mut worst: f64 = 0.0;
    for t in times {
        worst = worst.max(t.map_err(|e| TrainError::Args(format!("measuring all-reduce: {e}")))?);
    }
    Ok(2.0 * (ranks - 1) as f64 / ranks as f64 * (n * 4) as f64 / worst)
}

/// Share of `peak` (FLOP/s of `threads` threads) our f32 GEMM reaches at width `h`.
fn gemm_efficiency(h: usize, threads: usize, peak: f64) -> f64 {
    use megatron_tensor::cpu::matmul_forward;
    let rows = 256;
    let x = vec![0.5f32; rows * h];
    let w = vec![0.25f32; h * h];
    let mut out = vec![0.0f32; rows * h];
    megatron_tensor::threads::set_gemm_threads(threads);
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t0 = Instant::now();
        matmul_forward(&mut out, &x, &w, None, rows, h, h);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&out);
    (2.0 * (rows * h * h) as f64 / best / peak).min(1.0)
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
    let bandwidth = copy_bandwidth(threads) / ranks as f64;
    let all_reduce = all_reduce_bandwidth(ranks)?;
    let half = a.bf16 || a.fp16;
    Ok(Cluster {
        gpus_per_node: ranks,
        num_nodes: 1,
        memory_per_gpu: memory / ranks as f64,
        reserved_memory: 0.0,
        peak_flops: peak,
        intra_node_bandwidth: all_reduce.min(bandwidth * 4.0),
        inter_node_bandwidth: all_reduce.min(bandwidth * 4.0),
        memory_bandwidth: bandwidth,
        gemm_efficiency: gemm_efficiency(a.hidden_size, per_rank, peak),
        memory_efficiency: 1.0,
        attention: AttentionKernel::Flash,
        activation_bytes: if half { 2.0 } else { 4.0 },
        engine: Engine::ThisEngine,
    })
}
